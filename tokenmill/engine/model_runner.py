"""Model runner: owns the model and its paged KV cache, turns one scheduled step into flat batch
tensors, runs the forward pass and returns the logits of the sequences that need a next token."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import numpy as np
import torch

from tokenmill.attention.backend import SequenceSlice, get_attention_backend
from tokenmill.config import CacheConfig
from tokenmill.loader import LoadedModel

logger = logging.getLogger(__name__)


@dataclass
class StepSequence:
    """One sequence's share of a step: its new tokens, where they start, and its cache blocks."""

    token_ids: list[int]  # the new tokens to run (a prompt chunk, or one decode token)
    num_cached: int  # tokens of this sequence already in the KV cache
    block_table: list[int]
    needs_logits: bool = True  # False for a prompt chunk that does not reach the prompt's end


class ModelRunner:
    def __init__(self, loaded: LoadedModel, cache_config: CacheConfig) -> None:
        self.model = loaded.model
        self.config = loaded.config
        self.device = loaded.device
        self.dtype = loaded.dtype
        self.block_size = cache_config.block_size
        if self.device.type == "cpu":
            torch.set_num_threads(len(os.sched_getaffinity(0)))  # every core we may use, for intra-op work
            # denormal floats (they appear in hidden states and attention) run ~100x slower on x86;
            # flushing them to zero changes nothing measurable and keeps every op at full speed
            torch.set_flush_denormal(True)
        self.backend = get_attention_backend(self.device, self.dtype)
        self.num_blocks = cache_config.num_blocks or self._blocks_for_memory(cache_config.kv_cache_memory_gib)
        c = self.config
        # one allocation for all layers: [layers, K/V, blocks, block_size, kv_heads, head_dim]
        self.kv_cache = torch.zeros(
            c.num_hidden_layers, 2, self.num_blocks, self.block_size, c.num_key_value_heads, c.head_dim,
            dtype=self.dtype, device=self.device,
        )
        for i, layer in enumerate(self.model.layers):
            layer.self_attn.kv_cache = self.kv_cache[i]
            layer.self_attn.backend = self.backend
        logger.info("KV cache: %d blocks of %d tokens = %d tokens (%.2f GiB, %s)", self.num_blocks, self.block_size,
                    self.num_blocks * self.block_size, self.kv_cache.numel() * self.kv_cache.element_size() / 2**30,
                    self.dtype)

    def bytes_per_block(self) -> int:
        return self.block_size * self.config.kv_bytes_per_token(self.dtype)

    def _blocks_for_memory(self, gib: float) -> int:
        blocks = int(gib * 2**30) // self.bytes_per_block()
        if blocks < 1:
            raise ValueError(f"kv_cache_memory {gib} GiB is smaller than one KV block ({self.bytes_per_block()} bytes)")
        return blocks

    @torch.inference_mode()
    def execute(self, seqs: list[StepSequence]) -> torch.Tensor:
        """Run one step. Sequences with one new token must come first (decodes, then prompt
        chunks). Returns float32 logits [number of seqs with needs_logits, vocab]."""
        num_new = np.fromiter((len(s.token_ids) for s in seqs), dtype=np.int64, count=len(seqs))
        num_cached = np.fromiter((s.num_cached for s in seqs), dtype=np.int64, count=len(seqs))
        input_ids = np.fromiter((t for s in seqs for t in s.token_ids), dtype=np.int64, count=int(num_new.sum()))
        starts = np.cumsum(num_new) - num_new
        positions = np.arange(len(input_ids)) - np.repeat(starts - num_cached, num_new)
        last = (starts + num_new - 1)[[s.needs_logits for s in seqs]]

        meta = self.backend.build_metadata(
            [SequenceSlice(int(c), int(n), s.block_table) for s, c, n in zip(seqs, num_cached, num_new)],
            self.block_size, self.device,
        )
        hidden = self.model(torch.from_numpy(input_ids).to(self.device),
                            torch.from_numpy(positions).to(self.device), meta)
        return self.model.compute_logits(hidden[torch.from_numpy(last).to(self.device)]).float()
