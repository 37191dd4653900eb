"""Local replicas for data parallelism: N `tokenmill serve` subprocesses on free 127.0.0.1 ports.

Each replica is a whole server with its own engine, started with the same flags. On CPU the machine's
cores are split between them (each replica's process is pinned to its share, and the engine sizes
its thread pool from the cores it may use). Replicas run in their own process group (a terminal's
Ctrl-C reaches only the router, which stops them in order) and, on Linux, get SIGTERM if the process
that started them dies: no orphans.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import httpx
import psutil

from tokenmill.ports import free_ports

_PR_SET_PDEATHSIG = 1


def cpu_shares(n: int) -> list[list[int]]:
    """The cores this process may use, split into `n` equal shares (at least one core each; with
    fewer cores than replicas, replicas share cores in turn)."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    per = max(1, len(cores) // n)
    return [[cores[(i * per + j) % len(cores)] for j in range(per)] for i in range(n)]


def serve_argv(args: argparse.Namespace, skip: Iterable[str]) -> list[str]:
    """The `tokenmill serve` flags that rebuild `args` (those differing from their defaults), without
    the destinations in `skip`."""
    from tokenmill.server.cli import add_serve_parser

    scratch = argparse.ArgumentParser(add_help=False)
    parser = add_serve_parser(scratch.add_subparsers())
    skip = set(skip) | {"help", "func"}
    argv: list[str] = []
    for action in parser._actions:
        if not action.option_strings or action.dest in skip or not hasattr(args, action.dest):
            continue
        value = getattr(args, action.dest)
        if value == action.default:
            continue
        if isinstance(action, argparse.BooleanOptionalAction):
            argv.append(action.option_strings[0] if value else action.option_strings[1])
        elif action.nargs == 0:  # store_true / store_false
            argv.append(action.option_strings[0])
        elif isinstance(value, (list, tuple)):
            argv += [action.option_strings[0], *map(str, value)]
        elif value is not None:
            argv += [action.option_strings[0], str(value)]
    return argv


def _replica_main(argv: list[str]) -> int:
    """`python -m tokenmill.router.launcher PARENT_PID CPUS serve ...`: ask for SIGTERM when the parent
    dies (Linux), pin this process to CPUS (comma-separated, or "-" for no pinning), then be the server.
    Done here, after exec, rather than in a preexec_fn (unsafe when the parent has threads)."""
    parent, cpus, *serve = argv
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != int(parent):  # the parent died before the request took effect
        return 1
    if cpus != "-":
        os.sched_setaffinity(0, [int(c) for c in cpus.split(",")])
    from tokenmill.server.cli import main

    return main(serve)


class LocalReplicas:
    """`n` `tokenmill serve` processes, started with `argv` (no --host/--port), each on its own port."""

    def __init__(
        self,
        argv: Sequence[str],
        n: int,
        pin_cpus: bool = True,
        log_dir: str | Path | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        if n < 1:
            raise ValueError(f"need at least one replica, got {n}")
        self.argv, self.n, self.log_dir = list(argv), n, Path(log_dir) if log_dir else None
        self.cpus = cpu_shares(n) if pin_cpus and hasattr(os, "sched_setaffinity") else [None] * n
        self.env = dict(os.environ if env is None else env, PYTHONUNBUFFERED="1")
        self.ports: list[int] = []
        self.procs: list[subprocess.Popen] = []
        self._trees: dict[int, list[psutil.Process]] = {}

    @property
    def urls(self) -> list[str]:
        return [f"http://127.0.0.1:{p}" for p in self.ports]

    def start(self) -> LocalReplicas:
        self.ports = free_ports(self.n)
        for i, (port, cpus) in enumerate(zip(self.ports, self.cpus)):
            pinned = ",".join(map(str, cpus)) if cpus else "-"
            cmd = [
                sys.executable,
                "-m",
                "tokenmill.router.launcher",
                str(os.getpid()),
                pinned,
                "serve",
                *self.argv,
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
            ]
            env = dict(self.env, **({"OMP_NUM_THREADS": str(len(cpus))} if cpus else {}))
            out = open(self.log_dir / f"replica-{i}.log", "wb") if self.log_dir else None  # noqa: SIM115
            try:
                self.procs.append(
                    subprocess.Popen(
                        cmd, env=env, stdout=out, stderr=subprocess.STDOUT if out else None, start_new_session=True
                    )
                )
            finally:
                if out is not None:
                    out.close()
        return self

    def wait_healthy(self, timeout: float = 600.0) -> None:
        """Return once every replica's /health is 200; RuntimeError if one exits or `timeout` passes."""
        deadline = time.monotonic() + timeout
        waiting = set(range(self.n))
        while waiting:
            for i in sorted(waiting):
                code = self.procs[i].poll()
                if code is not None:
                    raise RuntimeError(f"replica {i} (port {self.ports[i]}) exited with status {code} while starting")
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{self.urls[i]}/health", timeout=2).status_code == 200:
                        waiting.discard(i)
            if waiting and time.monotonic() > deadline:
                raise RuntimeError(f"replicas {sorted(waiting)} not healthy after {timeout:.0f} s")
            if waiting:
                time.sleep(0.25)

    def pids(self) -> list[int]:
        """The replicas' processes and all their children (engine cores)."""
        pids = []
        for proc in self.procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                pids += [proc.pid, *(c.pid for c in psutil.Process(proc.pid).children(recursive=True))]
        return pids

    def stop(self, timeout: float = 45.0) -> None:
        """SIGTERM every replica (each drains and stops its engine), wait up to `timeout` s, then kill
        whatever is left of them and their children."""
        self._trees = {}
        for proc in self.procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                self._trees[proc.pid] = psutil.Process(proc.pid).children(recursive=True)
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.0, deadline - time.monotonic()))
        self.kill()

    def kill(self) -> None:
        """SIGKILL the replicas still running and every child they had (psutil checks each is still the
        same process, so a reused pid is never hit)."""
        for proc in self.procs:
            children = self._trees.get(proc.pid)
            if children is None:
                with contextlib.suppress(psutil.NoSuchProcess):
                    children = psutil.Process(proc.pid).children(recursive=True)
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(10)
            for child in children or []:
                with contextlib.suppress(psutil.NoSuchProcess):
                    child.kill()


if __name__ == "__main__":
    sys.exit(_replica_main(sys.argv[1:]))
