"""Throughput of a batch mixing 4 LoRA adapters against the base model alone (in-process engine).

Random rank-R PEFT adapters of every attention and MLP projection are written for the model (no
training: the cost does not depend on the values), loaded at run time, and each run generates
--output-len tokens for --prompts random prompts of --prompt-len tokens: all on the base model, all
on one adapter, and spread over the 4 adapters (request i on adapter i % 4). The mixed batch also runs
on the paths before the CPU kernel, to see where the time goes: `torch path` (the adapters' products
as torch ops per adapter group, and a step with adapters running the layers one by one instead of
the compiled decode step, as before) and `kernel, layers` (the C++ LoRA kernel in each layer, but
still no compiled decode step). One engine serves every run (a batch without adapters runs exactly
as with LoRA off); runs alternate, --repeats times; medians of output tokens/s, each against the
base model's, by wall time and by the CPU time the process got.

    .venv/bin/python benchmarks/bench_lora.py [--model smollm2-135m-instruct] [--rank 16] [--repeats 3]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from tokenmill import LLM, SamplingParams
from tokenmill.kernels import decode_step
from tokenmill.kernels import lora as lora_kernel
from tokenmill.layers.forward_context import current_lora_batch

ADAPTERS = 4
PROJECTIONS = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}


def write_adapter(directory: Path, config, rank: int, seed: int) -> None:
    """A PEFT adapter directory with random factors for every projection of `config`'s layers."""
    g = torch.Generator().manual_seed(seed)
    h, kv, inter = config.hidden_size, config.num_key_value_heads * config.head_dim, config.intermediate_size
    q = config.num_attention_heads * config.head_dim
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h)}
    shapes |= {"gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for block, names in PROJECTIONS.items():
            for name in names:
                fan_in, fan_out = shapes[name]
                stem = f"base_model.model.model.layers.{layer}.{block}.{name}"
                tensors[f"{stem}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) * 0.02
                tensors[f"{stem}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.02
    directory.mkdir(parents=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    targets = [n for names in PROJECTIONS.values() for n in names]
    (directory / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": targets})
    )


@contextlib.contextmanager
def older_path(kernel: bool):
    """The adapters as before the compiled decode step ran them: steps with adapter tokens run the layers
    one by one, each adding its deltas with the C++ kernel (`kernel`) or torch ops per adapter group."""
    applies, kernel_applies = decode_step.CompiledDecode.applies, lora_kernel.applies
    decode_step.CompiledDecode.applies = lambda self, *a: current_lora_batch() is None and applies(self, *a)
    if not kernel:
        lora_kernel.applies = lambda *a: False
    try:
        yield
    finally:
        decode_step.CompiledDecode.applies, lora_kernel.applies = applies, kernel_applies


def one_run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[float, float]:
    """Output tokens per second of one batch (prompts not in the prefix cache), and per CPU second this
    process used (every thread's): on a shared machine the second depends less on what else runs."""
    llm.engine.core.reset_prefix_cache()
    start, cpu = time.perf_counter(), time.process_time()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return tokens / (time.perf_counter() - start), tokens / (time.process_time() - cpu)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct", help="base model alias or path (default: %(default)s)")
    ap.add_argument("--rank", type=int, default=16, help="LoRA rank of the random adapters (default: %(default)s)")
    ap.add_argument("--prompts", type=int, default=16, help="requests in each batch (default: %(default)s)")
    ap.add_argument(
        "--prompt-len", type=int, default=64, help="random prompt tokens per request (default: %(default)s)"
    )
    ap.add_argument("--output-len", type=int, default=32, help="tokens generated per request (default: %(default)s)")
    ap.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="runs of each variant, alternating; medians reported (default: %(default)s)",
    )
    args = ap.parse_args()
    llm = LLM(args.model, enable_lora=True, max_loras=ADAPTERS, max_lora_rank=args.rank)
    config = llm.engine.core.model_config
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(ADAPTERS):  # loaded at run time, as POST /v1/load_lora_adapter does
            write_adapter(Path(tmp) / f"lora{i}", config, args.rank, seed=i)
            llm.engine.core.load_lora(f"lora{i}", str(Path(tmp) / f"lora{i}"))
        rng = random.Random(0)
        prompts = [[rng.randrange(config.vocab_size) for _ in range(args.prompt_len)] for _ in range(args.prompts)]

        def params(names: list[str | None]) -> list[SamplingParams]:
            return [
                SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True, lora_name=n) for n in names
            ]

        mixed = params([f"lora{i % ADAPTERS}" for i in range(args.prompts)])
        runs = {  # name: (params, the path's context)
            "base model": (params([None] * args.prompts), contextlib.nullcontext),
            "one adapter": (params(["lora0"] * args.prompts), contextlib.nullcontext),
            f"{ADAPTERS} adapters mixed": (mixed, contextlib.nullcontext),
            "mixed, kernel, layers": (mixed, lambda: older_path(kernel=True)),
            "mixed, torch path": (mixed, lambda: older_path(kernel=False)),
        }
        one_run(llm, prompts[:2], runs["one adapter"][0][:2])  # warm-up
        rates: dict[str, list[tuple[float, float]]] = {name: [] for name in runs}
        for _ in range(args.repeats):
            for name, (ps, path) in runs.items():
                with path():
                    rates[name].append(one_run(llm, prompts, ps))
    llm.shutdown()
    base = [statistics.median(r[i] for r in rates["base model"]) for i in (0, 1)]
    print(f"{args.model}, rank {args.rank}, {args.prompts} prompts x {args.prompt_len} + {args.output_len} tokens")
    for name, values in rates.items():
        wall, cpu = (statistics.median(v[i] for v in values) for i in (0, 1))
        print(
            f"{name:>22}: {wall:8.1f} output tok/s ({wall / base[0]:.2f}x base), "
            f"{cpu:8.1f} per CPU second ({cpu / base[1]:.2f}x base)"
        )


if __name__ == "__main__":
    main()
