"""The `tokenmill` command: info, generate, serve, router, disagg-proxy, bench, eval, plan, doctor,
train-draft-head."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
import time

from tokenmill.engine_args import DEFAULT_MODEL, add_engine_arg, add_engine_args, engine_config_from_args
from tokenmill.fields import from_attributes

# `tokenmill info`'s engine flags (their defaults and choices are the engine's), with help saying what info
# does with each
INFO_FLAGS = {
    "model": f"model: an alias ({DEFAULT_MODEL}), a .gguf file or an HF checkpoint directory (default: %(default)s)",
    "dtype": "compute dtype to report for (default: %(default)s)",
    "device": "torch device: cpu or cuda[:N] (default: %(default)s)",
    "quantization": "weight format to report for, resolved as `serve` resolves it (default: %(default)s)",
    "kv_cache_dtype": "KV cache dtype to report sizes for, as `serve` takes it (int8 / fp8_e4m3 / fp8_e5m2: "
    "quantized, with scales); auto as `serve` resolves it (default: %(default)s)",
}


def cmd_info(args: argparse.Namespace) -> None:
    import torch

    from tokenmill.config import resolve_cache_dtype, resolve_device, resolve_dtype
    from tokenmill.layers.attention import Attention
    from tokenmill.layers.fused_moe import FusedMoE
    from tokenmill.layers.mla import MLAAttention
    from tokenmill.loader import build_model, open_checkpoint
    from tokenmill.loader.source import resolve_model
    from tokenmill.quantization import resolve_quantization
    from tokenmill.quantization.unquantized import UnquantizedConfig

    source = resolve_model(args.model)
    ckpt = open_checkpoint(source)
    c = ckpt.config
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device, c.torch_dtype)
    method = resolve_quantization(
        args.quantization,
        source.kind,
        device,
        dtype,
        exact=args.dtype != "auto",
        checkpoint_method=getattr(ckpt, "quant_method", None),
    )
    cache_dtype = resolve_cache_dtype(args.kv_cache_dtype, dtype, method)
    model = build_model(c, UnquantizedConfig(), dtype, torch.device("meta"))  # shapes only, no memory
    params = sum(p.numel() for p in model.parameters())
    moe = [m for m in model.modules() if isinstance(m, FusedMoE)]
    attention = [m for m in model.modules() if isinstance(m, Attention)]
    kv_bytes = sum(m.kv_spec(cache_dtype).bytes_per_token for m in attention)
    windows = {m.sliding_window for m in attention}
    rows = [
        ("model", source.name),
        ("file", str(source.path)),
        ("format", source.kind),
        ("architecture", c.architecture),
        ("parameters", _count(params)),
        ("dtype", str(dtype)),
        ("weights", method),
        ("layers", c.num_hidden_layers),
        ("hidden size", c.hidden_size),
        ("heads", c.num_attention_heads),
        ("kv heads", c.num_key_value_heads),
        ("head dim", c.head_dim),
        ("vocab", c.vocab_size),
        ("context length", c.max_position_embeddings),
        ("rope theta", c.rope_theta),
        ("rope scaling", c.rope_scaling or "none"),
        ("tied embeddings", c.tie_word_embeddings),
        ("KV bytes per token", f"{kv_bytes} ({cache_dtype})"),
        *_context_parallel_rows(args.decode_context_parallel_size, kv_bytes),
        ("KV tokens per GiB", _kv_tokens_per_gib(attention, cache_dtype)),
        # the disk tier (--kv-cache-dir) stores the pool's own bytes, one file per block; the RAM tier
        # (--kv-offloading-size) a block's bytes per slot, nothing more
        (
            "KV bytes per token by tier",
            f"pool {kv_bytes}, disk {kv_bytes} + a header per block of tokens, RAM {kv_bytes}",
        ),
    ]
    if windows - {None}:
        window = min(windows - {None})
        windowed = sum(m.sliding_window is not None for m in attention)
        rows.append(("sliding window", f"{window} tokens in {windowed} of {len(attention)} layers"))
        # out-of-window blocks return to their pool: a window layer holds the window and a partial block
        # each side (block size 16) plus the prefill chunk
        windowed_bytes = sum(m.kv_spec(cache_dtype).bytes_per_token for m in attention if m.sliding_window is not None)
        bound = (window + 2 * 16) * windowed_bytes
        if None not in windows:
            rows.append(("KV bytes per sequence", f"at most ~{bound} (window + 2 blocks) plus the prefill chunk"))
        else:
            rows.append(
                (
                    "KV bytes per sequence",
                    f"{kv_bytes - windowed_bytes} per token (full-attention layers) + at most ~{bound} (window layers)",
                )
            )
    mla = [m for m in model.modules() if isinstance(m, MLAAttention)]
    if mla:
        expanded = sum(m.expanded_kv_bytes_per_token(cache_dtype) for m in mla)
        rows.append(
            (
                "KV layout",
                f"latent (MLA): {mla[0].kv_lora_rank} + {mla[0].rope_dim} rope values per token "
                f"and layer; full per-head K/V would be {expanded} bytes per token "
                f"({expanded / kv_bytes:.1f}x)",
            )
        )
    if moe:
        active = params - sum(m.inactive_parameters() for m in moe)
        rows[5:5] = [
            ("active parameters", f"{_count(active)} per token"),
            ("experts", f"{moe[0].num_experts}, {moe[0].top_k} per token, in {len(moe)} layers"),
        ]
    if args.load:
        rows += _weight_rows(args)
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")


def _context_parallel_rows(size: int, kv_bytes: int) -> list[tuple[str, str]]:
    """With --decode-context-parallel-size N: what each rank stores of a token's K/V (its stripe of
    every sequence: 1/N of the tokens, `tokenmill.attention.context_parallel`)."""
    if size == 1:
        return []
    return [("KV bytes per token per rank", f"{kv_bytes // size} (context parallelism over {size} ranks)")]


def _weight_rows(args: argparse.Namespace) -> list[tuple[str, str]]:
    """Load the weights as `serve` would: seconds, bytes used from the file's map vs copied, RSS."""
    from tokenmill.loader import load_model
    from tokenmill.loader.residency import weight_residency

    start = time.perf_counter()
    loaded = load_model(args.model, args.dtype, args.device, quantization=args.quantization)
    seconds = time.perf_counter() - start
    r = weight_residency(loaded)
    mib = 2**20
    return [
        ("load time", f"{seconds:.1f} s"),
        (
            "weights mapped / copied",
            f"{r['mapped'] / mib:.1f} / {r['copied'] / mib:.1f} MiB (file {r['file'] / mib:.1f} MiB)",
        ),
        ("resident memory after load", f"{r['rss'] / mib:.0f} MiB"),
        ("of it the file's pages", f"{r['rss_file'] / mib:.0f} MiB"),
    ]


