"""`tokenmill plan`: the command line and its tables (rich), or the same data as JSON."""

from __future__ import annotations

import argparse
import json

from tokenmill.engine_args import add_engine_arg
from tokenmill.plan.hardware import HARDWARE
from tokenmill.plan.model_facts import KV_DTYPE_BYTES


def add_plan_parser(sub) -> None:
    plan = sub.add_parser(
        "plan",
        help="estimate memory, fit and speed of a model on some hardware, without running it",
        description="From the model's config alone: weight bytes per format, KV bytes per token, how many "
        "sequences fit, decode and prefill rooflines, and what quantization, a quantized KV cache, "
        "speculative decoding or tensor parallelism would change.",
    )
    add_engine_arg(plan, "model", "alias, .gguf file or HF directory (default: %(default)s)")
    plan.add_argument(
        "--hardware",
        default="auto",
        help=f"auto (this machine, measured once and cached) or one of {', '.join(HARDWARE)} (default: %(default)s)",
    )
    plan.add_argument(
        "--remeasure",
        action="store_true",
        help="with --hardware auto: measure this machine again (run it when the machine is idle)",
    )
    plan.add_argument("--context", type=int, default=4096, help="tokens per sequence (default: %(default)s)")
    plan.add_argument("--concurrency", type=int, default=1, help="sequences decoding together (default: %(default)s)")
    plan.add_argument(
        "--kv-cache-dtype",
        default="float16",
        choices=[k for k in KV_DTYPE_BYTES if k != "bfloat16"],
        help="KV cache dtype of the main tables (default: %(default)s)",
    )
    plan.add_argument(
        "--memory-gib", type=float, default=None, help="memory for weights + KV (default: 90%% of the hardware's)"
    )
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan.set_defaults(func=cmd_plan)


def cmd_plan(args: argparse.Namespace) -> None:
    from tokenmill.plan.hardware import resolve_hardware
    from tokenmill.plan.model_facts import model_facts
    from tokenmill.plan.report import build_plan

    for name in ("context", "concurrency"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be at least 1, got {getattr(args, name)}")
    memory = None if args.memory_gib is None else args.memory_gib * 2**30
    hardware = resolve_hardware(args.hardware, args.remeasure)
    plan = build_plan(model_facts(args.model), hardware, args.context, args.concurrency, args.kv_cache_dtype, memory)
    if args.json:
        print(json.dumps(plan, indent=1))
    else:
        render(plan)


def render(p: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    m, hw = p["model"], p["hardware"]
    params = f"{_n(m['total_params'])} parameters"
    if m["experts"]:
        params += f", {_n(m['active_params'])} active ({m['experts_per_token']} of {m['experts']} experts)"
    rates = ", ".join(f"{k} {v / 1e12:,.3g} TFLOP/s" for k, v in hw["flops"].items())
    console.print(
        f"[bold]{m['name']}[/] ({m['architecture']}, {params}, {m['weights']}) on [bold]{hw['name']}[/]: "
        f"{hw['memory_bytes'] / 1e9:.0f} GB at {hw['bandwidth'] / 1e9:,.0f} GB/s, "
        f"{rates}  [dim]({hw['source']})[/]"
    )
    console.print(
        f"context {p['context']}, concurrency {p['concurrency']}, KV {p['kv_dtype']}, "
        f"{p['memory_for_model'] / 1e9:.1f} GB for weights + KV; the longest context one sequence fits: "
        f"{p['max_context_one_sequence']:,} (model: {m['max_context']:,})"
    )
    c = p["concurrency"]
    _table(
        console,
        "Weight formats",
        ["format", "bytes", "bits/weight", "sequences fit", "decode b=1 tok/s", f"decode b={c} tok/s", "prefill tok/s"],
        [
            [
                w["format"],
                _b(w["bytes"]),
                f"{w['bits_per_weight']:.2f}",
                w["sequences_that_fit"],
                _r(w["decode_batch1_tokens_per_s"]),
                _r(w["decode_tokens_per_s"]),
                _r(w["prefill_tokens_per_s"]),
            ]
            for w in p["weights"]
        ],
        Table,
    )
    _table(
        console,
        "KV cache",
        ["dtype", "bytes/token", f"bytes/sequence ({p['context']})", "sequences fit", f"decode b={c} tok/s"],
        [
            [
                k["dtype"],
                f"{k['bytes_per_token']:,}",
                _b(k["bytes_per_sequence"]),
                k["sequences_that_fit"],
                _r(k["decode_tokens_per_s"]),
            ]
            for k in p["kv"]
        ],
        Table,
    )
    _table(
        console,
        f"Decode roofline ({p['weights'][0]['format']} weights, compute at {p['compute']})",
        ["batch", "tok/s", "step ms", "bytes/step", "bound"],
        [
            [d["batch"], _r(d["tokens_per_s"]), f"{d['seconds'] * 1e3:.2f}", _b(d["bytes"]), d["bound"]]
            for d in p["decode"]
        ],
        Table,
    )
    _table(
        console,
        "Speculative decoding and tensor parallelism",
        ["option", "decode b=1", f"decode b={c}"],
        [
            [
                f"spec: acceptance {s['acceptance']}, {s['drafts']} drafts ({s['tokens_per_step']:.2f} tokens/step)",
                f"{s['speedup_batch1']:.2f}x",
                f"{s['speedup']:.2f}x",
            ]
            for s in p["speculative"]
        ]
        + [
            [
                f"tensor parallel x{t['devices']} (fits {t['sequences_that_fit']})",
                _r(t["decode_batch1_tokens_per_s"]) + " tok/s",
                _r(t["decode_tokens_per_s"]) + " tok/s",
            ]
            for t in p["tensor_parallel"]
        ],
        Table,
    )
    for line in p["recommendations"]:
        console.print(f"- {line}")


def _table(console, title: str, columns: list[str], rows: list[list], table_cls) -> None:
    table = table_cls(title=title, title_justify="left")
    for i, col in enumerate(columns):
        table.add_column(col, justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*(str(x) for x in row))
    console.print(table)


def _n(x: float) -> str:
    return f"{x / 1e9:.2f}B" if x >= 1e9 else f"{x / 1e6:.1f}M" if x >= 1e6 else f"{x / 1e3:.1f}K"


def _b(x: float) -> str:
    return f"{x / 1e9:.2f} GB" if x >= 1e9 else f"{x / 1e6:.1f} MB" if x >= 1e6 else f"{x / 1e3:.1f} KB"


def _r(x: float) -> str:
    return f"{x:,.0f}" if x >= 10 else f"{x:.2f}"
