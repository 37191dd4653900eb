"""`tokenmill train-draft-head`: train Medusa heads for a target model on its own greedy outputs, on CPU
(`--kind eagle3`: an EAGLE-3 drafter, `train_eagle`; `--kind dflash|dspark`: a block drafter,
`train_dflash`; both from the same prompts, outputs and hidden states).

1. Prompts: passages of a corpus (by default the benchmark corpus, Python's own docstrings), each as a
   plain text to continue and, when the tokenizer has a chat template, as a chat turn asking about it.
2. The target generates a greedy continuation of each (self-distillation: the heads learn what this
   model says, which is exactly what they will be verified against).
3. One prefill of every prompt + continuation gives the final hidden state h_t at each position.
4. Head i learns to predict the token at t + 2 + i from h_t (the LM head predicts t + 1), through the
   target's own LM head, frozen and shared (the heads hold only their residual blocks, initialised to
   the identity, so training starts from "the next token"); cross-entropy summed over heads, Adam.
5. Held-out sequences give each head's top-1 accuracy; the heads are written in the Medusa layout
   (`tokenmill.spec_decode.medusa.save_medusa_heads`) with the training summary in config.json.
"""

from __future__ import annotations

import logging
import math
import random
import time
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from tokenmill.config import check_positive_ints
from tokenmill.sampling_params import SamplingParams
from tokenmill.spec_decode.medusa import MedusaHeads, save_medusa_heads

logger = logging.getLogger(__name__)

DRAFT_KINDS = ("medusa", "eagle3", "dflash", "dspark")
EAGLE_EPOCHS = 8  # the EAGLE-3 and DFlash drafters' default: whole layers to train, one sequence per step
CHAT_ASKS = ("Explain what this text says:", "Summarize this:", "Continue this text:", "What is this about?")


@dataclass
class TrainOptions:
    num_heads: int = 3
    num_layers: int = 1
    num_prompts: int = 160
    prompt_tokens: int = 96  # passage length, in tokens
    max_tokens: int = 128  # greedy continuation per prompt
    epochs: int = 3
    lr: float = 1e-3
    batch_size: int = 256
    held_out: float = 0.1  # fraction of sequences kept out of training to measure accuracy
    seed: int = 0
    corpus: str | None = None  # a text file; None: the benchmark corpus
    progress: bool = True
    kind: str = "medusa"  # or "eagle3" (`train_eagle`)
    draft_vocab_size: int = 8192  # eagle3: the drafter's vocabulary, the target's most frequent output tokens
    block_size: int = 8  # dflash / dspark: the block (its first token and block_size - 1 drafts)

    def __post_init__(self) -> None:
        if self.kind not in DRAFT_KINDS:
            raise ValueError(f"kind must be one of {', '.join(DRAFT_KINDS)}, got {self.kind!r}")
        check_positive_ints(
            self,
            (
                "num_heads",
                "num_layers",
                "num_prompts",
                "prompt_tokens",
                "max_tokens",
                "epochs",
                "batch_size",
                "draft_vocab_size",
                "block_size",
            ),
        )
        if not 0 < self.held_out < 1:
            raise ValueError(f"held_out must be in (0, 1), got {self.held_out!r}")
        if self.lr <= 0:
            raise ValueError(f"lr must be positive, got {self.lr!r}")


@dataclass
class TrainReport:
    sequences: int = 0
    positions: int = 0
    loss_first: list[float] = field(default_factory=list)  # per head, first epoch's mean
    loss_last: list[float] = field(default_factory=list)  # per head, last epoch's mean
    accuracy: list[float] = field(default_factory=list)  # per head, top-1 on held-out positions
    seconds: dict[str, float] = field(default_factory=dict)  # per phase

    def accuracy_text(self) -> str:
        """The held-out accuracies as the logs and the command print them: "61.2%, 40.3%"."""
        return ", ".join(f"{a:.1%}" for a in self.accuracy)


def corpus_passages(tokenizer, opts: TrainOptions) -> list[list[int]]:
    """`num_prompts` prompts of token ids: corpus passages of `prompt_tokens`, half of them (when a chat
    template exists) wrapped in a chat turn."""
    if opts.corpus:
        with open(opts.corpus, encoding="utf-8") as f:
            text = f.read()
    else:
        from tokenmill.bench.datasets import corpus_text

        text = corpus_text()
    ids = tokenizer.encode(text)
    if len(ids) < opts.prompt_tokens * 2:
        raise ValueError(f"corpus: {len(ids)} tokens is too short for passages of {opts.prompt_tokens}")
    rng = random.Random(opts.seed)
    chat = bool(tokenizer.hf.chat_template)
    prompts = []
    for i in range(opts.num_prompts):
        start = rng.randrange(len(ids) - opts.prompt_tokens)
        passage = ids[start : start + opts.prompt_tokens]
        if chat and i % 2:
            content = f"{CHAT_ASKS[i // 2 % len(CHAT_ASKS)]}\n\n{tokenizer.decode(passage)}"
            prompts.append(
                tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
            )
        else:
            prompts.append(passage)
    return prompts


