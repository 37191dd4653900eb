"""One device -> host read per step, counted without a GPU.

On CUDA every read of a device tensor's values by the host waits for the GPU to finish everything queued
before it: `.item()`, `int()` / `bool()` of a tensor (`if t.any():`), `.tolist()`, `.cpu()`, boolean-mask
indexing and `nonzero` (their output's size is data). A step should read the device once: the sampled
ids (with their logprobs when asked, in the same transfer).

On the CPU there is no device to wait for, so `DeviceReads` marks what would live on the device: the
model's parameters and buffers and the KV cache, and every tensor an op computes from a marked one (a
TorchDispatchMode sees each op). Host arrays (numpy, the scheduler's lists, tensors made from them) stay
unmarked. It counts the reads of marked tensors: `_local_scalar_dense` (what `.item()`, `int()`,
`float()` and `bool()` dispatch to), the data-dependent ops (`nonzero`, `masked_select`, `unique`,
boolean indexing, `repeat_interleave` without an output size) and the Python methods that read a CPU
tensor without dispatching (`tolist`, `numpy`, `cpu`, `to("cpu")`). A new `.item()` or `.tolist()` of
anything the model computed, anywhere in the step, is one more read.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from helpers import all_logits, make_core, make_runner, make_tiny_model
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakTensorKeyDictionary

from tokenmill.attention.metadata import build_common_metadata
from tokenmill.attention.triton_paged import TritonPagedBackend
from tokenmill.config import SpeculativeConfig
from tokenmill.engine.request import EngineCoreRequest
from tokenmill.layers.paged_forward import StepInputs
from tokenmill.loader import load_model
from tokenmill.sampling_params import SamplingParams

SHAPE_FROM_DATA = {
    torch.ops.aten.nonzero.default,
    torch.ops.aten.masked_select.default,
    torch.ops.aten._unique2.default,
    torch.ops.aten.unique_consecutive.default,
    torch.ops.aten.unique_dim.default,
}
HOST_READS = ("tolist", "numpy", "cpu", "__array__")


class DeviceReads(TorchDispatchMode):
    """Counts the host's reads of "device" tensors (see the module docstring) while active."""

    def __init__(self, roots: list[torch.Tensor]) -> None:
        super().__init__()
        self.marked = WeakTensorKeyDictionary()
        for t in roots:
            self.marked[t] = True
        self.reads: list[str] = []

    def _is_marked(self, t) -> bool:
        return isinstance(t, torch.Tensor) and (t in self.marked or (t._base is not None and t._base in self.marked))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        from_device = any(self._is_marked(t) for t in inputs)
        if from_device and self._reads_values(func, args, kwargs):
            self.reads.append(str(func))
        out = func(*args, **kwargs)
        if from_device or func is torch.ops.aten.copy_.default and self._is_marked(args[1]):
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self.marked[t] = True
        return out

    @staticmethod
    def _reads_values(func, args, kwargs) -> bool:
        if func is torch.ops.aten._local_scalar_dense.default or func in SHAPE_FROM_DATA:
            return True
        if func is torch.ops.aten.repeat_interleave.Tensor:
            return kwargs.get("output_size") is None
        if func in (torch.ops.aten.index.Tensor, torch.ops.aten.index_put.default, torch.ops.aten.index_put_.default):
            return any(i is not None and i.dtype == torch.bool for i in args[1])
        return False

    @contextlib.contextmanager
    def python_reads(self):
        """Count the Tensor methods that read a CPU tensor's values without dispatching an op."""
        originals = {name: getattr(torch.Tensor, name) for name in HOST_READS + ("to",)}

        def reader(name):
            def read(t, *args, **kwargs):
                if self._is_marked(t) and (name != "to" or _to_host(args, kwargs)):
                    self.reads.append(f"Tensor.{name}")
                return originals[name](t, *args, **kwargs)

            return read

        for name in originals:
            setattr(torch.Tensor, name, reader(name))
        try:
            yield
        finally:
            for name, method in originals.items():
                setattr(torch.Tensor, name, method)


def _to_host(args, kwargs) -> bool:
    target = kwargs.get("device", args[0] if args else None)
    return isinstance(target, (str, torch.device)) and torch.device(target).type == "cpu"


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama")
    make_tiny_model("llama-gqa-untied", directory)
    return str(directory)


@pytest.fixture(scope="module")
def core(llama):
    spec = SpeculativeConfig(num_speculative_tokens=3, disable_by_batch_size=8, min_acceptance=0.0)
    return make_core(llama, num_blocks=64, speculative=spec)


def _step_kind(sched) -> str:
    n = list(sched.num_scheduled_tokens.values())
    if sched.spec_token_ids:
        return "speculative"
    return "decode" if max(n) == 1 else "mixed" if min(n) == 1 else "prefill"


def test_every_step_reads_the_device_once(core):
    """Decode steps, steps mixing a prompt with decodes, and speculative (n-gram) verify steps, greedy
    and seeded sampling, with logprobs: each reads the device exactly once."""
    runner = core.executor.runner
    roots = [*runner.model.parameters(), *runner.model.buffers(), *runner.kv_caches]
    execute, steps = runner.execute, []

    def counted(sched, *args, **kwargs):
        counter = DeviceReads(roots)
        with counter, counter.python_reads():
            out = execute(sched, *args, **kwargs)
        if sched.num_scheduled_tokens:
            steps.append((_step_kind(sched), counter.reads))
        return out

    repeat = [5, 6, 7, 8] * 6  # n-gram lookup finds drafts in a repeating prompt
    greedy = SamplingParams(max_tokens=8, temperature=0.0, logprobs=2, ignore_eos=True)
    seeded = SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, seed=3, logprobs=1, ignore_eos=True)
    runner.execute = counted
    try:
        core.add_request(EngineCoreRequest("a", repeat, greedy))
        core.add_request(EngineCoreRequest("b", repeat[1:], seeded))
        core.step()
        core.step()
        # a prompt beside the others' decodes, then decoding alone
        core.add_request(EngineCoreRequest("c", list(range(40, 70)), SamplingParams(max_tokens=16, ignore_eos=True)))
        while core.has_unfinished():
            core.step()
    finally:
        del runner.execute
    assert {"decode", "mixed", "speculative"} <= {kind for kind, _ in steps}, steps
    bad = [(kind, reads) for kind, reads in steps if len(reads) != 1]
    assert not bad, f"steps that read the device other than once: {bad}"


