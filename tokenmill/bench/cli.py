"""`tokenmill bench serve | sweep | compare | offline`.

Wiring: `add_bench_parser(subparsers)` adds `bench` to a parent CLI; each subcommand sets `func`, called
as `args.func(args)`. Standalone: `python -m tokenmill.bench.cli serve --base-url ... --model ...`.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
from pathlib import Path

from tokenmill.cli_args import add_hardware_arg, add_server_args, quiet_http_logs
from tokenmill.fields import from_attributes

_EPILOG = """\
examples:
  tokenmill bench serve --base-url http://127.0.0.1:8000 --model smollm2-135m-instruct \\
      --dataset random --random-input-len 512 --random-output-len 64 --num-prompts 200 \\
      --max-concurrency 8 --slo ttft=500ms,tpot=50ms --result-file out/run.json
  tokenmill bench sweep --model M --concurrencies 1,2,4,8,16 --slo ttft=1s,tpot=100ms --result-file out/sweep.json
  tokenmill bench compare out/tokenmill.json out/vllm.json --plot-dir out
  tokenmill bench offline --model smollm2-135m-instruct --dataset shared-prefix --num-prompts 64
"""


# ---------------------------------------------------------------------------------------------- flags


def _add_target_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    add_server_args(g, "the benchmark")
    g.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer for exact prompt lengths: a tokenmill model name, a .gguf file or a local HF "
        "directory/cached repo id (default: --model)",
    )
    g.add_argument(
        "--extra-body",
        type=json.loads,
        default={},
        help="JSON object merged into every request body, e.g. '{\"top_p\": 0.9}' (default: none)",
    )
    g.add_argument(
        "--json-schema",
        default=None,
        metavar="PATH",
        help="constrain every request's output to the JSON schema in this file (sends OpenAI "
        "response_format {'type': 'json_schema', ...}); compare with a run without it to see the "
        "cost of structured output",
    )
    g.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="per-request timeout in seconds; a request past it counts as failed (default: %(default)s)",
    )
    g.add_argument(
        "--server-pid",
        type=int,
        default=None,
        help="PID of the server process: its CPU use (with children) is sampled during the run",
    )


# the numeric flags of the workload and of the load: (flag, type, default, help)
_WORKLOAD_SIZES = [
    ("--num-prompts", int, 1000, "requests to measure (conversations for multi-turn)"),
    (
        "--random-input-len",
        int,
        1024,
        "prompt tokens (random, long-context short prompts), question tokens "
        "(shared-prefix), user-turn tokens (multi-turn)",
    ),
    ("--random-output-len", int, 128, "output tokens to ask for (max_tokens); jsonl lines without output_len"),
    ("--random-range-ratio", float, 0.0, "lengths drawn uniformly in [L*(1-r), L*(1+r)]"),
    ("--num-prefixes", int, 4, "shared-prefix: distinct system prompts"),
    ("--prefix-len", int, 1024, "shared-prefix: tokens per system prompt"),
    ("--num-turns", int, 4, "multi-turn: user turns per conversation"),
    ("--long-context-len", int, 4096, "long-context: tokens of the long prompts"),
    ("--long-context-fraction", float, 0.1, "long-context: fraction of prompts that are long, at least one"),
]
_LOAD = [
    (
        "--request-rate",
        float,
        math.inf,
        "requests (conversations) started per second, gamma-distributed gaps; inf: all at once",
    ),
    ("--burstiness", float, 1.0, "gamma shape of the gaps: 1 = Poisson, <1 burstier, >1 more regular"),
    (
        "--max-concurrency",
        int,
        None,
        "most requests in flight; with an infinite rate, a closed loop of this many clients",
    ),
    ("--num-warmups", int, 0, "requests sent before measuring, not counted"),
    (
        "--max-duration",
        float,
        None,
        "stop the run after this many seconds: requests in flight count as failed, the rest are not sent",
    ),
]


def _add_numbers(g, flags: list[tuple]) -> None:
    """One flag per (flag, type, default, help) of `flags`; the help says the default where there is one."""
    for flag, kind, default, text in flags:
        g.add_argument(
            flag, type=kind, default=default, help=text if default is None else f"{text} (default: %(default)s)"
        )


def _add_dataset_args(p: argparse.ArgumentParser, seed: bool = True) -> None:
    from tokenmill.bench.datasets import DATASETS

    g = p.add_argument_group("workload")
    g.add_argument(
        "--dataset",
        default="random",
        choices=DATASETS,
        help="random: lengths drawn around --random-input-len/--random-output-len; "
        "shared-prefix: --num-prefixes system prompts of --prefix-len tokens shared by the "
        "questions; multi-turn: conversations of --num-turns turns, each re-sending the history; "
        "long-context: --long-context-fraction of prompts are --long-context-len tokens; "
        "jsonl: --dataset-path (default: %(default)s)",
    )
    g.add_argument(
        "--dataset-path",
        default=None,
        help='jsonl file: one object per line, {"prompt": "..."} or {"messages": [...]}, optionally '
        'with "output_len"; cycled to --num-prompts',
    )
    _add_numbers(g, _WORKLOAD_SIZES)
    if seed:
        g.add_argument("--seed", type=int, default=0, help="seed of the workload and arrivals (default: %(default)s)")


def _add_load_args(p: argparse.ArgumentParser) -> None:
    _add_numbers(p.add_argument_group("load"), _LOAD)


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument(
        "--ignore-eos",
        action="store_true",
        help="keep generating past EOS so outputs have exactly the asked length (sends ignore_eos: true)",
    )
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default: %(default)s)")


def _add_output_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("output")
    g.add_argument(
        "--slo",
        default=None,
        help="service-level objective for goodput, e.g. ttft=500ms,tpot=50ms,e2e=10s (units us/ms/s; "
        "bare numbers are ms)",
    )
    g.add_argument(
        "--cost-per-hour",
        "--price-per-hour",
        type=float,
        default=None,
        help="machine price in $/hour: report $ per 1M input tokens, per 1M output tokens, per request",
    )
    add_hardware_arg(g)
    g.add_argument("--result-file", default=None, help="write the full result (every request's timings) as JSON")
    g.add_argument("--plot-dir", default=None, help="write PNG charts here (default: next to --result-file, if given)")
    g.add_argument(
        "--label",
        default="",
        help="name of this run in tables and charts (default: none; `bench compare` then uses the file name)",
    )
    g.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def _add_sweep_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sweep").add_mutually_exclusive_group(required=True)
    g.add_argument("--concurrencies", default=None, help="comma-separated --max-concurrency values, e.g. 1,2,4,8")
    g.add_argument("--request-rates", default=None, help="comma-separated --request-rate values, e.g. 1,2,4,8")
    p.add_argument(
        "--slo-attainment",
        type=float,
        default=0.9,
        help="fraction of requests that must meet --slo for a load to count as meeting it (default: %(default)s)",
    )


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    """Add `bench` (with serve, sweep, compare, offline) to a parent CLI's subparsers."""
    bench = subparsers.add_parser(
        "bench",
        help="benchmark a server or the engine",
        description="Drive an OpenAI-compatible server (tokenmill, vLLM, SGLang, llama-server, ...) or the engine "
        "in-process with realistic traffic and report the serving metrics.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_subcommands(bench)
    return bench


def _add_subcommands(bench: argparse.ArgumentParser) -> None:
    sub = bench.add_subparsers(dest="bench_command", metavar="{serve,sweep,compare,offline}")
    bench.set_defaults(func=lambda args: bench.print_help())

    serve = sub.add_parser(
        "serve",
        help="one run against a server",
        description="Benchmark a running OpenAI-compatible server with one workload and load.",
    )
    for add in (_add_target_args, _add_dataset_args, _add_load_args, _add_sampling_args, _add_output_args):
        add(serve)
    serve.set_defaults(func=cmd_serve)

    sweep = sub.add_parser(
        "sweep",
        help="the same workload at several concurrencies or rates",
        description="Run the same workload at several loads: throughput-latency curve and knee "
        "(the highest load that still meets --slo).",
    )
    for add in (
        _add_target_args,
        _add_dataset_args,
        _add_load_args,
        _add_sampling_args,
        _add_output_args,
        _add_sweep_args,
    ):
        add(sweep)
    sweep.set_defaults(func=cmd_sweep)

    compare = sub.add_parser(
        "compare",
        help="tables and charts of several result files side by side",
        description="Compare result files (runs or sweeps) in one table and charts.",
    )
    compare.add_argument("files", nargs="+", help="result JSON files from serve, sweep or offline")
    compare.add_argument(
        "--labels", default=None, help="comma-separated names for the files (default: their labels or file names)"
    )
    compare.add_argument("--plot-dir", default=".", help="where to write compare_*.png (default: %(default)s)")
    compare.set_defaults(func=cmd_compare)

    offline = sub.add_parser(
        "offline",
        help="the engine in-process, no HTTP",
        description="Run a workload through tokenmill's engine in this process: engine-only throughput and latency.",
    )
    from tokenmill.engine_args import add_engine_args

    add_engine_args(offline)  # --model, --seed (also the workload seed) and the engine sizing flags
    _add_dataset_args(offline, seed=False)
    _add_load_args(offline)
    _add_sampling_args(offline)
    _add_output_args(offline)
    offline.add_argument(
        "--chat", action="store_true", help="build prompts with the model's chat template (as the chat endpoint would)"
    )
    offline.set_defaults(func=cmd_offline)


# ---------------------------------------------------------------------------------------------- commands


def _config(args: argparse.Namespace) -> dict:
    """The flags worth recording (JSON-able, no secrets)."""
    skip = {"func", "api_key"}
    return {
        k: v
        for k, v in vars(args).items()
        if k not in skip and isinstance(v, (str, int, float, bool, dict, list, type(None)))
    }


def _run_options(args: argparse.Namespace, tokenizer):
    from tokenmill.bench.client import LoadConfig
    from tokenmill.bench.datasets import DatasetConfig
    from tokenmill.bench.metrics import parse_slo
    from tokenmill.bench.runner import RunOptions

    dataset = from_attributes(  # the flags named as the fields, and these
        DatasetConfig,
        args,
        name=args.dataset,
        input_len=args.random_input_len,
        output_len=args.random_output_len,
        range_ratio=args.random_range_ratio,
        path=args.dataset_path,
    )
    dataset.validate()
    load = from_attributes(LoadConfig, args)
    load.validate()
    if args.num_warmups < 0:
        raise ValueError("--num-warmups must be >= 0")
    if args.cost_per_hour is not None and args.cost_per_hour < 0:
        raise ValueError("--cost-per-hour must be >= 0")
    return RunOptions(
        dataset=dataset,
        load=load,
        tokenizer=tokenizer,
        num_warmups=args.num_warmups,
        slo=parse_slo(args.slo),
        cost_per_hour=args.cost_per_hour,
        progress=not args.disable_tqdm,
        label=args.label,
        config=_config(args),
    )


def _endpoint(args: argparse.Namespace):
    from tokenmill.bench.client import EndpointConfig

    if not isinstance(args.extra_body, dict):
        raise ValueError("--extra-body must be a JSON object")
    if args.model is None:
        args.model = _served_model(args.base_url, args.api_key)
    extra_body = dict(args.extra_body)
    if args.json_schema:
        try:
            schema = json.loads(Path(args.json_schema).read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"--json-schema {args.json_schema}: {e}") from None
        extra_body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": Path(args.json_schema).stem, "schema": schema},
        }
    return from_attributes(EndpointConfig, args, extra_body=extra_body)


