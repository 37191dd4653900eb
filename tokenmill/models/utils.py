"""Loading checkpoint tensors into a model built from `tokenmill.layers`, shared by model files.

A checkpoint tensor (HF naming, e.g. `model.layers.0.self_attn.q_proj.weight`) goes to a module and
a shard: fused layers hold several checkpoint modules (`packed_modules` of the model class, e.g.
q/k/v -> qkv_proj shards 0/1/2). Modules with a `weight_loader` (linear layers, embeddings) load it
themselves in their own format; other parameters are copied. Every expected tensor must arrive.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from torch import nn

from tokenmill.layers.embedding import LMHead
from tokenmill.layers.linear import LinearBase
from tokenmill.quantization.unquantized import load_dense

Target = tuple[str, str, int | None]  # (module name, "weight" / "bias" / parameter name, shard)


def checkpoint_targets(model: nn.Module, name: str) -> Iterator[Target]:
    """Where checkpoint tensor `name` goes (nowhere for rotary caches or a head that shares the
    embedding; to the embedding and the head when a tied head is stored in its own format)."""
    if "rotary_emb" in name:
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
            kinds = [] if isinstance(module, LMHead) and module.tied else ["weight"]
            kinds += ["bias"] if module.bias is not None else []
            for kind in kinds:
                shards = [None] if module.num_shards == 1 else range(module.num_shards)
                expected.update(_key(mname, kind, s) for s in shards)
        else:
            expected.update(_key(mname, p, None) for p, _ in module.named_parameters(recurse=False))
    return expected


def load_checkpoint(model: nn.Module, weights: Iterable[tuple[str, object]]) -> None:
    """Load every checkpoint tensor; raise if one is unknown, misshapen or missing."""
    modules = dict(model.named_modules())
    expected, loaded = expected_tensors(model), set()
    for name, weight in weights:
        for mname, kind, shard in checkpoint_targets(model, name):
            key = _key(mname, kind, shard)
            module = modules.get(mname)
            if module is None or key not in expected:
                raise ValueError(f"checkpoint tensor {name!r} does not belong to this model")
            try:
                if hasattr(module, "weight_loader"):
                    module.weight_loader(kind, weight, shard)
                else:
                    load_dense(getattr(module, kind), weight, slice(None), (slice(None),))
            except ValueError as e:
                raise ValueError(f"checkpoint tensor {name} {e}") from None
            loaded.add(key)
    missing = sorted(expected - loaded)
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {', '.join(missing[:4])}")


def _key(module: str, kind: str, shard: int | None) -> str:
    return f"{module}.{kind}" if shard is None else f"{module}.{kind}#{shard}"
