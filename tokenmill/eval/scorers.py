"""Scorers: a text -> its tokens' offsets, logprobs and top-1 flags (`tasks.Scored`).

- `EngineScorer`: the engine in-process (`LLM`), prompt logprobs with max_tokens 0.
- `ServerScorer`: any OpenAI-compatible server, through /v1/completions with echo, logprobs=1 and
  max_tokens 0 (the legacy fields every such server has; `text_offset` places each token). A server
  that refuses max_tokens 0 is asked for one token, which is ignored.
"""

from __future__ import annotations

import httpx

from tokenmill.eval.tasks import Scored


class EngineScorer:
    def __init__(self, llm) -> None:
        self.llm = llm
        self.tokenizer = llm.get_tokenizer()

    def score(self, texts: list[str]) -> list[Scored]:
        from tokenmill import SamplingParams

        outs = self.llm.generate(texts, SamplingParams(max_tokens=0, prompt_logprobs=1), use_tqdm=len(texts) > 8)
        scored = []
        for text, out in zip(texts, outs):
            ids, entries = out.prompt_token_ids, out.prompt_logprobs
            pieces = [self.tokenizer.decode(ids[: i + 1], skip_special_tokens=False) for i in range(len(ids))]
            offsets = [len(pieces[i - 1]) if i else 0 for i in range(len(ids))]
            shift = len(pieces[-1]) - len(text)  # a BOS or prefix the tokenizer adds before the text
            scored.append(
                Scored(
                    [max(0, o - shift) for o in offsets],
                    [None if e is None else e[t].logprob for t, e in zip(ids, entries)],
                    [e is not None and e[t].rank == 1 for t, e in zip(ids, entries)],
                )
            )
        return scored


class ServerScorer:
    def __init__(
        self, base_url: str, model: str | None = None, api_key: str | None = None, timeout: float = 600.0
    ) -> None:
        self.url = base_url.rstrip("/") + "/completions"
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(headers=headers, timeout=timeout)
        self.model = model or self._first_model(base_url)
        self.max_tokens = 0

    def _first_model(self, base_url: str) -> str:
        return self._check(self._send("GET", base_url.rstrip("/") + "/models")).json()["data"][0]["id"]

    def _send(self, method: str, url: str, **kwargs) -> httpx.Response:
        try:
            return self.client.request(method, url, **kwargs)
        except httpx.HTTPError as e:
            raise ConnectionError(f"cannot reach {url}: {e}") from None

    @staticmethod
    def _check(r: httpx.Response) -> httpx.Response:
        if r.is_error:
            raise ConnectionError(f"{r.request.url} answered {r.status_code}: {r.text[:500]}")
        return r

    def score(self, texts: list[str]) -> list[Scored]:
        return [self._one(t) for t in texts]

    def _one(self, text: str) -> Scored:
        body = {
            "model": self.model,
            "prompt": text,
            "echo": True,
            "logprobs": 1,
            "temperature": 0,
            "max_tokens": self.max_tokens,
        }
        r = self._send("POST", self.url, json=body)
        if r.status_code == 400 and self.max_tokens == 0:  # a server without scoring-only requests
            self.max_tokens = 1
            return self._one(text)
        lp = self._check(r).json()["choices"][0]["logprobs"]
        offsets, logprobs, tops = lp["text_offset"], lp["token_logprobs"], lp["top_logprobs"]
        keep = [i for i, o in enumerate(offsets) if o < len(text)]  # drop a generated token
        greedy = [
            tops[i] is not None and logprobs[i] is not None and logprobs[i] >= max(tops[i].values()) - 1e-6
            for i in keep
        ]
        return Scored([offsets[i] for i in keep], [logprobs[i] for i in keep], greedy)
