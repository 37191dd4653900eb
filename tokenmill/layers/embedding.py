"""Token embedding and the LM head (the output projection to vocabulary logits). Under tensor
parallelism both are split by vocabulary: each rank holds a contiguous slice of the token rows
(`vocab_shard`); an embedding lookup is summed over the ranks (the other ranks' tokens give zeros),
and the head's logits are gathered from every rank."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.distributed import parallel_state
from tokenmill.layers.linear import LinearBase
from tokenmill.quantization.base import QuantizationConfig
from tokenmill.quantization.unquantized import UnquantizedLinearMethod, load_dense


def vocab_shard(vocab_size: int, rank: int, size: int) -> tuple[int, int]:
    """(first token, number of tokens) of rank `rank`'s slice: ceil(vocab / size) each, the last
    rank's shorter when the vocabulary does not divide."""
    per = -(-vocab_size // size)
    start = min(rank * per, vocab_size)
    return start, min(per, vocab_size - start)


class VocabEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.tp_size = parallel_state.tp_size()
        self.start, rows = vocab_shard(num_embeddings, parallel_state.tp_rank(), self.tp_size)
        self.weight = nn.Parameter(torch.empty(rows, embedding_dim), requires_grad=False)

    def weight_loader(self, kind: str, weight, shard: int | None = None) -> None:
        load_dense(self.weight, weight, slice(None), (slice(self.start, self.start + self.weight.shape[0]),))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill_(outside[:, None], 0)
        return parallel_state.all_reduce(out)


class LMHead(LinearBase):
    """hidden [T, H] -> logits [T, vocab], in whatever weight format the quantization config gives it."""

    def __init__(
        self, vocab_size: int, hidden_size: int, quant_config: QuantizationConfig | None = None, prefix: str = "lm_head"
    ) -> None:
        self.vocab_size = vocab_size
        super().__init__(
            hidden_size, [vocab_size], False, quant_config, prefix, parallel_state.tp_rank(), parallel_state.tp_size()
        )
        self.tied = False  # shares the embedding's parameter
        self.reads_embedding = False  # tied in the checkpoint, but stored in its own format here

    def _output_partition(self, shard):
        start, rows = vocab_shard(self.vocab_size, self.tp_rank, self.tp_size)
        return rows, start

    def tie_to(self, embedding: VocabEmbedding) -> None:
        """For a checkpoint with tied embeddings: a dense head shares the embedding's weight; a
        quantized head keeps its own storage, loaded from the embedding's checkpoint tensor."""
        if isinstance(self.quant_method, UnquantizedLinearMethod):
            self.weight = embedding.weight
            self.tied = True
        else:
            self.reads_embedding = True

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.quant_method.apply(self, hidden, None)
        if self.tp_size == 1:
            return logits
        per = -(-self.vocab_size // self.tp_size)  # every rank's slice padded to the same width, then trimmed
        logits = F.pad(logits, (0, per - logits.shape[-1]))
        return parallel_state.all_gather(logits)[..., : self.vocab_size]
