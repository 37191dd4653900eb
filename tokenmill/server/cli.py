"""`tokenmill serve`: the OpenAI-compatible HTTP server.

`add_serve_parser(subparsers)` registers the subcommand (its `func` default is `run_server`);
`python -m tokenmill.server.cli serve ...` runs it standalone.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import signal
import sys
import time
from pathlib import Path

import uvicorn

from tokenmill.cli_args import add_http_args, listening_socket, require_positive
from tokenmill.engine_args import add_engine_args, engine_config_from_args
from tokenmill.fields import from_attributes
from tokenmill.http_server import uvicorn_config
from tokenmill.kv_transfer.cli import add_kv_role_args
from tokenmill.router.cli import POLICY_DESTS, add_policy_args
from tokenmill.server.limits import add_limit_args, limits_from_args

logger = logging.getLogger("tokenmill.server")

_DEFAULT_MAX_BODY = 8 * 2**20


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "serve",
        help="run the OpenAI-compatible HTTP server",
        description="Serve a model over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
        "/v1/models, /tokenize, /detokenize, /health, /version, /metrics) and a web page at / (a chat "
        "playground and a live dashboard). The engine core runs in "
        "its own process; the HTTP front end tokenizes, detokenizes and streams.",
    )
    add_engine_args(p)
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="name(s) clients pass as 'model'; the first is used in responses (default: the model's name)",
    )
    p.add_argument(
        "--max-queue",
        type=int,
        default=None,
        help="most requests waiting for a batch slot; further requests get HTTP 429 (default: no limit)",
    )
    r = p.add_argument_group("deadlines and recovery")
    r.add_argument(
        "--request-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="abort a request this long after it arrived (HTTP 504, or an error event in a stream) "
        "(default: no deadline)",
    )
    r.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="on SIGTERM/SIGINT, stop accepting requests (HTTP 503 with Retry-After) and let the ones in "
        "flight finish for up to this long, then abort the rest and exit 0; a second signal "
        "stops at once (default: %(default)s)",
    )
    r.add_argument(
        "--watchdog-timeout",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="restart the engine core when it makes no progress for this long while requests are in "
        "flight (/health reports it meanwhile); a core that dies is always restarted "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE_OR_TEMPLATE",
        help="the operator's chat template (a Jinja file, or the template text) instead of the model's; "
        "clients can never send their own",
    )
    add_limit_args(p)
    o = p.add_argument_group("output parsing")
    o.add_argument(
        "--reasoning-parser",
        choices=["deepseek_r1", "qwen3"],
        default=None,
        help="the model thinks in <think>...</think>: chat responses carry the thinking in "
        "'reasoning_content' (streams in delta.reasoning_content), output constraints start "
        "after </think>, and requests may set 'max_reasoning_tokens'",
    )
    s = p.add_argument_group("HTTP")
    add_http_args(s)
    s.add_argument(
        "--api-key",
        default=os.environ.get("TOKENMILL_API_KEY"),
        help="require 'Authorization: Bearer KEY' (or 'x-api-key: KEY') on every /v1 route (default: "
        "$TOKENMILL_API_KEY; unset means no authentication)",
    )
    s.add_argument(
        "--max-body-bytes",
        type=int,
        default=_DEFAULT_MAX_BODY,
        help="largest accepted request body in bytes; larger ones get HTTP 413 (default: %(default)s)",
    )
    s.add_argument(
        "--no-ui",
        dest="ui",
        action="store_false",
        help="do not serve the web page (chat playground and live dashboard) at / nor its numbers at /ui/stats",
    )
    s.add_argument(
        "--price-per-hour",
        type=float,
        default=None,
        metavar="DOLLARS",
        help="what the machine costs per hour: the web page's dashboard shows the cost per million input "
        "and output tokens from it (with --data-parallel-size N, each replica is charged 1/N) "
        "(default: no cost shown)",
    )
    s.add_argument(
        "--max-stored-responses",
        type=int,
        default=256,
        help="/v1/responses kept in memory for previous_response_id, least recently used dropped first; each "
        "holds its conversation's messages (default: %(default)s)",
    )
    lg = p.add_argument_group("logging")
    lg.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="level of tokenmill's own log lines (default: %(default)s)",
    )
    lg.add_argument(
        "--log-interval",
        type=float,
        default=10.0,
        help="seconds between throughput / KV-usage log lines, 0 disables them (default: %(default)s)",
    )
    lg.add_argument("--disable-log-requests", action="store_true", help="do not log a line per finished request")
    dp = p.add_argument_group("data parallelism (see also `tokenmill router`)")
    dp.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        metavar="N",
        help="run N replicas of the server, each with its own engine and the flags above, on free "
        "127.0.0.1 ports (on CPU each pinned to 1/N of the cores), behind a router on "
        "--host/--port that balances requests by prefix-cache affinity and load; the replicas "
        "stop with the router. 1 = one server, no router (default: %(default)s)",
    )
    add_policy_args(dp)  # the router's flags, used with N > 1
    pd = p.add_argument_group("disaggregated prefill/decode (see also `tokenmill disagg-proxy`)")
    add_kv_role_args(pd)
    p.set_defaults(func=run_server)
    return p


DATA_PARALLEL_DESTS = ("data_parallel_size", *POLICY_DESTS)


def kv_transfer_from_args(args: argparse.Namespace):
    """--kv-role / --kv-transfer-config as a `KVTransferConfig` (None: neither given); ValueError naming the flag."""
    from tokenmill.kv_transfer.config import KVTransferConfig

    config = KVTransferConfig.from_args(args.kv_role, args.kv_transfer_config)
    if config is not None and args.data_parallel_size > 1:
        raise ValueError("--kv-role does not combine with --data-parallel-size > 1 (one producer, one consumer)")
    if config is not None and args.tensor_parallel_size > 1:
        raise ValueError("--kv-role needs --tensor-parallel-size 1")
    return config


def read_chat_template(value: str | None) -> str | None:
    """--chat-template: a file's contents, or the value itself when it is template text."""
    if value is None:
        return None
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text()
    if "{" not in value:
        raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template")
    return value


