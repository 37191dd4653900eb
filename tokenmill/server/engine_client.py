"""The front end's handle on the engine-core process (the role of vLLM's AsyncLLM + core client).

`EngineClient.start()` spawns the core process and loads the tokenizer while the core loads the
weights. Once the event loop runs, `attach()` starts a reader thread that hands each core message
to the loop; there the `OutputProcessor` detokenizes, applies stop strings (asking the core to
abort a request that hit one) and fans `n > 1` children back into one request, and each request's
`RequestStream` (an asyncio queue) receives a `StreamOutput` per step. Leaving a stream early
aborts its request in the core. If the core process dies, every in-flight stream fails with
`EngineDeadError` and `healthy` turns False.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import multiprocessing
import queue
import threading
import time
from dataclasses import dataclass

from tokenmill.config import EngineConfig
from tokenmill.engine.core import RequestRejected
from tokenmill.engine.outputs import Logprob
from tokenmill.engine.output_processor import CompletionOutput, OutputProcessor, RequestOutput, child_request_id
from tokenmill.loader.source import resolve_model
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.core_process import run_engine_core
from tokenmill.tokenizer import Tokenizer, load_tokenizer

logger = logging.getLogger(__name__)

_POLL_SECONDS = 0.2


def _tokenizer_data(tokenizer: Tokenizer):
    """What the core's grammar compiler needs from the tokenizer (None: structured output off)."""
    try:
        from tokenmill.structured.backend import TokenizerData

        return TokenizerData.from_tokenizer(tokenizer)
    except Exception:  # noqa: BLE001 - serve without structured output rather than not at all
        logger.exception("cannot prepare the tokenizer for structured output; constrained requests will fail")
        return None


class EngineDeadError(RuntimeError):
    """The core process is gone (crashed, killed, or the server is shutting down)."""


class EngineStartupError(RuntimeError):
    """The core process could not load the model."""


class QueueFullError(RuntimeError):
    """More requests are waiting than --max-queue allows."""


class RequestFailed(RuntimeError):
    """The engine failed on this request (its other requests were not affected)."""


class RequestTimeout(RuntimeError):
    """The request ran past its deadline (--request-timeout) and was aborted."""


def _failure(result: RequestOutput) -> Exception | None:
    """The error of a request one of whose samples the engine failed on, or None."""
    for o in result.outputs:
        if o.error is not None:
            return RequestRejected(o.error, o.error_param) if o.error_param else RequestFailed(o.error)
    return None


@dataclass
class SampleDelta:
    """What one step added to one of a request's `n` samples (copied: safe to keep)."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None
    stop_reason: str | int | None


@dataclass
class StreamOutput:
    request_id: str
    prompt_token_ids: list[int]
    num_cached_tokens: int
    deltas: list[SampleDelta]  # only the samples that changed this step
    finished: bool
    outputs: list[CompletionOutput]  # cumulative per sample; final once `finished`


def _copy_step(result: RequestOutput, reported: set[int]) -> StreamOutput:
    """Snapshot a RequestOutput's per-step deltas (the processor reuses its objects next step)."""
    deltas = []
    for o in result.outputs:
        newly_finished = o.finish_reason is not None and o.index not in reported
        if o.delta_token_ids or o.delta_text or newly_finished:
            deltas.append(SampleDelta(o.index, o.delta_text, list(o.delta_token_ids),
                                      list(o.delta_logprobs) if o.delta_logprobs is not None else None,
                                      o.finish_reason, o.stop_reason))
            if newly_finished:
                reported.add(o.index)
    return StreamOutput(result.request_id, result.prompt_token_ids, result.num_cached_tokens, deltas,
                        result.finished, result.outputs)


def _merge_steps(older: StreamOutput, newer: StreamOutput) -> StreamOutput:
    """Two undelivered steps as one: per sample, the texts, tokens and logprobs joined."""
    by_index = {d.index: d for d in older.deltas}
    for d in newer.deltas:
        old = by_index.get(d.index)
        if old is None:
            by_index[d.index] = d
            continue
        logprobs = None if old.logprobs is None and d.logprobs is None else (old.logprobs or []) + (d.logprobs or [])
        by_index[d.index] = SampleDelta(d.index, old.text + d.text, old.token_ids + d.token_ids, logprobs,
                                        d.finish_reason, d.stop_reason)
    return dataclasses.replace(newer, deltas=sorted(by_index.values(), key=lambda d: d.index))


