"""Token embedding and the LM head (the output projection to vocabulary logits)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.layers.linear import ReplicatedLinear
from tokenmill.quantization.base import QuantizationConfig
from tokenmill.quantization.unquantized import UnquantizedLinearMethod, load_dense


class VocabEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim), requires_grad=False)

    def weight_loader(self, kind: str, weight, shard: int | None = None) -> None:
        load_dense(self.weight, weight, slice(None), (slice(None),))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class LMHead(ReplicatedLinear):
    """hidden [T, H] -> logits [T, vocab], in whatever weight format the quantization config gives it."""

    def __init__(self, vocab_size: int, hidden_size: int, quant_config: QuantizationConfig | None = None,
                 prefix: str = "lm_head") -> None:
        super().__init__(hidden_size, vocab_size, bias=False, quant_config=quant_config, prefix=prefix)
        self.tied = False  # shares the embedding's parameter
        self.reads_embedding = False  # tied in the checkpoint, but stored in its own format here

    def tie_to(self, embedding: VocabEmbedding) -> None:
        """For a checkpoint with tied embeddings: a dense head shares the embedding's weight; a
        quantized head keeps its own storage, loaded from the embedding's checkpoint tensor."""
        if isinstance(self.quant_method, UnquantizedLinearMethod):
            self.weight = embedding.weight
            self.tied = True
        else:
            self.reads_embedding = True
