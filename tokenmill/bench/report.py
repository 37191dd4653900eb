"""Results out: JSON files (strict JSON: infinities are written as strings) and rich tables in the terminal."""

from __future__ import annotations

import json
import math
from pathlib import Path

from rich.console import Console
from rich.table import Table

from tokenmill.bench.metrics import LATENCY_METRICS, PERCENTILES

LATENCY_NAMES = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "E2E latency"}
_STATS = ("mean", "median", "std", *(f"p{p}" for p in PERCENTILES))


# ---------------------------------------------------------------------------------------------- JSON


def _strict(obj):
    """Non-finite floats as strings ("inf"), so the file is standard JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _strict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_strict(v) for v in obj]
    return obj


def write_json(result: dict, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_strict(result), indent=1, allow_nan=False) + "\n")
    return path


def load_json(path: str | Path) -> dict:
    result = json.loads(Path(path).read_text())
    if not isinstance(result, dict) or "tokenmill_bench" not in result:
        raise ValueError(f"{path} is not a tokenmill bench result file")
    return result


# ---------------------------------------------------------------------------------------------- formatting


def fmt(value, digits: int = 2, unit: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}{unit}"
    return f"{value:,.{digits}f}{unit}"


def pct(value) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def load_label(result: dict) -> str:
    cfg = result.get("config", {})
    parts = []
    if cfg.get("max_concurrency") is not None:
        parts.append(f"concurrency {cfg['max_concurrency']}")
    rate = cfg.get("request_rate")
    parts.append("rate inf" if rate in (None, "inf") or rate == math.inf else f"rate {rate}/s")
    return ", ".join(parts)


# ---------------------------------------------------------------------------------------------- one run


def run_table(result: dict) -> Table:
    s, cfg = result["summary"], result.get("config", {})
    title = f"tokenmill bench {result['kind']}" + (f": {result['label']}" if result.get("label") else "")
    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column("metric", style="bold")
    table.add_column("value", justify="right")

    def section(name: str) -> None:
        if table.row_count:
            table.add_section()
        table.add_row(f"[cyan]{name}[/cyan]", "")

    section("workload")
    table.add_row("target", str(cfg.get("base_url") or cfg.get("model") or "-"))
    table.add_row("dataset", f"{cfg.get('dataset', '-')} ({load_label(result)})")
    table.add_row("requests completed / failed", f"{s['completed']} / {s['failed']}")
    if s.get("planned_requests") and s["planned_requests"] != s["num_requests"]:
        table.add_row("requests not sent (--max-duration)", fmt(s["planned_requests"] - s["num_requests"]))
    table.add_row("duration", fmt(s["duration_s"], unit=" s"))
    table.add_row("input / output tokens", f"{fmt(s['total_input_tokens'])} / {fmt(s['total_output_tokens'])}")
    section("throughput")
    table.add_row("requests/s", fmt(s["request_throughput"], 3))
    table.add_row("input tokens/s", fmt(s["input_throughput"], 1))
    table.add_row("output tokens/s", fmt(s["output_throughput"], 1))
    table.add_row("total tokens/s", fmt(s["total_token_throughput"], 1))
    table.add_row("achieved concurrency", fmt(s["achieved_concurrency"]))
    if s.get("slo"):
        slo = ", ".join(f"{k}<={v:g}ms" for k, v in s["slo"].items())
        table.add_row(f"goodput ({slo})", fmt(s["goodput"], 3, " req/s"))
        table.add_row("SLO attainment", pct(s["slo_attainment"]))
    server = result.get("server_metrics") or {}
    if server.get("exposed") or s.get("client_cached_tokens") is not None:
        section("server cache")
    if server.get("exposed"):
        table.add_row("prefix cache hit rate (/metrics)", pct(server.get("prefix_cache_hit_rate")))
        for tier, t in (server.get("kv_tiers") or {}).items():
            table.add_row(
                f"KV {tier} tier hit rate (/metrics)", f"{pct(t['hit_rate'])} of {fmt(int(t['queries']))} tokens"
            )
        table.add_row(
            "KV cache usage before / after / peak",
            " / ".join(
                pct(server.get(k)) for k in ("kv_cache_usage_before", "kv_cache_usage_after", "kv_cache_usage_max")
            ),
        )
    if server.get("moe"):
        moe = server["moe"]
        table.add_row(
            "MoE load imbalance max / mean (max/mean tokens per expert)",
            f"{fmt(moe['load_imbalance_max'], 2)} / {fmt(moe['load_imbalance_mean'], 2)} "
            f"over {moe['moe_layers']} layers",
        )
        if moe.get("rank_tokens"):
            table.add_row(
                "MoE tokens per expert-parallel rank (imbalance)",
                f"{' / '.join(fmt(int(n)) for n in moe['rank_tokens'])} ({fmt(moe['rank_imbalance'], 2)})",
            )
    if s.get("client_cached_tokens") is not None and s["total_input_tokens"]:
        table.add_row(
            "prompt tokens cached (usage)",
            f"{fmt(s['client_cached_tokens'])} ({pct(s['client_cached_tokens'] / s['total_input_tokens'])})",
        )
    steps = server.get("steps")
    if steps and s["duration_s"]:
        section("engine steps (/metrics)")
        for kind, label in (("decode", "decode steps (newest tokens only)"), ("prompt", "steps with prompt tokens")):
            k = steps.get(kind)
            if k and k["steps"]:
                table.add_row(
                    label,
                    f"{fmt(k['steps'])} x {fmt(k['mean_ms'], 1)} ms, {fmt(k['tokens'] / k['steps'], 1)} tokens each: "
                    f"{pct(k['seconds'] / s['duration_s'])} of the run",
                )
    spec = server.get("spec")
    if spec:
        section("speculative decoding (/metrics)")
        table.add_row(
            "verify steps / drafted / accepted tokens",
            f"{fmt(spec['drafts'])} / {fmt(spec.get('draft_tokens'))} / {fmt(spec.get('accepted_tokens'))}",
        )
        table.add_row("acceptance rate", pct(spec.get("acceptance_rate")))
        table.add_row("mean tokens per verify step", fmt(spec.get("mean_accepted_length"), 2))
        if spec.get("acceptance_per_position"):
            table.add_row("acceptance by draft position", " / ".join(pct(r) for r in spec["acceptance_per_position"]))
        if spec.get("draft_seconds") is not None and spec.get("verify_seconds") is not None:
            table.add_row(
                "time drafting / verifying", f"{fmt(spec['draft_seconds'], 2)} s / {fmt(spec['verify_seconds'], 2)} s"
            )
    util = result.get("utilization") or {}
    if util.get("server_cpu_percent") or util.get("gpu"):
        section("utilization")
        if util.get("server_cpu_percent"):
            cpu = util["server_cpu_percent"]
            table.add_row("server CPU % mean / max (100 = 1 core)", f"{fmt(cpu['mean'], 0)} / {fmt(cpu['max'], 0)}")
            main = util.get("server_main_cpu_percent")
            if main:
                table.add_row(
                    "  of it the server's main process (tokenmill: the HTTP front end)",
                    f"{fmt(main['mean'], 0)} / {fmt(main['max'], 0)}",
                )
        for gpu in util.get("gpu") or []:
            table.add_row(
                f"GPU {gpu['device']} util % mean / max",
                f"{fmt(gpu['util_percent']['mean'], 0)} / {fmt(gpu['util_percent']['max'], 0)}",
            )
    roofline = result.get("roofline") or {}
    if roofline.get("none"):
        section("roofline")
        table.add_row("not computed", roofline["none"])
    elif roofline:
        section(f"roofline: {roofline['hardware']} ({roofline['weight_format']} weights)")
        for row in roofline_rows(roofline):
            table.add_row(*row)
    cpu = util.get("server_cpu")
    if cpu:
        section("server CPU over the run")
        share = (
            f" ({pct(cpu['share_of_this_machine'])} of this machine's {cpu['cpu_count']})" if cpu["cpu_count"] else ""
        )
        table.add_row("cores busy", f"{fmt(cpu['cores_busy'], 2)}{share}")
        table.add_row("measured from", cpu["source"])
    cost = result.get("cost")
    if cost:
        section(f"cost at ${cost['cost_per_hour']:g}/h")
        table.add_row("$ per 1M input tokens", fmt(cost["per_1m_input_tokens"], 4))
        table.add_row("$ per 1M output tokens", fmt(cost["per_1m_output_tokens"], 4))
        table.add_row("$ per request", fmt(cost["per_request"], 6))
    return table


def roofline_rows(r: dict) -> list[tuple[str, str]]:
    """(figure, its share of the machine's roofline) lines of a result's `roofline`."""
    rows = []
    if r.get("decode"):
        d = r["decode"]
        rows.append(
            (
                f"decode (TPOT p50 at batch {d['batch']:.1f}): memory bandwidth",
                f"{d['achieved_bytes_per_s'] / 1e9:,.3g} of {d['machine_bytes_per_s'] / 1e9:,.3g} GB/s = {pct(d['share'])}",
            )
        )
    for key, name in (("prefill", "prefill (mean prompt / TTFT p50)"), ("throughput", "all tokens of the run")):
        if r.get(key):
            c = r[key]
            rows.append(
                (
                    f"{name}: {c['compute']} compute",
                    f"{c['achieved_flops_per_s'] / 1e9:,.1f} of {c['machine_flops_per_s'] / 1e9:,.1f} GFLOP/s "
                    f"= {pct(c['share'])}",
                )
            )
    return rows


def latency_table(summary: dict) -> Table:
    table = Table(title="latency (ms)", title_justify="left")
    table.add_column("metric", style="bold")
    for stat in _STATS:
        table.add_column(stat, justify="right")
    for key in LATENCY_METRICS:
        d = summary[f"{key}_ms"]
        table.add_row(LATENCY_NAMES[key], *(fmt(d[stat]) for stat in _STATS))
    return table


def errors_table(summary: dict) -> Table | None:
    if not summary.get("errors"):
        return None
    table = Table(title="failed requests", title_justify="left")
    table.add_column("count", justify="right")
    table.add_column("error")
    for error, count in summary["errors"].items():
        table.add_row(str(count), error or "(no error text)")
    return table


def print_run(result: dict, console: Console | None = None) -> None:
    console = console or Console()
    console.print(run_table(result))
    console.print(latency_table(result["summary"]))
    errors = errors_table(result["summary"])
    if errors is not None:
        console.print(errors)


# ---------------------------------------------------------------------------------------------- sweeps


def sweep_table(result: dict) -> Table:
    by = result["sweep_by"]
    table = Table(title=f"sweep over {by.replace('_', ' ')}", title_justify="left")
    columns = [
        by.replace("_", " "),
        "req/s",
        "out tok/s",
        "TTFT p50",
        "TTFT p99",
        "TPOT p50",
        "TPOT p99",
        "ITL p99",
        "E2E p99",
        "failed",
    ]
    if result.get("slo"):
        columns += ["goodput", "SLO met"]
    for c in columns:
        table.add_column(c, justify="right")
    knee = (result.get("knee") or {}).get("load")
    for point in result["points"]:
        s = point["summary"]
        row = [
            fmt(point["load"], 3).rstrip("0").rstrip("."),
            fmt(s["request_throughput"], 3),
            fmt(s["output_throughput"], 1),
            fmt(s["ttft_ms"]["p50"], 1),
            fmt(s["ttft_ms"]["p99"], 1),
            fmt(s["tpot_ms"]["p50"], 1),
            fmt(s["tpot_ms"]["p99"], 1),
            fmt(s["itl_ms"]["p99"], 1),
            fmt(s["e2el_ms"]["p99"], 1),
            str(s["failed"]),
        ]
        if result.get("slo"):
            row += [fmt(s["goodput"], 3), pct(s["slo_attainment"])]
        table.add_row(*row, style="bold green" if point["load"] == knee else None)
    return table


def print_sweep(result: dict, console: Console | None = None) -> None:
    console = console or Console()
    console.print(sweep_table(result))
    errors: dict[str, int] = {}
    for point in result["points"]:
        for error, count in point["summary"]["errors"].items():
            errors[error] = errors.get(error, 0) + count
    if errors:
        console.print(errors_table({"errors": errors}))
    if not result.get("slo"):
        console.print("no --slo given: no knee")
    elif result.get("knee"):
        console.print(
            f"knee (highest load with >= {pct(result['min_slo_attainment'])} of requests within the SLO): "
            f"[bold green]{result['sweep_by']} = {result['knee']['load']:g}[/bold green]"
        )
    else:
        console.print("[red]no load met the SLO[/red]")


# ---------------------------------------------------------------------------------------------- compare

COMPARE_ROWS = [
    ("requests completed", lambda s: s["completed"], 0),
    ("requests failed", lambda s: s["failed"], 0),
    ("requests/s", lambda s: s["request_throughput"], 3),
    ("output tokens/s", lambda s: s["output_throughput"], 1),
    ("total tokens/s", lambda s: s["total_token_throughput"], 1),
    ("goodput req/s", lambda s: s["goodput"], 3),
    *[
        (f"{LATENCY_NAMES[k]} {stat} (ms)", lambda s, k=k, stat=stat: s[f"{k}_ms"][stat], 1)
        for k in LATENCY_METRICS
        for stat in ("median", "p99")
    ],
]


def runs_of(result: dict, name: str | None = None) -> list[tuple[str, dict]]:
    """(name, run result) pairs: the run itself, or each point of a sweep ("<name> <point label>")."""
    name = name or result.get("label") or result["kind"]
    if result["kind"] == "sweep":
        return [(f"{name} {p['label']}", p) for p in result["points"]]
    return [(name, result)]


def compare_table(named: list[tuple[str, dict]]) -> Table:
    table = Table(title="comparison", title_justify="left")
    table.add_column("metric", style="bold")
    for name, _ in named:
        table.add_column(name, justify="right")
    for title, get, digits in COMPARE_ROWS:
        table.add_row(title, *(fmt(get(r["summary"]), digits) for _, r in named))
    return table
