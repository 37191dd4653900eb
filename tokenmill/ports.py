"""Free local TCP ports for what this process starts and something else binds a moment later (a data-
parallel replica's server, the ranks' torch.distributed rendezvous), outside the kernel's ephemeral
range: a port the kernel hands out (bind to port 0) may be given, before its server binds it, to any
outgoing connection on this machine as its source port (the server then fails to start); a port outside
the range can only be taken by another explicit bind.

Standard library only.
"""

from __future__ import annotations

import contextlib
import random
import socket
from pathlib import Path

_LOWEST = 10000  # below: the ports services are configured on


def ephemeral_ports() -> range:
    """The ports the kernel gives outgoing connections and bind(port 0) (Linux's setting, or its default)."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999
    return range(low, high + 1)


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """`n` distinct ports free on `host` just now, outside the ephemeral range where it leaves room (else
    the kernel's choice)."""
    ephemeral, rng = ephemeral_ports(), random.SystemRandom()
    candidates = [p for p in range(_LOWEST, 65536) if p not in ephemeral]
    with contextlib.ExitStack() as stack:  # all held bound together: never the same port twice
        ports: list[int] = []
        for _ in range(200 * n):
            if len(ports) == n:
                break
            s = stack.enter_context(socket.socket())
            try:
                s.bind((host, rng.choice(candidates) if candidates else 0))
            except OSError:
                continue
            ports.append(s.getsockname()[1])
        if len(ports) < n:
            raise RuntimeError(f"no {n} free ports on {host}")
        return ports


def free_port(host: str = "127.0.0.1") -> int:
    return free_ports(1, host)[0]
