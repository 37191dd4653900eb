"""The front end's handle on the engine-core process (the role of vLLM's AsyncLLM + core client).

`EngineClient.start()` spawns the core process and loads the tokenizer while the core loads the
weights. Once the event loop runs, `attach()` starts a reader thread that hands each core message
to the loop; there the `OutputProcessor` detokenizes, applies stop strings (asking the core to
abort a request that hit one) and fans `n > 1` children back into one request, and each request's
`RequestStream` receives a `StreamOutput` per step. Leaving a stream early aborts its request in
the core.

Recovery: if the core process dies, every in-flight stream fails with `EngineDeadError` (HTTP 503)
and a new core is started; requests are refused with 503 until it is ready. A watchdog restarts a
core that makes no progress for `watchdog_timeout` seconds while requests are in flight.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

from tokenmill.config import EngineConfig
from tokenmill.engine.output_processor import OutputProcessor
from tokenmill.loader.source import resolve_model
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.core_handle import CoreHandle
from tokenmill.server.messages import (
    AbortRequests,
    AddRejected,
    AddRequest,
    CoreFailed,
    LoRAUpdated,
    PrefixCacheReset,
    ResetPrefixCache,
    StatsChanged,
    StepDone,
    UpdateLoRA,
)
from tokenmill.server.request_stream import (
    EngineDeadError,
    QueueFullError,
    RequestRejected,
    RequestStream,
    copy_step,
    failure_of,
)
from tokenmill.tokenizer import Tokenizer, load_tokenizer

logger = logging.getLogger(__name__)


def _tokenizer_data(tokenizer: Tokenizer):
    """What the core's grammar compiler needs from the tokenizer (None: structured output off)."""
    try:
        from tokenmill.structured.backend import TokenizerData

        return TokenizerData.from_tokenizer(tokenizer)
    except Exception:  # noqa: BLE001 - serve without structured output rather than not at all
        logger.exception("cannot prepare the tokenizer for structured output; constrained requests will fail")
        return None


