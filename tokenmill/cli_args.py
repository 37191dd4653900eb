"""What several commands' command lines share, written once: the address flags of an HTTP front
(`serve`, `router`, `disagg-proxy`), the flags naming the server a client command sends to (`bench`,
`doctor`) and the roofline it is set against, and the steps around them (binding the port before
a slow start, quieting httpx's per-request log lines, refusing a flag that must be positive).

Standard library only: the router, the proxy and the bench client import it without torch.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket

DEFAULT_BASE_URL = "http://127.0.0.1:8000"


def add_http_args(group) -> None:
    """--host, --port, --uvicorn-log-level, --header-timeout of a front (the server, the router, the
    disaggregated-serving proxy)."""
    group.add_argument(
        "--host", default="127.0.0.1", help="address to bind; 0.0.0.0 listens on all interfaces (default: %(default)s)"
    )
    group.add_argument("--port", type=int, default=8000, help="TCP port to listen on (default: %(default)s)")
    group.add_argument(
        "--uvicorn-log-level",
        default="warning",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
        help="log level of the uvicorn HTTP server (default: %(default)s)",
    )
    group.add_argument(
        "--header-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="seconds a client may take to send a request's head (request line and headers), from "
        "connecting or from the end of the previous response on the connection, and then as long again "
        "for its body; a slower one is disconnected, so idle or trickling connections cannot pile up; "
        "0 turns the deadlines off (default: %(default)s)",
    )


def add_server_args(g, sender: str) -> None:
    """--base-url, --endpoint, --model, --api-key: the server that a client command (bench, doctor) sends
    its requests to; `sender` names what sends them, in the help."""
    g.add_argument(
        "--base-url", default=DEFAULT_BASE_URL, help="server root URL, with or without /v1 (default: %(default)s)"
    )
    g.add_argument(
        "--endpoint",
        default="/v1/completions",
        choices=["/v1/completions", "/v1/chat/completions"],
        help=f"API {sender} drives; chat sends message lists (default: %(default)s)",
    )
    g.add_argument("--model", default=None, help="model name to send (default: the first of the server's /v1/models)")
    g.add_argument(
        "--api-key",
        default=os.environ.get("OPENAI_API_KEY"),
        help=f"bearer token for {sender}'s requests (default: $OPENAI_API_KEY; never written to a result file)",
    )


def add_hardware_arg(g) -> None:
    """--hardware: the machine whose roofline the measured rates are set against (bench, doctor)."""
    g.add_argument(
        "--hardware",
        default="cached",
        help="the roofline line: each figure as a share of this machine's measured bandwidth (decode) or "
        "compute (prefill, all tokens). cached = the record `tokenmill plan` measured here, if any; "
        "auto = measure it now if missing; none; or a `tokenmill plan` hardware name for a server "
        "elsewhere (default: %(default)s)",
    )


def require_positive(args: argparse.Namespace, *dests: str) -> None:
    """ValueError naming the first of these flags that was given (not None) and is not > 0."""
    for dest in dests:
        value = getattr(args, dest)
        if value is not None and not value > 0:
            raise ValueError(f"--{dest.replace('_', '-')} must be positive, got {value}")


def quiet_http_logs() -> None:
    """httpx logs every request at INFO: thousands of lines in a benchmark, the router's health checks."""
    for name in ("httpx", "httpcore"):
        logging.getLogger(name).setLevel(max(logging.WARNING, logging.getLogger(name).level))


def listening_socket(host: str, port: int) -> socket.socket:
    """Bind before loading the model (or starting replicas), so a busy port fails in a second, not after the load.

    The socket names its protocol (TCP), as the address lookup gives it: asyncio turns Nagle's algorithm off
    (TCP_NODELAY) only on connections accepted from a socket that does. Without it a response written as
    head, then body (every non-streamed one) waited for the client's delayed ACK of the head: 40 ms on each
    request after a connection's first."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP, flags=socket.AI_PASSIVE)
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def bind_or_exit(args: argparse.Namespace) -> socket.socket:
    """`listening_socket` on --host/--port of a front that has nothing to clean up yet: SystemExit saying
    why when the port is taken."""
    try:
        return listening_socket(args.host, args.port)
    except OSError as e:
        raise SystemExit(f"tokenmill: error: cannot listen on {args.host}:{args.port}: {e}") from None