class RequestStream:
    """One request's outputs, step by step. Use as `async with stream: async for out in stream:`;
    leaving the block before the request finished aborts it (client gone, error, cancellation).

    Steps the reader has not taken yet are merged into one, so a slow reader holds at most one
    pending output (no longer than the request's own output), never one item per engine step."""

    def __init__(self, client: EngineClient, request_id: str, deadline: float | None = None) -> None:
        self.client = client
        self.request_id = request_id
        self.deadline = deadline  # time.monotonic() past which the request is aborted
        self._pending: collections.deque[StreamOutput | BaseException] = collections.deque()
        self._ready = asyncio.Event()
        self.finished = False
        self.reported: set[int] = set()  # samples whose finish was already delivered

    def put(self, item: StreamOutput | BaseException) -> None:
        if self._pending and isinstance(item, StreamOutput) and isinstance(self._pending[-1], StreamOutput):
            self._pending[-1] = _merge_steps(self._pending[-1], item)
        else:
            self._pending.append(item)
        self._ready.set()

    def __aiter__(self) -> RequestStream:
        return self

    async def _wait(self) -> None:
        while not self._pending:
            self._ready.clear()
            if self.deadline is None:
                await self._ready.wait()
                continue
            try:
                await asyncio.wait_for(self._ready.wait(), max(0.0, self.deadline - time.monotonic()))
            except TimeoutError:
                self.close()
                raise RequestTimeout("the request took longer than the server's request timeout") from None

    async def __anext__(self) -> StreamOutput:
        if self.finished:
            raise StopAsyncIteration
        await self._wait()
        item = self._pending.popleft()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    async def started(self) -> None:
        """Wait for the request's first output; raise at once if it failed before producing one (so a
        constrained request whose grammar is refused gets a 400, not an error inside a 200 stream)."""
        await self._wait()
        if isinstance(self._pending[0], BaseException):
            self.finished = True
            raise self._pending.popleft()

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if not self.finished:
            self.finished = True
            self.client.abort(self.request_id)
        self.client._streams.pop(self.request_id, None)


