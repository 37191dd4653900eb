"""GPT-OSS with its experts in MXFP4 (as the released checkpoints ship them) against the same model
with dense float32 experts, and against itself with every layer run from Python (without the compiled
decode step): expert bytes, single-stream decode and batched decode, the engines taking turns round by
round in one process (this host's bandwidth drifts).

    .venv/bin/python benchmarks/bench_gpt_oss_mxfp4.py [--rounds 3] [--tokens 32] [--prompt-len 128]
        [--batch 8] [--workdir /tmp/tokenmill-bench-gpt-oss]

The model is random-weight and GPT-OSS-shaped, scaled down so that its dense form fits here: hidden
1024, 8 layers (sliding / full), 16 heads of 64 (4 KV heads), 16 experts (top 4) of intermediate
1024, vocabulary 32000 (~0.45B parameters, 0.40B of them in experts). Its MXFP4 checkpoint is
written by the tests' reference packer (`tests/test_fp8_fp4.py`); the dense one is that checkpoint
dequantized (so both compute on the same weights). Prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

import torch

SHAPE = dict(
    vocab_size=32000,
    hidden_size=1024,
    intermediate_size=1024,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=64,
    num_local_experts=16,
    num_experts_per_tok=4,
    sliding_window=128,
    max_position_embeddings=4096,
)


sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the packer; the engine core helpers


def checkpoints(workdir: Path) -> tuple[Path, Path]:
    """(the MXFP4 checkpoint, the dense one holding its dequantized weights), written once."""
    import transformers
    from test_fp8_fp4 import write_gpt_oss_mxfp4

    mx, dense = workdir / "mxfp4", workdir / "dense"
    if not (mx / "config.json").exists():
        torch.manual_seed(0)
        hf = transformers.AutoModelForCausalLM.from_config(transformers.GptOssConfig(**SHAPE), dtype=torch.float32)
        write_gpt_oss_mxfp4(hf, mx)
    if not (dense / "config.json").exists():
        deq = transformers.AutoModelForCausalLM.from_pretrained(
            mx, quantization_config=transformers.Mxfp4Config(dequantize=True), dtype=torch.float32
        )
        deq.config.quantization_config = None
        deq.save_pretrained(dense)
        config = json.loads((dense / "config.json").read_text())
        config.pop("quantization_config", None)
        (dense / "config.json").write_text(json.dumps(config))
    return mx, dense


def expert_bytes(core) -> int:
    from tokenmill.layers.fused_moe import FusedMoE

    moe = [m for m in core.executor.runner.model.modules() if isinstance(m, FusedMoE)]
    return sum(
        t.numel() * t.element_size() for m in moe for t in (*m.parameters(), *m.buffers()) if t is not m.expert_tokens
    )


def decode_rate(core, prompts: list[list[int]], tokens: int) -> float:
    """Tokens generated per second after the prefill step, all prompts together (the engine core
    stepped directly: the random checkpoints have no tokenizer)."""
    from tokenmill.engine.request import EngineCoreRequest
    from tokenmill.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        core.add_request(EngineCoreRequest(str(i), p, params))
    core.step()  # the prompts (one step: they fit the token budget) and each first token
    start, generated = time.perf_counter(), 0
    while core.has_unfinished():
        generated += sum(len(o.new_token_ids) for o in core.step())
    return generated / (time.perf_counter() - start)


def decode_table(engines: dict, prompts: list[list[int]], args, first_column: str) -> dict[str, tuple[float, float]]:
    """The engines taking turns for `args.rounds` rounds, one stream and the batch each: prints the markdown
    table (expert bytes, medians) and returns each engine's (1-stream, batch) medians."""
    rates: dict[str, dict[str, list[float]]] = {name: {"1": [], "batch": []} for name in engines}
    for _ in range(args.rounds):
        for name, core in engines.items():
            rates[name]["1"].append(decode_rate(core, prompts[:1], args.tokens))
            rates[name]["batch"].append(decode_rate(core, prompts, args.tokens))
    print(
        f"# {time.strftime('%Y-%m-%d')} {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"torch {torch.__version__}; decode {args.tokens} tokens after {args.prompt_len}, medians of {args.rounds}"
    )
    print(f"| {first_column} | expert bytes | 1 stream tok/s | {args.batch} streams tok/s |")
    print("|---|---|---|---|")
    medians = {n: (statistics.median(r["1"]), statistics.median(r["batch"])) for n, r in rates.items()}
    for name, core in engines.items():
        print(f"| {name} | {expert_bytes(core) / 2**20:.0f} MiB | {medians[name][0]:.1f} | {medians[name][1]:.1f} |")
    return medians


def decode_args(doc: str, workdir: str, written: str) -> argparse.ArgumentParser:
    """The decode benchmarks' flags (this script's and bench_moe_gguf.py's): rounds, tokens, prompt length,
    batch, and where the model files are written once (`written`: what is written there)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--rounds", type=int, default=3, help="rounds of turns; medians are reported (default: %(default)s)"
    )
    ap.add_argument("--tokens", type=int, default=32, help="tokens generated per request (default: %(default)s)")
    ap.add_argument("--prompt-len", type=int, default=128, help="prompt tokens per request (default: %(default)s)")
    ap.add_argument(
        "--batch", type=int, default=8, help="concurrent requests of the batched measurement (default: %(default)s)"
    )
    ap.add_argument(
        "--workdir", default=workdir, help=f"where {written} written, once: reused when present (default: %(default)s)"
    )
    return ap


def main() -> None:
    args = decode_args(__doc__, "/tmp/tokenmill-bench-gpt-oss", "the checkpoints are").parse_args()

    from helpers import make_core

    from tokenmill.kernels.decode_step import CompiledDecode
    from tokenmill.loader import load_model

    mx, dense = checkpoints(Path(args.workdir))
    budget = args.batch * args.prompt_len
    with mock.patch.object(CompiledDecode, "build", classmethod(lambda cls, parts: None)):  # built once, kept
        layers = make_core(str(mx), num_blocks=256, max_num_batched_tokens=budget)
    assert layers.executor.runner.model.model.compiled_decode[1] is None
    engines = {
        "MXFP4 experts": make_core(str(mx), num_blocks=256, max_num_batched_tokens=budget),
        "MXFP4 experts, layers from Python": layers,
        "dense float32 experts": make_core(
            str(dense),
            num_blocks=256,
            max_num_batched_tokens=budget,
            loaded=load_model(str(dense), quantization="none"),
        ),
    }
    prompts = [[(97 * i + 13 * j) % 32000 for j in range(args.prompt_len)] for i in range(args.batch)]
    for core in engines.values():
        decode_rate(core, prompts[:1], 4)  # warm-up
    medians = decode_table(engines, prompts, args, "experts")
    base = medians["MXFP4 experts"]
    dense_one, dense_many = medians["dense float32 experts"]
    print(f"\nMXFP4 / dense: 1 stream {base[0] / dense_one:.2f}x, {args.batch} streams {base[1] / dense_many:.2f}x")
    layers_one, layers_many = medians["MXFP4 experts, layers from Python"]
    print(
        f"MXFP4, compiled step / layers from Python: 1 stream {base[0] / layers_one:.2f}x, "
        f"{args.batch} streams {base[1] / layers_many:.2f}x"
    )


if __name__ == "__main__":
    main()
