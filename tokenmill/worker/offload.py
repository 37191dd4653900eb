"""Hybrid CPU-GPU inference: weights kept in host memory beside a CUDA device (`OffloadConfig`).

`--cpu-offload-gb N`: about N GiB of whole decoder layers live in pinned host memory. The layers are
chosen before the model is built (`host_placement_planner`, on the model built on the meta device),
and built and loaded in host memory (`layers.host_placement`): their weights never touch the device,
so a model larger than the device starts. Their parameters point into two device slots (each as large
as the largest such layer); a layer's weights are copied into its slot on a side stream while the
layers before it run, and the layer waits for its copy only when it starts. The plan and the schedule are pure functions: `plan_weight_offload` spreads the offloaded layers
evenly over the model (a layer kept on the device runs between two streamed ones whenever there are
enough, and the copy hides behind it); `prefetch_schedule` says which copy starts when — the first
offloaded layer's at the step's start, each next one's as the one before it starts. Two slots suffice:
the copy into a slot starts only after everything queued before it (the slot's previous user, two
offloaded layers back, included) — the side stream waits for the compute stream first.

`--cpu-moe` / `--n-cpu-moe N`: the experts of every (or the first N) MoE layers are built and loaded on
the host and run there with the CPU expert code (a GGUF file's quantized experts keep their blocks and
run on the CPU block kernels, in float32); the router, attention, shared experts and dense layers stay
on the device, and each such layer's hidden states and router logits cross to the host and its routed
output comes back.

On a CPU "device" (the tests) everything works the same with host tensors on both sides and no streams,
so the bookkeeping (slots, views, the order of copies) is checked against the model without offload.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch
from torch import nn

from tokenmill.layers.fused_moe import FusedMoE
from tokenmill.layers.host_placement import NOTHING, HostPlacement

logger = logging.getLogger(__name__)

ALIGN = 256  # bytes: every tensor's offset in a slot (CUDA kernels assume aligned storage)


def plan_weight_offload(layer_bytes: list[int], budget_bytes: int) -> list[int]:
    """The decoder layers (by index) whose weights stay on the host: as many as fit in `budget_bytes`,
    spread evenly over the model so that device-resident layers sit between them."""
    for n in range(len(layer_bytes), 0, -1):
        chosen = spread(len(layer_bytes), n)
        if sum(layer_bytes[i] for i in chosen) <= budget_bytes:
            return chosen
    return []


def spread(num_layers: int, n: int) -> list[int]:
    """n of num_layers indices, evenly spaced and centred (each in the middle of its 1/n of the model)."""
    return [(2 * i + 1) * num_layers // (2 * n) for i in range(n)]


def prefetch_schedule(offloaded: list[int]) -> dict[int | None, int]:
    """When each offloaded layer's copy starts: {None (the step's start): the first, layer i (as it starts):
    the offloaded layer after it}."""
    return {before: layer for before, layer in zip([None, *offloaded], offloaded)}


def plan_cpu_moe(moe_layers: list[int], cpu_moe: bool, n_cpu_moe: int) -> list[int]:
    """The MoE layers (decoder layer indices) whose experts run on the host: all, or the first N."""
    ordered = sorted(moe_layers)
    return ordered if cpu_moe else ordered[:n_cpu_moe]


def layer_tensors(layer: nn.Module, kept: set[int] = frozenset()) -> list[torch.Tensor]:
    """A layer's streamed weights: its parameters but those in `kept` (ids: held by other modules too,
    or experts on the host). Buffers stay (counters the forward updates; small tables), and so do a
    weight format's tensors that are not parameters."""
    return [t for t in layer.parameters() if id(t) not in kept]


def kept_tensors(model: nn.Module, on_host: list[nn.Module]) -> set[int]:
    """Ids of the parameters the streaming leaves alone: those held under more than one name (a tied
    weight) and those of `on_host` (`--cpu-moe` experts, already on the host)."""
    seen, kept = set(), {id(t) for module in on_host for t in module.parameters()}
    for _, t in model.named_parameters(remove_duplicate=False):
        (kept if id(t) in seen else seen).add(id(t))
    return kept


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