def test_the_counter_sees_a_new_read():
    """Reads of what the model computes count, whatever the method; host tensors never do."""
    weight = torch.randn(4, 4)
    counter = DeviceReads([weight])
    host = torch.arange(4)
    with counter, counter.python_reads():
        y = weight @ torch.ones(4)
        y.tolist()
        int(y.argmax())
        y[y > 0]
        if (y > 100).any():
            pass
        y.cpu()
        host.tolist()
        int(host[1])
    assert counter.reads == [
        "Tensor.tolist",
        "aten._local_scalar_dense.default",
        "aten.index.Tensor",
        "aten._local_scalar_dense.default",
        "Tensor.cpu",
    ]


def test_step_inputs_fill_one_persistent_device_buffer():
    """Off the CPU the step's inputs are slices of one buffer, kept from step to step and grown when a
    step needs more (the meta device stands in for a GPU: no copy happens, the bookkeeping does)."""
    inputs = StepInputs(torch.device("meta"))
    inputs.reserve(8)
    buffer = inputs.staged
    ids, positions = _one_step(inputs, [np.arange(3), np.arange(3)])
    assert ids.device.type == "meta" and ids.shape == (3,) and positions.shape == (3,)
    assert ids._base is buffer and positions._base is buffer  # views of it: no allocation per step
    *_, slots = _one_step(inputs, [np.arange(5), np.arange(5), np.arange(5)])
    assert inputs.capacity == 16 and slots.shape == (5,)
    assert _one_step(StepInputs(torch.device("cpu")), [np.arange(2)])[0].tolist() == [0, 1]  # CPU: the array itself


def _one_step(inputs: StepInputs, arrays: list[np.ndarray]) -> list[torch.Tensor]:
    inputs.begin()
    staged = inputs.stage(arrays)
    inputs.send()
    return staged


class Copies(TorchDispatchMode):
    """Counts tensor copies (`copy_`: what a host-to-device transfer dispatches to) while active."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.ops.aten.copy_.default
        return func(*args, **(kwargs or {}))


def test_a_step_s_inputs_and_attention_metadata_go_up_in_one_copy():
    """The token ids, positions and slots of a step and the Triton backend's metadata of two windows
    (block table, lengths, tile maps: int32) are written into one staging buffer and reach the device
    buffer in one copy, as views of it, with the values of the metadata built on its own. The CPU stands
    in for the device with staging on (`direct=False`): the copy runs and its values arrive."""
    new, computed = np.array([1, 1, 7, 20]), np.array([5, 40, 0, 33])
    blocks = [[3], [9, 1, 4], [7], [2, 8, 6, 5]]
    common, positions = build_common_metadata(new, computed, blocks, 16, torch.device("cpu"))
    backend = TritonPagedBackend()
    alone = [backend.build_metadata(common, window) for window in (None, 13)]
    inputs = StepInputs(torch.device("cpu"), direct=False)
    inputs.reserve(256)
    for step in range(2):  # the staging buffer is reused once its copy is done
        copies = Copies()
        with copies:
            inputs.begin()
            ids, pos = inputs.stage([np.arange(29) + step, positions])
            common.stage = inputs.stage
            metas = [backend.build_metadata(common, window) for window in (None, 13)]
            inputs.send()
        assert copies.count == 1 and len(inputs.hosts) == 1
        buffer = inputs.staged.untyped_storage().data_ptr()
        assert ids.tolist() == list(range(step, 29 + step)) and pos.tolist() == positions.tolist()
        for meta, expected in zip(metas, alone):
            for name in ("block_table", "query_start_loc", "seq_lens", "tile_req", "tile_start"):
                got = getattr(meta, name)
                assert got.dtype == torch.int32 and got.untyped_storage().data_ptr() == buffer, name
                assert torch.equal(got, getattr(expected, name)), name
            assert (meta.block_m, meta.num_splits) == (expected.block_m, expected.num_splits)
    # a step larger than the reservation: what was staged goes up, the rest into a buffer twice as large
    inputs.begin()
    small, large = inputs.stage([np.arange(200), np.arange(300)])
    inputs.send()
    assert inputs.capacity == 512 and small.tolist() == list(range(200)) and large.tolist() == list(range(300))


def test_a_forward_from_the_staged_buffer_gives_the_same_logits(llama):
    """The model run on inputs that went up through the staging buffer (`direct=False` on the CPU: the
    copy runs) gives the logits of the inputs used in place, bit for bit."""
    runner = make_runner(load_model(llama, dtype="float32"))
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3]
    expected = all_logits(runner, prompt)
    runner.inputs = StepInputs(torch.device("cpu"), direct=False)
    assert torch.equal(all_logits(runner, prompt), expected)
    assert len(runner.inputs.hosts) == 1  # it went through the staging buffer
    with torch.inference_mode():
        _, common = runner.forward(np.array(prompt[:3]), np.array([3]), np.array([0]), [[[0]]])
    assert common.stage is None  # metadata built from it after the step's copy (a drafter's) goes up on its own
