"""Sample utilization during a run in a background thread: the server process's CPU (psutil, with its
children, and the process alone: for tokenmill the HTTP front end, whose engine core is a child), the
GPUs (NVML, only if pynvml is importable) and the server's KV-cache usage (/metrics).

The server's CPU over the whole run (`server_cpu`: cores kept busy) comes from its /metrics when it
exports a CPU-seconds counter (tokenmill: the whole server; others: `process_cpu_seconds_total`, the API
process alone), else from psutil's samples of its process tree (--server-pid, or the process listening
on the base URL's port when the server runs on this machine); the result names which.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from urllib.parse import urlparse

from tokenmill.bench import prometheus
from tokenmill.bench.metrics import distribution


class _ProcessCPU:
    """CPU% of a process tree (100 = one core busy), from psutil's deltas between calls."""

    def __init__(self, pid: int):
        import psutil

        self._psutil = psutil
        self.root = psutil.Process(pid)
        self._procs: dict[int, object] = {}
        self.sample()  # the first cpu_percent() of each process only starts its clock

    def sample(self) -> tuple[float, float, float]:
        """(CPU %, resident memory MiB) of the process and its children, and the CPU % of the process alone."""
        psutil = self._psutil
        try:
            procs = [self.root, *self.root.children(recursive=True)]
        except psutil.Error:
            return 0.0, 0.0, 0.0
        cpu = rss = own = 0.0
        for p in procs:
            known = self._procs.setdefault(p.pid, p)
            try:
                percent = known.cpu_percent(None)
                rss += known.memory_info().rss / 2**20
            except psutil.Error:
                self._procs.pop(p.pid, None)
                continue
            cpu += percent
            own = percent if p.pid == self.root.pid else own
        return cpu, rss, own


class _GPU:
    def __init__(self):
        import pynvml

        pynvml.nvmlInit()
        self.nvml = pynvml
        self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]

    def sample(self) -> list[tuple[float, float]]:
        """(utilization %, memory used MiB) per device."""
        out = []
        for h in self.handles:
            util = self.nvml.nvmlDeviceGetUtilizationRates(h)
            out.append((float(util.gpu), self.nvml.nvmlDeviceGetMemoryInfo(h).used / 2**20))
        return out

    def close(self) -> None:
        self.nvml.nvmlShutdown()


def _gpu_or_none() -> _GPU | None:
    try:
        return _GPU()
    except Exception:  # no pynvml, no driver, no device
        return None


CPU_COUNTERS = (
    ("tokenmill:server_cpu_seconds_total", "the server's /metrics (front end, engine core and workers)"),
    ("process_cpu_seconds_total", "the server's /metrics (process_cpu_seconds_total: its API process only)"),
)


def metrics_cpu_seconds(samples) -> tuple[float, str] | None:
    """(CPU seconds, where they come from) from the first CPU counter a server exports."""
    for name, source in CPU_COUNTERS:
        value = prometheus.metric_value(samples or [], (name,))
        if value is not None:
            return value, source
    return None


def _url(base_url: str):
    return urlparse(base_url if "://" in base_url else f"http://{base_url}")


def is_local(base_url: str) -> bool:
    """Whether the URL names this machine (a server there shares its CPUs and memory bandwidth)."""
    return _url(base_url).hostname in ("127.0.0.1", "localhost", "::1", "0.0.0.0", socket.gethostname())


def local_server_pid(base_url: str) -> int | None:
    """The process listening on the base URL's port, when the URL names this machine (None otherwise,
    or when the OS does not say)."""
    import psutil

    if not is_local(base_url):
        return None
    url = _url(base_url)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        listening = psutil.net_connections("tcp")
    except (psutil.Error, OSError):
        return None
    return next((c.pid for c in listening if c.status == psutil.CONN_LISTEN and c.laddr.port == port and c.pid), None)


