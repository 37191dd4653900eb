import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))

# The fast inner loop (`make test-fast`, `pytest -m unit`): modules whose tests start no server, no
# cluster of processes and no real model file. Every other module is an integration test (`make test`
# runs both); a new module is one until it is listed here.
UNIT_MODULES = {
    "test_doctor_units",
    "test_api_conversions",
    "test_core_start",
    "test_attention_backends",
    "test_attention_metadata",
    "test_engine",
    "test_embeddings",
    "test_eval_tasks",
    "test_gpu_hygiene",
    "test_help_texts",
    "test_import_layers",
    "test_kernels",
    "test_kv_connector",
    "test_kv_disk_tier",
    "test_layers",
    "test_llm_api",
    "test_mapped_weights",
    "test_lora",
    "test_offload",
    "test_plan",
    "test_prefill_attention",
    "test_prefix_cache",
    "test_prompt_logprobs",
    "test_quantization",
    "test_reasoning_parser",
    "test_request_edges",
    "test_sampler",
    "test_sampling_params",
    "test_step_budget",
    "test_step_isolation",
    "test_step_syncs",
    "test_server_units",
    "test_spec_dflash",
    "test_spec_gguf_q8",
    "test_spec_mtp",
    "test_step_contract",
    "test_structured_units",
    "test_tokenizer",
    "test_tools_units",
    "test_triton_attention",
    "test_triton_block",
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.stem in UNIT_MODULES:
            item.add_marker(pytest.mark.unit)


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread():
    """Torch in this process (the references, the in-process runners) runs on one thread: the tiny
    models' ops are too small to split. On an idle 2-core machine that is as fast (the default model
    too) for 40% less CPU time; on a busy one, where a thread waits at every OpenMP barrier for its
    partner to be scheduled, 4-6x faster (test_models' flat-batch cases: 39 s -> 6.5 s). Servers and
    parallel ranks are other processes and keep the product's choice (every core they may use);
    tests of multi-threaded kernels set the count themselves."""
    import torch

    from tokenmill.worker import model_runner

    threads, patch = torch.get_num_threads(), pytest.MonkeyPatch()
    torch.set_num_threads(1)
    patch.setattr(model_runner, "cpu_threads", lambda: 1)
    yield
    patch.undo()
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def default_model():
    """SmolLM2-135M-Instruct in the exact mode (float32 activations on its GGUF blocks: the reference
    comparisons hold token for token), loaded once per test session."""
    from tokenmill.loader import load_model

    return load_model("smollm2-135m-instruct", dtype="float32")


@pytest.fixture(scope="session")
def tokenizer():
    """The default model's tokenizer (no weights loaded)."""
    from tokenmill.loader.source import resolve_model
    from tokenmill.tokenizer import load_tokenizer

    return load_tokenizer(resolve_model("smollm2-135m-instruct"))


@pytest.fixture(scope="session")
def hf_default_model(default_model, tmp_path_factory):
    """transformers' float32 model on the default model's GGUF weights (the reference), loaded once."""
    from helpers import hf_from_gguf

    return hf_from_gguf(default_model.source.path, tmp_path_factory.mktemp("hf-default"))


@pytest.fixture(scope="session")
def exact_llm():
    """`LLM(...)` on the default model in the exact mode with a 256-block pool, built once for every
    module that compares with it (test_llm_api, the speculative-decoding references): each build loads
    the weights, fills a KV pool and warms up. Tests that use it leave its pool whole."""
    from test_server_utils import MODEL, model_available

    from tokenmill import LLM

    if not model_available():
        pytest.skip(f"{MODEL} is not installed")

    return LLM(model="smollm2-135m-instruct", num_kv_blocks=256, dtype="float32")


@pytest.fixture(scope="session")
def tiny_chat(tmp_path_factory, tokenizer):
    """The server of the chat APIs' tests (test_messages_api, test_responses_api), started once for both:
    a tiny model as "tiny" with the qwen3 reasoning parser, --api-key TINY_CHAT_KEY (the Messages API's
    auth tests) and --max-stored-responses 2 (the Responses API's store test)."""
    from test_server_utils import TINY_CHAT_KEY, tiny_chat_server

    yield from tiny_chat_server(
        tmp_path_factory, tokenizer, "chat-apis", "--api-key", TINY_CHAT_KEY, "--max-stored-responses", "2"
    )
