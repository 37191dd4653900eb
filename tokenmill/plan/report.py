"""The plan as data: every table `tokenmill plan` prints and the recommendation lines, one dict (what
`--json` writes)."""

from __future__ import annotations

from dataclasses import asdict

from tokenmill.plan import roofline as rl
from tokenmill.plan.hardware import Hardware
from tokenmill.plan.model_facts import KV_DTYPE_BYTES, WEIGHT_BITS, ModelFacts

MEMORY_UTILIZATION = 0.9  # of the device's memory for weights + KV (the rest: activations, runtime), as vLLM's
FORMATS = ("file", *WEIGHT_BITS)
KV_DTYPES = tuple(k for k in KV_DTYPE_BYTES if k != "bfloat16")
SPECULATIVE = ((0.6, 2), (0.6, 4), (0.8, 2), (0.8, 4))  # (acceptance rate, drafts per step)
TENSOR_PARALLEL = (1, 2, 4, 8)


def build_plan(
    facts: ModelFacts,
    hw: Hardware,
    context: int,
    concurrency: int,
    kv_dtype: str = "float16",
    memory: float | None = None,
) -> dict:
    """`memory`: bytes for weights + KV (default: MEMORY_UTILIZATION of the hardware's)."""
    memory = memory if memory is not None else hw.memory_bytes * MEMORY_UTILIZATION
    fmt = "file" if facts.file_bytes is not None else "float16"
    c, n = concurrency, context

    def decode(f=fmt, kv=kv_dtype, batch=c, devices=1):
        return rl.decode_step(facts, hw, f, kv, batch, n, devices=devices)

    weights = []
    for f in FORMATS:
        if f == "file" and facts.file_bytes is None:
            continue
        held = facts.weight_bytes(f)[0]
        weights.append(
            {
                "format": facts.file_format if f == "file" else f,
                "key": f,
                "bytes": held,
                "bits_per_weight": 8 * held / facts.total_params,
                "fits": held <= memory,
                "sequences_that_fit": rl.sequences_that_fit(facts, f, kv_dtype, n, memory),
                "decode_batch1_tokens_per_s": decode(f, batch=1).tokens_per_s,
                "decode_tokens_per_s": decode(f).tokens_per_s,
                "prefill_tokens_per_s": rl.prefill(facts, hw, f, n).tokens_per_s,
            }
        )
    kv = [
        {
            "dtype": d,
            "bytes_per_token": facts.kv_bytes_per_token(d),
            "bytes_per_sequence": facts.kv_bytes_per_sequence(n, d),
            "sequences_that_fit": rl.sequences_that_fit(facts, fmt, d, n, memory),
            "decode_tokens_per_s": decode(kv=d).tokens_per_s,
        }
        for d in KV_DTYPES
    ]
    layers = facts.layers
    plan = {
        "model": {
            "name": facts.name,
            "architecture": facts.architecture,
            "total_params": facts.total_params,
            "active_params": facts.active_params,
            "weights": facts.file_format or "float16 (config only)",
            "layers": len(layers),
            "window_layers": sum(layer.window is not None for layer in layers),
            "latent_kv": any(layer.tensors == 1 for layer in layers),
            "experts": facts.num_experts,
            "experts_per_token": facts.experts_per_token,
            "max_context": facts.max_context,
        },
        "hardware": asdict(hw),
        "memory_for_model": memory,
        "context": n,
        "concurrency": c,
        "weight_format": fmt,
        "kv_dtype": kv_dtype,
        "compute": hw.compute_rate(fmt)[0],
        "weights": weights,
        "kv": kv,
        "decode": [{"batch": b, **asdict(decode(batch=b))} for b in sorted({*rl.BATCHES, c})],
        "prefill": asdict(rl.prefill(facts, hw, fmt, n)),
        "crossover_batch": rl.crossover_batch(facts, hw, fmt, kv_dtype, n),
        "max_context_one_sequence": rl.max_context_that_fits(facts, fmt, kv_dtype, memory),
        "speculative": [
            {
                "acceptance": a,
                "drafts": k,
                "tokens_per_step": rl.expected_tokens_per_verify(a, k),
                "speedup_batch1": rl.speculative_speedup(facts, hw, fmt, kv_dtype, n, a, k),
                "speedup": rl.speculative_speedup(facts, hw, fmt, kv_dtype, n, a, k, batch=c),
            }
            for a, k in SPECULATIVE
        ],
        "tensor_parallel": [
            {
                "devices": t,
                "decode_batch1_tokens_per_s": decode(batch=1, devices=t).tokens_per_s,
                "decode_tokens_per_s": decode(devices=t).tokens_per_s,
                "sequences_that_fit": rl.sequences_that_fit(facts, fmt, kv_dtype, n, memory, t),
            }
            for t in TENSOR_PARALLEL
        ],
    }
    plan["recommendations"] = recommendations(plan)
    return plan


