"""A model over a paged KV cache: what the model runner and a drafter with a model of its own (a draft
model, an EAGLE-3 drafter, MTP layers) share. It allocates each KV-cache group's cache in the attention
backend's shape (and a quantized cache's scales, `tokenmill.attention.kv_quant`), binds every attention
layer to its part, and runs a flat batch: per request its new tokens after its cached ones, decodes
first, described once for attention (`build_common_metadata`, then one backend metadata per pool and
sliding window) and set as the forward context the attention layers read. Under prefill context
parallelism the backend splits a step's tokens over the ranks: each runs its share, and the final
hidden states are gathered."""

from __future__ import annotations

import logging

import numpy as np
import torch
from torch import nn

from tokenmill.attention.backend import AttentionBackend
from tokenmill.attention.kv_quant import SCALE_DTYPE, is_quantized
from tokenmill.attention.kv_spec import AttentionSpec, KVCacheConfig
from tokenmill.attention.metadata import CommonAttentionMetadata, build_common_metadata
from tokenmill.distributed import parallel_state
from tokenmill.kernels import host_memory
from tokenmill.layers.attention import Attention
from tokenmill.layers.forward_context import ForwardContext, set_forward_context

logger = logging.getLogger(__name__)


class PagedForward:
    def __init__(
        self, model: nn.Module, device: torch.device, cache_dtype: torch.dtype, backend: AttentionBackend
    ) -> None:
        self.model, self.device, self.cache_dtype, self.backend = model, device, cache_dtype, backend
        self.attention_layers = {m.layer_name: m for m in model.modules() if isinstance(m, Attention)}
        self.kv_cache_config: KVCacheConfig | None = None
        self.kv_caches: list[torch.Tensor] = []  # one tensor per KV-cache group: [layers, *backend shape]
        self.kv_scales: list[torch.Tensor | None] = []  # per group, quantized caches: [layers, *shape[:-1]]
        self.decode_graphs = None  # captured decode steps (`worker/cuda_graphs.py`), over these caches
        self.inputs = StepInputs(device)

    def kv_cache_specs(self) -> dict[str, AttentionSpec]:
        return {name: layer.kv_spec(self.cache_dtype) for name, layer in self.attention_layers.items()}

    def initialize_kv_cache(self, config: KVCacheConfig) -> None:
        """Allocate each group's cache in the backend's shape (and a quantized one's scales) and bind every
        attention layer to its part."""
        self.kv_cache_config = config
        self.kv_caches, self.kv_scales, self.decode_graphs = [], [], None
        self.group_keys = [(group.pool, group.spec.sliding_window) for group in config.groups]
        for g, group in enumerate(config.groups):
            names = [n for n in group.layer_names if n in self.attention_layers]  # a pipeline stage's own
            shape = self.backend.kv_cache_shape(config.pool_blocks[group.pool], config.block_size, group.spec)
            cache = (  # a CPU cache on huge pages: decode streams each sequence's part (host_memory)
                host_memory.zeros((len(names), *shape), group.spec.dtype)
                if self.device.type == "cpu"
                else torch.zeros(len(names), *shape, dtype=group.spec.dtype, device=self.device)
            )
            scales = (
                torch.zeros(len(names), *shape[:-1], dtype=SCALE_DTYPE, device=self.device)
                if is_quantized(group.spec.dtype)
                else None
            )
            self.kv_caches.append(cache)
            self.kv_scales.append(scales)
            for i, name in enumerate(names):
                layer_scales = None if scales is None else scales[i]
                self.attention_layers[name].bind_kv_cache(cache[i], self.backend, g, layer_scales)

    def release_kv_cache(self) -> None:
        """Drop the cache (a throwaway one, e.g. the memory profile's): the layers keep no reference."""
        for layer in self.attention_layers.values():
            layer.bind_kv_cache(None, self.backend, 0, None)
        self.kv_cache_config, self.kv_caches, self.kv_scales, self.decode_graphs = None, [], [], None

    def forward(
        self,
        input_ids: np.ndarray,
        num_new: np.ndarray,
        num_computed: np.ndarray,
        block_ids: list[list[list[int]]],
        lora: object | None = None,
        **model_inputs,
    ) -> tuple[object, CommonAttentionMetadata]:
        """Run the model on a flat batch (per request: its new tokens after `num_computed` cached ones,
        decodes first; `block_ids[request][pool]` its block tables; `model_inputs`: more inputs of the
        model's, e.g. a drafter's hidden states or a pipeline stage's intermediate tensors; `lora`: which
        rows run which LoRA adapter, `lora.manager.LoRABatch`). Returns the
        model's output (the final hidden state of every new token) and the step's description (of pool 0:
        positions and lengths are the same in all). A step of decodes replays a captured graph if there is one."""
        graphs = self.decode_graphs
        if graphs is not None and not model_inputs and lora is None and graphs.fits(num_new, block_ids):
            common, _ = build_common_metadata(  # host-side only: the graph's inputs travel in one copy
                num_new, num_computed, [t[0] for t in block_ids], self.kv_cache_config.block_size, torch.device("cpu")
            )
            return graphs.run(input_ids, num_computed, block_ids), common
        host = torch.device("cpu")
        commons = [
            build_common_metadata(
                num_new, num_computed, [tables[pool] for tables in block_ids], self.kv_cache_config.block_size, host
            )
            for pool in range(len(self.kv_cache_config.pool_blocks))
        ]
        (common, positions), commons = commons[0], [c for c, _ in commons]
        self.inputs.begin()  # the inputs and the attention metadata go up in one copy
        ids, positions, *slots = self.inputs.stage([input_ids, positions, *(c.slot_mapping.numpy() for c in commons)])
        for c, slot_mapping in zip(commons, slots):
            c.slot_mapping, c.device, c.stage = slot_mapping, self.device, self.inputs.stage
        # one backend metadata per (pool, sliding window): each group's layers read theirs
        metas = {key: self.backend.build_metadata(commons[key[0]], key[1]) for key in set(self.group_keys)}
        self.inputs.send()
        for c in commons:  # metadata built from them later (a drafter's) goes up on its own
            c.stage = None
        split = self.backend.token_split(common)  # prefill context parallelism: this rank's tokens only
        counted = split is not None or parallel_state.cp_rank() == 0  # each token once over the ranks
        context = ForwardContext({g: metas[key] for g, key in enumerate(self.group_keys)}, lora, count_experts=counted)
        if split is not None:
            ids, positions = ids[split.mine], positions[split.mine]
        with set_forward_context(context):
            hidden = self.model(ids, positions, **model_inputs)
        return (hidden if split is None else split.gather(hidden)), common


