"""A drafter's own paged KV cache, shared by the drafters that run a model of their own (a draft
model, an EAGLE-3 drafter, MTP layers): the drafter's module over a small pool of blocks, run as the
model runner runs the target (`tokenmill.layers.paged_forward`), and per request a block table and the
tokens whose KV the blocks hold. Requests that
finish give their blocks back; when the pool runs short, requests that are not in the current
forward lose theirs (least recently used first).
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict

import numpy as np
import torch

from tokenmill.attention.kv_spec import make_kv_cache_config
from tokenmill.attention.selector import get_attention_backend
from tokenmill.config import CacheConfig, EngineConfig, ParallelConfig, resolve_cache_dtype
from tokenmill.layers.paged_forward import PagedForward
from tokenmill.loader import LoadedModel
from tokenmill.quantization.unquantized import UnquantizedConfig

DRAFT_CONTEXT_TOKENS = 4096  # per drafting request, when sizing the draft's pool (max_model_len if smaller)


@dataclasses.dataclass
class DraftState:
    blocks: list[int] = dataclasses.field(default_factory=list)
    tokens: list[int] = dataclasses.field(default_factory=list)  # whose KV the blocks hold, in order
    start: int = 0  # the request's position of tokens[0] (hidden-state drafters that joined late)


def dense_weights(packed_modules: dict[str, list[str]]) -> UnquantizedConfig:
    """A drafter module's weight format: dense, with these fused checkpoint modules."""
    quant = UnquantizedConfig()
    quant.packed_modules = packed_modules
    return quant


def load_drafter_weights(module: torch.nn.Module, tensors: dict[str, torch.Tensor], context: str) -> None:
    """Load a drafter module's checkpoint tensors (every one expected, none left over), as the model
    loader does; errors name `context`."""
    from tokenmill.models.utils import load_checkpoint

    with torch.no_grad():
        try:
            load_checkpoint(module, tensors.items())
        except ValueError as e:
            raise ValueError(f"{context}: {e}") from None
        for m in module.modules():
            if hasattr(m, "quant_method"):
                m.quant_method.process_after_loading(m)


def draft_engine_config(config: EngineConfig, model: str | None) -> EngineConfig:
    """The drafter's engine config: the target's, with its own small KV pool (room for the context of
    `disable_by_batch_size` requests), one process and no speculation."""
    spec = config.speculative
    context = min(config.scheduler.fixed_max_model_len or DRAFT_CONTEXT_TOKENS, DRAFT_CONTEXT_TOKENS)
    blocks = spec.disable_by_batch_size * -(-context // config.cache.block_size) + spec.disable_by_batch_size
    return dataclasses.replace(
        config,
        model=model,
        speculative=None,
        parallel=ParallelConfig(),
        cache=CacheConfig(
            block_size=config.cache.block_size,
            num_blocks=blocks,
            enable_prefix_caching=False,
            cache_dtype=config.cache.cache_dtype,
        ),
    )


class DraftKVPool:
    def __init__(self, loaded: LoadedModel, config: EngineConfig) -> None:
        """`config`: the drafter's (`draft_engine_config`)."""
        self.model = loaded.model
        cache_dtype = resolve_cache_dtype(config.cache.cache_dtype, loaded.dtype, loaded.quantization)
        self.paged = PagedForward(
            loaded.model,
            loaded.device,
            cache_dtype,
            get_attention_backend(loaded.device, loaded.dtype, cache_dtype, config.attention_backend),
        )
        sched = config.scheduler
        kv = make_kv_cache_config(
            self.paged.kv_cache_specs(), config.cache, sched.max_num_seqs, sched.max_num_batched_tokens
        )
        self.paged.initialize_kv_cache(kv)
        self.block_size, self.num_pools, self.num_blocks = kv.block_size, len(kv.pool_blocks), kv.num_blocks
        self.free = list(range(kv.num_blocks))
        self.states: OrderedDict[str, DraftState] = OrderedDict()  # least recently used first

    @torch.inference_mode()
    def warm_up(self) -> None:
        """A prefill and a decode in block 0 (garbage afterwards, harmless: every block is written before
        it is read), so that kernels are compiled before the first request's clock starts."""
        tables = [[[0]] * self.num_pools]
        for ids, computed in (([0, 0], 0), ([0], 2)):
            hidden, _ = self.paged.forward(
                np.asarray(ids, dtype=np.int64),
                np.asarray([len(ids)], dtype=np.int64),
                np.asarray([computed], dtype=np.int64),
                tables,
            )
            self.model.compute_logits(hidden[-1:])

    def state(self, request_id: str) -> DraftState:
        """The request's state (new and empty if it has none), marked as used now."""
        state = self.states.setdefault(request_id, DraftState())
        self.states.move_to_end(request_id)
        return state

    def finish(self, request_id: str) -> None:
        state = self.states.pop(request_id, None)
        if state is not None:
            self.free.extend(state.blocks)

    def reserve(self, request_id: str, num_tokens: int, keep) -> bool:
        """Blocks for `num_tokens` positions of a request, taking them from requests not in `keep` if needed."""
        state = self.states[request_id]
        need = -(-num_tokens // self.block_size) - len(state.blocks)
        for victim in [r for r in self.states if r not in keep]:
            if len(self.free) >= need:
                break
            self.finish(victim)
        if len(self.free) < need:
            return False
        if need > 0:
            state.blocks.extend(self.free[-need:])
            del self.free[-need:]
        return True

    def forward(
        self, rids: list[str], inputs: list[list[int]], num_computed: list[int], extra: list[torch.Tensor] | None = None
    ) -> torch.Tensor:
        """One drafter forward of each request's `inputs` after its `num_computed` cached positions (and
        `extra[i]`, one row per input, passed to the module as `hidden_states`) -> the module's output
        after each one's last input, [requests, ...] in `rids` order."""
        num_new = [len(x) for x in inputs]
        order = sorted(range(len(rids)), key=lambda i: num_new[i] != 1)  # decodes first, as the runner lays out
        ids = [t for i in order for t in inputs[i]]
        model_inputs = {} if extra is None else {"hidden_states": torch.cat([extra[i] for i in order])}
        hidden, common = self.paged.forward(
            np.asarray(ids, dtype=np.int64),
            np.asarray([num_new[i] for i in order], dtype=np.int64),
            np.asarray([num_computed[i] for i in order], dtype=np.int64),
            [[self.states[rids[i]].blocks] * self.num_pools for i in order],
            **model_inputs,
        )
        last = torch.from_numpy(common.query_start_loc[1:] - 1).to(hidden.device)
        back = torch.empty(len(order), dtype=torch.long)
        back[torch.tensor(order)] = torch.arange(len(order))
        return hidden[last][back.to(hidden.device)]
