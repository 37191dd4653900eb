"""CUDA graphs for decode steps: at start, the model's forward over a batch of decodes is captured once per
padded batch size (1, 2, 4, 8, 16, 24, ... up to `max_num_seqs`); a step of n decodes then copies its
inputs into static buffers, replays the graph of the smallest size >= n and reads the first n rows out.
A decode step of a small batch is otherwise ~10 kernel launches per layer, each costing more on the host
than on the GPU.

Everything a replay reads lives at fixed addresses: token ids, positions, slots, context lengths and every
pool's block table are slices of one int64 device buffer, filled by one non-blocking copy from one pinned
host buffer per step (the step's only host -> device copy). The Triton backend's metadata is built over
those slices at capture; its split count is fixed per size (the kernel sizes its slices from the context
length it reads, so one graph serves every length). Padding rows decode token 0 with slot -1 (the KV write
kernel skips them) and a context of one key (block 0, read, never written).

`EagerGraph` stands in for `torch.cuda.CUDAGraph` off the GPU: its replay re-runs the captured function on
the same static buffers, so the bookkeeping (padding, staging, slicing) is tested on CPU.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from tokenmill.attention.kv_quant import is_quantized
from tokenmill.layers.forward_context import ForwardContext, set_forward_context

logger = logging.getLogger(__name__)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, then every multiple of 8, up to and including `max_num_seqs`."""
    return sorted({s for s in (1, 2, 4) if s < max_num_seqs} | set(range(8, max_num_seqs, 8)) | {max_num_seqs})


