"""The engine-core process: loads the model, runs `EngineCore.step()` in a loop, and talks to the
HTTP front end through two multiprocessing queues (the role of vLLM's EngineCoreProc); the messages
are the dataclasses of `tokenmill.server.messages`.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import multiprocessing
import os
import queue
import signal
import time
import traceback

from tokenmill.config import EngineConfig
from tokenmill.server.messages import (
    AbortRequests,
    AddRejected,
    AddRequest,
    CoreFailed,
    CoreReady,
    InitCore,
    LoadFailed,
    LoRAUpdated,
    PrefixCacheReset,
    ResetPrefixCache,
    Shutdown,
    StatsChanged,
    StepDone,
    UpdateLoRA,
)

logger = logging.getLogger(__name__)

# How often (seconds) an idle or busy core checks that the front end still exists.
_PARENT_CHECK_INTERVAL = 1.0


def stats_snapshot(core, num_received: int, fresh: bool = True) -> dict:
    """A small picklable view of the core's queues and KV pool for /metrics and the logs: every
    numeric field of `EngineStats` (running, waiting, KV usage, preemptions, prefix-cache counters)
    plus the pool's block counts."""
    snap = dataclasses.asdict(core.stats(fresh))
    snap.update(snap.pop("steps"))  # its counters by name, as /metrics counts them
    snap["num_free_blocks"] = core.kv.num_free_blocks
    snap["num_blocks"] = core.kv.num_blocks
    snap["num_received"] = num_received  # add messages handled so far (lets the front end size the queue)
    return snap


def kv_cache_scope(parallel) -> str:
    """Whose KV bytes `KVCacheConfig.total_bytes` counts, for the start-up log: the pool is sized from the
    driver's specs, so under tensor or context parallelism they are one rank's (its heads, its stripe of
    each block), and under pipeline parallelism one tensor-parallel rank's layers summed over the stages."""
    if parallel.pipeline_parallel_size > 1:
        share = " per tensor-parallel rank" if parallel.tensor_parallel_size > 1 else ""
        return f"{share} over {parallel.pipeline_parallel_size} pipeline stages"
    return f" per rank, {parallel.world_size} ranks" if parallel.world_size > 1 else ""


