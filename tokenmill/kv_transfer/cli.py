"""`tokenmill disagg-proxy`'s flags and entry point (the app is `proxy.py`, imported when it runs), and the
flags that make `tokenmill serve` one side of a disaggregated pair (`add_kv_role_args`)."""

from __future__ import annotations

import argparse

from tokenmill.cli_args import add_http_args, bind_or_exit, quiet_http_logs


def add_proxy_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "disagg-proxy",
        help="front a prefill and a decode server (disaggregated prefill/decode)",
        description="An OpenAI-compatible front (/v1/completions, /v1/chat/completions, /v1/models, /health) for a "
        "`tokenmill serve --kv-role producer` (prefill) and a `--kv-role consumer` (decode) server: each "
        "request is prefilled on the first, its KV blocks move to the second, which decodes and streams.",
    )
    p.add_argument(
        "--prefill",
        required=True,
        metavar="URL",
        help="the prefill (producer) server's root URL, e.g. http://127.0.0.1:8001",
    )
    p.add_argument(
        "--decode",
        required=True,
        metavar="URL",
        help="the decode (consumer) server's root URL, e.g. http://127.0.0.1:8002",
    )
    add_http_args(p.add_argument_group("HTTP"))
    p.set_defaults(func=run_proxy)
    return p


def add_kv_role_args(group) -> None:
    """--kv-role and --kv-transfer-config of `serve` (`KVTransferConfig.from_args` reads them)."""
    group.add_argument(
        "--kv-role",
        choices=["producer", "consumer"],
        default=None,
        help="producer: a prefill server (a request with kv_transfer_params runs its prompt, samples "
        "one token and sends the prompt's KV blocks to the consumer); consumer: a decode server "
        "(such a request receives its prompt's KV from the producer, then decodes). Both need the "
        "same model and KV cache flags (default: neither, a plain server)",
    )
    group.add_argument(
        "--kv-transfer-config",
        default=None,
        metavar="JSON",
        help='the transfer as a JSON object: {"kv_connector": "TorchDistributedConnector" (send/recv '
        'over torch.distributed: gloo on CPU, NCCL on CUDA) or "SharedMemoryConnector" (one host), '
        '"kv_rank": 0 producer / 1 consumer (default: from --kv-role), "kv_parallel_size": 2, '
        '"kv_ip": the producer\'s address (default 127.0.0.1), "kv_port": its rendezvous TCPStore '
        'port (default 14579), "kv_timeout": seconds a transfer may take (default 30)}',
    )


def run_proxy(args: argparse.Namespace) -> int:
    import uvicorn

    from tokenmill.http_server import uvicorn_config
    from tokenmill.kv_transfer.proxy import build_proxy_app

    for flag in ("prefill", "decode"):
        url = getattr(args, flag)
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"--{flag} must be an http(s) URL, got {url!r}")
    quiet_http_logs()
    sock = bind_or_exit(args)
    app = build_proxy_app(args.prefill, args.decode)
    config = uvicorn_config(app, args.uvicorn_log_level, 10, args.header_timeout)
    print(
        f"tokenmill disagg-proxy: prefill {args.prefill}, decode {args.decode}; listening at "
        f"http://{args.host}:{args.port}/v1",
        flush=True,
    )
    uvicorn.Server(config).run(sockets=[sock])
    return 0
