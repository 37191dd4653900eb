"""Grammar compilation in worker processes, under a deadline.

xgrammar compiles in C++ and cannot be interrupted; a pathological regex or grammar could take
minutes and a thread running it can never be stopped. So each compile runs in a worker process
with its own compiler; one that runs past `timeout` seconds is killed (the worker is restarted)
and its request rejected. The compiled grammar comes back serialized (xgrammar's JSON form: a few
hundred KB, milliseconds to rebuild). One dispatcher thread per worker feeds it jobs in order; it
also starts the worker, so that making a `CompileWorkers` costs the caller's thread nothing (the
engine core's step loop, or its start-up).
"""

from __future__ import annotations

import logging
import multiprocessing
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future

from tokenmill.structured.spec import StructuredOutputSpec, build_grammar, clean_error

logger = logging.getLogger(__name__)

_START_TIMEOUT = 120  # seconds for a worker to import xgrammar and build its compiler


class CompileTimeout(ValueError):
    """The grammar took longer to compile than the deadline allows."""


class _WorkerLost(Exception):
    """The worker process has to go (it ran past the deadline or died); `error` is the job's failure."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


def _worker_main(conn, tokenizer_data, vocab_size: int) -> None:
    """Worker process: compile each spec it receives; answer (True, serialized, seconds) or (False, error, 0)."""
    import time

    import xgrammar as xgr

    compiler = xgr.GrammarCompiler(tokenizer_data.xgrammar_info(vocab_size), max_threads=1, cache_enabled=False)
    conn.send("ready")
    while True:
        try:
            spec = conn.recv()
        except EOFError:
            return
        if spec is None:
            return
        start = time.perf_counter()
        try:
            compiled = compiler.compile_grammar(build_grammar(spec)).serialize_json()
            conn.send((True, compiled, time.perf_counter() - start))
        except Exception as e:  # noqa: BLE001 - reported to the request that asked
            conn.send((False, clean_error(e), 0.0))


class CompileWorkers:
    def __init__(
        self, tokenizer_data, vocab_size: int, info: Callable[[], object], num_workers: int = 2, timeout: float = 30.0
    ) -> None:
        self.timeout = timeout
        self._args = (tokenizer_data, vocab_size)
        # the core's xgrammar TokenizerInfo, to rebuild compiled grammars: built at the first result, not when the
        # workers start (each works out the tokenizer's bytes itself), so a core that made them at start is
        # not busy in the background while it serves its first requests
        self._info = info
        self._jobs: queue.Queue = queue.Queue()
        self._closed = False
        self.processes: list = [None] * num_workers  # each dispatcher's current worker process
        self._threads = [
            threading.Thread(target=self._dispatch, args=(i,), name=f"tokenmill-grammar-{i}", daemon=True)
            for i in range(num_workers)
        ]
        for t in self._threads:
            t.start()

    def submit(self, spec: StructuredOutputSpec) -> Future:
        future: Future = Future()
        self._jobs.put((spec, future))
        return future

    def _start(self, index: int):
        ctx = multiprocessing.get_context("spawn")
        here, there = ctx.Pipe()
        proc = ctx.Process(target=_worker_main, args=(there, *self._args), name="tokenmill-grammar-worker", daemon=True)
        proc.start()
        there.close()
        if not here.poll(_START_TIMEOUT) or here.recv() != "ready":
            proc.kill()
            raise RuntimeError(f"a grammar compiler process did not start within {_START_TIMEOUT} s")
        self.processes[index] = proc
        return proc, here

    def _dispatch(self, index: int) -> None:
        proc, conn = self._try_start(index)  # ready before the first grammar arrives
        while True:
            spec, future = self._jobs.get()
            if spec is None:
                break
            if not future.set_running_or_notify_cancel():
                continue
            try:
                if proc is None or not proc.is_alive():
                    proc, conn = self._start(index)
                self._run(spec, future, conn)
            except _WorkerLost as e:
                proc.kill()
                proc.join()
                future.set_exception(e.error)
                proc, conn = self._try_start(index)  # a new worker, ready for the next job
            except Exception as e:  # noqa: BLE001 - e.g. no process could be started: fail the job, go on
                logger.exception("the grammar compiler failed")
                future.set_exception(ValueError(f"the grammar compiler failed: {clean_error(e)}"))
                proc = None
        if proc is not None:
            conn.close()
            proc.kill()
            proc.join()

    def _try_start(self, index: int):
        try:
            return self._start(index)
        except Exception:  # noqa: BLE001 - retried at the next job
            logger.exception("cannot start a grammar compiler process")
            return None, None

    def _run(self, spec: StructuredOutputSpec, future: Future, conn) -> None:
        import xgrammar as xgr

        try:
            conn.send(spec)
            if not conn.poll(self.timeout):
                logger.warning("a %s grammar did not compile within %g s; killing its worker", spec.kind, self.timeout)
                raise _WorkerLost(CompileTimeout(f"compiling it took longer than {self.timeout:g} s"))
            ok, payload, seconds = conn.recv()
        except (EOFError, OSError):  # the worker died (e.g. out of memory)
            raise _WorkerLost(ValueError("the grammar compiler process failed on it")) from None
        if not ok:
            future.set_exception(ValueError(payload))
            return
        future.compile_seconds = seconds  # read by the compiler's statistics
        future.set_result(xgr.CompiledGrammar.deserialize_json(payload, self._info()))

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        while True:  # cancel what never started
            try:
                _, future = self._jobs.get_nowait()
            except queue.Empty:
                break
            future.cancel()
        for _ in self._threads:
            self._jobs.put((None, None))
