"""MTP speculation on a tiny DeepSeek-V3 (MLA, routed experts) whose checkpoint ships one
multi-token-prediction layer after its 2 decoder layers: greedy output is token-identical to
decoding without it, with a random MTP layer (its own embedding and head) and with one that drafts
the target's own last choice (sharing the target's embedding and head: every draft is the newest
token); the KV pools come back whole; a model without MTP layers is a clear error."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import make_core, make_tiny_model, run_core
from safetensors.torch import load_file, save_file
from test_spec_decode import repetitive_prompts

from tokenmill.config import SpeculativeConfig
from tokenmill.sampling_params import SamplingParams


def mtp_spec(**kw) -> SpeculativeConfig:
    return SpeculativeConfig(
        **{
            "method": "deepseek_mtp",
            "disable_by_batch_size": 64,
            "min_acceptance": 0.0,
            "num_speculative_tokens": 2,
            **kw,
        }
    )


def with_mtp_layer(directory, copies_last_choice: bool) -> None:
    """Turn a 3-layer checkpoint into 2 layers + an MTP layer (layer 2's block, enorm, hnorm, eh_proj and
    the shared head). `copies_last_choice`: the block adds nothing (o_proj and down_proj zero) and
    eh_proj passes hnorm(h_t) through, so the head gives the target's own prediction from h_t."""
    config = json.loads((directory / "config.json").read_text())
    config.update(num_hidden_layers=2, num_nextn_predict_layers=1)
    (directory / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(directory / "model.safetensors"))
    h, gen = config["hidden_size"], torch.Generator().manual_seed(2)
    mtp = {"enorm.weight": torch.ones(h), "hnorm.weight": torch.ones(h), "shared_head.norm.weight": torch.ones(h)}
    if copies_last_choice:
        mtp["eh_proj.weight"] = torch.cat((torch.zeros(h, h), torch.eye(h)), dim=1)
        for name in tensors:
            if name.startswith("model.layers.2.") and name.endswith(("o_proj.weight", "down_proj.weight")):
                tensors[name] = torch.zeros_like(tensors[name])
    else:
        mtp["eh_proj.weight"] = torch.randn(h, 2 * h, generator=gen) * 0.05
        mtp["embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
        mtp["shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    tensors.update({f"model.layers.2.{name}": t for name, t in mtp.items()})
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp")
    for name, copies in (("random", False), ("copies", True)):
        make_tiny_model("deepseek-v3", root / name, num_hidden_layers=3)
        with_mtp_layer(root / name, copies)
    make_tiny_model("llama-gqa-untied", root / "llama")
    return root


@pytest.mark.parametrize("which", ["random", "copies"])
def test_greedy_output_is_identical_with_mtp(models, which):
    model = str(models / which)
    prompts = repetitive_prompts(3)
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    params = [
        greedy,
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, speculative=False),
    ]
    plain = run_core(make_core(model, block_size=8), prompts, params)
    core = make_core(model, block_size=8, speculative=mtp_spec(), max_num_batched_tokens=48)
    assert core.config.speculative.method == "mtp"  # deepseek_mtp is its alias
    drafts = []

    def record(c) -> None:
        drafts.extend(
            (r.spec_token_ids, (r.prompt_token_ids + r.output_token_ids)[-1])
            for r in c.scheduler.running
            if r.spec_token_ids
        )

    assert run_core(core, prompts, params, on_step=record) == plain
    assert drafts and core.scheduler.spec_stats.num_draft_tokens > 0
    if which == "copies":  # the head gives the target's own choice from h_t: every draft is the newest token
        assert all(d == [newest] * len(d) for d, newest in drafts)
    core.step()
    assert core.kv.num_free_blocks == core.kv.num_blocks
    pool = core.executor.runner.drafter.pool
    assert not pool.states and len(pool.free) == pool.num_blocks


def test_seeded_sampling_with_mtp_is_reproducible(models):
    core = make_core(str(models / "random"), speculative=mtp_spec())
    seeded = [SamplingParams(temperature=0.8, seed=3 + i, max_tokens=12, ignore_eos=True) for i in range(2)]
    prompts = repetitive_prompts(2)
    assert run_core(core, prompts, seeded) == run_core(core, prompts, seeded)


def test_mtp_needs_mtp_layers(models, tmp_path):
    with pytest.raises(ValueError, match="needs a target whose config.json has num_nextn_predict_layers"):
        make_core(str(models / "llama"), speculative=mtp_spec())
    make_tiny_model("deepseek-v3", tmp_path / "no-weights", num_hidden_layers=2)  # announces 1, ships none
    with pytest.raises(ValueError, match=r"has no model.layers.2.\* tensors"):
        make_core(str(tmp_path / "no-weights"), speculative=mtp_spec())
    with pytest.raises(ValueError, match="speculative_config.model .* only by them"):
        SpeculativeConfig(method="mtp", model=str(tmp_path))
