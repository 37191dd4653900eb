"""One engine-core process as the front end sees it: spawn, hand it the tokenizer facts, wait until
the model is loaded, read its messages on a thread, stop or kill it. The engine client keeps one
and replaces it when the core dies or hangs."""

from __future__ import annotations

import logging
import multiprocessing
import pickle
import queue
import threading
from collections.abc import Callable

import psutil

from tokenmill.config import EngineConfig
from tokenmill.server.core_process import run_engine_core
from tokenmill.server.messages import CoreReady, InitCore, LoadFailed, Shutdown

logger = logging.getLogger(__name__)

_POLL_SECONDS = 0.2


class EngineStartupError(RuntimeError):
    """The core process could not load the model."""


class CoreHandle:
    def __init__(self, config: EngineConfig) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.inputs, self.outputs = ctx.Queue(), ctx.Queue()
        self.progress = ctx.Value("Q", 0, lock=False)  # bumped by the core inside its steps (worker/heartbeat.py)
        self.proc = ctx.Process(
            target=run_engine_core,
            args=(config, self.inputs, self.outputs, self.progress),
            name="tokenmill-engine-core",
        )  # not daemonic: it starts grammar workers
        self.proc.start()
        self._stopping = threading.Event()
        self._reader: threading.Thread | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def progress_mark(self) -> tuple[int, float]:
        """What changes while the core makes progress: its step counter, and the CPU seconds it and
        its children (tensor-parallel workers) have used."""
        try:
            proc = psutil.Process(self.proc.pid)
            cpu = sum(sum(p.cpu_times()[:2]) for p in [proc, *proc.children(recursive=True)])
        except psutil.Error:  # gone, or a child went while we looked: no CPU mark this time
            cpu = 0.0
        return self.progress.value, cpu

    @property
    def alive(self) -> bool:
        return self.proc.is_alive()

    def put(self, message: object) -> None:
        """Send the core one of the front-end messages of `tokenmill.server.messages`."""
        self.inputs.put(message)

    def init(self, eos_token_ids, tokenizer_data) -> dict:
        """Send what the core needs from the tokenizer; wait until the model is loaded. Its ready info."""
        self.inputs.put(InitCore(sorted(eos_token_ids), tokenizer_data))
        while True:
            try:
                msg = self.outputs.get(timeout=_POLL_SECONDS)
            except queue.Empty:
                if not self.proc.is_alive():
                    raise EngineStartupError(
                        f"the engine core process exited (code {self.proc.exitcode}) while loading the model"
                    ) from None
                continue
            if isinstance(msg, CoreReady):
                return msg.info
            if isinstance(msg, LoadFailed):
                raise EngineStartupError(msg.message)

    def start_reader(self, deliver: Callable[[object], None], on_dead: Callable[[str], None]) -> None:
        """Hand each core message to `deliver`; call `on_dead(reason)` once if the process goes away."""

        def read() -> None:
            while not self._stopping.is_set():
                try:
                    msg = self.outputs.get(timeout=_POLL_SECONDS)
                except queue.Empty:
                    if not self.proc.is_alive() and not self._stopping.is_set():
                        on_dead(f"the engine core process exited unexpectedly (exit code {self.proc.exitcode})")
                        return
                    continue
                except (EOFError, OSError, ValueError, pickle.UnpicklingError):  # e.g. killed mid-message
                    if not self._stopping.is_set():
                        on_dead("lost the connection to the engine core process")
                    return
                deliver(msg)

        self._reader = threading.Thread(target=read, name="tokenmill-core-reader", daemon=True)
        self._reader.start()

    def kill(self) -> None:
        """End a core that does not respond (the reader then reports it dead)."""
        self.proc.kill()

    def stop(self, timeout: float = 10.0, warn: bool = True) -> None:
        """Ask the core to exit; terminate, then kill it if it does not. Idempotent."""
        self._stopping.set()
        proc = self.proc
        if proc.is_alive():
            try:
                self.inputs.put(Shutdown())
            except (OSError, ValueError):
                pass
            proc.join(timeout)
        if proc.is_alive():
            if warn:
                logger.warning("engine core did not exit in %.0fs; terminating it", timeout)
            proc.terminate()
            proc.join(3)
        if proc.is_alive():
            proc.kill()
            proc.join(3)
        if self._reader is not None and self._reader is not threading.current_thread():
            self._reader.join(2)
        for q in (self.inputs, self.outputs):
            q.cancel_join_thread()
            q.close()
