"""The C++ CPU kernels against the plain torch ops they replace, on shapes that hit every code path
(vector loops and their tails, head sizes that are not a multiple of the vector width)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tokenmill import kernels
from tokenmill.kernels import fused_ops, paged_attention, variants


@pytest.mark.parametrize("head_dim", [16, 20, 64, 72])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize(
    "window, soft_cap, sinks",
    [(None, None, False), (24, None, False), (None, 2.0, False), (9, 1.5, False), (None, None, True), (9, None, True)],
)
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_paged_decode_attention_matches_sdpa(head_dim, group, window, soft_cap, sinks, cache_dtype):
    """Against softmax(q k^T) v in float32 on the cache's values (16-bit caches widened as they are read);
    with sinks, each head's sink logit joins the softmax and its weight is dropped (GPT-OSS)."""
    check_against_sdpa(head_dim, group, window, soft_cap, sinks, cache_dtype)


@pytest.mark.parametrize(
    "head_dim, group, cache_dtype",
    [
        (64, 7, torch.float16),
        (72, 7, torch.bfloat16),
        (64, 8, torch.float32),
        (64, 16, torch.float16),
        (24, 16, torch.bfloat16),
    ],
)
def test_paged_decode_attention_of_many_query_heads_per_kv_head(head_dim, group, cache_dtype):
    """The values are weighed for up to 8 query heads a pass (then the rest): 7 (Qwen2.5), 8 (Llama 3),
    16, on the 16-lane (head_dim 64) and 8-lane (72, 24) vector paths of an AVX-512 build."""
    check_against_sdpa(head_dim, group, None, 1.5, True, cache_dtype)