def recommendations(p: dict) -> list[str]:
    """One plain sentence per lever, with the number behind it."""
    c, n, kv = p["concurrency"], p["context"], p["kv_dtype"]
    base = next(w for w in p["weights"] if w["key"] == p["weight_format"])
    step = next(d for d in p["decode"] if d["batch"] == c)
    out = []
    fits = base["sequences_that_fit"]
    out.append(
        f"Memory: {base['format']} weights take {_gb(base['bytes'])} of {_gb(p['memory_for_model'])}; "
        f"{fits} sequences of {n} tokens fit with a {kv} KV cache "
        + ("(enough for " if fits >= c else "(NOT enough for ")
        + f"{c} concurrent)."
    )
    if fits < c:
        options = [
            (w["format"], d["dtype"])
            for w in p["weights"]
            for d in p["kv"]
            if w["key"] != "float32" and _fit(p, w, d) >= c
        ]
        out.append(
            "To fit them: "
            + (
                f"{options[0][0]} weights with a {options[0][1]} KV cache, or more devices."
                if options
                else "more memory or devices (no weight or KV format suffices)."
            )
        )
    out.append(
        f"Decode at batch {c}: ~{step['tokens_per_s']:,.0f} tok/s, {step['bound']}-bound "
        f"({_gb(step['bytes'])} read per step)."
    )
    smallest = min((w for w in p["weights"] if w["key"] != "file"), key=lambda w: w["bytes"])
    gain = smallest["decode_tokens_per_s"] / base["decode_tokens_per_s"]
    if gain > 1.05:
        out.append(
            f"Quantization: {smallest['format']} weights would read less per step: ~{gain:.2f}x decode "
            f"({smallest['decode_tokens_per_s']:,.0f} tok/s), {_gb(smallest['bytes'])} held."
        )
    kvq = next(d for d in p["kv"] if d["dtype"] == "int8")
    own = next(d for d in p["kv"] if d["dtype"] == kv)
    if kvq["bytes_per_sequence"] < own["bytes_per_sequence"]:
        out.append(
            f"KV quantization: an int8 / fp8 cache fits {kvq['sequences_that_fit']} sequences "
            f"(now {own['sequences_that_fit']}) and decodes batch {c} at "
            f"~{kvq['decode_tokens_per_s'] / own['decode_tokens_per_s']:.2f}x."
        )
    cross = p["crossover_batch"]
    out.append(
        f"Batching: decode turns compute-bound at batch {cross}: below it more concurrent sequences add "
        "throughput almost for free, past it they share a fixed FLOP rate."
        if cross
        else "Batching: decode stays memory-bound at every batch (the KV reads grow as fast as the FLOPs)."
    )
    spec = {(s["acceptance"], s["drafts"]): s for s in p["speculative"]}
    lo, hi = spec[0.6, 4], spec[0.8, 4]
    out.append(
        f"Speculative decoding (4 drafts): ~{lo['speedup_batch1']:.2f}x at acceptance 0.6, "
        f"~{hi['speedup_batch1']:.2f}x at 0.8 for one stream; at batch {c} ~{lo['speedup']:.2f}x / "
        f"{hi['speedup']:.2f}x"
        + (" (compute-bound: drafts cost as much as they save)." if step["bound"] == "compute" else ".")
    )
    tp = {t["devices"]: t for t in p["tensor_parallel"]}
    out.append(
        f"Tensor parallelism (ideal, all-reduces not counted): 2 / 8 devices give ~"
        f"{tp[2]['decode_batch1_tokens_per_s']:,.0f} / {tp[8]['decode_batch1_tokens_per_s']:,.0f} tok/s for one "
        f"stream and room for {tp[2]['sequences_that_fit']} / {tp[8]['sequences_that_fit']} sequences."
    )
    pre = p["prefill"]
    out.append(
        f"Prefill of {n} tokens: ~{pre['tokens_per_s']:,.0f} tok/s ({pre['bound']}-bound, "
        f"{pre['seconds'] * 1e3:,.0f} ms to the first token at {p['compute']})."
    )
    return out


def _fit(p: dict, weights: dict, kv: dict) -> int:
    """Sequences that fit with these weights and this KV dtype (the table's own numbers)."""
    return max(0, int((p["memory_for_model"] - weights["bytes"]) // kv["bytes_per_sequence"]))


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"
