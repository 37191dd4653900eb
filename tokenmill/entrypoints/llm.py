"""`LLM`: the offline Python API, shaped like vLLM's."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from tqdm.auto import tqdm

from tokenmill.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig, SpeculativeConfig
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.engine.output_processor import RequestOutput
from tokenmill.sampling_params import SamplingParams

Prompt = str | list[int] | dict


class LLM:
    """Load a model and generate for many prompts at once with continuous batching.

    >>> llm = LLM(model="smollm2-135m-instruct")
    >>> llm.generate(["The capital of France is"], SamplingParams(max_tokens=8))[0].outputs[0].text
    """

    def __init__(self, model: str | None = None, dtype: str = "auto", device: str = "cpu", seed: int = 0,
                 quantization: str = "auto",
                 max_num_seqs: int = 64, max_num_batched_tokens: int = 512, max_model_len: int | None = None,
                 kv_cache_memory: float = 1.0, num_kv_blocks: int | None = None, block_size: int = 16,
                 kv_cache_dtype: str = "auto", speculative_config: dict | None = None,
                 tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1,
                 distributed_executor_backend: str = "mp", engine_config: EngineConfig | None = None,
                 enable_expert_parallel: bool = False) -> None:
        """The keyword arguments build the engine's configuration; `engine_config` gives all of it instead."""
        config = engine_config or EngineConfig(
            model=model, dtype=dtype, device=device, seed=seed, quantization=quantization,
            cache=CacheConfig(block_size=block_size, kv_cache_memory_gib=kv_cache_memory, num_blocks=num_kv_blocks,
                              cache_dtype=kv_cache_dtype),
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                      max_model_len=max_model_len),
            speculative=SpeculativeConfig(**speculative_config) if speculative_config else None,
            parallel=ParallelConfig(tensor_parallel_size=tensor_parallel_size, pipeline_parallel_size=pipeline_parallel_size,
                                    distributed_executor_backend=distributed_executor_backend,
                                    enable_expert_parallel=enable_expert_parallel),
        )
        self.engine = LLMEngine(config)
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt], sampling_params: SamplingParams |
                 Sequence[SamplingParams] | None = None, use_tqdm: bool = True) -> list[RequestOutput]:
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

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Chat completion for one conversation (a list of messages) or several, through the
        model's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.engine.tokenizer
        prompts = [tok.apply_chat_template(c, add_generation_prompt=add_generation_prompt) for c in conversations]
        return self.generate([{"prompt_token_ids": p} for p in prompts], sampling_params, use_tqdm)

    def _run(self, requests: list[tuple[str | list[int], SamplingParams]], use_tqdm: bool) -> list[RequestOutput]:
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
