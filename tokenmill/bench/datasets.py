"""Benchmark workloads: real text (Python's own docstrings and the Zen of Python) cut to exact token lengths.

A workload is a list of `Session`s. A session is one request, except in `multi-turn`, where it is a
conversation whose turn k is sent after the reply to turn k-1 arrives, with the whole history.

Datasets (`--dataset`):
  random        input/output lengths drawn uniformly in L*(1-r) .. L*(1+r) (`--random-range-ratio` r)
  shared-prefix `--num-prefixes` long system prompts (`--prefix-len` tokens) shared by many questions
  multi-turn    `--num-turns` user turns per conversation, each re-sending the history
  long-context  a fraction (`--long-context-fraction`) of very long prompts (`--long-context-len`) among short ones
  jsonl         the user's file: one JSON object per line with "prompt" (text) or "messages" (chat), and
                optionally "output_len" (or "max_tokens") for the expected output length
"""

from __future__ import annotations

import ast
import codecs
import importlib
import importlib.util
import inspect
import json
import math
import random
import warnings
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

DATASETS = ("random", "shared-prefix", "multi-turn", "long-context", "jsonl")

# Stdlib modules whose docstrings make the prompt corpus (fixed order: the same text on every run).
_CORPUS_MODULES = (
    "argparse",
    "asyncio.events",
    "asyncio.queues",
    "asyncio.streams",
    "asyncio.tasks",
    "bisect",
    "calendar",
    "collections",
    "concurrent.futures._base",
    "contextlib",
    "csv",
    "dataclasses",
    "datetime",
    "decimal",
    "difflib",
    "email.message",
    "enum",
    "fractions",
    "functools",
    "gettext",
    "heapq",
    "http.client",
    "http.cookiejar",
    "inspect",
    "ipaddress",
    "itertools",
    "json",
    "json.decoder",
    "logging",
    "logging.handlers",
    "mailbox",
    "pathlib",
    "pickle",
    "pprint",
    "queue",
    "random",
    "re",
    "shlex",
    "shutil",
    "smtplib",
    "socket",
    "statistics",
    "string",
    "subprocess",
    "tarfile",
    "tempfile",
    "textwrap",
    "threading",
    "timeit",
    "typing",
    "unittest.case",
    "unittest.mock",
    "urllib.parse",
    "urllib.request",
    "uuid",
    "warnings",
    "weakref",
    "zipfile",
)
_MIN_DOC_CHARS = 120  # shorter docstrings are mostly one-liners ("Return self.")
TRANSCRIPT_ROLES = {"system": "System", "user": "User", "assistant": "Assistant"}


# ---------------------------------------------------------------------------------------------- corpus