class Copier:
    """The side stream of the copies and the events between it and the compute stream (CUDA); on the
    CPU the copies run at once and there is nothing to wait for."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None

    def copy(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]):
        """(host, device) pairs copied after everything queued so far; returns what to wait on."""
        if not self.cuda:
            for host, dev in pairs:
                dev.copy_(host)
            return None
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            for host, dev in pairs:
                dev.copy_(host, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        return done

    @staticmethod
    def wait(done) -> None:
        if done is not None:
            torch.cuda.current_stream().wait_event(done)


def host_placement_planner(offload) -> Callable[[nn.Module], HostPlacement]:
    """For `load_model`: what `offload` (an `OffloadConfig`) keeps in host memory, chosen on the model's
    shapes (built on the meta device): the MoE layers' experts --cpu-moe / --n-cpu-moe name, and as many
    decoder layers as --cpu-offload-gb holds, spread, counted without those experts."""

    def plan(model: nn.Module) -> HostPlacement:
        experts = host_experts(model, offload)
        if not offload.cpu_offload_gb:
            return HostPlacement(experts=frozenset(m.layer_index for m in experts))
        kept = kept_tensors(model, experts)
        sizes = [sum(t.nbytes for t in layer_tensors(layer, kept)) for layer in model_layers(model)]
        chosen = plan_weight_offload(sizes, int(offload.cpu_offload_gb * 2**30))
        if not chosen:
            logger.warning(
                "cpu offload: %.2f GiB holds no whole decoder layer (%d bytes the smallest); nothing offloaded",
                offload.cpu_offload_gb,
                min(sizes),
            )
        return HostPlacement(frozenset(chosen), frozenset(m.layer_index for m in experts))

    return plan


def model_layers(model: nn.Module) -> list[nn.Module]:
    layers = list(getattr(getattr(model, "model", None), "layers", None) or [])
    if not layers:
        raise ValueError("cpu_offload_gb, cpu_moe and n_cpu_moe need a model made of decoder layers")
    return layers


def host_experts(model: nn.Module, offload) -> list[FusedMoE]:
    """The MoE layers whose experts run on the host (--cpu-moe / --n-cpu-moe)."""
    moe = {m.layer_index: m for m in model.modules() if isinstance(m, FusedMoE)}
    if (offload.cpu_moe or offload.n_cpu_moe) and not moe:
        raise ValueError("cpu_moe / n_cpu_moe: the model has no MoE layers")
    return [moe[i] for i in plan_cpu_moe(list(moe), offload.cpu_moe, offload.n_cpu_moe)]


def to_device_but_parameters(layer: nn.Module, device: torch.device, skip: set[int]) -> None:
    """A layer built in host memory: its buffers and other tensors (a weight format's, counters) to the
    device, where its forward reads them; the parameters stay, to be streamed, and so do the modules in
    `skip` (ids: experts that run on the host)."""
    for module in layer.modules():
        if id(module) in skip:
            continue
        for name, t in list(vars(module).items()) + list(module._buffers.items()):
            if isinstance(t, torch.Tensor) and not isinstance(t, nn.Parameter) and t.device.type != device.type:
                setattr(module, name, t.to(device))


class StreamedLayers:
    """The offloaded layers of a model: host copies, device slots and the hooks that stream them."""

    def __init__(
        self, model: nn.Module, offloaded: list[int], device, kept: set[int], on_host: list[nn.Module]
    ) -> None:
        self.device, self.copier = torch.device(device), Copier(torch.device(device))
        layers, skip = model_layers(model), {id(m) for host in on_host for m in host.modules()}
        pin = self.device.type == "cuda"
        sizes = [sum(_aligned(t.nbytes) for t in layer_tensors(layers[i], kept)) for i in offloaded]
        slots = [torch.empty(max(sizes), dtype=torch.uint8, device=self.device) for _ in range(min(2, len(offloaded)))]
        self.pairs: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for m, i in enumerate(offloaded):
            slot, offset, pairs = slots[m % 2], 0, []
            to_device_but_parameters(layers[i], self.device, skip)
            for t in layer_tensors(layers[i], kept):
                host = t.detach().cpu()  # built there (`host_placement_planner`): no copy
                host = host.pin_memory() if pin else host
                view = slot[offset : offset + t.nbytes].view(t.dtype).view(t.shape)
                t.data = view  # the device storage it had is freed
                pairs.append((host, view))
                offset += _aligned(t.nbytes)
            self.pairs[i] = pairs
        for slot in slots:  # nothing valid until a layer's copy lands in it
            slot.fill_(0xFF)
        self.schedule, self.pending = prefetch_schedule(offloaded), {}
        model.register_forward_pre_hook(lambda *_: self._start(None))
        for i in offloaded:
            layers[i].register_forward_pre_hook(functools.partial(self._enter, i))
            layers[i].decode_parts = lambda: None  # no compiled decode step: it would skip the hook
        self.bytes = sum(t.nbytes for pairs in self.pairs.values() for t, _ in pairs)
        logger.info(
            "cpu offload: %.2f GiB of weights in host memory, decoder layers %s streamed through 2 slots of %.2f GiB",
            self.bytes / 2**30,
            offloaded,
            max(sizes) / 2**30,
        )

    def _start(self, before: int | None) -> None:
        layer = self.schedule.get(before)
        if layer is not None:
            self.pending[layer] = self.copier.copy(self.pairs[layer])

    def _enter(self, layer: int, module, args) -> None:
        if layer not in self.pending:  # a forward that did not start at the model's (its layers alone)
            self.pending[layer] = self.copier.copy(self.pairs[layer])
        self.copier.wait(self.pending.pop(layer))
        self._start(layer)


def run_experts_on_host(moe: FusedMoE, device: torch.device) -> None:
    """Have `moe`'s forward run its routed experts on the host (moved there, if the loader did not build
    them there) and the shared experts (an MLP of the device) on the device; the token counters stay on
    the device. Quantized experts (a GGUF file's blocks) run on the CPU block kernels, which take float32
    activations; dense ones in their own dtype."""
    quantized = isinstance(moe.w13, nn.ModuleList)
    if quantized and any(t.device.type != "cpu" for t in moe.buffers() if t is not moe.expert_tokens):
        raise ValueError(
            f"{moe.prefix}: --cpu-moe / --n-cpu-moe: quantized experts are built on the host by the loader "
            "(load_model's plan_host); these were loaded for the device"
        )
    counters = moe.expert_tokens
    moe.to("cpu")
    # on the device (a layer streamed from the host was built with them there), read with the other
    # layers' in one copy
    moe.expert_tokens = counters.to(device)
    host_forward = moe.forward

    def forward(x, router_logits, correction_bias=None, shared=None, shared_scale=None):
        bias = None if correction_bias is None else correction_bias.to("cpu")
        rows = x.to("cpu", torch.float32) if quantized else x.to("cpu")
        out = host_forward(rows, router_logits.to("cpu"), bias).to(device, x.dtype)
        if shared is not None:
            always = shared(x)
            out = out + (always if shared_scale is None else shared_scale * always)
        return out

    moe.forward = forward


def apply_offload(
    model: nn.Module, offload, device: torch.device, host: HostPlacement = NOTHING
) -> StreamedLayers | None:
    """Place the model's weights as `offload` (an `OffloadConfig`) asks: experts on the host, and the
    decoder layers `host.layers` (built in host memory by the loader, as `host_placement_planner` chose
    them) streamed from there. Returns the streaming (None: none)."""
    model_layers(model)  # refuses a model without decoder layers
    on_host = host_experts(model, offload)
    for m in on_host:
        run_experts_on_host(m, device)
    if on_host:
        logger.info("cpu moe: the experts of layers %s run on the host", [m.layer_index for m in on_host])
    if not host.layers:
        return None
    return StreamedLayers(model, sorted(host.layers), device, kept_tensors(model, on_host), on_host)