class StepInputs:
    """A step's integer inputs on the device — token ids, positions, every pool's slots, and the attention
    backend's metadata (block tables, lengths, tile maps) — in one host-to-device copy. Between `begin` and
    `send`, `stage` writes host arrays into a host staging buffer and returns views of one persistent device
    buffer at the same offsets (int64, or int32 packed two to a slot), which `send` fills with one copy.
    On the CPU (`direct`, the default there) `stage` returns the arrays themselves: no copy is cheapest.

    On a GPU the staging buffers are pinned, so the copy does not block the host (one from pageable
    memory would wait for the device's queue), and persistent: a staging buffer is reused once its copy
    is done (an event recorded after it), otherwise another one is taken, so the host never waits for an
    earlier step's copy (a drafter runs several forwards a step). The device buffer (sized up front by
    `reserve` for the largest step; grown, rarely, if a step needs more) is read on the copy's stream:
    the next step's copy lands after its readers."""

    def __init__(self, device: torch.device, direct: bool | None = None) -> None:
        self.device, self.capacity, self.staged = device, 0, None
        self.direct = device.type == "cpu" if direct is None else direct
        self.pinned = device.type == "cuda"
        self.hosts: list[tuple[torch.Tensor, object]] = []  # (staging buffer, the event after its copy)
        self.host, self.sent, self.used = None, 0, 0

    def reserve(self, size: int) -> None:
        if not self.direct and size > self.capacity:
            self.staged = torch.empty(size, dtype=torch.int64, device=self.device)
            self.capacity, self.hosts, self.host = size, [], None

    def begin(self) -> None:
        """A new step's staging: the first staging buffer whose copy is done (a new one if none is)."""
        if self.direct:
            return
        ready = [i for i, (_, event) in enumerate(self.hosts) if event is None or event.query()]
        if ready:
            self.host = self.hosts.pop(ready[0])[0]
        else:
            self.host = torch.empty(self.capacity, dtype=torch.int64, pin_memory=self.pinned)  # host
        self.sent = self.used = 0

    def stage(self, arrays: list[np.ndarray], dtype: torch.dtype = torch.int64) -> list[torch.Tensor]:
        """Device tensors (of `dtype`: int64 or int32) holding `arrays` once `send` has run."""
        if self.direct:
            return [
                torch.from_numpy(np.asarray(a, dtype=np.int64 if dtype == torch.int64 else np.int32)) for a in arrays
            ]
        per_slot = 8 // dtype.itemsize
        slots = [-(-a.size // per_slot) for a in arrays]
        if self.used + sum(slots) > self.capacity:
            self._grow(sum(slots))
        out, host = [], self.host.numpy().view(np.int64 if per_slot == 1 else np.int32)
        for a, n in zip(arrays, slots):
            start = self.used * per_slot
            host[start : start + a.size] = a.reshape(-1)
            view = self.staged[self.used : self.used + n]
            out.append((view if per_slot == 1 else view.view(dtype)[: a.size]).view(a.shape))
            self.used += n
        return out

    def send(self) -> None:
        """The one copy of everything staged since `begin` (without blocking the host on a GPU)."""
        if self.direct or self.used == self.sent:
            return
        part = slice(self.sent, self.used)
        self.staged[part].copy_(self.host[part], non_blocking=self.pinned)
        event = None
        if self.pinned:
            event = torch.cuda.Event()
            event.record()
        self.hosts.append((self.host, event))
        self.sent = self.used

    def _grow(self, needed: int) -> None:
        """More room than `reserve` gave, mid-step: what is staged goes up into the old buffer (its views
        keep it alive), and staging goes on in buffers of twice the size."""
        logger.info("step inputs: %d values, more than the %d reserved; growing", needed, self.capacity)
        self.send()
        self.reserve(max(needed, 2 * self.capacity))
        self.begin()