def _kv_tokens_per_gib(attention: list, chosen) -> str:
    """Tokens of KV cache in 1 GiB with the chosen cache dtype, then with each kind of cache (every layer
    counted per token: a sliding-window model fits more)."""
    import torch

    def per_gib(dtype: torch.dtype) -> str:
        return f"{2**30 // sum(m.kv_spec(dtype).bytes_per_token for m in attention):,}"

    kinds = {
        "float32": torch.float32,
        "float16/bfloat16": torch.float16,
        "int8": torch.int8,
        "fp8": torch.float8_e4m3fn,
    }
    return f"{per_gib(chosen)} ({chosen}); " + ", ".join(f"{name} {per_gib(dt)}" for name, dt in kinds.items())


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.1f}K"


def cmd_generate(args: argparse.Namespace) -> None:
    from tokenmill.engine.llm_engine import LLMEngine
    from tokenmill.sampling_params import SamplingParams

    engine = LLMEngine(engine_config_from_args(args))
    tok = engine.tokenizer
    prompt = (
        tok.apply_chat_template([{"role": "user", "content": args.prompt}]) if args.chat else tok.encode(args.prompt)
    )
    params = from_attributes(SamplingParams, args, seed=args.sampling_seed)  # the flags named as its fields
    start = time.perf_counter()
    engine.add_request("cli", prompt, params)
    n_out = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            sample = out.outputs[0]
            n_out = len(sample.token_ids)
            sys.stdout.write(sample.delta_text)
            sys.stdout.flush()
    elapsed = time.perf_counter() - start
    print(
        f"\n[{len(prompt)} prompt tokens, {n_out} generated in {elapsed:.2f}s, {n_out / elapsed:.1f} tok/s]",
        file=sys.stderr,
    )


