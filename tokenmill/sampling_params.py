"""Per-request sampling parameters (mirrors vLLM's ``SamplingParams``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from tokenmill.structured.spec import ReasoningSpec, StructuredOutputSpec

# Temperatures below this are treated as greedy decoding (same threshold as vLLM).
_GREEDY_EPS = 1e-5
# Most top-N logprobs a request may ask for per generated token.
MAX_LOGPROBS = 20
# The seeds torch.Generator.manual_seed takes: any 64-bit value, signed or unsigned. Sample i of an n > 1
# request is seeded with seed + i, so seed + n - 1 must fit too: checked here, when the request is admitted,
# not when the model runner builds the generator in the middle of a step of other requests.
SEED_MIN, SEED_END = -(2**63), 2**64
# The sampler divides float32 logits by the temperature, and a token's logit by the repetition penalty (or
# multiplies a negative one by it). A temperature past float32's range becomes inf, and a masked token's
# -inf / inf is NaN; a penalty near 0 (or huge) sends a logit to +-inf, and a prompt may hold every token.
# Within these bounds every such logit stays finite (|logit| < 1e4 after 1e6), as -inf stays -inf.
MAX_TEMPERATURE = 3.0e38  # below float32's largest
REPETITION_PENALTY_RANGE = (1e-6, 1e6)
POOLING_KINDS = ("last", "mean")  # an embedding is the final hidden state of the last prompt token, or their mean


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass
class SamplingParams:
    """How to pick tokens for one request and when to stop it.

    ``top_k`` of 0 or -1 disables top-k; ``logprobs=N`` returns the top-N logprobs per
    generated token (plus the sampled one; 0 means only the sampled token's); ``prompt_logprobs=N``
    the same for every prompt token given the ones before it (``max_tokens=0`` then scores the
    prompt without generating);
    ``ignore_eos`` keeps generating past EOS (it does not stop EOS being sampled).
    ``structured_output`` constrains the output (JSON schema, regex, choice, grammar; see
    `tokenmill.structured`); ``reasoning`` tells the engine where a reasoning model's thinking ends
    (constraints start after it) and optionally caps it.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # logprob of each prompt token (and the top-N) given the ones before
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_output: StructuredOutputSpec | None = None
    reasoning: ReasoningSpec | None = None
    logit_bias: dict[int, float] | None = None  # added to the logits of these token ids, in [-100, 100]
    speculative: bool = True  # False: never draft tokens for this request (when the engine speculates)
    kv_transfer_id: str | None = None  # disaggregated prefill/decode: the KV transfer this request's prompt belongs to
    # embeddings: pool the prompt's final hidden states ("last" token or "mean") instead of generating
    # (with max_tokens 0); the engine returns the raw pooled vector, the server normalizes it
    pooling: str | None = None
    lora_name: str | None = None  # the LoRA adapter to run the request with (None: the base model)

    def __post_init__(self) -> None:
        # Normalise.
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, (list, tuple)):
            self.stop = list(self.stop)
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif isinstance(self.stop_token_ids, (list, tuple)):
            self.stop_token_ids = list(self.stop_token_ids)
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        def bad(field: str, what: str) -> None:
            raise ValueError(f"{field} {what}, got {getattr(self, field)!r}")

        if not _is_int(self.n) or self.n < 1:
            bad("n", "must be an int >= 1")
        if not _is_num(self.temperature) or not 0 <= self.temperature <= MAX_TEMPERATURE:
            bad("temperature", f"must be in [0, {MAX_TEMPERATURE:g}] (a float32)")
        if not _is_num(self.top_p) or not 0 < self.top_p <= 1:
            bad("top_p", "must be in (0, 1]")
        if not _is_int(self.top_k) or self.top_k < 0:
            bad("top_k", "must be an int >= 0 (or -1 to disable)")
        if not _is_num(self.min_p) or not 0 <= self.min_p <= 1:
            bad("min_p", "must be in [0, 1]")
        for field in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, field)
            if not _is_num(value) or not -2 <= value <= 2:
                bad(field, "must be in [-2, 2]")
        low, high = REPETITION_PENALTY_RANGE
        if not _is_num(self.repetition_penalty) or not low <= self.repetition_penalty <= high:
            bad("repetition_penalty", f"must be in [{low:g}, {high:g}]")
        if self.seed is not None and (not _is_int(self.seed) or not SEED_MIN <= self.seed <= SEED_END - self.n):
            bad(
                "seed",
                f"must fit in 64 bits, as must seed + n - 1 (sample i of n is seeded with seed + i): "
                f"an int in [-2**63, 2**64 - {self.n}]",
            )
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 0):
            bad("max_tokens", "must be an int >= 0 or None")
        if self.max_tokens == 0 and self.prompt_logprobs is None and self.pooling is None:
            bad("max_tokens", "can be 0 only to score the prompt (with prompt_logprobs, or echo and logprobs)")
        if self.pooling is not None and (self.pooling not in POOLING_KINDS or self.max_tokens != 0):
            bad("pooling", f"must be one of {POOLING_KINDS}, with max_tokens 0")
        if self.lora_name is not None and (not isinstance(self.lora_name, str) or not self.lora_name):
            bad("lora_name", "must be a non-empty string or None")
        if self.max_tokens == 0 and self.n != 1:
            bad("n", "must be 1 when max_tokens is 0 (the prompt is scored once)")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            bad("min_tokens", "must be an int >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", "must be a non-empty string or a list of non-empty strings")
        if not isinstance(self.stop_token_ids, list) or not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be a list of ints >= 0")
        for field in ("logprobs", "prompt_logprobs"):
            value = getattr(self, field)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                bad(field, f"must be an int in [0, {MAX_LOGPROBS}] or None")
        for field in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output", "speculative"):
            if not isinstance(getattr(self, field), bool):
                bad(field, "must be a bool")
        if self.structured_output is not None and not isinstance(self.structured_output, StructuredOutputSpec):
            bad("structured_output", "must be a StructuredOutputSpec or None")
        if self.reasoning is not None and not isinstance(self.reasoning, ReasoningSpec):
            bad("reasoning", "must be a ReasoningSpec or None")
        if self.logit_bias is not None and (
            not isinstance(self.logit_bias, dict)
            or not all(_is_int(t) and t >= 0 and _is_num(b) and -100 <= b <= 100 for t, b in self.logit_bias.items())
        ):
            bad("logit_bias", "must map token ids (ints >= 0) to biases in [-100, 100]")

    @property
    def needs_every_prompt_position(self) -> bool:
        """Whether the runner must compute every prompt position's output (prompt logprobs, mean
        pooling): such a request takes no prefix-cache hits, as cached blocks hold K/V only."""
        return self.prompt_logprobs is not None or self.pooling == "mean"

    @property
    def greedy(self) -> bool:
        """True when decoding is argmax (temperature ~ 0)."""
        return self.temperature < _GREEDY_EPS
