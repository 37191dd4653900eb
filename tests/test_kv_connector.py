"""The KV connector seam (`tokenmill.kv_transfer.base`) with real engine cores on a tiny random Llama:
a host-memory block store written against the interface alone — the shape of the KV-cache tiers to
come — saves full prompt blocks in one engine and supplies them to another whose pool never saw them
(greedy tokens unchanged, those tokens not computed again); a disaggregated consumer that already holds
a prompt's first blocks in its prefix cache loads only the rest of the transferred KV."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import pytest
import torch
from helpers import make_core, make_tiny_model, run_core
from test_server_utils import free_port

from tokenmill.engine.core import EngineCore
from tokenmill.executor import UniProcExecutor
from tokenmill.kv_transfer.base import (
    BlockTable,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorScheduler,
    KVConnectorWorker,
    cache_tensors,
)
from tokenmill.kv_transfer.config import KVTransferConfig
from tokenmill.kv_transfer.connector import BLOCK_DIM
from tokenmill.loader import load_model
from tokenmill.sampling_params import SamplingParams

BLOCK = 16
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@dataclass
class StoreMetadata(KVConnectorMetadata):
    save: list[tuple[list[tuple], BlockTable]] = field(default_factory=list)  # (block keys, block table)
    load: list[tuple[list[tuple], BlockTable, int]] = field(default_factory=list)  # (block keys, table, first block)


class StoreScheduler(KVConnectorScheduler):
    """Keys of the stored blocks: a block's key is the prompt up to its end (a chained prefix key)."""

    def __init__(self, stored: set[tuple], kv) -> None:
        super().__init__()
        self.stored, self.kv, self.bs, self.meta = stored, kv, kv.block_size, StoreMetadata()

    def _keys(self, request, first: int, end: int) -> list[tuple]:
        return [tuple(request.prompt_token_ids[: (i + 1) * self.bs]) for i in range(first, end)]

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> int:
        first = num_computed_tokens // self.bs
        found = first
        for key in self._keys(request, first, (request.num_prompt_tokens - 1) // self.bs):
            if key not in self.stored:
                break
            found += 1
        return found * self.bs - num_computed_tokens

    def update_state_after_alloc(self, request, blocks, num_computed_tokens, num_external_tokens) -> None:
        if num_external_tokens:
            first = num_computed_tokens // self.bs
            end = (num_computed_tokens + num_external_tokens) // self.bs
            self.meta.load.append((self._keys(request, first, end), blocks, first))

    def build_connector_meta(self, sched, requests):
        meta, self.meta = self.meta, StoreMetadata()
        for rid, num_new in sched.num_scheduled_tokens.items():
            request = requests[rid]
            if request.num_computed_tokens < request.num_prompt_tokens <= request.num_computed_tokens + num_new:
                keys = self._keys(request, 0, request.num_prompt_tokens // self.bs)
                meta.save.append((keys, self.kv.block_ids(rid)))
                self.stored.update(keys)
        return meta if meta.save or meta.load else None


class StoreWorker(KVConnectorWorker):
    """Block contents by key, in host memory (shared by the engines of a test)."""

    def __init__(self, tensors, blocks: dict[tuple, list[torch.Tensor]]) -> None:
        self.tensors, self.blocks = tensors, blocks

    def start_load_kv(self, meta: StoreMetadata) -> None:
        for keys, table, first in meta.load:
            for i, key in enumerate(keys, first):
                for (t, pool), saved in zip(self.tensors, self.blocks[key]):
                    t.select(BLOCK_DIM, table[pool][i]).copy_(saved)

    def wait_for_save(self, meta: StoreMetadata) -> None:
        for keys, table in meta.save:
            for i, key in enumerate(keys):
                self.blocks.setdefault(key, [t.select(BLOCK_DIM, table[pool][i]).clone() for t, pool in self.tensors])

    def get_finished(self, idle: bool) -> KVConnectorOutput:
        return KVConnectorOutput()


def install_store(core: EngineCore, stored: set, blocks: dict) -> None:
    """Give a core the store connector (both halves), as a connector chosen by the config would be."""
    core.kv_connector = core.scheduler.connector = StoreScheduler(stored, core.kv)
    core.executor.kv_connector = StoreWorker(cache_tensors(core.executor.runner), blocks)


@pytest.fixture(scope="module")
def random_model(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-random-connector")
    make_tiny_model("llama-gqa-untied", directory)
    return directory


def _plain(model_dir):
    """An engine core on its own copy of the model (a model binds the KV cache of the last core built on it)."""
    return make_core(str(model_dir), num_blocks=48, max_num_batched_tokens=32, loaded=load_model(str(model_dir)))


def test_a_block_store_connector_supplies_prompt_blocks_another_engine_saved(random_model):
    prompt = list(range(5, 58))  # 53 tokens: 3 full blocks, the 4th partial
    sharing = prompt[: 2 * BLOCK] + [200, 201, 202, 203, 204]  # the first 2 blocks only
    expected = run_core(_plain(random_model), [prompt, sharing], GREEDY)
    stored, blocks = set(), {}
    saver = _plain(random_model)
    install_store(saver, stored, blocks)
    assert run_core(saver, [prompt], GREEDY)["0"] == expected["0"]
    assert len(blocks) == 3
    loader = _plain(random_model)  # its own pool: no prefix-cache hits for these prompts
    install_store(loader, stored, blocks)
    first_steps = []
    got = run_core(
        loader,
        [prompt, sharing],
        GREEDY,
        on_step=lambda c: first_steps.append(dict(c.last_schedule.num_scheduled_tokens)),
    )
    assert got == expected
    # the stored blocks counted as computed: prompt 53 - 48 = 5 tokens, the other 37 - 32 = 5
    assert first_steps[0] == {"0": 5, "1": 5}
    assert loader.stats().prefix_cache_hits == 48 + 32
    assert loader.kv.num_free_blocks == loader.kv.num_blocks


def test_a_consumer_loads_only_the_kv_beyond_its_own_prefix_hits(random_model):
    port = free_port()

    def core(role):
        config = dataclasses.replace(
            _plain(random_model).config,
            kv_transfer=KVTransferConfig(role, "SharedMemoryConnector", kv_port=port, kv_timeout=5),
        )
        return EngineCore(config, UniProcExecutor(config, load_model(str(random_model))), set())

    producer, consumer = core("producer"), core("consumer")
    first = list(range(5, 60))
    second = first[: 2 * BLOCK] + list(range(100, 120))  # shares 2 full blocks with the first
    expected = run_core(_plain(random_model), [first, second], GREEDY)
    loads = []
    for i, prompt in enumerate([first, second]):
        params = dataclasses.replace(GREEDY, kv_transfer_id=f"t{i}")
        run_core(producer, [prompt], params)
        out = run_core(
            consumer,
            [prompt],
            params,
            on_step=lambda c: loads.append(
                c.last_schedule.kv_connector_metadata.load if c.last_schedule.kv_connector_metadata else {}
            ),
        )
        assert out["0"] == expected[str(i)]
    starts = [first_block for load in loads for _, first_block in load.values()]
    assert starts == [0, 2]  # the second prompt's first 2 blocks came from the consumer's prefix cache
    assert consumer.stats().kv_transfers == producer.stats().kv_transfers == 2
    for c in (producer, consumer):
        assert c.kv.num_free_blocks == c.kv.num_blocks
        c.executor.kv_connector.close()
