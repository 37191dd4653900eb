"""Hybrid CPU-GPU placement (`worker/offload.py`), checked without a GPU: the plans and the prefetch
schedule as pure functions, the flags refused off CUDA, and the streaming itself on a CPU "device" (host
copies streamed into slot buffers that start as NaN, so a layer run before its copy landed shows) against
the same model without offload."""

from __future__ import annotations

import argparse
import math

import numpy as np
import pytest
import torch
from helpers import all_logits, make_runner, make_tiny_model, write_tiny_gguf

from tokenmill.config import OffloadConfig
from tokenmill.engine_args import EngineArgs, add_engine_args
from tokenmill.layers.host_placement import NOTHING, HostPlacement
from tokenmill.loader import build_model, load_model, open_checkpoint
from tokenmill.loader.source import resolve_model
from tokenmill.quantization.unquantized import UnquantizedConfig
from tokenmill.worker.offload import (
    apply_offload,
    host_placement_planner,
    kept_tensors,
    layer_tensors,
    plan_cpu_moe,
    plan_weight_offload,
    prefetch_schedule,
)

CPU = torch.device("cpu")


def test_offloaded_layers_are_spread_and_fit_the_budget():
    assert plan_weight_offload([10] * 8, 20) == [2, 6]  # a kept layer runs while the next one streams
    assert plan_weight_offload([10] * 8, 29) == [2, 6]
    assert plan_weight_offload([10] * 8, 80) == list(range(8))
    assert plan_weight_offload([10] * 8, 9) == []  # not one whole layer
    assert plan_weight_offload([10, 50, 10, 10], 30) == [0, 2, 3]  # the most layers of a spread that fits
    assert plan_weight_offload([10, 50, 10, 10], 25) == [2]  # one layer: the middle one
    assert prefetch_schedule([2, 6]) == {None: 2, 2: 6}
    assert prefetch_schedule([0, 2, 3]) == {None: 0, 0: 2, 2: 3}
    assert prefetch_schedule([]) == {}


def test_cpu_moe_plans_all_or_the_first_n_moe_layers():
    assert plan_cpu_moe([5, 1, 3], cpu_moe=True, n_cpu_moe=0) == [1, 3, 5]
    assert plan_cpu_moe([5, 1, 3], cpu_moe=False, n_cpu_moe=2) == [1, 3]
    assert plan_cpu_moe([5, 1, 3], cpu_moe=False, n_cpu_moe=9) == [1, 3, 5]
    assert plan_cpu_moe([5, 1, 3], cpu_moe=False, n_cpu_moe=0) == []


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(cpu_offload_gb=4), "CUDA device"),
        (dict(cpu_moe=True), "CUDA device"),
        (dict(n_cpu_moe=2), "CUDA device"),
        (dict(cpu_offload_gb=-1), "cpu_offload_gb must be"),
        (dict(n_cpu_moe=-1), "n_cpu_moe must be"),
        (dict(cpu_moe=True, n_cpu_moe=2), "exclude each other"),
    ],
)
def test_offload_settings_are_refused_where_meaningless(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(model=None, **kwargs).create_engine_config()


def test_the_flags_set_the_engine_arguments():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = EngineArgs.from_cli_args(parser.parse_args(["--cpu-offload-gb", "2.5", "--n-cpu-moe", "3"]))
    assert (args.cpu_offload_gb, args.cpu_moe, args.n_cpu_moe) == (2.5, False, 3)
    assert EngineArgs.from_cli_args(parser.parse_args(["--cpu-moe"])).cpu_moe
    assert "--cpu-offload-gb" in parser.format_help() and "--n-cpu-moe N" in parser.format_help()


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama4")
    make_tiny_model("llama-gqa-untied", directory, num_hidden_layers=4)
    return str(directory)


def _layer_bytes(model) -> int:
    return sum(t.nbytes for t in layer_tensors(model.model.layers[0], kept_tensors(model, [])))


def test_streamed_layers_give_the_model_s_logits(llama):
    reference = make_runner(load_model(llama, dtype="float32"))
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5, 9]]
    expected = [all_logits(reference, p) for p in prompts]
    size = _layer_bytes(reference.model)
    offload = OffloadConfig(cpu_offload_gb=3.5 * size / 2**30)
    loaded = load_model(llama, dtype="float32", plan_host=host_placement_planner(offload))
    runner = make_runner(loaded)
    layers = list(runner.model.model.layers)
    streamed = apply_offload(runner.model, offload, CPU, loaded.host)
    runner.model.model.compiled_decode = (None, None)  # make_runner's warm-up built it; ModelRunner places first
    assert sorted(streamed.pairs) == [0, 2, 3]  # three layers fit, spread; two slots between them
    weight = layers[2].self_attn.qkv_proj.weight
    assert weight.isnan().all()  # not resident: only its copy before the layer runs fills it
    for prompt, logits in zip(prompts, expected):  # twice: the slots are reused from step to step
        torch.testing.assert_close(all_logits(runner, prompt), logits, rtol=0, atol=0)
    assert math.isclose(streamed.bytes, 3 * size)
    # a decode step: layer by layer (a compiled step would run past the layers' hooks), so within rounding
    # of the reference's compiled step
    torch.testing.assert_close(
        _decode_logits(runner, prompts[1]), _decode_logits(reference, prompts[1]), rtol=0, atol=1e-5
    )