def _zen_of_python() -> str:
    """The text of `import this`, without importing it (the import prints)."""
    spec = importlib.util.find_spec("this")
    if spec is None or not spec.origin:
        return ""
    tree = ast.parse(Path(spec.origin).read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "s":
            return codecs.decode(ast.literal_eval(node.value), "rot13")
    return ""


def _docstrings(module_name: str) -> list[str]:
    try:
        module = importlib.import_module(module_name)
    except ImportError:  # a stdlib module missing from a stripped-down Python
        return []
    docs = [inspect.getdoc(module) or ""]
    for name, obj in sorted(vars(module).items()):
        if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
            continue
        if inspect.isclass(obj):
            docs.append(inspect.getdoc(obj) or "")
            docs.extend(
                inspect.getdoc(m) or ""
                for n, m in sorted(vars(obj).items())
                if not n.startswith("_") and inspect.isfunction(m)
            )
        elif inspect.isfunction(obj):
            docs.append(inspect.getdoc(obj) or "")
    return [d for d in docs if len(d) >= _MIN_DOC_CHARS]


@lru_cache(maxsize=1)
def corpus_text() -> str:
    """Several hundred kB of English technical prose that ships with every Python."""
    paragraphs = [_zen_of_python()]
    seen: set[str] = set()
    for module_name in _CORPUS_MODULES:
        with warnings.catch_warnings():  # deprecated aliases (typing.io, ...) warn when touched
            warnings.simplefilter("ignore", DeprecationWarning)
            docs = _docstrings(module_name)
        for doc in docs:
            if doc not in seen:  # re-exported objects would repeat text
                seen.add(doc)
                paragraphs.append(doc)
    return "\n\n".join(p for p in paragraphs if p)


# ---------------------------------------------------------------------------------------------- tokenizer


class BenchTokenizer:
    """What the bench needs of a tokenizer, over a Hugging Face tokenizer (`hf`)."""

    def __init__(self, hf, name: str):
        self.hf = hf
        self.name = name

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def count(self, text: str, add_special_tokens: bool = True) -> int:
        return len(self.encode(text, add_special_tokens))

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def render_chat(self, messages: list[dict]) -> str:
        """The prompt text the model's chat template makes of `messages` (ready for the reply)."""
        return self.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def count_chat(self, messages: list[dict]) -> int | None:
        """Prompt tokens of a chat request as a server would template it; None without a template."""
        if not self.has_chat_template:
            return None
        return self.count(self.render_chat(messages), add_special_tokens=False)


def load_bench_tokenizer(name: str) -> BenchTokenizer:
    """A tokenmill model name/path (via tokenmill's loader), else a local or cached HF tokenizer. Never downloads."""
    errors = []
    try:
        from tokenmill.loader.source import resolve_model
        from tokenmill.tokenizer import load_tokenizer

        return BenchTokenizer(load_tokenizer(resolve_model(name)).hf, name)
    except Exception as e:  # not a tokenmill model: try transformers' own resolution below
        errors.append(f"tokenmill: {e}")
    try:
        from transformers import AutoTokenizer

        return BenchTokenizer(AutoTokenizer.from_pretrained(name, local_files_only=True), name)
    except Exception as e:
        errors.append(f"transformers: {type(e).__name__}: {e}")
    raise ValueError(
        f"cannot load a tokenizer for {name!r} (pass --tokenizer with a local path or a tokenmill "
        f"model name): " + "; ".join(errors)
    )


class TextSampler:
    """Cuts windows of the corpus whose token count is exactly what was asked for."""

    def __init__(self, tokenizer: BenchTokenizer, add_special_tokens: bool = True):
        self.tok = tokenizer
        self.special = add_special_tokens
        self.ids = tokenizer.encode(corpus_text(), add_special_tokens=False)

    def _window(self, start: int, n: int) -> str:
        start %= len(self.ids)
        ids = self.ids[start : start + n]
        while len(ids) < n:  # longer than the corpus: wrap around
            ids += self.ids[: n - len(ids)]
        return self.tok.decode(ids)

    def text(self, num_tokens: int, start: int, prefix: str = "") -> str:
        """`prefix` + corpus text from token `start`, `num_tokens` tokens in all (as the server counts them)."""
        base = self.tok.count(prefix, self.special) if prefix else self.tok.count("", self.special)
        if num_tokens < base or num_tokens < 1:
            raise ValueError(f"cannot make a {num_tokens}-token prompt (the fixed part alone is {base} tokens)")
        for attempt in range(8):  # a window that cannot hit the target exactly: try a nearby one
            text = self._fit(num_tokens, start + 101 * attempt, prefix, num_tokens - base)
            if text is not None:
                return text
        raise ValueError(f"could not cut a text of exactly {num_tokens} tokens from the corpus")

    def _fit(self, target: int, start: int, prefix: str, n: int) -> str | None:
        tried: set[int] = set()
        while n >= 0 and n not in tried and len(tried) < 16:
            tried.add(n)
            text = prefix + self._window(start, n)
            got = self.tok.count(text, self.special)
            if got == target:
                return text
            n += target - got
        return None

    def random_start(self, rng: random.Random) -> int:
        return rng.randrange(len(self.ids))


# ---------------------------------------------------------------------------------------------- workloads


@dataclass
class Turn:
    """One request. `content` is the prompt text (completions) or message list (chat) of a single-turn
    session, or the new user message text of a multi-turn one."""

    content: str | list[dict]
    output_len: int
    prompt_len: int | None = None  # tokens of the prompt as sent; None when only known at run time


@dataclass
class Session:
    turns: list[Turn]
    multi_turn: bool = False

    def prompt(self, index: int, replies: list[str], chat: bool) -> str | list[dict]:
        """What to send for turn `index`, given the replies to the turns before it."""
        if not self.multi_turn:
            return self.turns[index].content
        messages = []
        for turn, reply in zip(self.turns[: index + 1], replies[:index] + [None]):
            messages.append({"role": "user", "content": turn.content})
            if reply is not None:
                messages.append({"role": "assistant", "content": reply})
        return messages if chat else transcript(messages)


def transcript(messages: list[dict]) -> str:
    """A chat as plain text for a completions endpoint, ending where the assistant's reply goes."""
    lines = [f"{TRANSCRIPT_ROLES.get(m['role'], m['role'].title())}: {m['content']}" for m in messages]
    return "\n\n".join(lines + ["Assistant:"])


@dataclass
class DatasetConfig:
    name: str = "random"
    num_prompts: int = 100
    seed: int = 0
    input_len: int = 1024  # --random-input-len: prompt (random, long-context), question (shared-prefix), user turn
    output_len: int = 128  # --random-output-len
    range_ratio: float = 0.0  # --random-range-ratio
    num_prefixes: int = 4
    prefix_len: int = 1024
    num_turns: int = 4
    long_context_len: int = 4096
    long_context_fraction: float = 0.1
    path: str | None = None  # jsonl
    extra: dict = field(default_factory=dict)

    def validate(self) -> None:
        if self.name not in DATASETS:
            raise ValueError(f"unknown dataset {self.name!r}; choose from {', '.join(DATASETS)}")
        if self.num_prompts < 1:
            raise ValueError("--num-prompts must be >= 1")
        if not 0 <= self.range_ratio < 1:
            raise ValueError("--random-range-ratio must be in [0, 1)")
        if self.input_len < 1 or self.output_len < 1:
            raise ValueError("--random-input-len and --random-output-len must be >= 1")
        if self.name == "shared-prefix" and (self.num_prefixes < 1 or self.prefix_len < 1):
            raise ValueError("--num-prefixes and --prefix-len must be >= 1")
        if self.name == "multi-turn" and self.num_turns < 1:
            raise ValueError("--num-turns must be >= 1")
        if self.name == "long-context" and not (0 <= self.long_context_fraction <= 1 and self.long_context_len >= 1):
            raise ValueError("--long-context-fraction must be in [0, 1] and --long-context-len >= 1")
        if self.name == "jsonl" and not self.path:
            raise ValueError("--dataset jsonl needs --dataset-path FILE")


def sample_len(length: int, range_ratio: float, rng: random.Random) -> int:
    """Uniform integer in [L*(1-r), L*(1+r)], at least 1."""
    lo = max(1, math.floor(length * (1 - range_ratio)))
    hi = max(lo, math.ceil(length * (1 + range_ratio)) if range_ratio else length)
    return rng.randint(lo, hi)


def build_sessions(cfg: DatasetConfig, tokenizer: BenchTokenizer | None, chat: bool) -> list[Session]:
    """`cfg.num_prompts` sessions (conversations for multi-turn) for a chat or a completions endpoint."""
    cfg.validate()
    rng = random.Random(cfg.seed)
    if cfg.name == "jsonl":
        return _jsonl(cfg, tokenizer, chat)
    if tokenizer is None:
        raise ValueError(f"dataset {cfg.name!r} needs a tokenizer")
    sampler = TextSampler(tokenizer, add_special_tokens=not chat)
    builders = {
        "random": _random,
        "shared-prefix": _shared_prefix,
        "multi-turn": _multi_turn,
        "long-context": _long_context,
    }
    return builders[cfg.name](cfg, sampler, rng, chat)


def _single(sampler: TextSampler, text: str, output_len: int, chat: bool, prompt_len: int) -> Session:
    if chat:
        messages = [{"role": "user", "content": text}]
        return Session([Turn(messages, output_len, sampler.tok.count_chat(messages) or prompt_len)])
    return Session([Turn(text, output_len, prompt_len)])


def _random(cfg, sampler, rng, chat) -> list[Session]:
    sessions = []
    for _ in range(cfg.num_prompts):
        n_in = sample_len(cfg.input_len, cfg.range_ratio, rng)
        n_out = sample_len(cfg.output_len, cfg.range_ratio, rng)
        sessions.append(_single(sampler, sampler.text(n_in, sampler.random_start(rng)), n_out, chat, n_in))
    return sessions


def _long_context(cfg, sampler, rng, chat) -> list[Session]:
    n_long = (
        min(cfg.num_prompts, max(1, round(cfg.long_context_fraction * cfg.num_prompts)))
        if cfg.long_context_fraction > 0
        else 0
    )
    long_positions = set(rng.sample(range(cfg.num_prompts), n_long))
    sessions = []
    for i in range(cfg.num_prompts):
        n_in = cfg.long_context_len if i in long_positions else sample_len(cfg.input_len, cfg.range_ratio, rng)
        n_out = sample_len(cfg.output_len, cfg.range_ratio, rng)
        sessions.append(_single(sampler, sampler.text(n_in, sampler.random_start(rng)), n_out, chat, n_in))
    return sessions


def _shared_prefix(cfg, sampler, rng, chat) -> list[Session]:
    stride = len(sampler.ids) // cfg.num_prefixes
    prefixes = [sampler.text(cfg.prefix_len, i * stride) + "\n\n" for i in range(cfg.num_prefixes)]
    sessions = []
    for _ in range(cfg.num_prompts):
        prefix = prefixes[rng.randrange(cfg.num_prefixes)]
        n_q = sample_len(cfg.input_len, cfg.range_ratio, rng)
        n_out = sample_len(cfg.output_len, cfg.range_ratio, rng)
        start = sampler.random_start(rng)
        if chat:
            messages = [
                {"role": "system", "content": prefix.rstrip()},
                {"role": "user", "content": sampler.text(n_q, start)},
            ]
            sessions.append(Session([Turn(messages, n_out, sampler.tok.count_chat(messages))]))
        else:
            n_prefix = sampler.tok.count(prefix, sampler.special)
            text = sampler.text(n_prefix + n_q, start, prefix=prefix)
            sessions.append(Session([Turn(text, n_out, n_prefix + n_q)]))
    return sessions


def _multi_turn(cfg, sampler, rng, chat) -> list[Session]:
    sessions = []
    for _ in range(cfg.num_prompts):
        turns = []
        for _ in range(cfg.num_turns):
            n_in = sample_len(cfg.input_len, cfg.range_ratio, rng)
            n_out = sample_len(cfg.output_len, cfg.range_ratio, rng)
            turns.append(Turn(sampler.text(n_in, sampler.random_start(rng)), n_out))
        sessions.append(Session(turns, multi_turn=True))
    return sessions


def _jsonl(cfg, tokenizer, chat) -> list[Session]:
    rows = []
    path = Path(cfg.path)
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            raise ValueError(f"{path}:{lineno}: not JSON: {e}") from e
        if not isinstance(row, dict) or not isinstance(row.get("prompt", row.get("messages")), (str, list)):
            raise ValueError(f'{path}:{lineno}: expected an object with "prompt" (a string) or "messages" (a list)')
        rows.append(row)
    if not rows:
        raise ValueError(f"{path} has no prompts")
    sessions = []
    for i in range(cfg.num_prompts):  # in file order, cycling when the file is shorter than --num-prompts
        row = rows[i % len(rows)]
        output_len = int(row.get("output_len") or row.get("max_tokens") or cfg.output_len)
        if "messages" in row:
            messages = row["messages"]
            content = messages if chat else transcript(messages)
        else:
            content = [{"role": "user", "content": row["prompt"]}] if chat else row["prompt"]
        prompt_len = None
        if tokenizer is not None:
            prompt_len = tokenizer.count_chat(content) if chat else tokenizer.count(content)
        sessions.append(Session([Turn(content, output_len, prompt_len)]))
    return sessions
