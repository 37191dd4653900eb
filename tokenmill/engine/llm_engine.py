"""LLMEngine: tokenizer + engine core + output processor in one process (the Python API's engine)."""

from __future__ import annotations

import logging
import time

from tokenmill.config import EngineConfig
from tokenmill.engine.core import EngineCore
from tokenmill.engine.output_processor import OutputProcessor, RequestOutput, child_request_id
from tokenmill.executor import executor_for
from tokenmill.sampling_params import SamplingParams
from tokenmill.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        executor = executor_for(config)
        self.model_config = executor.model_config
        self.model_name = executor.source.name
        self.tokenizer = load_tokenizer(executor.source)
        self.core = EngineCore(config, executor, self.tokenizer.eos_token_ids, self._tokenizer_data)
        self.processor = OutputProcessor(self.tokenizer)
        logger.info("KV cache capacity: %d tokens", self.core.capacity_tokens)

    def _tokenizer_data(self):
        from tokenmill.structured.backend import TokenizerData

        return TokenizerData.from_tokenizer(self.tokenizer)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> None:
        """Queue a prompt (text or token ids). Raises ValueError if it can never be served (including an
        invalid structured-output schema, regex or grammar)."""
        params = params or SamplingParams()
        if params.structured_output is not None:
            from tokenmill.structured.spec import check_spec

            check_spec(params.structured_output)
        if isinstance(prompt, str):
            text, token_ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, token_ids = None, list(prompt)
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        children = self.processor.add_request(request_id, text, token_ids, params, arrival, priority)
        try:
            for child in children:
                self.core.add_request(child)
        except ValueError:
            self.core.abort_requests([c.request_id for c in children])
            self.processor.abort(request_id)
            raise

    def abort_request(self, request_id: str) -> None:
        state = self.processor.abort(request_id)
        if state is not None:
            n = len(state.outputs)
            self.core.abort_requests([child_request_id(request_id, i, n) for i in range(n)])

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished()

    def step(self) -> list[RequestOutput]:
        outputs, to_abort = self.processor.process(self.core.step())
        if to_abort:
            self.core.abort_requests(to_abort)
        return outputs