def hidden_states(
    llm, sequences: list[list[int]], progress: bool, batch: int = 16, aux_layers: tuple[int, ...] = ()
) -> list[torch.Tensor]:
    """The target's final hidden state at every position of each sequence (with `aux_layers`: the
    residual stream entering those layers, concatenated, as an EAGLE-3 drafter reads it), from
    prefills of `batch` sequences at a time (prefix caching is off in the trainer's engine, so every
    position is computed).
    Each forward's flat batch is read back as the runner laid it out (per request: its new tokens after
    its computed ones); a chunk is matched to a sequence by its tokens (sequences equal over a chunk
    have equal hidden states there)."""
    runner = llm.engine.core.executor.runner
    forward = runner.forward
    chunks: list[tuple[np.ndarray, np.ndarray, np.ndarray, torch.Tensor]] = []

    def capture(input_ids, num_new, num_computed, *rest, **model_inputs):
        hidden, common = forward(input_ids, num_new, num_computed, *rest, **model_inputs)
        kept = runner.model.model.aux_hidden if aux_layers else hidden
        chunks.append((input_ids.copy(), num_new.copy(), num_computed.copy(), kept.detach().float().cpu()))
        return hidden, common

    result: list[torch.Tensor] = []
    runner.forward = capture
    runner.model.model.aux_layers = aux_layers
    try:
        for first in tqdm(range(0, len(sequences), batch), desc="hidden states", disable=not progress):
            group = sequences[first : first + batch]
            chunks.clear()
            llm.generate(group, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
            states = [torch.zeros(len(seq), chunks[0][3].shape[1]) for seq in group]
            filled = [torch.zeros(len(seq), dtype=torch.bool) for seq in group]
            for ids, num_new, num_computed, hidden in chunks:
                offset = 0
                for n, start in zip(num_new.tolist(), num_computed.tolist()):
                    run = ids[offset : offset + n].tolist()
                    i = next(
                        i
                        for i, seq in enumerate(group)
                        if len(seq) >= start + n and not filled[i][start] and seq[start : start + n] == run
                    )
                    states[i][start : start + n] = hidden[offset : offset + n]
                    filled[i][start : start + n] = True
                    offset += n
            if not all(bool(f.all()) for f in filled):
                raise RuntimeError("hidden states: a sequence was not fully computed")
            result.extend(states)
    finally:
        runner.forward = forward
        runner.model.model.aux_layers = ()
    return result


def training_pairs(
    states: list[torch.Tensor], sequences: list[list[int]], starts: list[int], num_heads: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(h_t [N, H], targets [N, heads]) for the generated positions t >= start - 1 of each sequence with
    all heads' targets t + 2 .. t + 1 + heads inside it."""
    xs, ys = [], []
    for h, seq, start in zip(states, sequences, starts):
        tokens = torch.tensor(seq)
        last = len(seq) - 1 - num_heads  # the last t whose furthest target exists
        positions = torch.arange(max(start - 1, 0), last)
        if positions.numel() == 0:
            continue
        xs.append(h[positions])
        ys.append(torch.stack([tokens[positions + 2 + i] for i in range(num_heads)], dim=1))
    return torch.cat(xs), torch.cat(ys)


def lm_head_weight(llm, hidden_size: int) -> torch.Tensor:
    """The target's LM head as a dense float32 [vocab, hidden] matrix, whatever its storage format:
    the head applied to the identity (exact for quantized heads: each row quantizes to one nonzero)."""
    model = llm.engine.core.executor.runner.model
    dtype = llm.engine.core.executor.dtype
    with torch.inference_mode():
        weight = model.compute_logits(torch.eye(hidden_size, dtype=dtype)).float().T
    return weight.clone()  # a normal tensor (autograd may save it), contiguous


def head_losses(heads: MedusaHeads, weight: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Per head: mean cross-entropy of its prediction through the shared LM head."""
    states = heads.head_states(x, heads.num_heads)
    return torch.stack([nn.functional.cross_entropy(s @ weight.T, y[:, i]) for i, s in enumerate(states)])


def train(
    x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, opts: TrainOptions, report: TrainReport
) -> MedusaHeads:
    vocab, hidden = weight.shape
    heads = MedusaHeads(opts.num_heads, opts.num_layers, hidden, vocab, own_lm_heads=False)
    for layers in heads.blocks:
        for linear in layers:  # x + SiLU(0) = x: every head starts as "the next token"
            nn.init.zeros_(linear.weight)
            nn.init.zeros_(linear.bias)
    optimizer = torch.optim.Adam(heads.parameters(), lr=opts.lr)
    gen = torch.Generator().manual_seed(opts.seed)
    batches = math.ceil(x.shape[0] / opts.batch_size)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, opts.lr, total_steps=batches * opts.epochs)
    bar = tqdm(total=batches * opts.epochs, desc="training", disable=not opts.progress)
    for epoch in range(opts.epochs):
        order = torch.randperm(x.shape[0], generator=gen)
        total = torch.zeros(opts.num_heads)
        for b in range(batches):
            idx = order[b * opts.batch_size : (b + 1) * opts.batch_size]
            losses = head_losses(heads, weight, x[idx], y[idx])
            optimizer.zero_grad()
            losses.sum().backward()
            optimizer.step()
            schedule.step()
            total += losses.detach() * idx.numel()
            bar.update()
            bar.set_postfix(epoch=epoch + 1, loss=f"{float(losses.detach().mean()):.3f}")
        mean = (total / x.shape[0]).tolist()
        if epoch == 0:
            report.loss_first = mean
        report.loss_last = mean
    bar.close()
    return heads.eval()


@torch.no_grad()
def accuracy(heads: MedusaHeads, weight: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> list[float]:
    """Per head: the fraction of positions where its top-1 token is the target's greedy token."""
    if x.shape[0] == 0:
        return [0.0] * heads.num_heads
    states = heads.head_states(x, heads.num_heads)
    return [float(((s @ weight.T).argmax(-1) == y[:, i]).float().mean()) for i, s in enumerate(states)]


def target_sequences(model: str, opts: TrainOptions, dtype: str, quantization: str, report: TrainReport):
    """The target (an `LLM`), the prompts and each prompt + its greedy continuation."""
    from tokenmill import LLM

    clock = time.perf_counter()
    llm = LLM(  # the engine arguments every entry point takes (tokenmill.engine_args.EngineArgs)
        model,
        dtype=dtype,
        quantization=quantization,
        seed=opts.seed,
        enable_prefix_caching=False,
        max_num_batched_tokens=2048,
    )
    prompts = corpus_passages(llm.get_tokenizer(), opts)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=opts.max_tokens),
        use_tqdm=opts.progress,
    )
    report.seconds["generate"] = time.perf_counter() - clock
    return llm, prompts, [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs)]


