"""Sample utilization during a run in a background thread: the server process's CPU (psutil, with its
children, and the process alone: for tokenmill the HTTP front end, whose engine core is a child), the
GPUs (NVML, only if pynvml is importable) and the server's KV-cache usage (/metrics)."""

from __future__ import annotations

import threading
import time

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
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        if self.cpu is not None:  # one last sample covers the tail (and runs shorter than one interval)
            self.cpu_samples.append(self.cpu.sample())
        if self.gpu is not None:
            self.gpu.close()

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
        out: dict = {"server_cpu_percent": None, "server_main_cpu_percent": None, "server_rss_mib": None, "gpu": None}
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


def _brief(values: list[float]) -> dict:
    d = distribution(values)
    return {"mean": d["mean"], "max": d["max"], "samples": d["count"]}
