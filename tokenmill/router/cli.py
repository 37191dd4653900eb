"""`tokenmill router` (a front for running replicas) and `tokenmill serve --data-parallel-size N`
(N local replicas behind a router).

`add_router_parser(subparsers)` registers `router`; `add_policy_args(group)` adds the routing flags
both commands take; `python -m tokenmill.router.cli router ...` runs the router standalone.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

from tokenmill.cli_args import add_http_args, bind_or_exit, quiet_http_logs

logger = logging.getLogger("tokenmill.router")

POLICY_DESTS = ("policy", "prefix_match_threshold", "balance_threshold", "health_interval")


def add_policy_args(group) -> None:
    from tokenmill.router.policy import POLICIES

    group.add_argument(
        "--policy",
        choices=list(POLICIES),
        default="prefix",
        help="routing policy: prefix = to the replica that was sent the longest leading part of the "
        "prompt (its prefix cache likely holds it) when that covers --prefix-match-threshold of "
        "the prompt and loads are balanced, else least-load; least-load = fewest requests in "
        "flight; round-robin = in turn (default: %(default)s)",
    )
    group.add_argument(
        "--prefix-match-threshold",
        type=float,
        default=0.5,
        metavar="F",
        help="prefix policy: least fraction of the prompt (in characters; chat: the rendered "
        "messages) a replica's record must match for the request to follow it "
        "(default: %(default)s)",
    )
    group.add_argument(
        "--balance-threshold",
        type=int,
        default=8,
        metavar="N",
        help="prefix policy: when the most and fewest requests in flight on healthy replicas differ "
        "by more than this, route by least-load instead (default: %(default)s)",
    )
    group.add_argument(
        "--health-interval",
        type=float,
        default=1.0,
        metavar="SECONDS",
        help="seconds between /health checks of every replica; a replica that fails one (or "
        "refuses a connection) gets no requests until it passes again (default: %(default)s)",
    )


def add_router_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "router",
        help="balance requests over running `tokenmill serve` replicas (data parallelism)",
        description="An OpenAI-compatible front (/v1/completions, /v1/chat/completions, /v1/models, /health, "
        "/metrics) for several replicas, routing each request by prefix-cache affinity and load. "
        "A replica that fails its health check or refuses connections gets no requests; a request "
        "whose replica fails before answering is retried once on another; one whose replica stops "
        "answering (two /health checks in a row time out) is retried too, or its stream ends with an error event; "
        "with none healthy the router answers 503.",
    )
    p.add_argument(
        "--replica",
        action="append",
        required=True,
        metavar="URL",
        help="a replica's root URL (e.g. http://127.0.0.1:8001); repeat for each replica",
    )
    r = p.add_argument_group("routing")
    add_policy_args(r)
    r.add_argument(
        "--shared-kv-tier",
        action="store_true",
        help="prefix policy: the replicas share one KV disk tier (the same --kv-cache-dir), so a "
        "prefix one of them computed can be loaded by any: such prefixes are routed by load",
    )
    http = p.add_argument_group("HTTP")
    add_http_args(http)
    http.add_argument(
        "--no-ui",
        dest="ui",
        action="store_false",
        help="do not serve the web page at / (chat playground, and the dashboard of a replica picked on the page)",
    )
    p.set_defaults(func=run_router)
    return p


def _policy(args: argparse.Namespace, num_replicas: int):
    from tokenmill.router.app import RouterSettings
    from tokenmill.router.policy import make_policy

    if not args.health_interval > 0:
        raise ValueError(f"--health-interval must be positive, got {args.health_interval}")
    # replicas on one --kv-cache-dir (`serve --data-parallel-size N --kv-cache-dir PATH`) share its prefixes
    shared = bool(getattr(args, "shared_kv_tier", False) or getattr(args, "kv_cache_dir", None))
    options = {"shared_tier": True} if shared and args.policy == "prefix" else {}
    policy = make_policy(args.policy, num_replicas, args.prefix_match_threshold, args.balance_threshold, **options)
    return policy, RouterSettings(health_interval=args.health_interval, ui=getattr(args, "ui", True))


def _serve_router(args: argparse.Namespace, urls: list[str], sock, note: str = "") -> None:
    import uvicorn

    from tokenmill.http_server import DEFAULT_HEADER_TIMEOUT, uvicorn_config
    from tokenmill.router.app import build_router_app

    quiet_http_logs()
    policy, settings = _policy(args, len(urls))
    app = build_router_app(urls, policy, settings)
    config = uvicorn_config(
        app,
        getattr(args, "uvicorn_log_level", "warning"),
        10,
        getattr(args, "header_timeout", DEFAULT_HEADER_TIMEOUT),
    )
    server = uvicorn.Server(config)
    host = f"[{args.host}]" if ":" in args.host else args.host
    print(
        f"tokenmill router: {args.policy} policy over {len(urls)} replicas ({', '.join(urls)}){note}; "
        f"listening at http://{host}:{args.port}/v1",
        flush=True,
    )
    server.run(sockets=[sock])


def _raise_exit(signum, frame) -> None:
    raise SystemExit(128 + signum)


_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_STOPPED_BY_SIGNAL = {128 + s for s in _STOP_SIGNALS}


def _serve_until_signal(args: argparse.Namespace, urls: list[str], sock, note: str = "") -> None:
    """Serve; return normally when a SIGTERM/SIGINT stopped the server (uvicorn re-raises the signal it
    handled once it is done: `_raise_exit` turns that into SystemExit, caught here)."""
    try:
        _serve_router(args, urls, sock, note)
    except SystemExit as e:
        if e.code not in _STOPPED_BY_SIGNAL:
            raise


def run_router(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _policy(args, len(args.replica))  # flag errors before binding
    sock = bind_or_exit(args)
    previous = {s: signal.signal(s, _raise_exit) for s in _STOP_SIGNALS}
    try:
        _serve_until_signal(args, args.replica, sock)
    finally:
        sock.close()
        for s, handler in previous.items():
            signal.signal(s, handler)
    print("tokenmill router: stopped", flush=True)
    return 0


def serve_data_parallel(args: argparse.Namespace, data_parallel_dests: tuple[str, ...]) -> int:
    """`tokenmill serve --data-parallel-size N`: N replicas with the same engine flags on free local ports
    (each pinned to its share of the CPU cores on CPU), then the router on --host/--port until
    SIGTERM/SIGINT; the replicas are stopped however the router ends (a second signal kills them)."""
    from tokenmill.router.launcher import LocalReplicas, serve_argv

    logging.basicConfig(
        level=getattr(logging, args.log_level.upper()), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    quiet_http_logs()
    n = args.data_parallel_size
    try:
        _policy(args, n)  # flag errors before anything starts
    except ValueError as e:
        print(f"tokenmill serve: error: {e}", file=sys.stderr)
        return 2
    sock = bind_or_exit(args)
    if args.price_per_hour:  # the machine's price, shared by its replicas
        args = argparse.Namespace(**{**vars(args), "price_per_hour": args.price_per_hour / n})
    argv = serve_argv(args, skip={"host", "port", "api_key", *data_parallel_dests})
    env = dict(os.environ)
    env.pop("TOKENMILL_API_KEY", None)
    if args.api_key:  # by environment, not on the replicas' command lines; the router passes clients' keys on
        env["TOKENMILL_API_KEY"] = args.api_key
    replicas = LocalReplicas(argv, n, pin_cpus=str(args.device) == "cpu", env=env)
    previous = {s: signal.signal(s, _raise_exit) for s in _STOP_SIGNALS}
    try:
        print(f"tokenmill: starting {n} replicas of {args.model} ...", flush=True)
        replicas.start()
        try:
            replicas.wait_healthy()
        except RuntimeError as e:
            print(f"tokenmill serve: error: {e}", file=sys.stderr)
            return 1
        share = replicas.cpus[0]
        cpus = "" if share is None else f", {len(share)} core{'s' if len(share) > 1 else ''} each"
        _serve_until_signal(args, replicas.urls, sock, note=cpus)
    finally:
        sock.close()
        for s in _STOP_SIGNALS:  # a second signal: no more waiting
            signal.signal(s, lambda signum, frame: replicas.kill())
        print("tokenmill: stopping the replicas ...", flush=True)
        replicas.stop(timeout=args.shutdown_timeout + 15)
        for s, handler in previous.items():
            signal.signal(s, handler)
    print("tokenmill: server stopped", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tokenmill")
    sub = parser.add_subparsers(dest="command", required=True)
    add_router_parser(sub)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"tokenmill router: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
