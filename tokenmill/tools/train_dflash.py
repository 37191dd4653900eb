"""`tokenmill train-draft-head --kind dflash|dspark`: train a small DFlash block drafter (with
`dspark`: its sequential and confidence heads too) for a target on CPU, on the target's own greedy
continuations (prompts, generation and hidden-state collection are `train_head`'s), and write it in
the published layout (`dflash.save_dflash`), so that it loads as a published one.

The module trained is the engine's own (`DFlashModule` / `DSparkModule`: plain torch). Each step takes
one sequence: its context is every position's target hidden states (layers `target_layer_ids`), and
`blocks_per_sequence` random anchors a among the generated positions each give a block [token a,
mask, ...] at positions a .. a + block_size - 1 that sees the context before a and itself (one
attention mask for all blocks); row j learns token a + j through the target's frozen LM head
(cross-entropy weighted exp(-(j - 1) / (block_size / 2)): early rows decide acceptance most). DSpark's
sequential head is trained teacher-forced on the true previous token (exactly what it sees whenever
the drafts before it were accepted), its confidence head on whether its argmax is the target's token.

Acceptance per position j, measured on held-out sequences, is the fraction of blocks whose rows
1 .. j are all the target's tokens (teacher-forced, which is exact for greedy verification: a row
only counts when every draft before it was accepted, i.e. equal to the true tokens).
"""

from __future__ import annotations

import logging
import math
import time

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from tokenmill.spec_decode.dflash import DFlashConfig, DFlashModule, save_dflash
from tokenmill.spec_decode.dspark import DSparkModule
from tokenmill.tools.train_head import (
    TrainOptions,
    TrainReport,
    hidden_states,
    lm_head_weight,
    target_sequences,
    training_summary,
)

logger = logging.getLogger(__name__)

BLOCKS_PER_SEQUENCE = 16


def default_target_layers(num_layers: int, count: int = 3) -> list[int]:
    """`count` target layers spread from the second to the second-last (DFlash: 1 .. L - 3)."""
    last = max(num_layers - 3, 1)
    return sorted({round(1 + i * (last - 1) / max(count - 1, 1)) for i in range(count)})


def new_drafter(
    target_config, kind: str, num_layers: int, block_size: int, target_layers: list[int], seed: int
) -> DFlashModule:
    """A drafter of the target's layer shape; the mask token is the target's last vocabulary id."""
    c = target_config
    config = DFlashConfig(
        hidden_size=c.hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        intermediate_size=c.intermediate_size,
        rms_norm_eps=c.rms_norm_eps,
        rope_theta=c.rope_theta,
        rope_scaling=c.rope_scaling,
        attention_bias=False,
        block_size=block_size,
        mask_token_id=c.vocab_size - 1,
        target_layer_ids=target_layers,
    )
    torch.manual_seed(seed)
    drafter = DSparkModule(config, max(c.hidden_size // 4, 1)) if kind == "dspark" else DFlashModule(config)
    if kind == "dspark":
        torch.nn.init.zeros_(drafter.spark_head.out_proj.weight)  # starts as the DFlash rows
    return drafter


def blocks(seq: list[int], start: int, size: int, count: int, mask_id: int, gen: torch.Generator):
    """`count` random anchors among the generated positions (each with a context before it) -> (block
    token ids [m * size], positions, targets [m, size - 1] (-100 past the end), attention mask
    [m * size, len + m * size])."""
    n = len(seq)
    low = max(start - 1, 1)
    if n - 2 < low:
        return None
    anchors = (torch.randperm(n - 1 - low, generator=gen)[:count] + low).sort().values
    offsets = torch.arange(size)
    positions = (anchors[:, None] + offsets).flatten()
    tokens = torch.tensor(seq)
    ids = torch.full((len(anchors), size), mask_id)
    ids[:, 0] = tokens[anchors]
    wanted = anchors[:, None] + offsets[1:]
    targets = torch.where(wanted < n, tokens[wanted.clamp(max=n - 1)], -100)
    rows = len(anchors) * size
    mask = torch.zeros(rows, n + rows, dtype=torch.bool)
    block_of = torch.arange(rows) // size
    mask[:, :n] = torch.arange(n)[None] < anchors[block_of][:, None]
    mask[:, n:] = block_of[:, None] == block_of[None]
    return ids.flatten(), positions, targets, mask


def block_losses(drafter, aux, seq, start, embedding, weight, gen, count=BLOCKS_PER_SEQUENCE):
    """(loss, the rows' argmax hits [m, size - 1] (-1: no target)) of one sequence's random blocks."""
    c = drafter.config
    made = blocks(seq, start, c.block_size, count, c.mask_token_id, gen)
    if made is None:
        return None
    ids, positions, targets, mask = made
    context = drafter.context(aux[: len(seq)], torch.arange(len(seq)))
    hidden = drafter(embedding[ids] * c.input_embedding_scale, positions, [context], [len(ids)], [mask])
    rows = hidden.view(-1, c.block_size, c.hidden_size)[:, 1:]
    weights = torch.exp(-torch.arange(c.block_size - 1) / (c.block_size / 2)).expand_as(targets)
    valid = targets != -100

    def weighted_ce(r):
        logits = drafter.scale_logits(r @ weight.T)
        ce = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="none")
        return (ce * weights.flatten()).sum() / weights[valid].sum(), logits

    loss, logits = weighted_ce(rows)
    if isinstance(drafter, DSparkModule):
        previous = torch.cat((ids.view(-1, c.block_size)[:, :1], targets[:, :-1].clamp(min=0)), 1)
        refined = drafter.refine(rows, embedding[previous] * c.input_embedding_scale)
        spark_loss, logits = weighted_ce(refined)
        tokens = logits.argmax(-1)
        conf = drafter.confidence(refined.detach().flatten(0, 1), logits.detach().flatten(0, 1), tokens.flatten())
        hit = (tokens == targets).float().flatten()
        bce = F.binary_cross_entropy(conf[valid.flatten()], hit[valid.flatten()])
        loss = loss + spark_loss + bce
    hits = torch.where(valid, (logits.argmax(-1) == targets).long(), -1)
    return loss, hits


def acceptance(hits: torch.Tensor) -> list[float]:
    """Per position j: the fraction of full blocks whose rows 1 .. j are all hits."""
    full = hits[(hits >= 0).all(1)]
    if full.shape[0] == 0:
        return [math.nan] * hits.shape[1]
    return full.cumprod(1).float().mean(0).tolist()


def train_blocks(drafter, data, embedding, weight, epochs: int, lr: float, seed: int, progress=None) -> list[float]:
    """Adam with a one-cycle schedule, one sequence's blocks per step; the mean loss of each epoch.
    `data`: (aux, sequence, start) per sequence."""
    params = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(params, lr=lr)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, lr, total_steps=max(1, epochs * len(data)))
    gen, means = torch.Generator().manual_seed(seed), []
    drafter.train()
    for _ in range(epochs):
        total, steps = 0.0, 0
        for i in torch.randperm(len(data), generator=gen).tolist():
            made = block_losses(drafter, *data[i], embedding, weight, gen)
            if made is not None:
                optimizer.zero_grad()
                made[0].backward()
                optimizer.step()
                total, steps = total + float(made[0].detach()), steps + 1
            schedule.step()
            if made is None:
                continue
            if progress is not None:
                progress(float(made[0].detach()))
        means.append(total / max(1, steps))
    return means


