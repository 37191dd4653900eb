"""A mixture-of-experts GGUF model on CPU three ways, taking turns round by round in one process (this
host's speed drifts): its experts dequantized to float32 and every layer run from Python (the tree
before session 16), its experts in the file's blocks with the layers from Python, and its experts in
blocks with the compiled step (every layer, the experts included, in one C++ call; with int8 activations,
one OpenMP parallel region). Single-stream and batched decode, and the experts' bytes.

    .venv/bin/python benchmarks/bench_moe_gguf.py [--rounds 3] [--tokens 32] [--prompt-len 128]
        [--batch 8] [--workdir /tmp/tokenmill-bench-moe-gguf]

The model is random-weight and Qwen3-MoE-shaped, scaled down: hidden 1024, 12 layers, 16 heads of 64
(4 KV heads), 32 experts (top 4) of intermediate 512, SmolLM2's vocabulary of 49152 (~0.72B parameters,
0.60B of them in experts); written as a GGUF file (the tests' writer, `tests/helpers.py`, with SmolLM2's
tokenizer: llama.cpp runs it too, `benchmarks/peers/single_stream.py --models <the file>`) with Q4_0
experts, Q8_0 attention, embedding and output, so gguf-q8 (the default mode) runs every product on int8
panels.
Prints a markdown table.
"""

from __future__ import annotations

import sys
from contextlib import nullcontext
from pathlib import Path
from unittest import mock

import torch

SHAPE = dict(
    vocab_size=49152,
    hidden_size=1024,
    intermediate_size=2048,
    num_hidden_layers=12,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=64,
    num_experts=32,
    num_experts_per_tok=4,
    moe_intermediate_size=512,
    norm_topk_prob=True,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)
TYPES = {
    **{name: "Q8_0" for name in ("attn_q", "attn_k", "attn_v", "attn_output", "output", "token_embd")},
    **{name: "Q4_0" for name in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")},
}

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the GGUF writer; the engine core helpers


def smollm2_file() -> Path:
    """The default model's GGUF file (its tokenizer, and vocabulary size, are the bench model's)."""
    return next((Path(__file__).resolve().parents[1] / ".venv").rglob("SmolLM2-135M-Instruct.Q4_1.gguf"))


def checkpoint(workdir: Path) -> Path:
    """The GGUF file, written once."""
    path = workdir / "qwen3-moe-shaped.gguf"
    if not path.exists():
        import transformers
        from helpers import write_tiny_gguf

        workdir.mkdir(parents=True, exist_ok=True)
        torch.manual_seed(0)
        hf = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3MoeConfig(**SHAPE), dtype=torch.float32)
        write_tiny_gguf(hf, path, TYPES, tokenizer_from=smollm2_file())
    return path


def main() -> None:
    from bench_gpt_oss_mxfp4 import decode_args, decode_rate, decode_table  # this directory's

    args = decode_args(__doc__, "/tmp/tokenmill-bench-moe-gguf", "the GGUF file is").parse_args()
    from helpers import make_core

    from tokenmill.kernels.decode_step import CompiledDecode
    from tokenmill.loader import load_model
    from tokenmill.quantization.gguf import GGUFConfig

    path = str(checkpoint(Path(args.workdir)))
    budget = args.batch * args.prompt_len
    prompts = [[(97 * i + 13 * j) % 32000 for j in range(args.prompt_len)] for i in range(args.batch)]
    no_step = classmethod(lambda cls, parts: None)

    def engine(dense_experts: bool, layers: bool):
        with (
            mock.patch.object(GGUFConfig, "expert_method", lambda self, prefix: None)
            if dense_experts
            else nullcontext(),
            mock.patch.object(CompiledDecode, "build", no_step) if layers else nullcontext(),  # built once, and kept
        ):
            core = make_core(path, num_blocks=256, max_num_batched_tokens=budget, loaded=load_model(path))
            decode_rate(core, prompts[:1], 4)
        compiled = core.executor.runner.model.model.compiled_decode[1] is not None
        assert compiled != layers, "the step was not built as asked"
        return core

    engines = {
        "float32 experts, layers from Python": engine(True, True),
        "experts in blocks, layers from Python": engine(False, True),
        "experts in blocks, compiled step": engine(False, False),
    }
    medians = decode_table(engines, prompts, args, "model")
    first = medians["float32 experts, layers from Python"]
    for name, (one, many) in list(medians.items())[1:]:
        print(
            f"\n{name} / float32 experts: 1 stream {one / first[0]:.2f}x, {args.batch} streams {many / first[1]:.2f}x"
        )


if __name__ == "__main__":
    main()