def _on_sigterm_during_startup(signum, frame) -> None:
    raise SystemExit(128 + signum)


def run_server(args: argparse.Namespace) -> int:
    """Start the engine core, then serve until SIGTERM/SIGINT. Returns 0 after a clean shutdown;
    raises SystemExit with a non-zero status (after printing why) if the server cannot start."""
    if args.data_parallel_size < 1:
        print(
            f"tokenmill serve: error: --data-parallel-size must be >= 1, got {args.data_parallel_size}", file=sys.stderr
        )
        raise SystemExit(2)
    try:
        kv_transfer_from_args(args)
    except ValueError as e:
        print(f"tokenmill serve: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    if args.data_parallel_size > 1:
        from tokenmill.router.cli import serve_data_parallel

        code = serve_data_parallel(args, DATA_PARALLEL_DESTS)
    else:
        code = _run(args)
    if code:
        raise SystemExit(code)
    # The process ends now. Its last collections would walk every object torch and transformers made
    # (about a second on a busy two-core machine, in every stop and restart); frozen, they are skipped.
    # Exit handlers and destructors still run.
    gc.freeze()
    return code


def _run(args: argparse.Namespace) -> int:
    start = time.monotonic()
    logging.basicConfig(
        level=getattr(logging, args.log_level.upper()), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("tokenmill").setLevel(getattr(logging, args.log_level.upper()))

    # imported here, not at the top: they pull in torch, and `tokenmill --help` should stay fast
    from tokenmill.server.api import ServerSettings, build_app
    from tokenmill.server.core_handle import EngineStartupError
    from tokenmill.server.engine_client import EngineClient
    from tokenmill.server.metrics import ServerMetrics

    try:
        kv_transfer_from_args(args)  # the checks of --kv-role against the other flags
        config = engine_config_from_args(args)
        limits = limits_from_args(args)
        chat_template = read_chat_template(args.chat_template)
        if args.max_queue is not None and args.max_queue < 1:
            raise ValueError(f"--max-queue must be >= 1, got {args.max_queue}")
        require_positive(args, "request_timeout", "shutdown_timeout", "watchdog_timeout")
        if args.max_body_bytes <= 0:
            raise ValueError(f"--max-body-bytes must be positive, got {args.max_body_bytes}")
        if args.price_per_hour is not None and not args.price_per_hour >= 0:
            raise ValueError(f"--price-per-hour must be >= 0, got {args.price_per_hour}")
        if args.max_stored_responses <= 0:
            raise ValueError(f"--max-stored-responses must be positive, got {args.max_stored_responses}")
    except ValueError as e:
        print(f"tokenmill serve: error: {e}", file=sys.stderr)
        return 2
    try:
        sock = listening_socket(args.host, args.port)
    except OSError as e:
        print(f"tokenmill serve: error: cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 1

    previous = signal.signal(signal.SIGTERM, _on_sigterm_during_startup)
    client = EngineClient(
        config,
        max_queue=args.max_queue,
        chat_template=chat_template,
        request_timeout=args.request_timeout,
        watchdog_timeout=args.watchdog_timeout,
    )
    try:
        print(f"tokenmill: loading {args.model} ...", flush=True)
        try:
            info = client.start()
        except (EngineStartupError, FileNotFoundError, ValueError) as e:
            print(f"tokenmill serve: error: could not start the engine: {e}", file=sys.stderr)
            return 1
        names = args.served_model_name or [info["model_name"]]
        metrics = ServerMetrics(names[0], log_requests=not args.disable_log_requests)
        metrics.set_engine_info(config, info)
        client.metrics = metrics
        settings = from_attributes(ServerSettings, args, api_key=args.api_key or None, limits=limits)
        app = build_app(client, metrics, names, settings)
        uv_config = uvicorn_config(app, args.uvicorn_log_level, 5, args.header_timeout)
        server = _Server(
            uv_config, client, lambda: _print_ready(args, info, names, start, client), args.shutdown_timeout
        )
        signal.signal(signal.SIGTERM, previous)
        server.run(sockets=[sock])
    finally:
        client.stop_process()
        sock.close()
    if not server.started:
        print("tokenmill serve: error: the HTTP server failed to start (see the log above)", file=sys.stderr)
        return 1
    print("tokenmill: server stopped", flush=True)
    return 0


def _print_ready(args, info: dict, names: list[str], start: float, client) -> None:
    gib = info["kv_cache_bytes"] / 2**30
    limit = min(info["max_model_len"], info["capacity_tokens"])
    host = f"[{args.host}]" if ":" in args.host else args.host
    print(
        f"tokenmill: model {info['model_name']} ({info['architecture']}, {info['dtype']} on {info['device']}), "
        f"served as {', '.join(names)}; loaded in {info['load_seconds']:.1f} s",
        flush=True,
    )
    print(
        f"tokenmill: KV cache {info['num_blocks']} blocks x {info['block_size']} tokens = "
        f"{info['capacity_tokens']} tokens ({gib:.3f} GiB{info['kv_cache_scope']}), prefix caching "
        f"{'on' if args.enable_prefix_caching else 'off'}; max model len {info['max_model_len']}"
        + (f" (requests limited to {limit} tokens by the KV cache)" if limit < info["max_model_len"] else ""),
        flush=True,
    )
    auth = " (API key required on /v1)" if args.api_key else ""
    ui = f"; web page at http://{host}:{args.port}/" if args.ui else ""
    print(
        f"tokenmill: ready in {time.monotonic() - start:.1f} s at http://{host}:{args.port}/v1{auth}{ui}; "
        f"engine core pid {client.core_pid}",
        flush=True,
    )


class _Server(uvicorn.Server):
    """uvicorn's server, plus: announce readiness; on SIGTERM/SIGINT drain (refuse new requests with
    503, let in-flight ones finish for up to `shutdown_timeout` s, abort the rest), then stop and
    exit 0 instead of re-raising the signal. A second signal stops at once."""

    def __init__(self, config: uvicorn.Config, client, on_ready, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.client = client
        self.on_ready = on_ready
        self.shutdown_timeout = shutdown_timeout
        self.loop: asyncio.AbstractEventLoop | None = None
        self._draining = False

    async def startup(self, sockets=None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)
        if self.started:
            self.on_ready()

    def handle_exit(self, sig, frame) -> None:
        if self.loop is None or self.loop.is_closed():
            return self._stop(sig, frame)
        if self._draining:  # the second signal: now
            self.loop.call_soon_threadsafe(self._shutdown, sig, frame)
            return None
        self._draining = True
        self.loop.call_soon_threadsafe(lambda: self.loop.create_task(self._drain(sig, frame)))
        return None

    async def _drain(self, sig, frame) -> None:
        name = signal.Signals(sig).name
        logger.info(
            "received %s: draining %d in-flight requests (up to %.0f s); refusing new ones",
            name,
            self.client.num_in_flight,
            self.shutdown_timeout,
        )
        self.client.begin_drain()
        deadline = time.monotonic() + self.shutdown_timeout
        while self.client.num_in_flight and time.monotonic() < deadline and not self.should_exit:
            await asyncio.sleep(0.05)
        self._shutdown(sig, frame)

    def _shutdown(self, sig, frame) -> None:
        if self.should_exit:
            return
        if self.client.num_in_flight:
            logger.warning("aborting %d requests still in flight", self.client.num_in_flight)
        logger.info("shutting down")
        self.client.begin_shutdown()
        self._stop(sig, frame)

    def _stop(self, sig, frame) -> None:
        super().handle_exit(sig, frame)
        captured = getattr(self, "_captured_signals", None)
        if isinstance(captured, list):
            captured.clear()  # drained and stopped cleanly: exit 0, not by the signal


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tokenmill")
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve_parser(sub)
    args = parser.parse_args(argv)
    return args.func(args)  # run_server: 0, or SystemExit on failure


if __name__ == "__main__":
    sys.exit(main())
