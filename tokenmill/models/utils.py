"""Loading checkpoint tensors into a model built from `tokenmill.layers`, shared by model files.

A checkpoint tensor (HF naming, e.g. `model.layers.0.self_attn.q_proj.weight`) goes to a module and
a shard: fused layers hold several checkpoint modules (`packed_modules` of the model class, e.g.
q/k/v -> qkv_proj shards 0/1/2), and an MoE layer's `experts.N.<projection>` go to its stacked
expert tensors (`layers.fused_moe.EXPERT_PROJECTIONS`). A model class may rename checkpoint
modules (`checkpoint_renames`, e.g. Mixtral's `block_sparse_moe` -> `mlp`). Expert biases
(`experts.N.<projection>.bias`) go to the experts' stacked biases. Modules with a
`weight_loader` (linear layers, embeddings, experts) load it themselves in their own format; other
parameters are copied. Every expected tensor must arrive.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator

from torch import nn

from tokenmill.distributed.pipeline import PPMissingLayer
from tokenmill.layers import host_placement
from tokenmill.layers.embedding import LMHead
from tokenmill.layers.fused_moe import EXPERT_PROJECTIONS
from tokenmill.layers.linear import LinearBase
from tokenmill.quantization.unquantized import load_dense

Shard = int | tuple[int | None, int] | None  # a fused layer's part; (expert, part) for experts
Target = tuple[str, str, Shard]  # (module name, "weight" / "bias" / parameter name, shard)

_EXPERT = re.compile(r"(.*\.experts)\.(\d+)\.(\w+)\.(weight|bias)$")
_ALL_EXPERTS = re.compile(r"(.*\.experts)\.(\w+)\.(weight|bias)$")  # one tensor holding every expert (GGUF)


def decoder_layers(num_layers: int, make: Callable[[int], nn.Module]) -> list[nn.Module]:
    """`make(i)` for every decoder layer, on the device the model is built on, except the layers that
    --cpu-offload-gb streams (`layers.host_placement`), built in host memory."""
    host = host_placement.current().layers
    layers = []
    for i in range(num_layers):
        with host_placement.on_host(i in host):
            layers.append(make(i))
    return layers


def checkpoint_targets(model: nn.Module, name: str) -> Iterator[Target]:
    """Where checkpoint tensor `name` goes (nowhere for rotary caches or a head that shares the
    embedding; to the embedding and the head when a tied head is stored in its own format)."""
    if "rotary_emb" in name:
        return
    for old, new in getattr(model, "checkpoint_renames", {}).items():
        name = name.replace(old, new)
    m = _EXPERT.match(name) or _ALL_EXPERTS.match(name)
    if m and m.groups()[-2] in EXPERT_PROJECTIONS:
        param, part = EXPERT_PROJECTIONS[m.groups()[-2]]
        kind = param if m.groups()[-1] == "weight" else f"{param}_bias"
        yield m.group(1), kind, (int(m.group(2)) if m.re is _EXPERT else None, part)
        return
    head: LMHead | None = getattr(model, "lm_head", None)
    if name == "lm_head.weight" and head is not None and (head.tied or head.reads_embedding):
        return
    module, _, kind = name.rpartition(".")
    parent, _, leaf = module.rpartition(".")
    for fused, parts in model.packed_modules.items():
        if leaf in parts:
            yield f"{parent}.{fused}", kind, parts.index(leaf)
            return
    yield module, kind, None
    if head is not None and head.reads_embedding and name == "model.embed_tokens.weight":
        yield "lm_head", "weight", None


def expected_tensors(model: nn.Module) -> set[str]:
    """`module.kind` (or `module.kind#shard` for fused layers) of every tensor the checkpoint must provide."""
    expected = set()
    for mname, module in model.named_modules():
        if isinstance(module, LinearBase):
            kinds = [] if isinstance(module, LMHead) and module.tied else list(module.quant_method.checkpoint_kinds)
            kinds += ["bias"] if module.bias is not None else []
            for kind in kinds:
                shards = [None] if module.num_shards == 1 else range(module.num_shards)
                expected.update(_key(mname, kind, s) for s in shards)
        elif hasattr(module, "checkpoint_keys"):
            expected.update(_key(mname, kind, shard) for kind, shard in module.checkpoint_keys())
        else:
            expected.update(_key(mname, p, None) for p, _ in module.named_parameters(recurse=False))
    return expected


def load_checkpoint(model: nn.Module, weights: Iterable[tuple[str, object]]) -> None:
    """Load every checkpoint tensor; raise if one is unknown, misshapen or missing."""
    modules = dict(model.named_modules())
    expected, loaded = expected_tensors(model), set()
    elsewhere = tuple(f"{m}." for m, module in modules.items() if isinstance(module, PPMissingLayer))
    for name, weight in weights:
        for mname, kind, shard in checkpoint_targets(model, name):
            if elsewhere and mname.startswith(elsewhere):  # a layer of another pipeline stage
                continue
            module = modules.get(mname)
            keys = _covered(module, mname, kind, shard) if module is not None else set()
            if not keys or not (keys <= expected or _optional(module, kind)):
                raise ValueError(f"checkpoint tensor {name!r} does not belong to this model")
            try:
                if hasattr(module, "weight_loader"):
                    module.weight_loader(kind, weight, shard)
                else:
                    load_dense(getattr(module, kind), weight, slice(None), (slice(None),))
            except ValueError as e:
                raise ValueError(f"checkpoint tensor {name} {e}") from None
            loaded |= keys
    missing = sorted(expected - loaded)
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {', '.join(missing[:4])}")


def _optional(module: nn.Module | None, kind: str) -> bool:
    """Whether `kind` is a tensor the module's weight format accepts but does not require."""
    return kind in getattr(getattr(module, "quant_method", None), "optional_kinds", ())


def _covered(module: nn.Module | None, mname: str, kind: str, shard: Shard) -> set[str]:
    """The expected keys one checkpoint tensor fills (every expert's, for a tensor of all experts)."""
    if shard is None and getattr(module, "num_shards", 1) > 1:  # stored fused
        return {_key(mname, kind, s) for s in range(module.num_shards)}
    if isinstance(shard, tuple) and shard[0] is None:
        keys = module.checkpoint_keys() if hasattr(module, "checkpoint_keys") else []
        return {_key(mname, k, s) for k, s in keys if k == kind and s[1] == shard[1]}
    return {_key(mname, kind, shard)}


def _key(module: str, kind: str, shard: Shard) -> str:
    return f"{module}.{kind}" if shard is None else f"{module}.{kind}#{shard}"
