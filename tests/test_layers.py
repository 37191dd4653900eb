"""The layer library: how checkpoint tensors and tensor-parallel ranks map onto linear layers, run
for real over a two-process gloo group."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_server_utils import free_port

from tokenmill.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)

HIDDEN, HEAD_DIM, HEADS, KV_HEADS = 32, 8, 4, 1


def _checkpoint():
    g = torch.Generator().manual_seed(0)
    t = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    return {
        "q": t(HEADS * HEAD_DIM, HIDDEN),
        "k": t(KV_HEADS * HEAD_DIM, HIDDEN),
        "v": t(KV_HEADS * HEAD_DIM, HIDDEN),
        "qb": t(HEADS * HEAD_DIM),
        "gate": t(48, HIDDEN),
        "up": t(48, HIDDEN),
        "down": t(HIDDEN, 48),
        "down_b": t(HIDDEN),
        "x": t(5, HIDDEN),
    }


def _layers(rank: int, size: int):
    """Each layer of one rank, loaded from the full checkpoint tensors as the model loader does."""
    w = _checkpoint()
    qkv = QKVParallelLinear(HIDDEN, HEAD_DIM, HEADS, KV_HEADS, bias=False, prefix="qkv", tp_rank=rank, tp_size=size)
    for shard, name in enumerate("qkv"):
        qkv.weight_loader("weight", w[name], shard)
    gate_up = MergedColumnParallelLinear(HIDDEN, [48, 48], prefix="gate_up", tp_rank=rank, tp_size=size)
    gate_up.weight_loader("weight", w["gate"], 0)
    gate_up.weight_loader("weight", w["up"], 1)
    column = ColumnParallelLinear(HIDDEN, HEADS * HEAD_DIM, bias=True, prefix="q", tp_rank=rank, tp_size=size)
    column.weight_loader("weight", w["q"])
    column.weight_loader("bias", w["qb"])
    down = RowParallelLinear(48, HIDDEN, bias=True, prefix="down", tp_rank=rank, tp_size=size)
    down.weight_loader("weight", w["down"])
    down.weight_loader("bias", w["down_b"])
    return w, qkv, gate_up, column, down


def test_single_rank_layers_compute_the_full_matmuls():
    w, qkv, gate_up, column, down = _layers(0, 1)
    x = w["x"]
    torch.testing.assert_close(qkv(x), x @ torch.cat([w["q"], w["k"], w["v"]]).T)
    torch.testing.assert_close(gate_up(x), x @ torch.cat([w["gate"], w["up"]]).T)
    torch.testing.assert_close(column(x), x @ w["q"].T + w["qb"])
    h = torch.randn(5, 48)
    torch.testing.assert_close(down(h), h @ w["down"].T + w["down_b"])
    rep = ReplicatedLinear(HIDDEN, 48, prefix="r")
    rep.weight_loader("weight", w["gate"])
    torch.testing.assert_close(rep(x), x @ w["gate"].T)


def _rank(rank: int, size: int, port: int, results) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    try:
        w, qkv, gate_up, column, down = _layers(rank, size)
        x = w["x"]
        h = torch.randn(5, 48, generator=torch.Generator().manual_seed(1))
        half = h.shape[1] // size
        results[rank] = {
            "qkv": qkv(x),
            "gate_up": gate_up(x),
            "column": column(x),
            "down": down(h[:, rank * half : (rank + 1) * half]),
        }  # each rank holds its columns
    finally:
        dist.destroy_process_group()


def test_two_ranks_split_rows_and_columns_and_all_reduce():
    port = free_port()
    results = mp.Manager().dict()
    mp.spawn(_rank, args=(2, port, results), nprocs=2, join=True)
    w = _checkpoint()
    x, h = w["x"], torch.randn(5, 48, generator=torch.Generator().manual_seed(1))
    q_ref, k_ref, v_ref = x @ w["q"].T, x @ w["k"].T, x @ w["v"].T
    for rank in range(2):
        out = results[rank]
        q, k, v = out["qkv"].split([HEADS * HEAD_DIM // 2, HEAD_DIM, HEAD_DIM], dim=1)
        torch.testing.assert_close(q, q_ref[:, rank * 16 : (rank + 1) * 16])  # half the query heads
        torch.testing.assert_close(k, k_ref)  # the one kv head, replicated on both ranks
        torch.testing.assert_close(v, v_ref)
        gate, up = out["gate_up"].split(24, dim=1)
        torch.testing.assert_close(gate, (x @ w["gate"].T)[:, rank * 24 : (rank + 1) * 24])
        torch.testing.assert_close(up, (x @ w["up"].T)[:, rank * 24 : (rank + 1) * 24])
        torch.testing.assert_close(out["column"], (x @ w["q"].T + w["qb"])[:, rank * 16 : (rank + 1) * 16])
        torch.testing.assert_close(out["down"], h @ w["down"].T + w["down_b"])  # summed over ranks, bias once


def test_layers_refuse_splits_that_do_not_divide():
    with pytest.raises(ValueError, match="do not split over 3 ranks"):
        QKVParallelLinear(HIDDEN, HEAD_DIM, HEADS, 2, tp_rank=0, tp_size=3, prefix="qkv")
    with pytest.raises(ValueError, match="do not split over 3 ranks"):
        RowParallelLinear(32, 8, tp_rank=0, tp_size=3, prefix="o")


def _same_routing(ref_weights, ref_ids, weights, ids) -> None:
    """Equal expert sets per token with equal weights (the order of the top-k does not matter)."""
    for t in range(ids.shape[0]):
        ours = dict(zip(ids[t].tolist(), weights[t].tolist()))
        theirs = dict(zip(ref_ids[t].tolist(), ref_weights[t].tolist()))
        assert ours.keys() == theirs.keys()
        for e in ours:
            assert abs(ours[e] - theirs[e]) <= 1e-6 * max(1.0, abs(theirs[e]))


@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy"])
def test_deepseek_v2_routing_matches_transformers(method):
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    from tokenmill.layers.fused_moe import Routing, select_experts

    torch.manual_seed(0)
    config = DeepseekV2Config(
        hidden_size=32,
        n_routed_experts=16,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        topk_method=method,
        routed_scaling_factor=1.5,
    )
    router = DeepseekV2TopkRouter(config)
    router.weight.data.normal_()
    x = torch.randn(64, 32)
    _, ref_weights, ref_ids = router(x)
    groups = 4 if method == "group_limited_greedy" else 1
    routing = Routing(4, renormalize=False, num_groups=groups, topk_groups=2, group_score="max", scale=1.5)
    _same_routing(ref_weights, ref_ids, *select_experts(x @ router.weight.t(), routing))


def test_deepseek_v3_routing_matches_transformers():
    """Sigmoid scores, a correction bias for choosing only, the best two experts score a group."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    from tokenmill.layers.fused_moe import Routing, select_experts

    torch.manual_seed(0)
    config = DeepseekV3Config(
        hidden_size=32,
        n_routed_experts=16,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
    )
    router = DeepseekV3TopkRouter(config)
    router.weight.data.normal_()
    router.e_score_correction_bias.normal_(std=0.5)
    x = torch.randn(64, 32)
    _, ref_weights, ref_ids = router(x)
    routing = Routing(
        4, renormalize=True, scoring="sigmoid", num_groups=4, topk_groups=2, group_score="top2", scale=2.5
    )
    weights, ids = select_experts(x @ router.weight.t(), routing, router.e_score_correction_bias)
    _same_routing(ref_weights, ref_ids, weights, ids)
    plain_ids = select_experts(x @ router.weight.t(), routing)[1]
    assert not torch.equal(plain_ids.sort(-1).values, ids.sort(-1).values)  # the bias changed some choices
