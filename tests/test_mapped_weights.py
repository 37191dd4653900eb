"""Weights used from their checkpoint's memory map: safetensors tensors and GGUF float tensors a
parameter can use as is become views of the file's private map instead of copies. The model then
answers exactly as the reference does, the map outlives the checkpoint reader, and a write to a
mapped weight never reaches the file."""

from __future__ import annotations

import gc
import hashlib

import psutil
import pytest
import torch
from helpers import (
    all_logits,
    assert_greedy_of,
    make_core,
    make_runner,
    make_tiny_model,
    run_core,
    write_tiny_gguf,
)
from safetensors.torch import load_file

from tokenmill.loader import load_model
from tokenmill.loader.residency import weight_residency
from tokenmill.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = [[3, 17, 99, 4, 250, 8, 61], [200, 1, 2, 3]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny untied Llama as an HF directory (float32 safetensors) and as a GGUF file whose tensors
    are F32 but for the attention output (F16; float16 values in both, so both match `hf`)."""
    root = tmp_path_factory.mktemp("mapped")
    hf = make_tiny_model("llama-gqa-untied", root / "hf")
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.self_attn.o_proj.weight.copy_(layer.self_attn.o_proj.weight.half().float())
    hf.save_pretrained(root / "hf")
    write_tiny_gguf(hf, root / "m.gguf", {"attn_output": "F16"})
    return hf, root


def mapped_names(loaded) -> set[str]:
    """The parameters that live in a map of one of the checkpoint's files."""
    path = str(loaded.source.path)
    maps = psutil.Process().memory_maps(grouped=False)
    ranges = [[int(a, 16) for a in m.addr.split("-")] for m in maps if m.path.startswith(path)]
    return {n for n, p in loaded.model.named_parameters() if any(a <= p.data_ptr() < b for a, b in ranges)}


def check_answers_as_reference(hf, loaded, path) -> None:
    runner = make_runner(loaded)
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPTS[0]])).logits[0]
    torch.testing.assert_close(
        all_logits(runner, PROMPTS[0]), ref, rtol=0, atol=1e-4 * max(1.0, float(ref.abs().max()))
    )
    ours = run_core(make_core(str(path), loaded=loaded), PROMPTS, GREEDY)
    for i, ids in enumerate(PROMPTS):
        assert_greedy_of(hf, ids, ours[str(i)], GREEDY.max_tokens)


def test_safetensors_weights_are_views_of_the_file_and_answer_as_the_reference(tiny):
    hf, root = tiny
    loaded = load_model(str(root / "hf"), dtype="float32")
    gc.collect()  # the checkpoint reader is gone; its map lives on with the tensors that use it
    names = mapped_names(loaded)
    # whole, unfused tensors come from the map; fused QKV and gate/up are copies
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"} <= names
    assert "model.layers.1.self_attn.o_proj.weight" in names and "model.layers.1.mlp.down_proj.weight" in names
    assert not any("qkv_proj" in n or "gate_up_proj" in n for n in names)
    r = weight_residency(loaded)
    assert r["mapped"] == sum(loaded.model.get_parameter(n).nbytes for n in names) > 0 and r["copied"] > 0
    check_answers_as_reference(hf, loaded, root / "hf")


def test_a_write_to_a_mapped_weight_stays_in_this_process(tiny):
    _, root = tiny
    (file,) = (root / "hf").glob("*.safetensors")
    before = hashlib.sha256(file.read_bytes()).hexdigest()
    loaded = load_model(str(root / "hf"), dtype="float32")
    norm = loaded.model.get_parameter("model.norm.weight")
    assert "model.norm.weight" in mapped_names(loaded)
    norm.data.fill_(7.0)  # copy-on-write: the page becomes this process's own
    assert bool((norm == 7.0).all())
    assert hashlib.sha256(file.read_bytes()).hexdigest() == before
    assert not bool((load_file(str(file))["model.norm.weight"] == 7.0).any())


def test_a_dtype_the_file_does_not_hold_is_a_copy(tiny):
    _, root = tiny
    loaded = load_model(str(root / "hf"), dtype="bfloat16")
    assert weight_residency(loaded)["mapped"] == 0 and not mapped_names(loaded)


def test_gguf_float_tensors_are_views_of_the_file_and_answer_as_the_reference(tiny):
    hf, root = tiny
    loaded = load_model(str(root / "m.gguf"), dtype="float32")
    gc.collect()
    names = mapped_names(loaded)
    # F32 in HF layout: mapped; F16 (converted), q/k (rows unpermuted) and fused layers: copies
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.layers.0.input_layernorm.weight"} <= names
    assert "model.layers.0.mlp.down_proj.weight" in names
    assert "model.layers.0.self_attn.o_proj.weight" not in names
    assert not any("qkv_proj" in n or "gate_up_proj" in n for n in names)
    assert weight_residency(loaded)["mapped"] > 0
    check_answers_as_reference(hf, loaded, root / "m.gguf")