def check_against_sdpa(head_dim, group, window, soft_cap, sinks, cache_dtype):
    torch.manual_seed(0)
    kv_heads, block_size, num_blocks = 2, 16, 64
    heads = kv_heads * group
    lengths = torch.tensor([1, 7, 8, 9, 16, 33, 200])
    blocks_needed = (lengths + block_size - 1) // block_size
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim).to(cache_dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim).to(cache_dtype)
    perm = torch.randperm(num_blocks)  # blocks scattered through the pool, as the cache manager leaves them
    tables = torch.zeros(len(lengths), int(blocks_needed.max()), dtype=torch.long)
    used = 0
    for i, n in enumerate(blocks_needed.tolist()):
        tables[i, :n] = perm[used : used + n]
        used += n
    q = torch.randn(len(lengths), heads, head_dim)
    sink = torch.randn(heads) * 2 if sinks else None
    out = paged_attention.paged_decode_attention(
        q, k_cache, v_cache, tables, lengths, 0.3, window, soft_cap, sinks=sink
    )
    k_cache, v_cache = k_cache.float(), v_cache.float()
    for i, length in enumerate(lengths.tolist()):
        start = max(0, length - window) if window else 0  # a window sees only the last `window` tokens
        keys = k_cache[tables[i]].reshape(-1, kv_heads, head_dim)[start:length].transpose(0, 1)
        values = v_cache[tables[i]].reshape(-1, kv_heads, head_dim)[start:length].transpose(0, 1)
        keys, values = keys.repeat_interleave(group, 0), values.repeat_interleave(group, 0)
        scores = q[i][:, None] @ keys.transpose(1, 2) * 0.3  # [H, 1, L]
        if soft_cap:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        if sinks:
            probs = torch.softmax(torch.cat((scores, sink.view(-1, 1, 1)), dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        ref = (probs @ values)[:, 0]
        torch.testing.assert_close(out[i], ref, rtol=1e-5, atol=1e-5)


def test_paged_decode_attention_of_a_row_depends_on_neither_its_batch_nor_the_threads():
    """A long context is cut into spans whose softmax partials merge in order: the spans depend on the
    sequence's own length, so its result is the same bits alone or in a batch, at 1 or 2 threads."""
    torch.manual_seed(0)
    k_cache, v_cache = torch.randn(2, 64, 16, 3, 64).half()
    lengths = torch.tensor([700, 5, 300])
    tables = torch.randperm(64)[:60].view(3, 20)
    q = torch.randn(3, 9, 64)
    threads = torch.get_num_threads()
    try:
        runs = []
        for n in (1, 2):
            torch.set_num_threads(n)
            runs.append(paged_attention.paged_decode_attention(q, k_cache, v_cache, tables, lengths, 0.125))
            runs.append(paged_attention.paged_decode_attention(q[:1], k_cache, v_cache, tables[:1], lengths[:1], 0.125))
    finally:
        torch.set_num_threads(threads)
    for out in runs[1:]:
        assert torch.equal(out[0], runs[0][0])
    assert torch.equal(runs[0], runs[2])


@pytest.mark.parametrize("heads, kv_heads", [(9, 3), (14, 2)])
def test_paged_decode_attention_of_a_head_does_not_depend_on_which_heads_share_its_task(heads, kv_heads):
    """A short sequence alone has fewer spans than threads: its kv heads' query heads are split across
    tasks (2 + 1 of 3, 4 + 3 of 7), where in a batch one task has them all; the scores convert each key
    row once for a group of up to 3 heads, so a head's group differs, its result must not."""
    torch.manual_seed(0)
    k_cache, v_cache = torch.randn(2, 32, 16, kv_heads, 64).half()
    lengths = torch.tensor([37, 200])
    tables = torch.randperm(32)[:30].view(2, 15)
    tables[0, 3:] = 0
    q = torch.randn(2, heads, 64)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        alone = paged_attention.paged_decode_attention(q[:1], k_cache, v_cache, tables[:1], lengths[:1], 0.125)
        batch = paged_attention.paged_decode_attention(q, k_cache, v_cache, tables, lengths, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone[0], batch[0])


@pytest.mark.parametrize("latent, rope", [(32, 8), (20, 4), (512, 64)])
@pytest.mark.parametrize("lengths", [[1, 9, 40, 130], [130]])
def test_paged_decode_attention_reads_a_latent_cache(latent, rope, lengths):
    """MLA's absorbed decode: every head attends over one shared row per token (latent + rope key
    features) and the values are a strided view of the rows' leading `latent` features. One sequence
    alone has fewer (sequence, kv head) pairs than threads: its heads are split across them."""
    torch.manual_seed(0)
    heads, block_size, num_blocks = 7, 16, 40
    lengths = torch.tensor(lengths)
    cache = torch.randn(num_blocks, block_size, 1, latent + rope)
    values = cache[..., :latent]
    tables = torch.randperm(num_blocks)[: len(lengths) * 9].view(len(lengths), 9)
    q = torch.randn(len(lengths), heads, latent + rope)
    out = paged_attention.paged_decode_attention(q, cache, values, tables, lengths, 0.2)
    assert out.shape == (len(lengths), heads, latent)
    for i, length in enumerate(lengths.tolist()):
        rows = cache[tables[i]].reshape(-1, latent + rope)[:length]
        ref = torch.softmax(q[i] @ rows.t() * 0.2, dim=-1) @ rows[:, :latent]
        torch.testing.assert_close(out[i], ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_write_kv_stores_rows_at_their_slots(cache_dtype):
    """Copied (float32) or rounded as torch's .to() rounds (16-bit caches)."""
    qkv = torch.randn(5, 4 + 2 * 2, 8)  # 4 query heads, 2 kv heads: k and v are strided views
    k, v = qkv[:, 4:6], qkv[:, 6:8]
    k_cache, v_cache = torch.zeros(3, 4, 2, 8, dtype=cache_dtype), torch.zeros(3, 4, 2, 8, dtype=cache_dtype)
    slots = torch.tensor([11, 0, 5, 6, 3])
    paged_attention.write_kv(k, v, k_cache, v_cache, slots)
    torch.testing.assert_close(k_cache.view(-1, 2, 8)[slots], k.to(cache_dtype), rtol=0, atol=0)
    torch.testing.assert_close(v_cache.view(-1, 2, 8)[slots], v.to(cache_dtype), rtol=0, atol=0)
    untouched = torch.ones(12, dtype=torch.bool)
    untouched[slots] = False
    assert k_cache.view(-1, 2, 8)[untouched].abs().sum() == 0


@pytest.mark.parametrize(
    "fused,reference",
    [
        (fused_ops.silu_and_mul, F.silu),
        (fused_ops.gelu_tanh_and_mul, lambda g: F.gelu(g, approximate="tanh")),
    ],
    ids=["silu", "gelu_tanh"],
)
def test_act_and_mul_over_its_vector_body_and_tail_and_extreme_gates(fused, reference):
    """SiLU's and GELU-tanh's e^x runs eight lanes at a time with a scalar tail (width 75: both), clamped
    where e^x would overflow: gates of +-100 still give act(+-100) * up. (GELU's tail below -5 is under
    1e-15: torch's 0.5 x (1 + tanh(u)) rounds it to 0 there, the logistic form keeps it.)"""
    torch.manual_seed(0)
    gate_up = torch.randn(5, 150) * 4
    gate_up[0, :75] = torch.linspace(-100, 100, 75)
    want = reference(gate_up[:, :75].double()) * gate_up[:, 75:].double()
    torch.testing.assert_close(fused(gate_up).double(), want, rtol=2e-6, atol=1e-14)


@pytest.mark.parametrize("vocab", [1, 7, 8, 1003])
def test_row_argmax_is_torchs_first_index_of_the_maximum(vocab):
    """The greedy sampler's argmax: the first index on ties (a tie planted after the maximum and one
    across the vector/tail boundary), a row of -inf gives 0, a NaN counts as the largest, as in torch."""
    torch.manual_seed(0)
    x = torch.randn(6, vocab)
    x[1] = x[1].round()  # ties everywhere
    x[2, -1] = x[2].max()  # the maximum again at the last (tail) position
    x[3] = float("-inf")
    x[4, vocab // 2] = float("nan")
    x[5, vocab // 3 :] = 5.0
    assert fused_ops.row_argmax(x).tolist() == x.max(dim=-1).indices.tolist()


@pytest.mark.parametrize("tokens", [1, 3, 40])
def test_fused_elementwise_ops_match_torch(tokens):
    torch.manual_seed(0)
    hidden, weight = 72, torch.randn(72)
    x, residual = torch.randn(tokens, hidden), torch.randn(tokens, hidden)
    total = x + residual
    out, summed = fused_ops.add_rms_norm(x.clone(), residual, weight, 1e-5)
    torch.testing.assert_close(summed, total)
    torch.testing.assert_close(out, F.rms_norm(total, (hidden,), weight, 1e-5), rtol=1e-5, atol=1e-5)
    out, _ = fused_ops.add_rms_norm(x.clone(), None, weight, 1e-5)
    torch.testing.assert_close(out, F.rms_norm(x, (hidden,), weight, 1e-5), rtol=1e-5, atol=1e-5)

    gate_up = torch.randn(tokens, 2 * hidden)
    torch.testing.assert_close(
        fused_ops.silu_and_mul(gate_up), F.silu(gate_up[:, :hidden]) * gate_up[:, hidden:], rtol=1e-5, atol=1e-6
    )

    head_dim, positions = 16, torch.randint(0, 50, (tokens,))
    angles = torch.rand(50, head_dim // 2) * 3
    emb = torch.cat((angles, angles), dim=-1)
    table = torch.stack((emb.cos(), emb.sin()))
    qkv = torch.randn(tokens, 5, head_dim)
    half = head_dim // 2
    x = qkv[:, :3]  # rotate a strided view, as the attention layer does
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    ref = x * table[0][positions][:, None] + rotated * table[1][positions][:, None]
    untouched = qkv[:, 3:].clone()
    fused_ops.rotary_inplace(x, positions, table)
    torch.testing.assert_close(qkv[:, :3], ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(qkv[:, 3:], untouched, rtol=0, atol=0)

    # partial rotary (a table narrower than the head): the first 8 features turned, the torch path's bits
    # (rotate-half's products and sums, none fused), the other 8 kept
    part = table[:, :, :4].repeat(1, 1, 2).contiguous()  # 4 angles, each twice: a [2, 50, 8] table
    x = torch.randn(tokens, 3, head_dim)
    rot = x[..., :8]
    want = (
        rot * part[0][positions][:, None] + torch.cat((-rot[..., 4:], rot[..., :4]), -1) * part[1][positions][:, None]
    )
    kept = x[..., 8:].clone()
    fused_ops.rotary_inplace(x, positions, part)
    assert torch.equal(x[..., :8], want) and torch.equal(x[..., 8:], kept)


# A module with no function, so that the build from source takes a second, not the kernels' minute (CI
# compiles them once, at install); torch's `load` names the module through TORCH_EXTENSION_NAME.
_TINY_EXTENSION = """
#include <Python.h>
#define TM_STR_(x) #x
#define TM_STR(x) TM_STR_(x)
#define TM_CAT_(a, b) a##b
#define TM_CAT(a, b) TM_CAT_(a, b)
static struct PyModuleDef tiny = {PyModuleDef_HEAD_INIT, TM_STR(TORCH_EXTENSION_NAME), NULL, -1, NULL};
PyMODINIT_FUNC TM_CAT(PyInit_, TORCH_EXTENSION_NAME)(void) { return PyModule_Create(&tiny); }
"""


def test_a_build_lock_left_by_a_killed_process_is_cleared(tmp_path):
    """torch leaves its `lock` file behind when a build is killed; the next build must not wait on it forever.
    The build from source (-march=native: not a prebuilt variant's name) is what a CPU without one runs:
    here it builds a tiny source directory in place of csrc/, into a cache of its own, by the same path."""
    if fused_ops.load() is None:
        pytest.skip("the CPU kernels cannot be built here")
    sources = tmp_path / "csrc"
    sources.mkdir()
    (sources / "bindings.cpp").write_text(_TINY_EXTENSION)
    cache = tmp_path / "cache"
    lock = cache / kernels.build_name(sources, "native") / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    code = (
        "import sys; from pathlib import Path; from tokenmill.kernels import fused_ops, variants; "
        "variants.sources_dir = lambda: Path(sys.argv[1]); "
        "assert fused_ops.load().__name__.startswith('tokenmill_cpu_')"
    )
    subprocess.run(
        [sys.executable, "-c", code, str(sources)],
        check=True,
        timeout=600,  # a hang, not a speed limit
        env={**os.environ, "TOKENMILL_CPU_ARCH": "native", "TORCH_EXTENSIONS_DIR": str(cache)},
    )
    assert not lock.exists()


def test_the_prebuilt_variant_for_this_cpu_is_loaded():
    """The install built every variant (setup.py): the best one this CPU runs, or the one $TOKENMILL_CPU_ARCH
    names, is loaded as it is, with nothing compiled at run time."""
    arch = os.environ.get("TOKENMILL_CPU_ARCH")
    variant = variants.named(arch) if arch else variants.best_for(kernels.cpu_flags())
    if variant is None or fused_ops.load() is None:
        pytest.skip("no prebuilt variant for this CPU, or the kernels are off")
    assert fused_ops.load().__name__ == f"tokenmill.kernels.{variant.module}", "prebuilt modules missing: make"
    # so too in a process that asks for the kernels before it has imported torch itself (the module links
    # to torch's libraries: imported first, the prebuilt module had failed to load and been built again)
    code = "from tokenmill.kernels import cpu_kernels; print(cpu_kernels().__name__)"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=600)
    assert loaded.stdout.split()[-1] == f"tokenmill.kernels.{variant.module}", loaded.stderr


def test_two_builds_of_the_kernels_load_in_one_process():
    """A prebuilt module imported first (to read its sources_hash: a stale one is then built from source)
    must not stop a second build from loading: each registers its own DecodeStep class."""
    import importlib.util

    runnable = [
        v
        for v in variants.VARIANTS
        if v.needs <= kernels.cpu_flags() and importlib.util.find_spec(f"tokenmill.kernels.{v.module}")
    ]
    if len(runnable) < 2 or fused_ops.load() is None:
        pytest.skip("fewer than two prebuilt variants installed that run here")
    modules = [importlib.import_module(f"tokenmill.kernels.{v.module}") for v in runnable[-2:]]
    assert modules[0].DecodeStep is not modules[1].DecodeStep


def test_the_best_variant_is_the_one_whose_instruction_sets_the_cpu_has():
    v3 = {
        "lm",
        "cx16",
        "lahf_lm",
        "popcnt",
        "pni",
        "sse4_1",
        "sse4_2",
        "ssse3",
        "avx",
        "avx2",
        "bmi1",
        "bmi2",
        "f16c",
        "fma",
        "abm",
        "movbe",
        "xsave",
    }
    v4 = v3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
    assert variants.best_for(frozenset({"lm", "sse2", "avx"})).name == "x86-64"
    assert variants.best_for(frozenset(v3 - {"fma"})).name == "x86-64"
    assert variants.best_for(frozenset(v3)).name == "haswell"  # Zen 3: AVX2, no VNNI
    assert variants.best_for(frozenset(v3 | {"avx_vnni"})).name == "haswell+avxvnni"  # Alder Lake
    assert variants.best_for(frozenset(v4)).name == "haswell"  # Skylake-X: AVX-512 without VNNI
    assert variants.best_for(frozenset(v4 | {"avx512_vnni"})).name == "x86-64-v4+avx512vnni"  # Zen 4, Ice Lake
    assert variants.best_for(frozenset({"fp", "asimd", "asimddp"})) is None  # aarch64: built from source
    assert variants.named("x86-64-v4+avx512vnni").cflags == ("-march=x86-64-v4", "-mavx512vnni")
    assert [variants.named(v.name) for v in variants.VARIANTS] == list(variants.VARIANTS)


@pytest.mark.parametrize("arch", ["x86-64", "haswell"])
def test_the_portable_build_passes_the_kernel_tests(arch):
    """Built for plain x86-64 (no AVX2/FMA: the scalar paths a CPU without them runs), and on a CPU with
    VNNI for haswell (AVX2 without VNNI: maddubs where the native build has vpdpbusd), the kernels pass
    the same tests against their torch references: the attention and elementwise kernels, the block
    matmuls (float and int8 activations), the LoRA kernel and the compiled decode step; x86-64 also the
    quantized KV cache's and the fp8 matmul's kernel tests (one pytest process for all: each costs a start)."""
    if os.environ.get("TOKENMILL_CPU_ARCH") or fused_ops.load() is None:
        pytest.skip("already the portable build, or no compiler here")
    if arch == "haswell" and not ({"avx512_vnni", "avx_vnni"} & kernels.cpu_flags() and "avx2" in kernels.cpu_flags()):
        pytest.skip("no VNNI here: the native build is the AVX2 path")
    tests = Path(__file__).parent
    files = [
        "test_kernels.py",
        "test_quantization.py",
        "test_models.py",
        "test_lora_kernel.py",
        "test_prefill_attention.py",
    ]
    keywords = (
        "(test_kernels and not portable and not lock) or block_quant_linear or int8_activation_kernel "
        "or compiled_decode_step_is_bit_identical or test_lora_kernel or test_prefill_attention"
    )
    if arch == "x86-64":
        files += ["test_kv_cache_quant.py", "test_fp8_fp4.py"]
        keywords += " or ((test_kv_cache_quant or test_fp8_fp4) and kernel and not portable)"
    selection = [*(str(tests / f) for f in files), "-k", keywords]
    env = {**os.environ, "TOKENMILL_CPU_ARCH": arch}
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *selection],
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )  # a hang, not a speed limit
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert " passed" in out.stdout and " skipped" not in out.stdout, out.stdout[-2000:]