def _served_model(base_url: str, api_key: str | None) -> str:
    import httpx

    url = base_url.rstrip("/") + ("/models" if base_url.rstrip("/").endswith("/v1") else "/v1/models")
    try:
        response = httpx.get(url, headers={"Authorization": f"Bearer {api_key}"} if api_key else {}, timeout=10)
        response.raise_for_status()
        return response.json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as e:
        raise ValueError(f"no --model given and cannot read the served model from {url}: {e}") from e


def _tokenizer(args: argparse.Namespace):
    from tokenmill.bench.datasets import load_bench_tokenizer

    name = args.tokenizer or args.model
    if args.dataset == "jsonl" and args.tokenizer is None:
        try:  # optional for jsonl: lengths then come from the server's usage
            return load_bench_tokenizer(name)
        except ValueError as e:
            logging.getLogger(__name__).warning("%s; prompt lengths will come from the server's usage only", e)
            return None
    return load_bench_tokenizer(name)


def _console():
    from rich.console import Console

    console = Console()
    return console if console.is_terminal else Console(width=120)  # pipes and logs: wide enough for the tables


def _write_outputs(result: dict, args: argparse.Namespace) -> None:
    from tokenmill.bench import plots, report

    console = _console()
    (report.print_sweep if result["kind"] == "sweep" else report.print_run)(result, console)
    if args.result_file:
        console.print(f"result: {report.write_json(result, args.result_file)}")
    plot_dir = args.plot_dir or (str(Path(args.result_file).parent) if args.result_file else None)
    if plot_dir:
        stem = Path(args.result_file).stem if args.result_file else f"bench_{result['kind']}"
        for path in plots.write_plots(result, Path(plot_dir) / stem):
            console.print(f"plot: {path}")