def training_summary(report: TrainReport, held: int, opts: TrainOptions) -> dict:
    """What config.json records of the training."""
    return {
        "sequences": report.sequences,
        "positions": report.positions,
        "held_out_sequences": held,
        "held_out_top1_accuracy": [round(a, 4) for a in report.accuracy],
        "loss_first_epoch": [round(v, 4) for v in report.loss_first],
        "loss_last_epoch": [round(v, 4) for v in report.loss_last],
        "seconds": {k: round(v, 1) for k, v in report.seconds.items()},
        "options": {
            k: getattr(opts, k)
            for k in ("num_prompts", "prompt_tokens", "max_tokens", "epochs", "lr", "batch_size", "seed", "corpus")
        },
    }


def train_draft_head(
    model: str, output: str, opts: TrainOptions, dtype: str = "auto", quantization: str = "auto"
) -> TrainReport:
    """Generate, collect hidden states, train, measure and write heads (or an EAGLE-3, DFlash or
    DSpark drafter: `opts.kind`) for `model` into `output`."""
    if opts.kind == "eagle3":
        from tokenmill.tools.train_eagle import train_eagle3

        return train_eagle3(model, output, opts, dtype, quantization)
    if opts.kind in ("dflash", "dspark"):
        from tokenmill.tools.train_dflash import train_dflash

        return train_dflash(model, output, opts, dtype, quantization)
    report = TrainReport()
    llm, prompts, sequences = target_sequences(model, opts, dtype, quantization, report)
    clock = time.perf_counter()
    states = hidden_states(llm, sequences, opts.progress)
    weight = lm_head_weight(llm, llm.engine.model_config.hidden_size)
    report.seconds["hidden_states"] = time.perf_counter() - clock
    held = max(1, round(len(sequences) * opts.held_out))
    starts = [len(p) for p in prompts]
    x, y = training_pairs(states[held:], sequences[held:], starts[held:], opts.num_heads)
    x_val, y_val = training_pairs(states[:held], sequences[:held], starts[:held], opts.num_heads)
    report.sequences, report.positions = len(sequences) - held, int(x.shape[0])
    clock = time.perf_counter()
    heads = train(x, y, weight, opts, report)
    report.seconds["train"] = time.perf_counter() - clock
    report.accuracy = accuracy(heads, weight, x_val, y_val)
    save_medusa_heads(heads, output, model, {"training": training_summary(report, held, opts)})
    logger.info(
        "wrote %d Medusa heads to %s: held-out top-1 accuracy %s",
        opts.num_heads,
        output,
        report.accuracy_text(),
    )
    return report


