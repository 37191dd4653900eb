"""`tokenmill eval`: score a local task file against the engine (--model) or a server (--base-url)."""

from __future__ import annotations

import argparse
import json
import sys

from tokenmill.cli_args import quiet_http_logs
from tokenmill.engine_args import add_engine_args, engine_config_from_args
from tokenmill.eval.tasks import KINDS


def add_eval_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "eval",
        help="score a task file, or the perplexity of a text corpus (log-likelihood, multiple choice, perplexity)",
        description="Score a JSONL task file (--task) or, with `tokenmill eval perplexity`, a text corpus (the one "
        "tokenmill ships, or --corpus) with the engine in-process (the model flags below) or against any "
        "OpenAI-compatible server (--base-url, through /v1/completions with echo + logprobs). "
        "Kinds: loglikelihood {context, continuation}; multiple_choice {context, choices, gold}; "
        "perplexity {text}.",
    )
    p.add_argument(
        "builtin",
        nargs="?",
        choices=("perplexity",),
        help="perplexity: token and word perplexity of --corpus, scored in chunks of whole lines",
    )
    p.add_argument("--task", default=None, metavar="FILE.jsonl", help="the task file, one JSON object per line")
    p.add_argument(
        "--corpus",
        default=None,
        metavar="FILE.txt",
        help="perplexity: the text to score (default: the corpus tokenmill ships, a frozen copy of its "
        "README, architecture notes and scheduler source, ~38 KB)",
    )
    p.add_argument(
        "--chunk-chars",
        type=int,
        default=2000,
        help="perplexity: characters per scored chunk, cut at line ends (default: %(default)s)",
    )
    p.add_argument(
        "--kind",
        default="auto",
        choices=("auto", *KINDS),
        help="task kind; auto tells it from the first item's fields (default: %(default)s)",
    )
    p.add_argument("--limit", type=int, default=None, help="score only the first N items (chunks)")
    p.add_argument(
        "--base-url",
        default=None,
        help="score against this server (e.g. http://127.0.0.1:8000/v1) instead of loading the model",
    )
    p.add_argument("--served-model", default=None, help="the model name to send to the server (default: its first)")
    p.add_argument("--api-key", default=None, help="bearer token for the server")
    p.add_argument("--output", default=None, metavar="FILE.json", help="write metrics and per-item results here")
    add_engine_args(p)
    p.set_defaults(func=run_eval)
    return p


def run_eval(args: argparse.Namespace) -> None:
    from tokenmill.eval.scorers import EngineScorer, ServerScorer
    from tokenmill.eval.tasks import corpus_items, evaluate, load_task, texts_to_score

    if (args.builtin is None) == (args.task is None):
        raise SystemExit("tokenmill eval: give either --task FILE.jsonl or `perplexity` (with an optional --corpus)")
    if args.builtin:
        kind, items = "perplexity", corpus_items(args.corpus, args.chunk_chars)
    else:
        kind, items = load_task(args.task, args.kind)
    items = items[: args.limit] if args.limit else items
    if args.base_url:
        quiet_http_logs()  # not a line per scored text
        scorer = ServerScorer(args.base_url, args.served_model, args.api_key)
    else:
        from tokenmill import LLM

        scorer = EngineScorer(LLM(engine_config=engine_config_from_args(args)))
    result = evaluate(kind, items, scorer.score([t for t, _ in texts_to_score(kind, items)]))
    summary = {k: v for k, v in result.items() if k != "per_item"}
    print(json.dumps(summary, indent=2))
    if args.output:
        with open(args.output, "w") as f:
            json.dump(result, f, indent=2)
        print(f"results: {args.output}", file=sys.stderr)