def _decode_logits(runner, prompt: list[int]) -> torch.Tensor:
    """The logits of one decode step of token 7 after `prompt` (prefilled into blocks from 0)."""
    all_logits(runner, prompt)
    blocks = [list(range(-(-(len(prompt) + 1) // runner.kv_cache_config.block_size)))]
    with torch.inference_mode():
        hidden, _ = runner.forward(np.array([7]), np.array([1]), np.array([len(prompt)]), [blocks])
        return runner.model.compute_logits(hidden)


def test_experts_on_the_host_give_the_model_s_logits(tmp_path):
    make_tiny_model("mixtral", tmp_path)
    runner = make_runner(load_model(str(tmp_path), dtype="float32"))
    prompt = [5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4]
    expected = all_logits(runner, prompt)
    before = runner.expert_load()
    apply_offload(runner.model, OffloadConfig(n_cpu_moe=1), CPU)
    first, second = sorted(runner.moe_layers, key=lambda m: m.layer_index)
    assert "forward" in vars(first) and "forward" not in vars(second)  # only the first layer's experts
    torch.testing.assert_close(all_logits(runner, prompt), expected, rtol=0, atol=0)
    after = runner.expert_load()
    assert all(sum(after[i]) == 2 * sum(before[i]) for i in after)  # counted on the device as before


def test_streamed_layers_are_built_and_loaded_in_host_memory(llama):
    """With --cpu-offload-gb the streamed layers' weights never touch the device, so a model larger than
    the device starts: the meta device stands in for a GPU (it holds no values, and the device bytes are
    the bytes of the tensors on it); the streamed layers are built and loaded on the CPU, with the
    checkpoint's values, as `load_model` does it."""
    reference = load_model(llama, dtype="float32").model
    offload = OffloadConfig(cpu_offload_gb=2.5 * _layer_bytes(reference) / 2**30)
    ckpt = open_checkpoint(resolve_model(llama))
    build = lambda host=NOTHING: build_model(
        ckpt.config, UnquantizedConfig(), torch.float32, torch.device("meta"), None, host
    )  # noqa: E731
    host = host_placement_planner(offload)(build())
    assert host == HostPlacement(layers=frozenset({1, 3}))
    model = build(host)
    with torch.no_grad():
        model.load_weights(ckpt.weights())
    expected = dict(reference.named_parameters())
    for name, t in model.named_parameters():
        on_host = any(name.startswith(f"model.layers.{i}.") for i in host.layers)
        assert t.device.type == ("cpu" if on_host else "meta"), name
        if on_host:
            torch.testing.assert_close(t, expected[name], rtol=0, atol=0)
    device_bytes = sum(t.nbytes for t in model.parameters() if t.is_meta)
    assert device_bytes == sum(t.nbytes for t in reference.parameters()) - 2 * _layer_bytes(reference)


def test_quantized_experts_on_the_host_run_the_cpu_block_kernels(tmp_path):
    """--n-cpu-moe on a GGUF file with Q8_0 / Q4_0 experts: the host layer's experts are built in host
    memory in the file's blocks and run on the CPU block kernels, giving the logits of the model whose
    weights are dequantized (float32 activations: the same weights, other sums); with --cpu-offload-gb
    beside it the other MoE layer (the one whose weights fit) is streamed. (On a GPU the device's copy
    of the model is dense; this CPU run keeps the file's blocks in every layer.)"""
    hf = make_tiny_model("mixtral", tmp_path)
    path = str(tmp_path / "m.gguf")
    write_tiny_gguf(hf, path, {"ffn_gate_exps": "Q8_0", "ffn_up_exps": "Q4_0", "ffn_down_exps": "Q8_0"})
    reference = make_runner(load_model(path, dtype="float32", quantization="none"))
    blocks = load_model(path, dtype="float32").model.model.layers[1]  # as the planner sizes it
    second_bytes = sum(t.nbytes for t in blocks.parameters())
    offload = OffloadConfig(cpu_offload_gb=1.01 * second_bytes / 2**30, n_cpu_moe=1)
    loaded = load_model(path, dtype="float32", plan_host=host_placement_planner(offload))
    assert loaded.host == HostPlacement(layers=frozenset({1}), experts=frozenset({0}))
    runner = make_runner(loaded)
    assert sorted(apply_offload(runner.model, offload, CPU, loaded.host).pairs) == [1]
    first, second = sorted(runner.moe_layers, key=lambda m: m.layer_index)
    assert isinstance(first.w13, torch.nn.ModuleList) and first.w13[0].codes.dtype == torch.int8  # Q8_0 / Q4_0 -> 8-bit
    assert isinstance(second.w13, torch.nn.ModuleList)
    assert isinstance(reference.moe_layers[0].w13, torch.nn.Parameter)  # dequantized
    for prompt in ([5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4], [7]):
        expected = all_logits(reference, prompt)
        torch.testing.assert_close(
            all_logits(runner, prompt), expected, rtol=0, atol=1e-4 * expected.abs().max().item()
        )
    assert sum(runner.expert_load()[first.layer_index]) > 0  # counted on the device
