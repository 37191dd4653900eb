"""`LLM`: the offline Python API, shaped like vLLM's."""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from tokenmill.config import EngineConfig
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.engine.output_processor import RequestOutput
from tokenmill.engine_args import EngineArgs
from tokenmill.sampling_params import SamplingParams

Prompt = str | list[int] | dict


class LLM:
    """Load a model and generate for many prompts at once with continuous batching.

    >>> llm = LLM(model="smollm2-135m-instruct")
    >>> llm.generate(["The capital of France is"], SamplingParams(max_tokens=8))[0].outputs[0].text
    """

    def __init__(self, model: str | None = None, *, engine_config: EngineConfig | None = None, **kwargs: Any) -> None:
        """`kwargs`: any `EngineArgs` field (the `serve` flags' names: `enable_prefix_caching`,
        `scheduling_policy`, `kv_transfer_config`, `tensor_parallel_size`, ...), checked by the same
        configuration tree as the flags; `engine_config` gives the whole configuration instead."""
        if engine_config is not None and (kwargs or model is not None):
            raise TypeError("LLM() takes engine_config or engine arguments, not both")
        config = engine_config or EngineArgs.from_kwargs("LLM()", model=model, **kwargs).create_engine_config()
        self.engine = LLMEngine(config)
        unfit = self.engine.core.max_model_len_error()
        if unfit:
            raise ValueError(unfit)
        self._ids = itertools.count()
        # worker processes / Ray actors and the process group go when the LLM does, or at exit
        self._release = weakref.finalize(self, _release, self.engine)

    def shutdown(self) -> None:
        """Release what this LLM started: tensor- or pipeline-parallel workers (processes or Ray actors),
        the torch.distributed process group, a KV-transfer connection. A second call does nothing; the
        LLM cannot generate afterwards. Also run by `with LLM(...) as llm:` and when the LLM is collected."""
        self._release()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for each prompt (text, token ids, or {"prompt_token_ids": [...]}); outputs in
        prompt order. `sampling_params` is one for all prompts or a list with one per prompt."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"sampling_params has {len(params)} entries for {len(prompts)} prompts")
        return self._run([(_prompt_input(p), sp) for p, sp in zip(prompts, params)], use_tqdm)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Chat completion for one conversation (a list of messages) or several, through the
        model's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.engine.tokenizer
        prompts = [tok.apply_chat_template(c, add_generation_prompt=add_generation_prompt) for c in conversations]
        return self.generate([{"prompt_token_ids": p} for p in prompts], sampling_params, use_tqdm)

    def _run(self, requests: list[tuple[str | list[int], SamplingParams]], use_tqdm: bool) -> list[RequestOutput]:
        if not self._release.alive:
            raise RuntimeError("this LLM was shut down; create a new one to generate")
        ids = []
        try:
            for prompt, params in requests:
                rid = str(next(self._ids))
                self.engine.add_request(rid, prompt, params)
                ids.append(rid)
        except ValueError:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        done: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="Generating", disable=not use_tqdm, unit="req") as bar:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        bar.update(1)
        return [done[rid] for rid in ids]


def _prompt_input(prompt: Prompt) -> str | list[int]:
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"])
        return prompt["prompt"]
    return prompt


def _release(engine: LLMEngine) -> None:
    engine.core.executor.close()
