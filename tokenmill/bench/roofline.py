"""The roofline line of a bench result: each measured figure as a share of this machine's measured
memory bandwidth (decode) or matmul rate (prefill, and all tokens of the run's batches), from
`tokenmill plan`'s hardware record and the served model's facts (`tokenmill.plan.measured`)."""

from __future__ import annotations


def roofline_of(summary: dict, facts, hw, fmt: str, kv_dtype: str = "float16") -> dict | None:
    """decode: a step of the run's achieved concurrency at its mean context took the median TPOT;
    prefill: the mean prompt in the median TTFT (queueing included: a lower bound); throughput: every
    input and output token of the run per second. None for a run that completed nothing."""
    from tokenmill.plan.measured import compute_share, decode_share

    n = summary["completed"]
    if not n:
        return None
    mean_in, mean_out = summary["total_input_tokens"] / n, summary["total_output_tokens"] / n
    context = int(mean_in + mean_out / 2)
    out: dict = {"hardware": hw.name, "hardware_source": hw.source, "weight_format": fmt}
    tpot = summary["tpot_ms"]["median"]
    if tpot:
        batch = max(1.0, summary["achieved_concurrency"])
        out["decode"] = decode_share(facts, hw, fmt, tpot / 1e3, batch, context, kv_dtype) | {"batch": batch}
    ttft = summary["ttft_ms"]["median"]
    if ttft and mean_in:
        rate = mean_in / (ttft / 1e3)
        out["prefill"] = compute_share(facts, hw, fmt, rate, int(mean_in)) | {"tokens_per_s": rate}
    if summary["total_token_throughput"]:
        rate = summary["total_token_throughput"]
        out["throughput"] = compute_share(facts, hw, fmt, rate, context) | {"tokens_per_s": rate}
    return out


def add_roofline(result: dict, hardware: str, local: bool, model: str | None, quantization=None, dtype=None) -> None:
    """Set `result["roofline"]` (each point's, for a sweep): the shares, or {"none": why not}."""
    from tokenmill.plan.measured import machine_and_model, weight_format

    found = machine_and_model(hardware, local, model)
    runs = result["points"] if result["kind"] == "sweep" else [result]
    for run in runs:
        if isinstance(found, str):
            run["roofline"] = {"none": found}
            continue
        hw, facts = found
        run["roofline"] = roofline_of(run["summary"], facts, hw, weight_format(facts, quantization, dtype))