class ResourceMonitor:
    """`with ResourceMonitor(pid, metrics_url): run()`, then `.summary()`."""

    def __init__(
        self,
        server_pid: int | None = None,
        metrics_url: str | None = None,
        interval: float = 0.5,
        model: str | None = None,
    ):
        self.interval = interval
        self.metrics_url = metrics_url
        self.model = model
        self.cpu = _ProcessCPU(server_pid) if server_pid else None
        self.gpu = _gpu_or_none()
        self.cpu_samples: list[tuple[float, float, float]] = []
        self.gpu_samples: list[list[tuple[float, float]]] = []
        self.kv_samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="bench-monitor", daemon=True)

    def __enter__(self) -> ResourceMonitor:
        self._cpu_start = self._metrics_cpu(), time.monotonic()
        self._thread.start()
        return self

    def _metrics_cpu(self) -> tuple[float, str] | None:
        return metrics_cpu_seconds(prometheus.scrape(self.metrics_url)) if self.metrics_url else None

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        if self.cpu is not None:  # one last sample covers the tail (and runs shorter than one interval)
            self.cpu_samples.append(self.cpu.sample())
        if self.gpu is not None:
            self.gpu.close()
        self._cpu_end = self._metrics_cpu(), time.monotonic()

    def _loop(self) -> None:
        # /metrics is polled less often than psutil: it costs the server a little work.
        next_scrape = 0.0
        while not self._stop.wait(self.interval):
            if self.cpu is not None:
                self.cpu_samples.append(self.cpu.sample())
            if self.gpu is not None:
                self.gpu_samples.append(self.gpu.sample())
            if self.metrics_url and time.monotonic() >= next_scrape:
                next_scrape = time.monotonic() + max(1.0, 2 * self.interval)
                samples = prometheus.scrape(self.metrics_url, timeout=2.0)
                usage = prometheus.metric_value(samples, prometheus.KV_USAGE, self.model) if samples else None
                if usage is not None:
                    self.kv_samples.append(usage)
                elif samples is None:
                    self.metrics_url = None  # not exposed: stop asking

    def summary(self) -> dict:
        out: dict = {
            "server_cpu_percent": None,
            "server_main_cpu_percent": None,
            "server_rss_mib": None,
            "gpu": None,
            "server_cpu": self._server_cpu(),
        }
        if self.cpu_samples:
            out["server_cpu_percent"] = _brief([c for c, _, _ in self.cpu_samples])
            out["server_main_cpu_percent"] = _brief([own for _, _, own in self.cpu_samples])
            out["server_rss_mib"] = _brief([m for _, m, _ in self.cpu_samples])
        if self.gpu_samples:
            devices = list(zip(*self.gpu_samples))
            out["gpu"] = [
                {
                    "device": i,
                    "util_percent": _brief([u for u, _ in dev]),
                    "memory_used_mib": _brief([m for _, m in dev]),
                }
                for i, dev in enumerate(devices)
            ]
        return out

    def _server_cpu(self) -> dict | None:
        """Cores the server kept busy over the run, and their share of this machine's when it runs here."""
        (start, t0), (end, t1) = getattr(self, "_cpu_start", (None, 0)), getattr(self, "_cpu_end", (None, 0))
        cores = os.cpu_count() or 1
        if start and end and t1 > t0 and end[1] == start[1]:
            busy, source = (end[0] - start[0]) / (t1 - t0), end[1]
        elif self.cpu_samples:
            busy, source = (
                sum(c for c, _, _ in self.cpu_samples) / len(self.cpu_samples) / 100,
                (f"psutil on the server's processes (pid {self.cpu.root.pid}, on this machine)"),
            )
        else:
            return None
        local = self.cpu is not None  # a process we can see runs here: its share of this machine's cores
        return {
            "cores_busy": busy,
            "share_of_this_machine": busy / cores if local else None,
            "cpu_count": cores if local else None,
            "source": source,
        }


def _brief(values: list[float]) -> dict:
    d = distribution(values)
    return {"mean": d["mean"], "max": d["max"], "samples": d["count"]}
