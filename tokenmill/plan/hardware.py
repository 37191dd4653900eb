"""Hardware for planning: memory, memory bandwidth and matmul rates, from published figures or
measured on this machine (`auto`, once, cached in ~/.cache/tokenmill/hardware.json).

Rates are dense (no 2:4 sparsity) peak FLOP/s by the operands' type; a planner compares them with
bandwidth, so the vendors' peaks make the estimates upper bounds (real kernels reach ~60-80% of
bandwidth and less of peak compute). CPU rows are estimates for the named class, not a datasheet.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

GB, TB, T = 1e9, 1e12, 1e12  # bytes and FLOP/s units


@dataclass
class Hardware:
    name: str
    kind: str  # "gpu" or "cpu": which rate prefill uses (see `compute_rate`)
    memory_bytes: float
    bandwidth: float  # bytes/s
    flops: dict[str, float] = field(default_factory=dict)  # FLOP/s by operand type: float32, float16, int8, fp8, fp4
    source: str = ""

    def compute_rate(self, fmt: str) -> tuple[str, float]:
        """The matmul rate the engine would run a weight format at: on CPU int8 activations for quantized
        weights (the block kernels' default) and float32 otherwise; on a GPU the compute dtype (float16)
        for weight-only formats, fp8 / fp4 tensor cores where the format is one and the chip has them."""
        if self.kind == "cpu":
            want = ["float32"] if fmt == "float32" else ["int8", "float32"]
        else:
            own = {"fp8": "fp8", "nvfp4": "fp4", "mxfp4": "fp4", "float32": "float32"}.get(fmt)
            want = [own, "float16"] if own else ["float16"]
        kind = next(k for k in want if k in self.flops)
        return kind, self.flops[kind]


def _gpu(name, memory_gb, bandwidth_tb, fp32, fp16, int8, fp8, fp4, source) -> Hardware:
    rates = {"float32": fp32 * T, "float16": fp16 * T, "int8": int8 * T, "fp8": fp8 * T, "fp4": fp4 * T}
    return Hardware(name, "gpu", memory_gb * GB, bandwidth_tb * TB, {k: v for k, v in rates.items() if v}, source)


# Published figures, dense TFLOP/s (half the "with sparsity" ones); 0: the chip has no such path.
HARDWARE = {
    h.name: h
    for h in (
        # NVIDIA H100 datasheet (SXM): 80 GB HBM3, 3.35 TB/s, FP32 67, BF16 989, INT8 / FP8 1,979 TFLOPS dense
        _gpu("h100", 80, 3.35, 67, 989, 1979, 1979, 0, "NVIDIA H100 Tensor Core GPU datasheet, SXM5"),
        # NVIDIA H200 datasheet: 141 GB HBM3e, 4.8 TB/s, the H100 SXM's compute
        _gpu("h200", 141, 4.8, 67, 989, 1979, 1979, 0, "NVIDIA H200 Tensor Core GPU datasheet, SXM"),
        # NVIDIA HGX B200 datasheet, per GPU: 180 GB HBM3e, 7.7 TB/s; dense FP16 2.25, INT8 / FP8 4.5, FP4 9
        # PFLOPS (the sheet's sparse figures halved); FP32 75 TFLOPS
        _gpu("b200", 180, 7.7, 75, 2250, 4500, 4500, 9000, "NVIDIA HGX B200 datasheet (per GPU, dense = sparse / 2)"),
        # AMD Instinct MI300X datasheet: 192 GB HBM3, 5.3 TB/s, FP32 163.4 (matrix), FP16 1,307.4, INT8 / FP8 2,614.9
        _gpu("mi300x", 192, 5.3, 163.4, 1307.4, 2614.9, 2614.9, 0, "AMD Instinct MI300X data sheet"),
        # NVIDIA DGX Spark (GB10): 128 GB LPDDR5x unified at 273 GB/s; "1 PFLOP FP4" is sparse: 0.5 dense,
        # FP8 / FP16 derived as 1/2 and 1/4 of that (Blackwell's ratios), FP32 assumed 1/16
        _gpu("dgx-spark", 128, 0.273, 31, 125, 250, 250, 500, "NVIDIA DGX Spark specifications (GB10); rates derived"),
        # Apple M4 Max (40-core GPU): up to 128 GB unified at 546 GB/s (Apple); ~18 TFLOPS FP32/FP16 GPU
        # (third-party estimate: Apple publishes none)
        _gpu("m4-max", 128, 0.546, 18.4, 18.4, 0, 0, 0, "Apple M4 Max (40-core GPU) specifications; FLOPS estimated"),
        # CPUs: peak = cores x GHz x FMA units x lanes x 2; bandwidth = channels x MT/s x 8 bytes
        # this host class: 2 vCPU of an AMD EPYC Zen 3 (AVX2: 2 FMA x 8 float32 lanes at ~3 GHz per core;
        # int8 via vpmaddubsw ~2x) and what one core's share of the memory system streams (~20 GB/s)
        Hardware(
            "zen3-2core",
            "cpu",
            24 * 2**30,
            20 * GB,
            {"float32": 96 * 1e9, "int8": 192 * 1e9},
            "estimate: 2 vCPU AMD EPYC Zen 3 (AVX2), this project's benchmark host",
        ),
        # AMD EPYC 9654 (Zen 4, 96 cores, 2.4 GHz, AVX-512 on 256-bit units): 12 x DDR5-4800 = 460.8 GB/s
        Hardware(
            "epyc-9654",
            "cpu",
            768 * GB,
            460.8 * GB,
            {"float32": 7.4 * T, "int8": 14.7 * T},
            "AMD EPYC 9654 product page (12 channels DDR5-4800); peak FLOPS computed",
        ),
        # Intel Xeon Platinum 8480+ (Sapphire Rapids, 56 cores, 2.0 GHz, AVX-512 + AMX): 8 x DDR5-4800 =
        # 307 GB/s; AMX ~ 1,024 bf16 / 2,048 int8 ops per cycle per core
        Hardware(
            "xeon-8480",
            "cpu",
            512 * GB,
            307.2 * GB,
            {"float32": 7.2 * T, "float16": 229 * T, "int8": 459 * T},
            "Intel Xeon Platinum 8480+ (ark.intel.com, 8 channels DDR5-4800); AMX peak computed",
        ),
    )
}


def cache_path() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache"))) / "tokenmill" / "hardware.json"


def resolve_hardware(name: str, remeasure: bool = False) -> Hardware:
    """A table entry (`h100`, `m4-max`, ...) or `auto`: this machine, measured once and cached
    (`remeasure`: measured again, e.g. after a run on a busy machine)."""
    if name == "auto":
        return this_machine(remeasure)
    key = name.lower().replace("_", "-")
    if key not in HARDWARE:
        raise ValueError(f"unknown hardware {name!r}; known: auto, {', '.join(HARDWARE)}")
    return HARDWARE[key]


# How `measure` measures, named in each record's source: a record it made otherwise (an older release's:
# bandwidth on 4 KiB pages, int8 as one kernel's rate) is measured again; one written by hand is kept.
MEASURED_BY = "bandwidth on huge pages, int8 peak"


def this_machine(remeasure: bool = False) -> Hardware:
    path = cache_path()
    if path.is_file() and not remeasure:
        try:
            cached = Hardware(**json.loads(path.read_text()))
        except (json.JSONDecodeError, TypeError) as e:
            raise ValueError(f"{path} is not a hardware record ({e}); delete it to measure again") from None
        if cached.name != "this machine" or MEASURED_BY in cached.source:
            return cached
    hardware = measure()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(asdict(hardware), indent=1))
    return hardware


def measure(threads: int = 2) -> Hardware:
    """This machine, with `threads` torch threads (a few seconds): its read bandwidth (`measure_bandwidth`),
    the float32 rate of a 1024^3 torch GEMM and the int8 peak of the block tiles' instruction
    (`_int8_peak_rate`) where the kernels are built; memory from the OS."""
    import torch

    bandwidth = measure_bandwidth(threads)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a = torch.randn(1024, 1024)
        flops = {"float32": 2 * 1024**3 / _best(lambda: a @ a)}
        int8 = _int8_peak_rate()
        if int8:
            flops["int8"] = int8
    finally:
        torch.set_num_threads(previous)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return Hardware(
        "this machine",
        "cpu",
        float(memory),
        bandwidth,
        flops,
        f"measured {time.strftime('%Y-%m-%d')} with {threads} threads, {MEASURED_BY} (cached in {cache_path()})",
    )


def measure_bandwidth(threads: int = 2) -> float:
    """Bytes a second this machine reads with `threads` torch threads: a 256 MiB tensor summed, the best of
    5 passes (a read stream, as a decode step reads its weights; a second or so), on huge pages as the
    engine's CPU weights and KV cache are (`host_memory`: on 4 KiB pages a VM reads less)."""
    import torch

    from tokenmill.kernels import host_memory

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        src = host_memory.zeros((64 * 2**20,), torch.float32).fill_(1.0)
        return src.nbytes / _best(src.sum)
    finally:
        torch.set_num_threads(previous)


def _int8_peak_rate() -> float | None:
    """The int8 multiply-adds a second all threads do on the instruction the block tiles use (`block_quant.int8_peak`:
    independent chains, no loads), as FLOP/s: the hardware's rate, which the tiles reach a share of (None
    without the compiled kernels)."""
    from tokenmill.kernels import block_quant

    if block_quant.load() is None:
        return None
    iterations = 200_000  # x 12 chains: ~10 ms a pass at one 512-bit vpdpbusd a cycle
    macs = block_quant.int8_peak(iterations)
    return 2 * macs / _best(lambda: block_quant.int8_peak(iterations))


def _best(fn, repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)