def padded_size(n: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds n decodes (None: more than the largest)."""
    return next((s for s in sizes if s >= n), None)


class CudaGraph:
    """One captured graph; every size shares one memory pool (their activations never live at once)."""

    def __init__(self, pool) -> None:
        self.graph, self.pool = torch.cuda.CUDAGraph(), pool

    def capture(self, fn):
        with torch.cuda.graph(self.graph, pool=self.pool):
            return fn()

    def replay(self) -> None:
        self.graph.replay()


class EagerGraph:
    """A graph's stand-in without CUDA: replay runs the function again into the captured output."""

    def __init__(self, pool=None) -> None:
        self.fn = self.out = None

    def capture(self, fn):
        self.fn, self.out = fn, fn()
        return self.out

    def replay(self) -> None:
        self.out.copy_(self.fn())


class DecodeGraphs:
    """The captured decode steps of a `PagedForward` (its model, caches and Triton backend)."""

    def __init__(self, runner, max_num_seqs: int, max_model_len: int, graph_class=None) -> None:
        self.runner, self.sizes = runner, capture_sizes(max_num_seqs)
        self.graph_class = graph_class or (CudaGraph if runner.device.type == "cuda" else EagerGraph)
        config = runner.kv_cache_config
        n, pools = self.sizes[-1], len(config.pool_blocks)
        self.block_size, self.width = config.block_size, -(-max_model_len // config.block_size)
        self.max_model_len = max_model_len
        # ids, positions, slots, context lengths (n each), then a [n, width] block table per pool
        self.length = 4 * n + pools * n * self.width
        device = runner.device
        self.static = torch.zeros(self.length, dtype=torch.int64, device=device)
        self.staging = torch.zeros(self.length, dtype=torch.int64, pin_memory=device.type == "cuda")  # host
        self.host = self.staging.numpy()
        self.ids, self.positions, self.slots, self.seq_lens = self.static[: 4 * n].view(4, n)
        self.tables = self.static[4 * n :].view(pools, n, self.width)
        self.query_start_loc = torch.arange(n + 1, device=device)
        self.tile_req, self.tile_start = (
            torch.arange(n, device=device),
            torch.zeros(n, dtype=torch.int64, device=device),
        )
        self.graphs, self.outputs = {}, {}
        self.pool = torch.cuda.graph_pool_handle() if self.graph_class is CudaGraph else None

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    def fits(self, num_new, block_ids: list[list[list[int]]]) -> bool:
        """Whether a step is one these graphs run: decodes only, few enough, block tables no wider."""
        return (
            len(num_new) <= self.max_size
            and (num_new == 1).all()
            and all(len(table) <= self.width for tables in block_ids for table in tables)
        )

    def _context(self, size: int) -> ForwardContext:
        from tokenmill.attention.triton_paged import TritonAttentionMetadata, num_splits_for  # imports Triton

        keys = self.runner.group_keys
        splits = num_splits_for(size, self.max_model_len)
        metas = {
            (pool, window): TritonAttentionMetadata(
                self.slots[:size],
                self.tables[pool, :size],
                self.query_start_loc[: size + 1],
                self.seq_lens[:size],
                self.tile_req[:size],
                self.tile_start[:size],
                1,
                splits if window is None else num_splits_for(size, min(window, self.max_model_len)),
                window,
            )
            for pool, window in set(keys)
        }
        return ForwardContext({g: metas[key] for g, key in enumerate(keys)})

    def _stage(self, input_ids: np.ndarray, num_computed: np.ndarray, block_ids: list[list[list[int]]]) -> None:
        """This step's decodes into the pinned buffer (the rest: padding), then one copy to the device."""
        n, m = len(input_ids), self.max_size
        host = self.host
        host[: 4 * m] = 0
        host[2 * m : 3 * m] = -1  # padding rows' slots: written nowhere
        host[3 * m : 4 * m] = 1  # and a context of one key
        host[:n] = input_ids
        host[m : m + n] = num_computed
        tables = host[4 * m :].reshape(-1, m, self.width)
        tables[:] = 0
        for r, per_pool in enumerate(block_ids):
            for pool, table in enumerate(per_pool):
                tables[pool, r, : len(table)] = table
        pos = num_computed
        host[2 * m : 2 * m + n] = (
            tables[0, np.arange(n), pos // self.block_size] * self.block_size + pos % self.block_size
        )
        host[3 * m : 3 * m + n] = num_computed + 1
        self.static.copy_(self.staging, non_blocking=True)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first (the pool's memory is sized by the first)."""
        model = self.runner.model
        for size in reversed(self.sizes):
            self._stage(np.zeros(0, np.int64), np.zeros(0, np.int64), [])
            context = self._context(size)

            def forward(size=size, context=context):
                with set_forward_context(context):
                    return model(self.ids[:size], self.positions[:size])

            if self.graph_class is CudaGraph:  # warm: kernels compiled, the allocator settled outside the capture
                forward()
            graph = self.graph_class(self.pool)
            self.outputs[size] = graph.capture(forward)
            self.graphs[size] = graph

    def run(self, input_ids: np.ndarray, num_computed: np.ndarray, block_ids: list[list[list[int]]]) -> torch.Tensor:
        """The final hidden states of a step of len(input_ids) <= max_size decodes."""
        size = padded_size(len(input_ids), self.sizes)
        self._stage(input_ids, num_computed, block_ids)
        self.graphs[size].replay()
        return self.outputs[size][: len(input_ids)]


def eager_reason(runner, config) -> str | None:
    """Why the runner's decode steps run eagerly (None: they are captured). Graphs apply on CUDA, without
    --enforce-eager, in one process, on the Triton backend over float caches, for a model whose decode
    forward has no side inputs or outputs (no drafter that reads hidden states) and never waits for the
    device (quantized MoE experts run one by one, their token counts read on the host; dense ones run in
    the Triton grouped GEMM)."""
    checks = (  # in order, each asked only when those before it pass: a reason, or False
        lambda: runner.device.type != "cuda" and "not on CUDA",
        lambda: config.enforce_eager and "--enforce-eager",
        lambda: config.offload.active and "host work in the step: --cpu-offload-gb / --cpu-moe",
        lambda: config.parallel.world_size > 1 and "several processes",
        lambda: runner.backend.name != "triton-paged" and f"the {runner.backend.name} attention backend",
        lambda: any(is_quantized(g.spec.dtype) for g in runner.kv_cache_config.groups) and "a quantized KV cache",
        lambda: (
            runner.drafter is not None and config.speculative.method != "ngram" and "a drafter that reads hidden states"
        ),
        lambda: any(isinstance(m.w13, torch.nn.ModuleList) for m in runner.moe_layers) and "quantized MoE experts",
    )
    return next((why for check in checks if (why := check())), None)


def capture_decode_graphs(runner, config) -> DecodeGraphs | None:
    """The runner's decode graphs, when they apply (`eager_reason`, said in the log on CUDA). A capture
    that fails anyway leaves the runner eager, saying why."""
    why = eager_reason(runner, config)
    if why is not None:
        if runner.device.type == "cuda":
            logger.info("CUDA graphs: off, decode steps run eagerly (%s)", why)
        return None
    graphs = DecodeGraphs(
        runner,
        config.scheduler.max_num_seqs,
        config.scheduler.max_model_len or runner.model_config.max_position_embeddings,
    )
    try:
        graphs.capture()
    except RuntimeError as e:
        logger.warning("CUDA graphs: capture failed, decode steps run eagerly (%s)", e)
        return None
    logger.info("CUDA graphs: decode steps of %s sequences captured", ", ".join(map(str, graphs.sizes)))
    return graphs
