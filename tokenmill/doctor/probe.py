"""The doctor's own traffic: a short, bounded probe in four phases, each aimed at one limit.

1. single: one short request alone (the baseline TTFT and decode step, and text for n-gram acceptance);
2. shared prefix: one request with a long prefix, then `shared` more with the same prefix at once (what
   a prefix cache should serve);
3. concurrency: `concurrency` short requests at once (queueing, the KV pool, --max-num-seqs);
4. long prompt: two decoding streams, then a long prompt while they decode (how much its prefill
   stalls them, and how fast a long prompt prefills); the streams stop when it has its tokens.

Prompts are words from a fixed list (about one token each in BPE vocabularies), sized from the
server's context limit (`max_model_len` in /v1/models, 2048 when absent). Every request is bounded
in tokens; the whole probe by `seconds` (phases not reached are reported as skipped).
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field

import httpx

from tokenmill.bench.client import EndpointConfig, send_request
from tokenmill.bench.metrics import RequestRecord

WORDS = (
    "the of and to in is was for on that with as by at from his her they this have had are but not be "
    "one all were we when there can an which she their said if will each about how up out them then "
    "many some so these would other into has more two like him see time could no make than first been "
    "its who now people my made over did down only way find use may water long little very after words "
    "called just where most know get through back much before go good new write our used me man too any "
    "day same right look think also around another came come work three word must because does part even "
    "place well such here take why things help put years different away again off went old number great "
    "tell men say small every found still between name should home big give air line set own under read "
    "last never us left end along while might next sound below saw something thought both few those always "
    "looked show large often together asked house world going want school important until form food keep"
).split()
SHORT_WORDS = 32  # a short request's prompt
LONG_TOKENS = 4  # the long prompt only needs its first tokens


@dataclass
class ProbeSettings:
    concurrency: int = 8
    shared: int = 3  # requests after the first that share its prefix
    seconds: float = 60.0  # the whole probe, at most
    output_tokens: int = 32  # max_tokens of the short requests
    long_words: int = 1024  # the long prompt, at most (and at most 60% of the context limit)


@dataclass
class ProbeResult:
    context_limit: int
    single: RequestRecord | None = None
    prefix_first: RequestRecord | None = None
    prefix_rest: list[RequestRecord] = field(default_factory=list)
    prefix_words: int = 0
    concurrent: list[RequestRecord] = field(default_factory=list)
    streams: list[RequestRecord] = field(default_factory=list)  # decoding while the long prompt arrived
    long: RequestRecord | None = None
    long_sent_at: float | None = None  # seconds after the probe started
    skipped: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)  # error texts of failed requests
    texts: list[tuple[str, str]] = field(default_factory=list)  # (prompt, output) pairs for n-gram acceptance


def words(n: int, rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(max(n, 1)))


def context_limit(base_url: str, model: str, headers: dict) -> int:
    """The served model's `max_model_len` from /v1/models (tokenmill: already capped by the KV pool)."""
    root = base_url.rstrip("/").removesuffix("/v1")
    try:
        data = httpx.get(f"{root}/v1/models", headers=headers, timeout=10).json()["data"]
        entry = next((m for m in data if m.get("id") == model), data[0])
        return int(entry.get("max_model_len") or 2048)
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        return 2048


def run_probe(endpoint: EndpointConfig, settings: ProbeSettings, limit: int, seed: int = 0) -> ProbeResult:
    return asyncio.run(_probe(endpoint, settings, limit, seed))


async def _probe(endpoint: EndpointConfig, settings: ProbeSettings, limit: int, seed: int) -> ProbeResult:
    rng = random.Random(seed)
    result = ProbeResult(context_limit=limit)
    # sizes that fit the limit with room for the outputs (words run a little over a token each)
    short = min(SHORT_WORDS, max(limit // 5, 4))
    short_out = min(settings.output_tokens, max(limit // 5, 2))
    result.prefix_words = min(256, max(limit // 4, 16))
    long_words = min(settings.long_words, int(limit * 0.6))
    t0 = time.perf_counter()
    deadline = t0 + settings.seconds
    limits = httpx.Limits(max_connections=settings.concurrency + 4)
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:

        async def send(prompt: str, max_tokens: int) -> RequestRecord:
            record = RequestRecord(expected_output_len=max_tokens)
            await send_request(client, endpoint, prompt, max_tokens, record, t0)
            if record.success:
                result.texts.append((prompt, record.output_text))
            else:
                result.failed.append(record.error)
            return record

        async def phase(name: str, work) -> None:
            left = deadline - time.perf_counter()
            if left <= 0:
                result.skipped.append(name)
                return
            try:
                await asyncio.wait_for(work(), left)
            except asyncio.TimeoutError:
                result.skipped.append(f"{name} (cut at the probe's {settings.seconds:g} s)")

        async def single() -> None:
            result.single = await send(words(short, rng), short_out)

        async def shared_prefix() -> None:
            prefix = words(result.prefix_words, rng)
            result.prefix_first = await send(f"{prefix} {words(8, rng)}", 4)
            result.prefix_rest = list(
                await asyncio.gather(*(send(f"{prefix} {words(8, rng)}", 4) for _ in range(settings.shared)))
            )

        async def concurrency() -> None:
            prompts = [words(short, rng) for _ in range(settings.concurrency)]
            result.concurrent = list(await asyncio.gather(*(send(p, short_out) for p in prompts)))

        async def long_prompt() -> None:
            streams = [RequestRecord() for _ in range(2)]
            # long enough to decode through the whole prefill; stopped once the long prompt has its tokens
            tasks = [
                asyncio.create_task(send_request(client, endpoint, words(short, rng), 8 * short_out, r, t0))
                for r in streams
            ]
            while not all(r.ttft is not None or r.error for r in streams) and not all(t.done() for t in tasks):
                await asyncio.sleep(0.005)  # both decoding before the long prompt arrives
            result.long_sent_at = time.perf_counter() - t0
            try:
                result.long = await send(words(long_words, rng), LONG_TOKENS)
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                result.streams = streams

        for name, work in (
            ("single", single),
            ("shared prefix", shared_prefix),
            ("concurrency", concurrency),
            ("long prompt", long_prompt),
        ):
            await phase(name, work)
    return result
