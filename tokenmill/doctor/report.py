"""The doctor's report: the measured figures in a few lines, then each finding (what limits the
deployment, the numbers behind it, what to change), as text or as one JSON object."""

from __future__ import annotations

from dataclasses import asdict

from tokenmill.doctor.rules import Evidence, Finding

_MARKS = {2: "!!", 1: "! ", 0: "- "}


def as_dict(target: str, ev: Evidence, findings: list[Finding]) -> dict:
    return {
        "target": target,
        "probe": ev.probe,
        "window": ev.window,
        "engine": ev.engine,
        "roofline": ev.roofline,
        "slo_ttft_s": ev.slo_ttft,
        "findings": [asdict(f) for f in findings],
    }


def _s(x: float | None, unit: str = "s") -> str:
    if x is None:
        return "-"
    return f"{x * 1e3:,.1f} ms" if unit == "s" and x < 1 else f"{x:,.2f} {unit}"


def summary_lines(ev: Evidence) -> list[str]:
    p, w, e = ev.probe, ev.window, ev.engine
    lines = []
    if p:
        step = p.get("decode_step")
        lines.append(
            f"alone: first token {_s(p.get('single_ttft'))}, decode {_s(step)} a token"
            + (f" ({1 / step:,.1f} tokens/s)" if step else "")
        )
        if p.get("concurrency"):
            lines.append(
                f"{p['concurrency']} at once: first token {_s(p.get('concurrent_ttft_p50'))} (median), "
                f"{p.get('concurrent_output_tokens_per_s') or 0:,.1f} output tokens/s"
            )
        if p.get("long_ttft") is not None:
            lines.append(f"a {p['long_prompt_tokens']:,}-token prompt: first token {_s(p['long_ttft'])}")
        if p.get("failed_requests"):
            lines.append(f"{p['failed_requests']} probe requests failed")
        if p.get("skipped_phases"):
            lines.append(f"not run: {', '.join(p['skipped_phases'])}")
    if w:
        queries, hits = w.get("prefix_queries"), w.get("prefix_hits")
        rate = f"{100 * hits / queries:.0f}%" if queries and hits is not None else "-"
        lines.append(
            f"/metrics over {w['seconds']:.1f} s: peak {w.get('peak_running') or 0:.0f} running, "
            f"{w.get('peak_waiting') or 0:.0f} waiting, KV {100 * (w.get('peak_kv_usage') or 0):.0f}% used, "
            f"{w.get('preemptions') or 0:.0f} preemptions, prefix-cache hit rate {rate}"
            + (f", {w['cpu_seconds'] / w['seconds']:.2f} cores busy" if w.get("cpu_seconds") is not None else "")
        )
    else:
        lines.append("no /metrics: judged from the probe's own timings only")
    if ev.roofline.get("none"):
        lines.append(f"no roofline: {ev.roofline['none']}")
    if e:
        lines.append(
            "engine: "
            + ", ".join(
                f"{k} {e[k]}"
                for k in (
                    "max_num_seqs",
                    "max_num_batched_tokens",
                    "enable_prefix_caching",
                    "capacity_tokens",
                    "max_model_len",
                    "engine_threads",
                    "cpu_count",
                )
                if k in e
            )
        )
    return lines


def render(target: str, ev: Evidence, findings: list[Finding]) -> str:
    out = [f"tokenmill doctor: {target}", *(f"  {line}" for line in summary_lines(ev)), ""]
    if not any(f.severity > 0 for f in findings):
        out.append("Nothing measured limits this deployment beyond its hardware.")
    for f in findings:
        out.append(f"{_MARKS[f.severity]} {f.title}")
        out += [f"     {line}" for line in f.evidence]
        out += [f"   -> {line}" for line in f.advice]
    return "\n".join(out)
