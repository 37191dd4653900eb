"""Speculative decoding on vs off, same run: output tok/s at 1, 4 and 16 concurrent requests, on a
code-editing workload (the prompt holds a source file, the answer rewrites it), open chat, and JSON
records under a JSON schema (structured output: eight objects with the same keys).

    .venv/bin/python benchmarks/bench_spec_decode.py [--models smollm2-135m,qwen2.5-coder-1.5b]
        [--spec '{"method": "ngram", "num_speculative_tokens": 4}' [--spec ...]] [--concurrency 1,4,16] [--tokens 128]
        [--workloads code-edit,chat,json] [--rounds 3]

Greedy decoding (the spec-on text is checked to equal the spec-off text). Two rates: output tok/s
of the whole batch (prefill included) and the median request's decode tok/s after its first token.
The spec-off engine and one spec-on engine are loaded side by side (each warmed up by a request),
and every batch runs on both back to back, `--rounds` times, the order swapped each round: a speedup
is the median of the rounds' on/off ratios, so the machine's drift and the run order cancel (the
rates shown are the rounds' medians). Requests of one batch are submitted together (offline,
`LLM.generate`), so at concurrency c every step holds up to c decodes. Acceptance: drafted and
accepted tokens, the mean tokens per verify step, and the seconds spent drafting / in verify steps.
How much was speculated at all: the share of the spec-on engine's steps that verified drafts and the
share of its output tokens that came from such a verify (under load the engine drafts less, or not at
all past `disable_by_batch_size`). `--spec` takes any `--speculative-config`, e.g. Medusa heads written
by `tokenmill train-draft-head`: '{"method": "medusa", "model": "DIR"}', or an EAGLE-3 drafter (published, or
written by `tokenmill train-draft-head --kind eagle3`): '{"method": "eagle3", "model": "DIR"}'. Several
`--spec` run one after another against the same spec-off run (ratios within one run).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path
from statistics import median

from quantization import model_file  # this script's neighbour (benchmarks/ is on sys.path)

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [
    "tokenmill/engine/scheduler.py",
    "tokenmill/engine/kv_cache_manager.py",
    "tokenmill/sample/sampler.py",
    "tokenmill/engine/request.py",
]
QUESTIONS = [
    "Why is the sky blue?",
    "What makes a good cup of coffee?",
    "How do vaccines work?",
    "What should I see on a first trip to Rome?",
    "Explain what a hash table is.",
    "How do I start learning to paint?",
    "What causes the seasons on Earth?",
    "Give me tips for a job interview.",
]


def code_prompts(n: int) -> list[str]:
    out = []
    for i in range(n):
        text = (ROOT / SOURCES[i % len(SOURCES)]).read_text()
        start = (i // len(SOURCES)) * 700 % max(1, len(text) - 1600)
        code = text[start : start + 1500]
        out.append(f"```python\n{code}\n```\nThe same code with every `request` renamed to `req`:\n```python\n")
    return out


def chat_prompts(n: int) -> list[str]:
    return [f"Question: {QUESTIONS[i % len(QUESTIONS)]}\nAnswer:" for i in range(n)]


RECORDS = {
    "type": "array",
    "minItems": 8,
    "maxItems": 8,
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
            "age": {"type": "integer", "minimum": 18, "maximum": 90},
        },
        "required": ["name", "city", "age"],
    },
}


def json_prompts(n: int) -> list[str]:
    return [f"Write 8 records of people as JSON (name, city, age), set {i}:\n" for i in range(n)]


WORKLOADS = {"code-edit": (code_prompts, False), "chat": (chat_prompts, False), "json": (json_prompts, True)}


def run(llm, prompts: list[str], tokens: int, structured: bool = False) -> tuple[float, float, list[str], int]:
    """(output tok/s of the whole batch, prefill included; median decode tok/s of a request after
    its first token; the texts; the output tokens). `structured`: under the RECORDS schema (ends where
    the JSON does)."""
    from tokenmill import SamplingParams
    from tokenmill.structured import StructuredOutputSpec

    params = SamplingParams(
        temperature=0,
        max_tokens=tokens,
        ignore_eos=not structured,
        structured_output=StructuredOutputSpec.json(RECORDS) if structured else None,
    )
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    # token_times holds one time per step that produced tokens (several with speculation)
    decode = sorted(
        (len(o.outputs[0].token_ids) - 1) / (o.metrics.token_times[-1] - o.metrics.token_times[0]) for o in outs
    )
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return output_tokens / elapsed, decode[len(decode) // 2], [o.outputs[0].text for o in outs], output_tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--models",
        default="smollm2-135m,qwen2.5-coder-1.5b",
        help="fetch.sh names or paths, comma-separated (default: %(default)s)",
    )
    ap.add_argument(
        "--spec",
        action="append",
        help="a --speculative-config (JSON); repeat to compare several (default: one ngram drafter of 4 tokens)",
    )
    ap.add_argument(
        "--concurrency",
        default="1,4,16",
        help="requests per batch, comma-separated: one row each (default: %(default)s)",
    )
    ap.add_argument("--tokens", type=int, default=128, help="output tokens per request (default: %(default)s)")
    ap.add_argument(
        "--workloads",
        default="code-edit,chat,json",
        help=f"comma-separated, of {', '.join(WORKLOADS)} (default: %(default)s)",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="off / on pairs per batch (medians of their ratios) (default: %(default)s)",
    )
    args = ap.parse_args()
    import torch

    from tokenmill import LLM

    torch.set_num_threads(2)
    specs = [json.loads(s) for s in args.spec or ['{"method": "ngram", "num_speculative_tokens": 4}']]
    levels = [int(c) for c in args.concurrency.split(",")]
    workloads = args.workloads.split(",")
    unknown = [w for w in workloads if w not in WORKLOADS]
    if unknown:
        ap.error(f"unknown workloads {', '.join(unknown)} (known: {', '.join(WORKLOADS)})")
    print(
        f"# {platform.processor() or platform.machine()}, 2 threads; {args.tokens} tokens per request, greedy; "
        f"{args.rounds} off/on rounds per row; specs {' '.join(json.dumps(s) for s in specs)}"
    )
    print(
        f"{'model':<22} {'method':<8} {'workload':<10} {'conc':>4} {'off tok/s':>10} {'on tok/s':>9} {'speedup':>8} "
        f"{'off decode':>10} {'on decode':>9} {'speedup':>8} {'accept':>7} {'tok/step':>9} {'spec steps':>10} "
        f"{'spec tok':>8} {'draft/verify s':>14} same"
    )

    def load(path: str, spec: dict | None):
        llm = LLM(path, speculative_config=spec, max_model_len=4096, kv_cache_memory=2.0)
        run(llm, chat_prompts(1), 8)  # warm up
        return llm, SpecCounters(llm.engine.core)

    for name in args.models.split(","):
        path = str(model_file(name))
        off, _ = load(path, None)
        for spec in specs:
            on, counters = load(path, spec)
            for workload in workloads:
                make, structured = WORKLOADS[workload]
                for c in levels:
                    rounds = []
                    for r in range(args.rounds):
                        got = {}
                        for engine in (off, on) if r % 2 == 0 else (on, off):
                            before = counters.read()
                            got[engine is on] = run(engine, make(c), args.tokens, structured)
                            if engine is on:
                                delta = [b - a for a, b in zip(before, counters.read())]
                        rounds.append((got[False], got[True], delta))
                    report(name, spec["method"], workload, c, rounds)
            del on
        del off


class SpecCounters:
    """The spec-on engine's speculation counters, read before and after each batch: its verify steps of
    a request, drafted and accepted tokens, seconds drafting and verifying (the scheduler's), and its
    steps, all and those that verified drafts (counted here as the engine submits them)."""

    def __init__(self, core) -> None:
        self.stats, self.steps, self.spec_steps = core.scheduler.spec_stats, 0, 0
        submit = core.executor.submit

        def counted(sched) -> None:
            self.steps += 1
            self.spec_steps += bool(sched.spec_token_ids)
            submit(sched)

        core.executor.submit = counted

    def read(self) -> tuple:
        s = self.stats
        return (
            s.num_drafts,
            s.num_draft_tokens,
            s.num_accepted_tokens,
            s.draft_seconds,
            s.verify_seconds,
            self.steps,
            self.spec_steps,
        )


def report(name: str, method: str, workload: str, c: int, rounds: list) -> None:
    """One row from the rounds' (off result, on result, on's counter deltas): medians of the rates and
    of each round's on/off ratio; the counters summed over the rounds."""
    off = median([o[0] for o, _, _ in rounds])
    on = median([n[0] for _, n, _ in rounds])
    speedup = median([n[0] / o[0] for o, n, _ in rounds])
    dec_off = median([o[1] for o, _, _ in rounds])
    dec_on = median([n[1] for _, n, _ in rounds])
    dec_speedup = median([n[1] / o[1] for o, n, _ in rounds])
    drafts, drafted, accepted, draft_s, verify_s, steps, spec_steps = (
        sum(col) for col in zip(*(d for *_, d in rounds))
    )
    tokens = sum(n[3] for _, n, _ in rounds)
    accept = f"{accepted / drafted:.0%}" if drafted else "-"
    per_step = f"{(accepted + drafts) / drafts:.2f}" if drafts else "-"
    same = all(n[2] == o[2] for o, n, _ in rounds)
    print(
        f"{name:<22} {method:<8} {workload:<10} {c:>4} {off:>10.1f} {on:>9.1f} {speedup:>7.2f}x {dec_off:>10.1f} "
        f"{dec_on:>9.1f} {dec_speedup:>7.2f}x {accept:>7} {per_step:>9} {spec_steps / max(steps, 1):>10.0%} "
        f"{(accepted + drafts) / max(tokens, 1):>8.0%} {draft_s:>6.2f}/{verify_s:<7.2f} {same}",
        flush=True,
    )


if __name__ == "__main__":
    main()