@torch.no_grad()
def held_out_acceptance(drafter, data, embedding, weight, seed: int) -> list[float]:
    drafter.eval()
    gen = torch.Generator().manual_seed(seed)
    hits = [made[1] for a, s, st in data if (made := block_losses(drafter, a, s, st, embedding, weight, gen))]
    return acceptance(torch.cat(hits)) if hits else []


def train_dflash(
    model: str, output: str, opts: TrainOptions, dtype: str = "auto", quantization: str = "auto"
) -> TrainReport:
    """Generate, collect the target's hidden states of its chosen layers, train, measure acceptance
    per position and write a DFlash (or DSpark) drafter for `model` into `output`."""
    report = TrainReport()
    llm, prompts, sequences = target_sequences(model, opts, dtype, quantization, report)
    config = llm.engine.model_config
    if config.num_hidden_layers < 3:
        raise ValueError(f"train-draft-head --kind {opts.kind}: the target needs at least 3 layers")
    layers = default_target_layers(config.num_hidden_layers)
    clock = time.perf_counter()
    aux = hidden_states(llm, sequences, opts.progress, aux_layers=tuple(i + 1 for i in layers))
    runner = llm.engine.core.executor.runner
    embedding = runner.model.model.embed_tokens.weight.detach().float().cpu().clone()
    weight = lm_head_weight(llm, config.hidden_size)
    report.seconds["hidden_states"] = time.perf_counter() - clock
    drafter = new_drafter(config, opts.kind, opts.num_layers, opts.block_size, layers, opts.seed)
    held = max(1, round(len(sequences) * opts.held_out))
    data = [(a, s, len(p)) for a, s, p in zip(aux, sequences, prompts)]
    report.sequences = len(data) - held
    report.positions = sum(len(s) - st for _, s, st in data[held:])
    clock = time.perf_counter()
    bar = tqdm(total=opts.epochs * (len(data) - held), desc="training", disable=not opts.progress)

    def progress(loss: float) -> None:
        bar.update()
        bar.set_postfix(loss=f"{loss:.3f}")

    losses = train_blocks(drafter, data[held:], embedding, weight, opts.epochs, opts.lr, opts.seed, progress)
    bar.close()
    report.seconds["train"] = time.perf_counter() - clock
    report.loss_first, report.loss_last = losses[:1], losses[-1:]
    report.accuracy = held_out_acceptance(drafter, data[:held], embedding, weight, opts.seed)
    summary = training_summary(report, held, opts)
    summary["held_out_acceptance_by_position"] = summary.pop("held_out_top1_accuracy")
    summary["held_out_acceptance_length"] = round(sum(a for a in report.accuracy if a == a), 3)
    save_dflash(drafter, output, {"base_model_name_or_path": model, "training": summary})
    logger.info(
        "wrote a %s drafter to %s: held-out acceptance by position %s",
        opts.kind,
        output,
        report.accuracy_text(),
    )
    return report