def _add_server_roofline(result: dict, args: argparse.Namespace) -> None:
    """The roofline line of a server run: the model file and weight format from tokenmill's
    /metrics (`engine_config_info`), else --tokenizer / --model as a tokenmill model name."""
    from tokenmill.bench import prometheus
    from tokenmill.bench.monitor import is_local
    from tokenmill.bench.roofline import add_roofline

    engine = prometheus.engine_info(prometheus.scrape(prometheus.metrics_url(args.base_url)) or [])
    model = engine.get("model_path") or args.tokenizer or args.model
    add_roofline(result, args.hardware, is_local(args.base_url), model, engine.get("quantization"), engine.get("dtype"))


def cmd_serve(args: argparse.Namespace) -> dict:
    from tokenmill.bench.runner import run_serve

    quiet_http_logs()
    endpoint = _endpoint(args)
    result = run_serve(endpoint, _run_options(args, _tokenizer(args)), server_pid=args.server_pid)
    _add_server_roofline(result, args)
    _write_outputs(result, args)
    return result


def cmd_sweep(args: argparse.Namespace) -> dict:
    from tokenmill.bench.runner import parse_loads, run_serve, run_sweep

    if not 0 < args.slo_attainment <= 1:
        raise ValueError("--slo-attainment must be in (0, 1]")
    quiet_http_logs()
    endpoint = _endpoint(args)
    opts = _run_options(args, _tokenizer(args))
    sweep_by, loads = (
        ("max_concurrency", args.concurrencies) if args.concurrencies else ("request_rate", args.request_rates)
    )
    result = run_sweep(
        lambda o: run_serve(endpoint, o, server_pid=args.server_pid),
        opts,
        parse_loads(loads),
        sweep_by,
        args.slo_attainment,
    )
    _add_server_roofline(result, args)
    _write_outputs(result, args)
    return result


