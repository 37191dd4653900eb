"""`tokenmill doctor --base-url URL [--probe] [--window S]`: what limits a serving deployment and what
to change. Works against any OpenAI-compatible server; with tokenmill it also reads the engine's
settings and its whole CPU use from /metrics; when the server runs on this machine and the model's
file is known, it sets the measured decode and prefill rates against this machine's roofline
(`tokenmill plan`'s hardware record)."""

from __future__ import annotations

import argparse
import json
import time

from tokenmill.cli_args import add_hardware_arg, add_server_args, quiet_http_logs, require_positive


def add_doctor_parser(sub) -> None:
    doctor = sub.add_parser(
        "doctor",
        help="find what limits a serving deployment and what to change",
        description="Read a server's /metrics over a window of live traffic, or drive a short bounded probe "
        "of its own (--probe), and report in plain words, with the numbers behind them, what limits "
        "this deployment (KV pool, --max-num-seqs, prefix caching, prefill chunk size, memory "
        "bandwidth, compute, CPU threads, queueing) and what to change.",
    )
    add_server_args(doctor, "the probe")
    doctor.add_argument(
        "--probe",
        action="store_true",
        help="send a short probe of its own (one request alone, requests sharing a prefix, --concurrency "
        "at once, a long prompt while others decode) instead of only watching live traffic",
    )
    doctor.add_argument(
        "--window",
        type=float,
        default=None,
        metavar="S",
        help="without --probe: seconds of live traffic to watch /metrics over (default: 30)",
    )
    doctor.add_argument(
        "--concurrency", type=int, default=8, help="requests the probe sends at once (default: %(default)s)"
    )
    doctor.add_argument(
        "--probe-seconds", type=float, default=60.0, help="the whole probe at most (default: %(default)s)"
    )
    doctor.add_argument(
        "--probe-output-tokens",
        type=int,
        default=32,
        help="tokens each short probe request asks for (default: %(default)s)",
    )
    doctor.add_argument(
        "--probe-long-prompt",
        type=int,
        default=1024,
        metavar="WORDS",
        help="words of the long probe prompt, at most 60%% of the context limit (default: %(default)s)",
    )
    doctor.add_argument(
        "--slo-ttft",
        type=float,
        default=1.0,
        metavar="S",
        help="time-to-first-token objective in seconds; queueing past it is reported (default: %(default)s)",
    )
    add_hardware_arg(doctor)
    doctor.add_argument("--json", action="store_true", help="print the figures and findings as JSON")
    doctor.set_defaults(func=cmd_doctor)


def cmd_doctor(args: argparse.Namespace) -> dict:
    from tokenmill.bench.prometheus import metrics_url
    from tokenmill.doctor import report
    from tokenmill.doctor.figures import probe_figures
    from tokenmill.doctor.rules import Evidence, diagnose
    from tokenmill.doctor.window import MetricsWindow

    require_positive(
        args, "concurrency", "probe_seconds", "probe_output_tokens", "probe_long_prompt", "window", "slo_ttft"
    )
    quiet_http_logs()
    ev = Evidence(slo_ttft=args.slo_ttft)
    with MetricsWindow(metrics_url(args.base_url)) as window:
        if args.probe:
            ev.probe = probe_figures(_run_probe(args, window))
        else:
            if not window.available:
                raise ValueError(f"{args.base_url} has no readable /metrics: run with --probe")
            time.sleep(30.0 if args.window is None else args.window)
    ev.window = window.summary()
    ev.engine = ev.window.pop("engine", {}) if ev.window else {}
    ev.roofline = _roofline(args, ev)
    findings = diagnose(ev)
    result = report.as_dict(args.base_url, ev, findings)
    print(json.dumps(result, indent=1, default=str) if args.json else report.render(args.base_url, ev, findings))
    return result


def _run_probe(args: argparse.Namespace, window):
    from tokenmill.bench.cli import _served_model
    from tokenmill.bench.client import EndpointConfig
    from tokenmill.bench.prometheus import engine_info
    from tokenmill.doctor.probe import ProbeSettings, context_limit, run_probe

    model = args.model or _served_model(args.base_url, args.api_key)
    tokenmill = bool(window.first and engine_info(window.first))
    endpoint = EndpointConfig(
        base_url=args.base_url,
        model=model,
        endpoint=args.endpoint,
        api_key=args.api_key,
        ignore_eos=tokenmill,  # outputs of the asked length (other servers may not take the field)
        timeout=args.probe_seconds,
    )
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    settings = ProbeSettings(
        concurrency=args.concurrency,
        seconds=args.probe_seconds,
        output_tokens=args.probe_output_tokens,
        long_words=args.probe_long_prompt,
    )
    return run_probe(endpoint, settings, context_limit(args.base_url, model, headers))


def _roofline(args: argparse.Namespace, ev) -> dict:
    """Shares of this machine's bandwidth (the lone request's decode) and compute (the long prompt's
    prefill), when the server runs here (or --hardware names a machine) and its model file is known
    (tokenmill), and the probe measured them."""
    from tokenmill.bench.monitor import is_local
    from tokenmill.plan.measured import compute_share, decode_share, machine_and_model, weight_format

    p, e = ev.probe, ev.engine
    if not p.get("decode_step"):
        return {}
    found = machine_and_model(args.hardware, is_local(args.base_url), e.get("model_path"))
    if isinstance(found, str):
        return {"none": found}
    hw, facts = found
    fmt = weight_format(facts, e.get("quantization"), e.get("dtype"))
    out = {"hardware": hw.name, "weight_format": fmt}
    out["decode"] = decode_share(facts, hw, fmt, p["decode_step"], 1, p.get("single_context") or 0) | {
        "step_seconds": p["decode_step"]
    }
    if p.get("long_ttft") and p.get("long_prompt_tokens"):
        rate = p["long_prompt_tokens"] / p["long_ttft"]
        out["prefill"] = compute_share(facts, hw, fmt, rate, p["long_prompt_tokens"]) | {"tokens_per_s": rate}
    return out
