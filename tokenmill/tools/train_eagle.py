"""`tokenmill train-draft-head --kind eagle3`: train a small EAGLE-3 drafter for a target on CPU, on
the target's own greedy continuations (the prompts, generation and hidden-state collection are the
Medusa trainer's, `train_head`), and write it in the published layout (`eagle.save_eagle3`), so that
it loads like a published one.

The drafter (`Eagle3Trainable`: plain torch under the published tensor names, causal attention over
whole sequences) learns, at each position t, the target's token t + 2 from the target's hidden states
entering layers 2, L // 2 and L - 3 at t and the embedding of token t + 1 (the target's, frozen and
shared). Its vocabulary is the `draft_vocab_size` tokens the target wrote most often (`d2t` maps them
back; others are left out of the loss). One step is trained (teacher-forced hidden states, no
"training-time test" unrolling), so the first draft is the strongest.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from tokenmill.spec_decode.eagle import default_aux_layers, save_eagle3
from tokenmill.tools.train_head import TrainOptions, TrainReport, hidden_states, target_sequences, training_summary

logger = logging.getLogger(__name__)


class Eagle3Trainable(nn.Module):
    """The EAGLE-3 drafter for training, its parameters named as in the published checkpoints."""

    def __init__(
        self,
        hidden: int,
        heads: int,
        kv_heads: int,
        head_dim: int,
        intermediate: int,
        draft_vocab: int,
        target_vocab: int,
        eps: float,
        rope_theta: float,
    ) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.rope_theta = heads, kv_heads, head_dim, rope_theta
        self.fc = nn.Linear(3 * hidden, hidden, bias=False)
        layer = self.midlayer = nn.Module()
        layer.input_layernorm, layer.hidden_norm = nn.RMSNorm(hidden, eps=eps), nn.RMSNorm(hidden, eps=eps)
        attn = layer.self_attn = nn.Module()
        attn.q_proj = nn.Linear(2 * hidden, heads * head_dim, bias=False)
        attn.k_proj = nn.Linear(2 * hidden, kv_heads * head_dim, bias=False)
        attn.v_proj = nn.Linear(2 * hidden, kv_heads * head_dim, bias=False)
        attn.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        layer.post_attention_layernorm = nn.RMSNorm(hidden, eps=eps)
        mlp = layer.mlp = nn.Module()
        mlp.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        mlp.up_proj = nn.Linear(hidden, intermediate, bias=False)
        mlp.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.norm = nn.RMSNorm(hidden, eps=eps)
        self.lm_head = nn.Linear(hidden, draft_vocab, bias=False)
        self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(target_vocab, dtype=torch.bool))

    def set_vocab(self, target_ids: torch.Tensor) -> None:
        """The draft vocabulary: these target ids (ascending)."""
        self.d2t.copy_(target_ids - torch.arange(len(target_ids)))
        self.t2d.zero_()
        self.t2d[target_ids] = True

    def _rotate(self, x: torch.Tensor) -> torch.Tensor:
        """Llama rotary embedding of x [heads, T, head_dim] at positions 0..T-1."""
        inv = self.rope_theta ** -(torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim)
        angles = torch.outer(torch.arange(x.shape[1], dtype=torch.float32), inv)
        cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
        half = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin

    def forward(self, aux: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """aux [T, 3H] (the target's at positions 0..T-1), embeds [T, H] (of tokens 1..T) -> draft-vocab
        logits [T, Vd] for tokens 2..T+1."""
        layer, attn, t = self.midlayer, self.midlayer.self_attn, aux.shape[0]
        hidden = self.fc(aux)
        x = torch.cat((layer.input_layernorm(embeds), layer.hidden_norm(hidden)), -1)
        q = self._rotate(attn.q_proj(x).view(t, self.heads, self.head_dim).transpose(0, 1))
        k = self._rotate(attn.k_proj(x).view(t, self.kv_heads, self.head_dim).transpose(0, 1))
        v = attn.v_proj(x).view(t, self.kv_heads, self.head_dim).transpose(0, 1)
        groups = self.heads // self.kv_heads
        out = F.scaled_dot_product_attention(
            q, k.repeat_interleave(groups, 0), v.repeat_interleave(groups, 0), is_causal=True
        )
        h = attn.o_proj(out.transpose(0, 1).reshape(t, -1)) + hidden
        n = layer.post_attention_layernorm(h)
        h = h + layer.mlp.down_proj(F.silu(layer.mlp.gate_proj(n)) * layer.mlp.up_proj(n))
        return self.lm_head(self.norm(h))


def new_drafter(target_config, draft_vocab: torch.Tensor, seed: int) -> Eagle3Trainable:
    """A drafter of the target's layer shape over the draft vocabulary `draft_vocab` (target ids)."""
    c = target_config
    torch.manual_seed(seed)
    drafter = Eagle3Trainable(
        c.hidden_size,
        c.num_attention_heads,
        c.num_key_value_heads,
        c.head_dim,
        c.intermediate_size,
        len(draft_vocab),
        c.vocab_size,
        c.rms_norm_eps,
        c.rope_theta,
    )
    drafter.set_vocab(draft_vocab)
    return drafter


def drafter_config(target_config, drafter: Eagle3Trainable, aux_layers: tuple[int, ...], extra: dict) -> dict:
    """config.json of the published layout for `drafter`."""
    c = target_config
    return {
        "model_type": "llama",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "num_hidden_layers": 1,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "max_position_embeddings": c.max_position_embeddings,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "vocab_size": c.vocab_size,
        "draft_vocab_size": drafter.lm_head.out_features,
        "target_hidden_size": c.hidden_size,
        "torch_dtype": "float32",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(aux_layers)},
        **extra,
    }