class EngineClient:
    def __init__(self, config: EngineConfig, max_queue: int | None = None, metrics=None,
                 chat_template: str | None = None, request_timeout: float | None = None) -> None:
        self.config = config
        self.max_queue = max_queue
        self.request_timeout = request_timeout  # seconds from arrival, then the request is aborted
        self.chat_template = chat_template  # the operator's --chat-template, replacing the model's
        self.metrics = metrics  # has on_outputs(list[RequestOutput]), on_abort(RequestOutput), on_stats(dict)
        self.tokenizer: Tokenizer | None = None
        self.info: dict = {}
        self.stats: dict = {}
        self._proc = None
        self._inputs = self._outputs = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reader: threading.Thread | None = None
        self._stopping = threading.Event()
        self._processor: OutputProcessor | None = None
        self._streams: dict[str, RequestStream] = {}
        self._children: dict[str, list[str]] = {}  # request id -> core (child) request ids
        self._parent: dict[str, str] = {}  # core request id -> request id
        self._num_sent = 0  # add messages sent to the core
        self._reset_waiters: list[asyncio.Future] = []  # reset_prefix_cache calls awaiting the core
        self.dead_reason: str | None = None
        self.shutting_down = False

    # ---- lifecycle ----------------------------------------------------------------------------

    def start(self) -> dict:
        """Spawn the core, load the tokenizer meanwhile, and wait until the model is loaded.
        Returns the core's ready info (KV capacity, max_model_len, ...)."""
        ctx = multiprocessing.get_context("spawn")
        self._inputs, self._outputs = ctx.Queue(), ctx.Queue()
        self._proc = ctx.Process(target=run_engine_core, args=(self.config, self._inputs, self._outputs),
                                 name="tokenmill-engine-core")  # not daemonic: it starts grammar workers
        self._proc.start()
        try:
            self.tokenizer = load_tokenizer(resolve_model(self.config.model), self.chat_template)
            self._inputs.put(("init", sorted(self.tokenizer.eos_token_ids), _tokenizer_data(self.tokenizer)))
            self.info = self._wait_ready()
        except BaseException:
            self.stop_process(timeout=1, warn=False)  # nothing to save in a core that is still loading
            raise
        self._processor = OutputProcessor(self.tokenizer)
        return self.info

    def _wait_ready(self) -> dict:
        while True:
            try:
                msg = self._outputs.get(timeout=_POLL_SECONDS)
            except queue.Empty:
                if not self._proc.is_alive():
                    raise EngineStartupError(
                        f"the engine core process exited (code {self._proc.exitcode}) while loading the model"
                    ) from None
                continue
            if msg[0] == "ready":
                return msg[1]
            if msg[0] == "error":
                raise EngineStartupError(msg[1])

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start delivering core messages to `loop` (call from the running loop)."""
        self._loop = loop
        self._reader = threading.Thread(target=self._read_outputs, name="tokenmill-core-reader", daemon=True)
        self._reader.start()

    @property
    def core_pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def healthy(self) -> bool:
        return self.dead_reason is None and self._proc is not None and self._proc.is_alive()

    def begin_shutdown(self) -> None:
        """Stop taking requests and fail the in-flight ones (called on SIGTERM/SIGINT)."""
        if self.shutting_down:
            return
        self.shutting_down = True
        for rid in list(self._streams):
            self.abort(rid)
        self._fail_all("the server is shutting down")

    def stop_process(self, timeout: float = 10.0, warn: bool = True) -> None:
        """Ask the core to exit; terminate, then kill it if it does not. Idempotent."""
        self._stopping.set()
        proc = self._proc
        if proc is None:
            return
        if proc.is_alive():
            try:
                self._inputs.put(("shutdown",))
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
        for q in (self._inputs, self._outputs):
            q.cancel_join_thread()
            q.close()

    # ---- requests -----------------------------------------------------------------------------

    def waiting_estimate(self) -> int:
        """Core requests waiting for a slot: the last reported count plus adds it has not seen yet."""
        return self.stats.get("num_waiting", 0) + self._num_sent - self.stats.get("num_received", 0)

    def generate(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams, arrival_time: float | None = None, priority: int = 0,
                 cache_salt: str | None = None) -> RequestStream:
        """Submit a request; iterate the returned stream for its outputs."""
        if self.shutting_down:
            raise EngineDeadError("the server is shutting down")
        if not self.healthy:
            raise EngineDeadError(self.dead_reason or "the engine core process is not running")
        if self.max_queue is not None and self.waiting_estimate() + params.n > self.max_queue:
            raise QueueFullError(f"the server's waiting queue is full ({self.max_queue} requests); retry later")
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        deadline = arrival + self.request_timeout if self.request_timeout is not None else None
        stream = RequestStream(self, request_id, deadline)
        self._streams[request_id] = stream
        children = self._processor.add_request(request_id, prompt, prompt_token_ids, params, arrival, priority,
                                               cache_salt)
        self._children[request_id] = [c.request_id for c in children]
        for child in children:
            self._parent[child.request_id] = request_id
            self._inputs.put(("add", child))
            self._num_sent += 1
        return stream

    def abort(self, request_id: str) -> None:
        """Abort a request (its blocks return to the pool after the core's next drain)."""
        result = self._processor.abort(request_id) if self._processor is not None else None
        child_ids = self._forget(request_id)
        if result is not None:
            if child_ids and self.healthy:
                self._inputs.put(("abort", child_ids))
            if self.metrics is not None:
                self.metrics.on_abort(result)

    async def reset_prefix_cache(self) -> int:
        """Ask the core to drop its cached prefix blocks; returns how many it dropped."""
        if not self.healthy:
            raise EngineDeadError(self.dead_reason or "the engine core process is not running")
        waiter = asyncio.get_running_loop().create_future()
        self._reset_waiters.append(waiter)
        self._inputs.put(("reset_prefix_cache",))
        return await waiter

    def _forget(self, request_id: str) -> list[str]:
        child_ids = self._children.pop(request_id, [])
        for cid in child_ids:
            self._parent.pop(cid, None)
        return child_ids

    # ---- core messages --------------------------------------------------------------------------

    def _read_outputs(self) -> None:
        """Reader thread: forward core messages to the event loop; notice the core dying."""
        while not self._stopping.is_set():
            try:
                msg = self._outputs.get(timeout=_POLL_SECONDS)
            except queue.Empty:
                if not self._proc.is_alive() and not self._stopping.is_set():
                    reason = f"the engine core process exited unexpectedly (exit code {self._proc.exitcode})"
                    self._call_soon(self._on_dead, reason)
                    return
                continue
            except (EOFError, OSError, ValueError):
                if not self._stopping.is_set():
                    self._call_soon(self._on_dead, "lost the connection to the engine core process")
                return
            self._call_soon(self._on_message, msg)

    def _call_soon(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # loop closed during shutdown
            pass

    def _on_message(self, msg: tuple) -> None:
        kind = msg[0]
        try:
            if kind == "step":
                self._on_step(msg[1])
                self._on_stats(msg[2])
            elif kind == "stats":
                self._on_stats(msg[1])
            elif kind == "rejected":
                self._on_rejected(msg[1], msg[2], msg[3])
            elif kind == "prefix_cache_reset":
                if self._reset_waiters:
                    self._reset_waiters.pop(0).set_result(msg[1])
            elif kind == "fatal":
                logger.error("engine core failed:\n%s", msg[1])
                self._on_dead("the engine core failed; see the server log")
        except Exception:  # a bug here must not kill the reader; fail loudly in the log
            logger.exception("error handling engine core message %r", kind)

    def _on_step(self, core_outputs: list) -> None:
        results, to_abort = self._processor.process(core_outputs)
        if to_abort:
            self._inputs.put(("abort", to_abort))  # stop strings found here: free their blocks now
        if self.metrics is not None and results:
            self.metrics.on_outputs(results)
        for result in results:
            stream = self._streams.get(result.request_id)
            error = _failure(result)
            if error is not None:  # one sample failed: the request fails (its other samples stop too)
                self._processor.abort(result.request_id)
                self._inputs.put(("abort", self._forget(result.request_id)))  # unknown ids are ignored
                if stream is not None:
                    stream.put(error)
                continue
            if result.finished:
                self._forget(result.request_id)
            if stream is not None:
                stream.put(_copy_step(result, stream.reported))

    def _on_stats(self, stats: dict) -> None:
        self.stats = stats
        if self.metrics is not None:
            self.metrics.on_stats(stats)

    def _on_rejected(self, core_request_id: str, message: str, param: str | None) -> None:
        request_id = self._parent.get(core_request_id)
        if request_id is None:
            return
        stream = self._streams.get(request_id)
        self._processor.abort(request_id)
        others = [c for c in self._forget(request_id) if c != core_request_id]
        if others:
            self._inputs.put(("abort", others))
        if stream is not None:
            stream.put(RequestRejected(message, param))

    def _on_dead(self, reason: str) -> None:
        if self.dead_reason is None:
            self.dead_reason = reason
            if not self.shutting_down:
                logger.error("%s; failing all requests", reason)
        self._fail_all(reason)

    def _fail_all(self, reason: str) -> None:
        for stream in list(self._streams.values()):
            stream.put(EngineDeadError(reason))
        for rid in list(self._children):
            self._forget(rid)
        while self._reset_waiters:
            self._reset_waiters.pop().set_exception(EngineDeadError(reason))
        if self._processor is not None:
            self._processor = OutputProcessor(self.tokenizer)


__all__ = ["EngineClient", "EngineDeadError", "EngineStartupError", "QueueFullError", "RequestFailed",
           "RequestRejected", "RequestStream", "RequestTimeout", "SampleDelta", "StreamOutput", "child_request_id"]