# The TrainOptions fields set by a flag of the same name (--num-heads: num_heads), their type and help; the
# default is the field's.
_OPTION_FLAGS = (
    ("num_heads", int, "medusa: heads, i.e. most drafts per step"),
    ("num_layers", int, "medusa: residual blocks per head; dflash / dspark: drafter layers"),
    ("block_size", int, "dflash / dspark: the block, i.e. at most block size - 1 drafts per step"),
    (
        "draft_vocab_size",
        int,
        "eagle3: the drafter's vocabulary, the target's most frequent output tokens (d2t maps them back)",
    ),
    ("num_prompts", int, "passages to continue, half of them as chat turns if the model has a chat template"),
    ("prompt_tokens", int, "tokens per passage"),
    ("max_tokens", int, "greedy tokens the target writes after each passage: the training targets"),
    ("lr", float, "peak learning rate, one-cycle schedule"),
    ("batch_size", int, "medusa: positions per step (the others train one sequence per step)"),
    ("held_out", float, "fraction of sequences kept out to measure each head's accuracy"),
    ("seed", int, "passage choice and training order"),
)


def add_train_head_parser(sub) -> None:
    from tokenmill.engine_args import add_engine_arg

    p = sub.add_parser(
        "train-draft-head",
        help="train Medusa heads or an EAGLE-3 / DFlash / DSpark drafter for a model on its own outputs (CPU)",
        description="Train Medusa heads (residual blocks tied to the target's LM head), or an EAGLE-3 "
        "drafter (--kind eagle3: one decoder layer over three of the target's layers' hidden "
        "states, in the published checkpoint layout), or a DFlash block drafter (--kind dflash: "
        "--num-layers non-causal layers drafting a block of --block-size in one forward, published "
        "layout; --kind dspark: plus a sequential head and a confidence head), on the target's own "
        "greedy continuations of corpus passages, and write them where --speculative-config "
        '\'{"method": "medusa" (or "eagle3", "dflash", "dspark"), "model": DIR}\' loads them; '
        "prints the held-out accuracy per head (dflash / dspark: acceptance per draft position).",
    )
    d = TrainOptions()
    add_engine_arg(
        p, "model", "the target: an alias, a .gguf file or an HF checkpoint directory (default: %(default)s)"
    )
    p.add_argument(
        "--output",
        required=True,
        help="directory to write config.json and the weights (medusa_lm_head.safetensors / model.safetensors) to",
    )
    p.add_argument(
        "--kind",
        choices=DRAFT_KINDS,
        default=d.kind,
        help="medusa: heads on the last hidden state; eagle3: an EAGLE-3 drafter; dflash: a block drafter; "
        "dspark: a block drafter with sequential and confidence heads (default: %(default)s)",
    )
    add_engine_arg(p, "dtype", "the target's compute dtype while generating (default: %(default)s)")
    p.add_argument(
        "--corpus",
        default=None,
        help="a UTF-8 text file to cut prompts from (default: the benchmark corpus, Python's own docstrings)",
    )
    p.add_argument(
        "--epochs",
        type=int,
        default=None,
        help=f"passes over the positions (default: {d.epochs} for medusa, {EAGLE_EPOCHS} for the others)",
    )
    for field_name, kind, text in _OPTION_FLAGS:
        p.add_argument(
            "--" + field_name.replace("_", "-"),
            type=kind,
            default=getattr(d, field_name),
            help=f"{text} (default: %(default)s)",
        )
    p.set_defaults(func=cmd_train_draft_head)


def cmd_train_draft_head(args) -> None:
    epochs = args.epochs or (TrainOptions.epochs if args.kind == "medusa" else EAGLE_EPOCHS)
    options = {name: getattr(args, name) for name, _, _ in _OPTION_FLAGS}
    opts = TrainOptions(**options, epochs=epochs, corpus=args.corpus, kind=args.kind)
    report = train_draft_head(args.model, args.output, opts, dtype=args.dtype)
    measure = "acceptance by draft position" if args.kind in ("dflash", "dspark") else "top-1 accuracy by head"
    print(
        f"{report.sequences} sequences, {report.positions} positions; held-out {measure}: "
        + report.accuracy_text()
        + f"; seconds {report.seconds}; written to {args.output}"
    )
