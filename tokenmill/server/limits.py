"""Per-request limits of the HTTP server: every one is checked before any work is queued, and a
request over one gets a 400 naming the field. Operators change them with the `serve` flags below."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

# the only chat_template_kwargs a client may pass (documented template switches); a client cannot
# bring its own template, nor change how the prompt is tokenized
CHAT_TEMPLATE_KWARGS = ("enable_thinking", "thinking", "reasoning_effort")


@dataclass
class RequestLimits:
    max_n: int = 128  # samples per prompt (n), as OpenAI
    max_prompts: int = 256  # prompts in one /v1/completions request
    max_choices: int = 256  # n x prompts: sequences one request may start
    max_stop: int = 64  # stop strings
    max_stop_length: int = 256  # characters per stop string
    max_stop_token_ids: int = 64
    max_logit_bias: int = 1024  # logit_bias entries
    max_tools: int = 128
    template_timeout: float = 10.0  # seconds to render a chat template / tokenize one request

    def __post_init__(self) -> None:
        for f in fields(self):
            if getattr(self, f.name) <= 0:
                raise ValueError(f"--{f.name.replace('_', '-')} must be positive, got {getattr(self, f.name)}")


_HELP = {
    "max_n": "most samples per prompt (n)",
    "max_prompts": "most prompts in one /v1/completions request",
    "max_choices": "most sequences one request may start (n x prompts); with --max-queue they also count "
    "against the queue",
    "max_stop": "most stop strings per request",
    "max_stop_length": "longest stop string, in characters",
    "max_stop_token_ids": "most stop_token_ids per request",
    "max_logit_bias": "most logit_bias entries per request",
    "max_tools": "most tools per chat request",
    "template_timeout": "seconds a request's chat template rendering and tokenization may take (off the event "
    "loop); longer is a 400",
}


def add_limit_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("request limits (a request over one gets HTTP 400 naming the field)")
    for f in fields(RequestLimits):
        g.add_argument(
            f"--{f.name.replace('_', '-')}",
            type=type(f.default),
            default=f.default,
            help=f"{_HELP[f.name]} (default: %(default)s)",
        )


def limits_from_args(args: argparse.Namespace) -> RequestLimits:
    return RequestLimits(**{f.name: getattr(args, f.name) for f in fields(RequestLimits)})