def cmd_offline(args: argparse.Namespace) -> dict:
    from tokenmill.bench.datasets import BenchTokenizer
    from tokenmill.bench.offline import load_engine, run_offline

    engine = load_engine(args)
    tokenizer = BenchTokenizer(engine.tokenizer.hf, args.model)
    result = run_offline(
        engine, _run_options(args, tokenizer), chat=args.chat, temperature=args.temperature, ignore_eos=args.ignore_eos
    )
    from tokenmill.bench.roofline import add_roofline

    add_roofline(result, args.hardware, True, args.model, args.quantization, args.dtype)
    _write_outputs(result, args)
    return result


def cmd_compare(args: argparse.Namespace) -> None:
    from tokenmill.bench import plots, report

    results = [report.load_json(f) for f in args.files]
    labels = (
        args.labels.split(",") if args.labels else [r.get("label") or Path(f).stem for r, f in zip(results, args.files)]
    )
    if len(labels) != len(results):
        raise ValueError(f"--labels has {len(labels)} names for {len(results)} files")
    named = list(zip(labels, results))
    console = _console()
    runs = [run for name, r in named for run in report.runs_of(r, name)]
    console.print(report.compare_table(runs))
    out = Path(args.plot_dir)
    written = [
        plots.plot_compare(named, out / "compare_bars.png"),
        plots.plot_latency_cdfs(runs, out / "compare_latency_cdf.png"),
    ]
    sweeps = [(name, r) for name, r in named if r["kind"] == "sweep"]
    if sweeps and len({r["sweep_by"] for _, r in sweeps}) == 1:
        written.append(plots.plot_sweeps(sweeps, out / "compare_sweep.png"))
    for path in written:
        console.print(f"plot: {path}")


# ---------------------------------------------------------------------------------------------- standalone


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tokenmill bench",
        description="tokenmill's benchmark tool.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--log-level", default="WARNING", help="logging level (default: %(default)s)")
    _add_subcommands(parser)
    return parser


def main(argv: list[str] | None = None) -> None:
    from tokenmill.entrypoints.cli import run_command

    run_command(build_parser().parse_args(argv), (ValueError, FileNotFoundError, RuntimeError))


if __name__ == "__main__":
    main()