class EngineClient:
    def __init__(
        self,
        config: EngineConfig,
        max_queue: int | None = None,
        metrics=None,
        chat_template: str | None = None,
        request_timeout: float | None = None,
        watchdog_timeout: float = 60.0,
    ) -> None:
        self.config = config
        self.max_queue = max_queue
        self.request_timeout = request_timeout  # seconds from arrival, then the request is aborted
        self.watchdog_timeout = watchdog_timeout  # seconds without core progress while requests are in flight
        self.chat_template = chat_template  # the operator's --chat-template, replacing the model's
        self.metrics = metrics  # on_outputs(list[RequestOutput]), on_abort(RequestOutput), on_stats(dict), on_restart()
        self.tokenizer: Tokenizer | None = None
        self._tokenizer_data = None
        self.info: dict = {}
        self.stats: dict = {}
        self._core: CoreHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._watchdog: asyncio.Task | None = None
        self._stopping = threading.Event()
        self._processor: OutputProcessor | None = None
        self._streams: dict[str, RequestStream] = {}
        self._children: dict[str, list[str]] = {}  # request id -> core (child) request ids
        self._parent: dict[str, str] = {}  # core request id -> request id
        self._num_sent = 0  # add messages sent to the current core
        self._reset_waiters: list[asyncio.Future] = []  # reset_prefix_cache calls awaiting the core
        self._lora_waiters: list[asyncio.Future] = []  # update_lora calls awaiting the core
        self._last_progress = time.monotonic()  # the core's last message (or the first request after idle)
        self._hang_reason: str | None = None  # set when the watchdog killed the core
        self.dead_reason: str | None = None  # why the core is not serving (None while it is)
        self.restarting = False
        self.num_restarts = 0
        self.draining = False  # SIGTERM: finishing in-flight requests, refusing new ones
        self.shutting_down = False

    # ---- lifecycle ----------------------------------------------------------------------------

    def start(self) -> dict:
        """Spawn the core, load the tokenizer meanwhile, and wait until the model is loaded.
        Returns the core's ready info (KV capacity, max_model_len, ...)."""
        self._core = CoreHandle(self.config)
        try:
            self.tokenizer = load_tokenizer(resolve_model(self.config.model), self.chat_template)
            self._tokenizer_data = _tokenizer_data(self.tokenizer)
            self.info = self._core.init(self.tokenizer.eos_token_ids, self._tokenizer_data)
        except BaseException:
            self._core.stop(timeout=1, warn=False)  # nothing to save in a core that is still loading
            raise
        self._processor = OutputProcessor(self.tokenizer)
        return self.info

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start delivering core messages to `loop`, and the watchdog (call from the running loop)."""
        self._loop = loop
        self._start_reader(self._core)
        self._watchdog = loop.create_task(self._watch())

    def _start_reader(self, core: CoreHandle) -> None:
        core.start_reader(
            lambda msg: self._call_soon(self._on_message, core, msg),
            lambda reason: self._call_soon(self._on_dead, core, reason),
        )

    @property
    def core_pid(self) -> int | None:
        return self._core.pid if self._core is not None else None

    @property
    def healthy(self) -> bool:
        return self.dead_reason is None and not self.restarting and self._core is not None and self._core.alive

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def begin_drain(self) -> None:
        """Refuse new requests (503); the in-flight ones go on (SIGTERM, before begin_shutdown)."""
        self.draining = True

    def begin_shutdown(self) -> None:
        """Stop taking requests and fail the in-flight ones."""
        if self.shutting_down:
            return
        self.shutting_down = True
        if self._watchdog is not None:
            self._watchdog.cancel()
        for rid in list(self._streams):
            self.abort(rid)
        self._fail_all("the server is shutting down")

    def stop_process(self, timeout: float = 10.0, warn: bool = True) -> None:
        """Stop the core (and any restart in progress). Idempotent."""
        self._stopping.set()
        if self._core is not None:
            self._core.stop(timeout, warn)

    # ---- recovery -----------------------------------------------------------------------------------

    async def _watch(self) -> None:
        """Kill a core that made no progress for watchdog_timeout seconds with requests in flight: no
        message came, its progress counter (bumped inside steps, per attention layer) stood still and
        neither it nor its workers used any CPU time. A core that is only slow on a busy machine (its
        threads descheduled, a long C++ step) is left alone; a stopped or deadlocked one is not."""
        seen = None
        while True:
            await asyncio.sleep(min(1.0, self.watchdog_timeout / 4))
            core = self._core
            if core is not None and (now := core.progress_mark()) != seen:
                seen, self._last_progress = now, time.monotonic()
            silent = time.monotonic() - self._last_progress
            if self._children and self.healthy and silent > self.watchdog_timeout:
                self._hang_reason = (
                    f"the engine core made no progress for {silent:.0f} s with {len(self._children)} requests in flight"
                )
                logger.error("%s; restarting it", self._hang_reason)
                self.dead_reason = self._hang_reason
                self._core.kill()  # the reader reports it dead, which restarts it

    def _on_dead(self, core: CoreHandle, reason: str) -> None:
        if core is not self._core:
            return  # an old core's last words
        reason = self._hang_reason or reason
        self._hang_reason = None
        if not self.shutting_down:
            logger.error("%s; failing all requests", reason)
        self.dead_reason = reason
        self._fail_all(reason)
        if not self.shutting_down and not self._stopping.is_set() and not self.restarting:
            self.restarting = True
            threading.Thread(target=self._restart, args=(core,), name="tokenmill-core-restart", daemon=True).start()

    def _restart(self, old: CoreHandle) -> None:
        """Worker thread: replace a dead core with a new one (the model is loaded again)."""
        old.stop(timeout=1, warn=False)
        logger.warning("restarting the engine core")
        try:
            core = CoreHandle(self.config)
            info = core.init(self.tokenizer.eos_token_ids, self._tokenizer_data)
        except Exception as e:  # noqa: BLE001 - stay unhealthy, and say why
            logger.error("the engine core could not be restarted: %s", e)
            self._call_soon(self._on_restart_failed, f"the engine core could not be restarted: {e}")
            return
        if self._stopping.is_set():
            core.stop(timeout=1, warn=False)
            return
        self._call_soon(self._on_restarted, core, info)

    def _on_restarted(self, core: CoreHandle, info: dict) -> None:
        self._core, self.info, self.stats = core, info, {}
        self._num_sent = 0
        self.dead_reason, self.restarting = None, False
        self.num_restarts += 1
        self._last_progress = time.monotonic()
        if self.metrics is not None:
            self.metrics.on_restart()
        self._start_reader(core)
        logger.warning("the engine core is back (restart %d)", self.num_restarts)

    def _on_restart_failed(self, reason: str) -> None:
        self.dead_reason, self.restarting = reason, False

    # ---- requests -----------------------------------------------------------------------------

    def waiting_estimate(self) -> int:
        """Core requests waiting for a slot: the last reported count plus adds it has not seen yet."""
        return self.stats.get("num_waiting", 0) + self._num_sent - self.stats.get("num_received", 0)

    def generate(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> RequestStream:
        """Submit a request; iterate the returned stream for its outputs."""
        if self.shutting_down or self.draining:
            raise EngineDeadError("the server is shutting down")
        if self.restarting:
            raise EngineDeadError("the engine core is restarting; retry shortly")
        if not self.healthy:
            raise EngineDeadError(self.dead_reason or "the engine core process is not running")
        if self.max_queue is not None and self.waiting_estimate() + params.n > self.max_queue:
            raise QueueFullError(f"the server's waiting queue is full ({self.max_queue} requests); retry later")
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        deadline = arrival + self.request_timeout if self.request_timeout is not None else None
        stream = RequestStream(self, request_id, deadline)
        if not self._children:
            self._last_progress = time.monotonic()  # the watchdog's clock starts with the work
        self._streams[request_id] = stream
        children = self._processor.add_request(
            request_id, prompt, prompt_token_ids, params, arrival, priority, cache_salt
        )
        self._children[request_id] = [c.request_id for c in children]
        for child in children:
            self._parent[child.request_id] = request_id
            self._core.put(AddRequest(child))
            self._num_sent += 1
        return stream

    def abort(self, request_id: str) -> None:
        """Abort a request (its blocks return to the pool after the core's next drain)."""
        result = self._processor.abort(request_id) if self._processor is not None else None
        child_ids = self._forget(request_id)
        if result is not None:
            if child_ids and self.healthy:
                self._core.put(AbortRequests(child_ids))
            if self.metrics is not None:
                self.metrics.on_abort(result)

    async def reset_prefix_cache(self) -> int:
        """Ask the core to drop its cached prefix blocks; returns how many it dropped."""
        if not self.healthy:
            raise EngineDeadError(self.dead_reason or "the engine core process is not running")
        waiter = asyncio.get_running_loop().create_future()
        self._reset_waiters.append(waiter)
        self._core.put(ResetPrefixCache())
        return await waiter

    async def update_lora(self, name: str, path: str | None) -> LoRAUpdated:
        """Ask the core to load the adapter at `path` as `name` (unload it: path None); its answer."""
        if not self.healthy:
            raise EngineDeadError(self.dead_reason or "the engine core process is not running")
        waiter = asyncio.get_running_loop().create_future()
        self._lora_waiters.append(waiter)
        self._core.put(UpdateLoRA(name, path))
        return await waiter

    def _forget(self, request_id: str) -> list[str]:
        child_ids = self._children.pop(request_id, [])
        for cid in child_ids:
            self._parent.pop(cid, None)
        return child_ids

    # ---- core messages --------------------------------------------------------------------------

    def _call_soon(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # loop closed during shutdown
            pass

    def _on_message(self, core: CoreHandle, msg: object) -> None:
        if core is not self._core:
            return  # from a core that was replaced
        self._last_progress = time.monotonic()
        try:
            match msg:
                case StepDone(outputs, stats):
                    self._on_step(outputs)
                    self._on_stats(stats)
                case StatsChanged(stats):
                    self._on_stats(stats)
                case AddRejected(request_id, message, param, code):
                    self._on_rejected(request_id, message, param, code)
                case PrefixCacheReset(num_blocks_dropped):
                    if self._reset_waiters:
                        self._reset_waiters.pop(0).set_result(num_blocks_dropped)
                case LoRAUpdated():
                    if self._lora_waiters:
                        self._lora_waiters.pop(0).set_result(msg)
                case CoreFailed(message):
                    logger.error("engine core failed:\n%s", message)
                    self._on_dead(core, "the engine core failed; see the server log")
        except Exception:  # a bug here must not kill the reader; fail loudly in the log
            logger.exception("error handling engine core message %s", type(msg).__name__)

    def _on_step(self, core_outputs: list) -> None:
        results, to_abort = self._processor.process(core_outputs)
        if to_abort:
            self._core.put(AbortRequests(to_abort))  # stop strings found here: free their blocks now
        if self.metrics is not None and results:
            self.metrics.on_outputs(results)
        for result in results:
            stream = self._streams.get(result.request_id)
            error = failure_of(result)
            if error is not None:  # one sample failed: the request fails (its other samples stop too)
                self._processor.abort(result.request_id)
                self._core.put(AbortRequests(self._forget(result.request_id)))  # unknown ids are ignored
                if stream is not None:
                    stream.put(error)
                continue
            if result.finished:
                self._forget(result.request_id)
            if stream is not None:
                stream.put(copy_step(result, stream.reported))

    def _on_stats(self, stats: dict) -> None:
        self.stats = stats
        if self.metrics is not None:
            self.metrics.on_stats(stats)

    def _on_rejected(self, core_request_id: str, message: str, param: str | None, code: str) -> None:
        request_id = self._parent.get(core_request_id)
        if request_id is None:
            return
        stream = self._streams.get(request_id)
        self._processor.abort(request_id)
        others = [c for c in self._forget(request_id) if c != core_request_id]
        if others:
            self._core.put(AbortRequests(others))
        if stream is not None:
            stream.put(RequestRejected(message, param, code))

    def _fail_all(self, reason: str) -> None:
        for stream in list(self._streams.values()):
            stream.put(EngineDeadError(reason))
        for rid in list(self._children):
            self._forget(rid)
        for waiters in (self._reset_waiters, self._lora_waiters):
            while waiters:
                waiters.pop().set_exception(EngineDeadError(reason))
        if self._processor is not None:
            self._processor = OutputProcessor(self.tokenizer)