# the commands that live in their own packages -> the module and function that add their parser; only the
# module of the command being run is imported (`tokenmill router` never loads the engine or torch)
OPTIONAL_COMMANDS = {
    "serve": ("tokenmill.server.cli", "add_serve_parser"),
    "router": ("tokenmill.router.cli", "add_router_parser"),
    "disagg-proxy": ("tokenmill.kv_transfer.cli", "add_proxy_parser"),
    "bench": ("tokenmill.bench.cli", "add_bench_parser"),
    "eval": ("tokenmill.eval.cli", "add_eval_parser"),
    "plan": ("tokenmill.plan.cli", "add_plan_parser"),
    "doctor": ("tokenmill.doctor.cli", "add_doctor_parser"),
    "train-draft-head": ("tokenmill.tools.train_head", "add_train_head_parser"),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole command line; with `command` (one of OPTIONAL_COMMANDS) only that one of them."""
    parser = argparse.ArgumentParser(prog="tokenmill", description="LLM inference engine and OpenAI-compatible server")
    parser.add_argument("--log-level", default="INFO", help="logging level (default: %(default)s)")
    sub = parser.add_subparsers(dest="command", required=True)

    info = sub.add_parser(
        "info",
        help="show a model's architecture, size and KV cache cost",
        description="Show a model's architecture, size and KV cache cost without loading weights.",
    )
    for name, text in INFO_FLAGS.items():
        add_engine_arg(info, name, text)
    info.add_argument(
        "--load",
        action="store_true",
        help="also load the weights: load time, bytes used from the file's memory map vs copied or "
        "repacked, resident memory after load",
    )
    add_engine_arg(
        info,
        "decode_context_parallel_size",
        "also show each rank's KV bytes per token when sequences are striped over N ranks (default: %(default)s)",
    )
    info.set_defaults(func=cmd_info)

    gen = sub.add_parser(
        "generate",
        help="generate text for one prompt, streamed to the terminal",
        description="Generate a completion for one prompt and stream it to the terminal.",
    )
    add_engine_args(gen)
    gen.add_argument("--prompt", required=True, help="the prompt text")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    gen.add_argument("--max-tokens", type=int, default=256, help="most tokens to generate (default: %(default)s)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: %(default)s)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold (default: %(default)s)")
    gen.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens; 0 = off")
    gen.add_argument("--sampling-seed", type=int, default=None, help="seed for this request's sampling")
    gen.set_defaults(func=cmd_generate)

    for name, (module, add_parser) in OPTIONAL_COMMANDS.items():
        if command in (None, name):
            getattr(importlib.import_module(module), add_parser)(sub)
    return parser


def _command_of(argv: list[str]) -> str | None:
    """The optional command `argv` runs, if it names one (else None: every parser is built)."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--log-level")
    pre.add_argument("command", nargs="?")
    known, _ = pre.parse_known_args(argv)
    return known.command if known.command in OPTIONAL_COMMANDS else None


def run_command(args: argparse.Namespace, errors: tuple[type[Exception], ...]) -> None:
    """Log at the parsed --log-level and run the parsed command (`args.func`); an error of `errors` is
    one line on stderr and exit status 2, not a traceback. `tokenmill` and `python -m tokenmill.bench.cli`."""
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        args.func(args)
    except errors as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    run_command(build_parser(_command_of(argv)).parse_args(argv), (ValueError, FileNotFoundError, ConnectionError))


if __name__ == "__main__":
    main()
