"""Medusa heads (Cai et al., 2024): k small heads on the target's final hidden state h_t, head i
predicting the token at t + 1 + i (the target's own LM head predicts t + 1). Each head is residual
blocks x + SiLU(W x + b), then an LM head: its own, or the target's (a head trained by
`tokenmill train-draft-head` is tied to it). One decode step then drafts k tokens with no extra
forward pass: the blocks of every head, then one LM-head call over all heads' rows.

Checkpoint layouts read (a directory with config.json and safetensors / a torch pickle):
- FasterDecoding/Medusa: `medusa_num_heads`, `medusa_num_layers`; tensors `{i}.{j}.linear.weight|bias`
  for the blocks and `{i}.{layers}.weight` for head i's LM head (optionally under `medusa_head.`);
- vLLM's: `num_heads`, `num_hidden_layers`; `blocks.{i}.layers.{j}.weight|bias`, `lm_heads.{i}.weight`.
A checkpoint without LM-head tensors uses the target's. `save_medusa_heads` writes the first layout.
`MedusaDrafter` drafts with them in the model runner.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from tokenmill.spec_decode.drafter import Drafter, DraftStep

if TYPE_CHECKING:
    from tokenmill.loader import LoadedModel

logger = logging.getLogger(__name__)

WEIGHT_FILES = ("medusa_lm_head.safetensors", "model.safetensors", "medusa_lm_head.pt", "pytorch_model.bin")
_ORIGINAL = re.compile(r"^(?:medusa_head\.)?(\d+)\.(\d+)\.(?:linear\.)?(weight|bias)$")
_VLLM = re.compile(r"^(?:blocks\.(\d+)\.layers\.(\d+)|lm_heads\.(\d+))\.(weight|bias)$")


class MedusaHeads(nn.Module):
    def __init__(self, num_heads: int, num_layers: int, hidden_size: int, vocab_size: int, own_lm_heads: bool) -> None:
        super().__init__()
        self.num_heads, self.num_layers, self.hidden_size, self.vocab_size = (
            num_heads,
            num_layers,
            hidden_size,
            vocab_size,
        )
        self.blocks = nn.ModuleList(
            nn.ModuleList(nn.Linear(hidden_size, hidden_size) for _ in range(num_layers)) for _ in range(num_heads)
        )
        self.lm_heads = (
            nn.ModuleList(nn.Linear(hidden_size, vocab_size, bias=False) for _ in range(num_heads))
            if own_lm_heads
            else None
        )

    def head_states(self, hidden: torch.Tensor, k: int) -> torch.Tensor:
        """hidden [R, H] -> the first k heads' states before their LM heads, [k, R, H]."""
        out = []
        for layers in self.blocks[:k]:
            x = hidden
            for linear in layers:
                x = x + nn.functional.silu(linear(x))
            out.append(x)
        return torch.stack(out)

    def logits(self, hidden: torch.Tensor, target_lm_head, k: int | None = None) -> torch.Tensor:
        """hidden [R, H] -> the first k (all) heads' logits [k, R, vocab]; `target_lm_head(x [N, H])`
        serves heads without their own, all rows in one call."""
        k = self.num_heads if k is None else min(k, self.num_heads)
        states = self.head_states(hidden, k)
        if self.lm_heads is not None:
            return torch.stack([head(s) for head, s in zip(self.lm_heads, states)])
        return target_lm_head(states.reshape(-1, self.hidden_size)).reshape(k, hidden.shape[0], -1)

    def propose(self, hidden: torch.Tensor, target_lm_head, k: int) -> list[list[int]]:
        """Greedy drafts of the (up to) k tokens after the one sampled from each row of hidden [R, H]."""
        return self.logits(hidden, target_lm_head, k).float().argmax(dim=-1).T.tolist()


class MedusaDrafter(Drafter):
    """Drafts of the tokens after each wanting request's newest token, from the hidden state its newest
    token was predicted from (every request as many as the most wanted, then trimmed)."""

    def __init__(self, path: str, target: LoadedModel) -> None:
        self.heads = load_medusa_heads(path, target.config.hidden_size, target.config.vocab_size).to(target.device)
        logger.info(
            "Medusa: %d heads of %d residual blocks from %s (%s LM heads)",
            self.heads.num_heads,
            self.heads.num_layers,
            path,
            "own" if self.heads.lm_heads is not None else "the target's",
        )

    def propose(self, step: DraftStep) -> dict[str, list[int]]:
        if not step.wanted:
            return {}
        rids, hidden = list(step.wanted), step.hidden
        rows = hidden[torch.tensor([step.last_rows[r] for r in rids], device=hidden.device)].float()
        drafted = self.heads.propose(
            rows, lambda x: step.model.compute_logits(x.to(hidden.dtype)), max(step.wanted.values())
        )
        return {r: d[: step.wanted[r]] for r, d in zip(rids, drafted)}