def _ready_info(core, load_seconds: float) -> dict:
    from tokenmill.kernels import host_memory  # torch: the core's process has it loaded

    executor = core.executor
    cfg = executor.model_config
    return {
        "model_name": executor.source.name,
        "model_path": str(executor.source.path),
        "architecture": cfg.architecture,
        "dtype": str(executor.dtype).replace("torch.", ""),
        "device": str(executor.device),
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "max_model_len": core.max_model_len,
        "num_blocks": core.kv.num_blocks,
        "block_size": core.kv.block_size,
        "capacity_tokens": core.capacity_tokens,
        "kv_cache_bytes": core.kv_cache_config.total_bytes,
        "kv_cache_scope": kv_cache_scope(core.config.parallel),
        "load_seconds": load_seconds,
        "pid": os.getpid(),
        "num_threads": _torch_threads(),
        "huge_pages": host_memory.mode(),  # whether the CPU weights and KV cache could get them
        "headless": cfg.headless,  # an embedding checkpoint: no generation
        "lora_modules": None if core.config.lora is None else dict(core.config.lora.modules),
    }


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def run_engine_core(config: EngineConfig, inputs, outputs, progress=None) -> None:
    """Process entry point (spawn context). Never raises: failures become messages. `progress`: a
    shared counter this core bumps as its steps advance (`tokenmill.worker.heartbeat`)."""
    # Ctrl-C reaches the whole process group; the front end decides when the core stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s [core] %(message)s")
    try:
        from tokenmill.engine.core import EngineCore
        from tokenmill.executor import executor_for
        from tokenmill.worker import heartbeat

        heartbeat.attach(progress)
        start = time.monotonic()
        # the front end loads the tokenizer meanwhile: the weights, the KV cache and the warm-up do not wait for it
        executor = executor_for(config)  # loads the model
        core = EngineCore(config, executor, set())
        unfit = core.max_model_len_error()
        if unfit:
            raise ValueError(unfit)
        init = _wait_for_init(inputs)
        if init is None:
            return
        # no grammar compiler yet: EngineCore makes one at the first constrained request, which costs its step
        # loop nothing (xgrammar and the compile worker processes start on the compiler's own threads), so
        # neither the start nor the first plain requests share the CPU with them
        core.set_tokenizer(*init)
        outputs.put(CoreReady(_ready_info(core, time.monotonic() - start)))
    except BaseException as e:  # noqa: BLE001 - report every load failure, then exit
        outputs.put(LoadFailed(f"{type(e).__name__}: {e}"))
        _flush(outputs)
        return
    try:
        _loop(core, inputs, outputs)
    except BaseException as e:  # noqa: BLE001
        outputs.put(CoreFailed(f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    _flush(outputs)
    gc.freeze()  # see `tokenmill.server.cli.run_server`: the front end waits for this process to end


def _wait_for_init(inputs) -> tuple[list[int], object] | None:
    """The `InitCore` message's contents; None if the front end went away or asked for anything else."""
    parent = multiprocessing.parent_process()
    while True:
        try:
            msg = inputs.get(timeout=_PARENT_CHECK_INTERVAL)
        except queue.Empty:
            if parent is not None and not parent.is_alive():
                return None
            continue
        if not isinstance(msg, InitCore):
            return None
        return list(msg.eos_token_ids), msg.tokenizer_data


def _flush(outputs) -> None:
    outputs.close()
    outputs.join_thread()


def _loop(core, inputs, outputs) -> None:
    from tokenmill.engine.core import RequestRejected

    parent = multiprocessing.parent_process()
    num_received = 0
    last_parent_check = time.monotonic()
    while True:
        busy = core.has_unfinished()
        messages = _drain(inputs, block=not busy)
        changed = False
        for msg in messages:
            match msg:
                case Shutdown():
                    return
                case AddRequest(request):
                    num_received += 1
                    changed = True
                    try:
                        core.add_request(request)
                    except RequestRejected as e:
                        outputs.put(AddRejected(request.request_id, str(e), e.param, e.code))
                    except Exception:  # noqa: BLE001 - one bad request must not take the engine down
                        logger.exception("request %s could not be added", request.request_id)
                        core.abort_requests([request.request_id])
                        outputs.put(
                            AddRejected(
                                request.request_id,
                                "the engine could not accept this request (see the server log)",
                                None,
                            )
                        )
                case AbortRequests(request_ids):
                    core.abort_requests(request_ids)
                    changed = True
                case ResetPrefixCache():
                    outputs.put(PrefixCacheReset(core.reset_prefix_cache()))
                case UpdateLoRA(name, path):
                    outputs.put(_update_lora(core, name, path))
        now = time.monotonic()
        if now - last_parent_check >= _PARENT_CHECK_INTERVAL:
            last_parent_check = now
            if parent is not None and not parent.is_alive():
                return  # the front end is gone: do not linger as an orphan
            core.executor.check_health()  # a dead tensor-parallel worker is reported even while idle
        if core.has_unfinished():
            step_outputs = core.step()
            # while steps keep coming, MoE counters are read from the device at most once a second
            outputs.put(StepDone(step_outputs, stats_snapshot(core, num_received, fresh=not core.has_unfinished())))
        elif changed:
            outputs.put(StatsChanged(stats_snapshot(core, num_received)))


def _update_lora(core, name: str, path: str | None) -> LoRAUpdated:
    from tokenmill.lora.peft import LoRAError

    try:
        core.load_lora(name, path) if path is not None else core.unload_lora(name)
    except LoRAError as e:
        return LoRAUpdated(str(e), e.param)
    except Exception:  # noqa: BLE001 - a failed load must not take the engine down
        logger.exception("LoRA adapter %s: %s failed", name, "loading" if path else "unloading")
        return LoRAUpdated("the engine could not update the adapter (see the server log)")
    return LoRAUpdated()


def _drain(inputs, block: bool) -> list:
    """Every message waiting now; when idle, wait (a bounded time) for the first one."""
    messages = []
    if block:
        try:
            messages.append(inputs.get(timeout=_PARENT_CHECK_INTERVAL))
        except queue.Empty:
            return messages
    while True:
        try:
            messages.append(inputs.get_nowait())
        except queue.Empty:
            return messages
