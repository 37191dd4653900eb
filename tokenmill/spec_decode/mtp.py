"""DeepSeek-V3 multi-token prediction (MTP) as a drafter: the layer a checkpoint ships after its last
decoder layer (`model.layers.{num_hidden_layers}.*`, config `num_nextn_predict_layers`). At position t
it reads the target's final hidden state h_t and the embedding of token t + 1 (zero at position 0, as
vLLM): eh_proj([enorm(embedding), hnorm(h_t)]), one decoder block (MLA attention, dense or routed
MLP as the layer index says), then the shared head (its norm and LM head) predicts token t + 2. The
block's output is fed back as the hidden state of the next position, so the one layer drafts any
number of tokens (`tokenmill.spec_decode.hidden_drafter`). The layer's own `embed_tokens` and
`shared_head.head` are loaded when the checkpoint has them, else the target's are shared.
"""

from __future__ import annotations

import dataclasses
import re

import torch
from torch import nn

from tokenmill.layers.embedding import LMHead, VocabEmbedding
from tokenmill.layers.linear import ReplicatedLinear
from tokenmill.layers.norm import RMSNorm
from tokenmill.loader import LoadedModel, default_dtype, open_checkpoint
from tokenmill.models.deepseek import DeepseekConfig, DeepseekDecoderLayer, DeepseekForCausalLM, mla_rotary_and_scale
from tokenmill.quantization.unquantized import UnquantizedConfig
from tokenmill.spec_decode.draft_pool import dense_weights, load_drafter_weights

_BLOCK_PARTS = ("self_attn.", "mlp.", "input_layernorm.", "post_attention_layernorm.")


class SharedHead(nn.Module):
    def __init__(self, config: DeepseekConfig, quant: UnquantizedConfig, own_head: bool) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if own_head:
            self.head = LMHead(config.vocab_size, config.hidden_size, quant, "shared_head.head")


class DeepseekMTP(nn.Module):
    packed_modules = DeepseekForCausalLM.packed_modules
    checkpoint_renames = DeepseekForCausalLM.checkpoint_renames
    aux = False  # reads the target's final hidden state

    def __init__(
        self, config: DeepseekConfig, layer: int, own_embedding: bool, own_head: bool, max_positions: int
    ) -> None:
        super().__init__()
        quant = dense_weights(self.packed_modules)
        h = config.hidden_size
        if own_embedding:
            self.embed_tokens = VocabEmbedding(config.vocab_size, h)
        self.enorm = RMSNorm(h, config.rms_norm_eps)
        self.hnorm = RMSNorm(h, config.rms_norm_eps)
        self.eh_proj = ReplicatedLinear(2 * h, h, False, quant, "eh_proj")
        self.shared_head = SharedHead(config, quant, own_head)
        rotary, scale = mla_rotary_and_scale(config, max_positions)
        if config.mtp_sparse:  # its MLP is routed experts, as layer `layer` of the model would have
            config = dataclasses.replace(config, sparse_layers=(*config.sparse_layers, layer))
        self.block = DeepseekDecoderLayer(config, rotary, scale, quant, "block", layer)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        embeds = self.embed_tokens(input_ids).masked_fill((positions == 0).unsqueeze(-1), 0)
        x = self.eh_proj(torch.cat((self.enorm(embeds)[0], self.hnorm(hidden_states)[0]), dim=-1))
        x, residual = self.block(positions, x, None)
        return x + residual

    def combine(self, target_hidden: torch.Tensor) -> torch.Tensor:
        return target_hidden

    def compute_logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.shared_head.head(self.shared_head.norm(x)[0])

    def to_target(self, ids: torch.Tensor) -> torch.Tensor:
        return ids


def load_mtp(target: LoadedModel) -> DeepseekMTP:
    """The target's first MTP layer, from its own checkpoint."""
    c = target.config
    if not isinstance(c, DeepseekConfig) or not c.num_nextn_predict_layers:
        raise ValueError(
            "speculative_config.method mtp needs a target whose config.json has num_nextn_predict_layers "
            f"> 0 (DeepSeek-V3 style), and {target.source.name} ({c.architecture}) has none"
        )
    if target.source.kind == "gguf":
        raise ValueError("speculative_config.method mtp reads the MTP layer from an HF checkpoint, not a GGUF file")
    layer = c.num_hidden_layers
    prefix = re.compile(rf"model\.layers\.{layer}\.(.*)")
    tensors = {}
    for name, tensor in open_checkpoint(target.source).weights():
        if m := prefix.match(name):
            rest = m.group(1)
            tensors[f"block.{rest}" if rest.startswith(_BLOCK_PARTS) else rest] = tensor
    if not tensors:
        raise ValueError(
            f"speculative_config.method mtp: {target.source.name} has no model.layers.{layer}.* tensors "
            "(the MTP layer num_nextn_predict_layers announces)"
        )
    own_embedding, own_head = "embed_tokens.weight" in tensors, "shared_head.head.weight" in tensors
    with torch.device(target.device), default_dtype(target.dtype):
        mtp = DeepseekMTP(c, layer, own_embedding, own_head, c.max_position_embeddings)
    load_drafter_weights(mtp, tensors, f"speculative_config.method mtp: model.layers.{layer}")
    if not own_embedding:
        mtp.embed_tokens = target.model.model.embed_tokens
    if not own_head:
        mtp.shared_head.head = target.model.lm_head
    return mtp.eval()