def read_tensors(path: Path, files: tuple[str, ...] = WEIGHT_FILES, what: str = "Medusa") -> dict[str, torch.Tensor]:
    """The tensors of the first of `files` (safetensors or a torch pickle) that `path` holds."""
    for name in files:
        file = path / name
        if file.exists():
            if file.suffix == ".safetensors":
                from safetensors.torch import load_file

                return load_file(str(file))
            return torch.load(file, map_location="cpu", weights_only=True)
    raise FileNotFoundError(f"no {what} weights in {path} (looked for {', '.join(files)})")


def load_medusa_heads(path: str, hidden_size: int, vocab_size: int) -> MedusaHeads:
    """Heads from a Medusa checkpoint directory, checked against the target's sizes."""
    root = Path(path)
    config_file = root / "config.json"
    if not config_file.exists():
        raise FileNotFoundError(f"speculative_config.model: {root} has no config.json (a Medusa checkpoint directory)")
    config = json.loads(config_file.read_text())
    num_heads = config.get("medusa_num_heads", config.get("num_heads"))
    num_layers = config.get("medusa_num_layers", config.get("num_hidden_layers", 1))
    if not isinstance(num_heads, int) or num_heads <= 0:
        raise ValueError(f"speculative_config.model: {config_file} names no medusa_num_heads / num_heads")
    blocks: dict[tuple[int, int, str], torch.Tensor] = {}
    lm_heads: dict[int, torch.Tensor] = {}
    for name, tensor in read_tensors(root).items():
        if m := _VLLM.match(name):
            if m.group(3) is not None:
                lm_heads[int(m.group(3))] = tensor
            else:
                blocks[(int(m.group(1)), int(m.group(2)), m.group(4))] = tensor
        elif m := _ORIGINAL.match(name):
            i, j = int(m.group(1)), int(m.group(2))
            if j == num_layers:
                lm_heads[i] = tensor
            else:
                blocks[(i, j, m.group(3))] = tensor
        else:
            raise ValueError(f"speculative_config.model: unexpected tensor {name!r} in {root}")
    if lm_heads and len(lm_heads) != num_heads:
        raise ValueError(f"speculative_config.model: {len(lm_heads)} LM heads for {num_heads} Medusa heads in {root}")
    heads = MedusaHeads(num_heads, num_layers, hidden_size, vocab_size, own_lm_heads=bool(lm_heads))
    state = {f"blocks.{i}.{j}.{kind}": t for (i, j, kind), t in blocks.items()}
    state.update({f"lm_heads.{i}.weight": t for i, t in lm_heads.items()})
    want = {n: p.shape for n, p in heads.state_dict().items()}
    missing = sorted(set(want) - set(state))
    if missing:
        raise ValueError(f"speculative_config.model: {root} lacks {', '.join(missing[:4])}")
    for name, tensor in state.items():
        if name not in want or tuple(tensor.shape) != tuple(want[name]):
            raise ValueError(
                f"speculative_config.model: {name} in {root} has shape {tuple(tensor.shape)}, the "
                f"target (hidden {hidden_size}, vocab {vocab_size}) needs {tuple(want.get(name, ()))}"
            )
    heads.load_state_dict({n: t.float() for n, t in state.items()})
    return heads.eval()


def save_medusa_heads(heads: MedusaHeads, path: str, base_model: str, extra: dict | None = None) -> None:
    """Write heads in the FasterDecoding/Medusa layout (config.json + medusa_lm_head.safetensors)."""
    from safetensors.torch import save_file

    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for i, layers in enumerate(heads.blocks):
        for j, linear in enumerate(layers):
            tensors[f"{i}.{j}.linear.weight"] = linear.weight.detach().contiguous()
            tensors[f"{i}.{j}.linear.bias"] = linear.bias.detach().contiguous()
        if heads.lm_heads is not None:
            tensors[f"{i}.{heads.num_layers}.weight"] = heads.lm_heads[i].weight.detach().contiguous()
    save_file(tensors, str(root / "medusa_lm_head.safetensors"))
    config = {
        "medusa_num_heads": heads.num_heads,
        "medusa_num_layers": heads.num_layers,
        "hidden_size": heads.hidden_size,
        "vocab_size": heads.vocab_size,
        "base_model_name_or_path": base_model,
        "tied_lm_head": heads.lm_heads is None,
        **(extra or {}),
    }
    (root / "config.json").write_text(json.dumps(config, indent=2) + "\n")