def save_drafter(
    drafter: Eagle3Trainable, target_config, aux_layers: tuple[int, ...], path: str, extra: dict | None = None
) -> None:
    save_eagle3(drafter.state_dict(), drafter_config(target_config, drafter, aux_layers, extra or {}), path)


def frequent_tokens(sequences: list[list[int]], starts: list[int], size: int) -> torch.Tensor:
    """The `size` tokens the target wrote most often (its outputs: from each start), ascending."""
    counts = Counter(t for seq, start in zip(sequences, starts) for t in seq[start:])
    return torch.tensor(sorted(t for t, _ in counts.most_common(size)))


def examples(
    aux: list[torch.Tensor], sequences: list[list[int]], embedding: torch.Tensor, drafter: Eagle3Trainable
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per sequence: (aux [T, 3H], embeddings of tokens 1..T, draft-vocab targets of tokens 2..T+1,
    -100 where out of the draft vocabulary) for positions 0..len - 3."""
    to_draft = torch.full((drafter.t2d.shape[0],), -100, dtype=torch.long)
    ids = torch.arange(len(drafter.d2t)) + drafter.d2t
    to_draft[ids] = torch.arange(len(ids))
    out = []
    for a, seq in zip(aux, sequences):
        tokens = torch.tensor(seq)
        out.append((a[: len(seq) - 2].clone(), embedding[tokens[1:-1]].clone(), to_draft[tokens[2:]]))
    return out


def train_drafter(drafter: Eagle3Trainable, data, epochs: int, lr: float, seed: int, progress=None) -> list[float]:
    """Adam with a one-cycle schedule, one sequence per step; the mean loss of each epoch."""
    optimizer = torch.optim.Adam(drafter.parameters(), lr=lr)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, lr, total_steps=max(1, epochs * len(data)))
    gen, means = torch.Generator().manual_seed(seed), []
    for _ in range(epochs):
        total = 0.0
        for i in torch.randperm(len(data), generator=gen).tolist():
            aux, embeds, targets = data[i]
            loss = F.cross_entropy(drafter(aux, embeds), targets, ignore_index=-100)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            schedule.step()
            total += float(loss.detach())
            if progress is not None:
                progress(float(loss.detach()))
        means.append(total / max(1, len(data)))
    return means


@torch.no_grad()
def top1_accuracy(drafter: Eagle3Trainable, data) -> float:
    """The fraction of in-vocabulary positions where the first draft is the target's token."""
    hits = total = 0
    for aux, embeds, targets in data:
        keep = targets != -100
        hits += int((drafter(aux, embeds).argmax(-1)[keep] == targets[keep]).sum())
        total += int(keep.sum())
    return hits / total if total else math.nan


def train_eagle3(
    model: str, output: str, opts: TrainOptions, dtype: str = "auto", quantization: str = "auto"
) -> TrainReport:
    """Generate, collect the target's auxiliary hidden states, train, measure and write an EAGLE-3
    drafter for `model` into `output`."""
    report = TrainReport()
    llm, prompts, sequences = target_sequences(model, opts, dtype, quantization, report)
    config = llm.engine.model_config
    aux_layers = default_aux_layers(config.num_hidden_layers)
    if config.num_hidden_layers < 6:
        raise ValueError(
            f"train-draft-head --kind eagle3: the target has {config.num_hidden_layers} layers; the "
            "drafter reads layers 2, L // 2 and L - 3, so it needs at least 6"
        )
    clock = time.perf_counter()
    aux = hidden_states(llm, sequences, opts.progress, aux_layers=aux_layers)
    embedding = llm.engine.core.executor.runner.model.model.embed_tokens.weight.detach().float().cpu()
    report.seconds["hidden_states"] = time.perf_counter() - clock
    held = max(1, round(len(sequences) * opts.held_out))
    starts = [len(p) for p in prompts]
    drafter = new_drafter(config, frequent_tokens(sequences[held:], starts[held:], opts.draft_vocab_size), opts.seed)
    data = examples(aux, sequences, embedding, drafter)
    report.sequences, report.positions = len(data) - held, sum(len(t) for _, _, t in data[held:])
    clock = time.perf_counter()
    bar = tqdm(total=opts.epochs * (len(data) - held), desc="training", disable=not opts.progress)

    def progress(loss: float) -> None:
        bar.update()
        bar.set_postfix(loss=f"{loss:.3f}")

    losses = train_drafter(drafter, data[held:], opts.epochs, opts.lr, opts.seed, progress)
    bar.close()
    report.seconds["train"] = time.perf_counter() - clock
    report.loss_first, report.loss_last = losses[:1], losses[-1:]
    report.accuracy = [top1_accuracy(drafter, data[:held])]
    save_drafter(
        drafter,
        config,
        aux_layers,
        output,
        {"base_model_name_or_path": model, "training": training_summary(report, held, opts)},
    )
    logger.info(
        "wrote an EAGLE-3 drafter to %s: held-out first-draft top-1 accuracy %.1f%%", output, 100 * report.accuracy[0]
    )
    return report
