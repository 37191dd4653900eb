"""Async streaming client for OpenAI-compatible servers, and the arrival process that drives it.

Arrivals: with `request_rate` finite, sessions start at gaps drawn from a gamma distribution of shape
`burstiness` and mean 1/rate (burstiness 1 is a Poisson process; lower is burstier, higher is more
regular); with an infinite rate they all start at once. `max_concurrency` caps requests in flight
(closed loop when the rate is infinite). A multi-turn session sends turn k after the reply to turn k-1.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
from tqdm.auto import tqdm

from tokenmill.bench.datasets import Session
from tokenmill.bench.metrics import RequestRecord

ABORTED = "aborted: the run reached --max-duration"
SKIPPED = "not sent: an earlier turn of this conversation failed"


@dataclass
class EndpointConfig:
    base_url: str
    model: str
    endpoint: str = "/v1/completions"
    api_key: str | None = None
    temperature: float = 0.0
    ignore_eos: bool = False
    extra_body: dict = field(default_factory=dict)
    timeout: float | None = 600.0  # per request, seconds

    @property
    def chat(self) -> bool:
        return self.endpoint.rstrip("/").endswith("chat/completions")

    @property
    def url(self) -> str:
        base, path = self.base_url.rstrip("/"), "/" + self.endpoint.lstrip("/")
        if base.endswith("/v1") and path.startswith("/v1/"):
            path = path[3:]
        return base + path

    def payload(self, prompt: str | list[dict], max_tokens: int) -> dict:
        body = {
            "model": self.model,
            "max_tokens": max_tokens,
            "temperature": self.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        body["messages" if self.chat else "prompt"] = prompt
        if self.ignore_eos:
            body["ignore_eos"] = True
        return body | self.extra_body


@dataclass
class LoadConfig:
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    max_duration: float | None = None
    seed: int = 0

    def validate(self) -> None:
        if not self.request_rate > 0:
            raise ValueError("--request-rate must be > 0 (inf: all at once)")
        if not self.burstiness > 0:
            raise ValueError("--burstiness must be > 0")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("--max-concurrency must be >= 1")
        if self.max_duration is not None and not self.max_duration > 0:
            raise ValueError("--max-duration must be > 0")


def arrival_gaps(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Waits before each of `n` session starts (the first is 0)."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    theta = 1.0 / (rate * burstiness)  # gamma(shape k, scale theta) has mean k*theta = 1/rate
    return [0.0] + [rng.gammavariate(burstiness, theta) for _ in range(n - 1)]


def _content(chunk: dict, chat: bool) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if not chat:
        return choice.get("text") or ""
    delta = choice.get("delta") or {}
    return (delta.get("reasoning_content") or "") + (delta.get("content") or "")


async def _stream(
    client: httpx.AsyncClient, cfg: EndpointConfig, prompt, max_tokens: int, record: RequestRecord, t0: float
) -> None:
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    start = time.perf_counter()
    record.start = start - t0
    last = None
    text: list[str] = []
    try:
        async with client.stream("POST", cfg.url, json=cfg.payload(prompt, max_tokens), headers=headers) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                record.error = f"HTTP {resp.status_code}: {body.strip()[:500]}"
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators, comments, "event:" lines
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                chunk = json.loads(data)
                if "error" in chunk:
                    err = chunk["error"]
                    record.error = f"stream error: {err.get('message', err) if isinstance(err, dict) else err}"
                    return
                piece = _content(chunk, cfg.chat)
                if piece:
                    if last is None:
                        record.ttft = now - start
                    else:
                        record.itl.append(now - last)
                    last = now
                    record.num_chunks += 1
                    text.append(piece)
                for choice in chunk.get("choices") or []:
                    record.finish_reason = choice.get("finish_reason") or record.finish_reason
                usage = chunk.get("usage")
                if usage:
                    record.prompt_tokens = usage.get("prompt_tokens", record.prompt_tokens)
                    if usage.get("completion_tokens") is not None:
                        record.output_tokens = usage["completion_tokens"]
                        record.output_tokens_source = "usage"
                    details = usage.get("prompt_tokens_details") or {}
                    if details.get("cached_tokens") is not None:
                        record.cached_tokens = details["cached_tokens"]
        record.success = True
    except asyncio.CancelledError:
        record.error = ABORTED
        raise
    except (httpx.HTTPError, OSError, ValueError) as e:
        record.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    finally:
        record.e2e = time.perf_counter() - start
        record.output_text = "".join(text)


async def send_request(
    client: httpx.AsyncClient,
    cfg: EndpointConfig,
    prompt,
    max_tokens: int,
    record: RequestRecord,
    t0: float,
    count_tokens: Callable[[str], int] | None = None,
) -> None:
    """Stream one request, filling `record` (timings, token counts, error text)."""
    try:
        await asyncio.wait_for(_stream(client, cfg, prompt, max_tokens, record, t0), cfg.timeout)
    except asyncio.TimeoutError:
        record.success = False
        record.error = f"timeout: no complete reply after {cfg.timeout:g} s (--timeout)"
    if record.output_tokens_source != "usage":  # the server sent no usage: count what it streamed
        if count_tokens is not None:
            record.output_tokens, record.output_tokens_source = count_tokens(record.output_text), "tokenizer"
        else:
            record.output_tokens, record.output_tokens_source = record.num_chunks, "chunks"
    if record.prompt_tokens is None:
        if record.expected_prompt_len is not None:
            record.prompt_tokens = record.expected_prompt_len
        elif count_tokens is not None and isinstance(prompt, str):
            record.prompt_tokens = count_tokens(prompt)


async def run_load(
    sessions: list[Session],
    cfg: EndpointConfig,
    load: LoadConfig,
    count_tokens: Callable[[str], int] | None = None,
    progress: bool = True,
    desc: str = "bench",
) -> tuple[list[RequestRecord], float]:
    """Send every session's turns per the arrival process; return (records, duration in seconds).
    Requests cut off by `max_duration` are recorded as failed; sessions not started by then are not sent."""
    load.validate()
    records: list[RequestRecord] = []
    limit = asyncio.Semaphore(load.max_concurrency) if load.max_concurrency else contextlib.nullcontext()
    gaps = arrival_gaps(len(sessions), load.request_rate, load.burstiness, load.seed)
    total = sum(len(s.turns) for s in sessions)
    limits = httpx.Limits(max_connections=load.max_concurrency, max_keepalive_connections=load.max_concurrency or 100)
    timeout = httpx.Timeout(cfg.timeout, connect=min(cfg.timeout or 30.0, 30.0))

    with tqdm(total=total, desc=desc, unit="req", disable=not progress, file=sys.stderr, leave=False) as bar:
        async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
            t0 = time.perf_counter()

            async def session_task(index: int, session: Session) -> None:
                replies: list[str] = []
                for k, turn in enumerate(session.turns):
                    async with limit:
                        record = RequestRecord(
                            session=index,
                            turn=k,
                            expected_output_len=turn.output_len,
                            expected_prompt_len=turn.prompt_len,
                        )
                        records.append(record)
                        await send_request(
                            client, cfg, session.prompt(k, replies, cfg.chat), turn.output_len, record, t0, count_tokens
                        )
                    bar.update(1)
                    if not record.success:
                        for j in range(k + 1, len(session.turns)):
                            records.append(
                                RequestRecord(
                                    session=index,
                                    turn=j,
                                    error=SKIPPED,
                                    start=record.start,
                                    expected_output_len=session.turns[j].output_len,
                                )
                            )
                            bar.update(1)
                        return
                    replies.append(record.output_text)

            tasks: list[asyncio.Task] = []

            async def dispatch_all() -> None:
                for i, (gap, session) in enumerate(zip(gaps, sessions)):
                    if gap:
                        await asyncio.sleep(gap)
                    tasks.append(asyncio.create_task(session_task(i, session)))
                await asyncio.gather(*tasks)

            try:
                await asyncio.wait_for(dispatch_all(), load.max_duration)
            except asyncio.TimeoutError:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
            duration = time.perf_counter() - t0
    records.sort(key=lambda r: (r.start, r.session, r.turn))
    return records, duration
