"""Context parallelism's cost: for each layout (decode / prefill context-parallel sizes), in a fresh
process, one prompt prefilled in one step and then decoded; per rank, the KV bytes a token of the
sequence takes and the bytes this rank contributes to context-parallel all-gathers (the
`parallel_state.stats` counter) per prompt token and per decoded token, next to what the layout
should move on paper (`expected`). No times: on a shared 2-core host they mean nothing.

    .venv/bin/python benchmarks/bench_context_parallel.py [--model M] [--layouts 1x1,2x1,1x2] [--prompt-len 256]
        [--tokens 16]

A layout is DCPxPCP. Default model: SmolLM2-135M-Instruct Q4_1 (30 layers, 9 heads of 64, 3 kv heads).
Prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

_RUN = r"""
import json, sys
from tokenmill.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig
from tokenmill.distributed import parallel_state
from tokenmill.engine.core import EngineCore
from tokenmill.engine.request import EngineCoreRequest
from tokenmill.executor import executor_for
from tokenmill.sampling_params import SamplingParams

model, dcp, pcp, prompt_len, tokens = sys.argv[1], *map(int, sys.argv[2:])
config = EngineConfig(model=model, cache=CacheConfig(num_blocks=(prompt_len + tokens) // 16 + 8),
                      scheduler=SchedulerConfig(max_num_batched_tokens=max(512, prompt_len)),
                      parallel=ParallelConfig(decode_context_parallel_size=dcp, prefill_context_parallel_size=pcp))
executor = executor_for(config)
core = EngineCore(config, executor, set())
prompt = [(37 * i) % 5000 + 100 for i in range(prompt_len)]
core.add_request(EngineCoreRequest("0", prompt, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)))
stats = parallel_state.stats
stats.__init__()
core.step()  # the prefill
prefill = stats.bytes.get("cp_all_gather", 0)
stats.__init__()
while core.has_unfinished():
    core.step()
decode = stats.bytes.get("cp_all_gather", 0)
m = executor.model_config
print("RESULT " + json.dumps({
    "kv_bytes_per_token": core.kv_cache_config.bytes_per_token, "prefill": prefill, "decode": decode,
    "layers": m.num_hidden_layers, "heads": m.num_attention_heads, "head_dim": m.head_dim, "hidden": m.hidden_size}))
executor.close()
"""


def expected(r: dict, dcp: int, pcp: int, prompt_len: int) -> tuple[float, float]:
    """Bytes this rank contributes per prompt token and per decoded token (float32): every layer
    all-gathers each query's partial output and log-sum-exp over the rank's stripe (heads x (dim + 1));
    a split prefill also gathers this rank's queries (its ~1/N of them, heads x dim) in every layer and
    its final hidden states once."""
    n = max(dcp, pcp)
    if n == 1:
        return 0.0, 0.0
    partial = r["layers"] * r["heads"] * (r["head_dim"] + 1) * 4
    share = -(-prompt_len // n) / prompt_len  # rows padded to the largest share
    prefill = partial
    if pcp > 1:
        prefill += share * (r["layers"] * r["heads"] * r["head_dim"] * 4 + r["hidden"] * 4)
    return prefill, partial


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="model alias or path (default: %(default)s)")
    parser.add_argument(
        "--layouts",
        default="1x1,2x1,1x2",
        help="layouts to measure, comma-separated, each DCPxPCP: decode x prefill context-parallel size; "
        "1x1 = no context parallelism (default: %(default)s)",
    )
    parser.add_argument(
        "--prompt-len",
        type=int,
        default=256,
        help="prompt length in tokens, prefilled in one step (default: %(default)s)",
    )
    parser.add_argument(
        "--tokens", type=int, default=16, help="tokens decoded after the prefill (default: %(default)s)"
    )
    args = parser.parse_args()
    print(
        "| DCP x PCP | KV bytes / token / rank | gathered B / prompt token (expected) | "
        "gathered B / decoded token (expected) |"
    )
    print("|---|---|---|---|")
    for layout in args.layouts.split(","):
        dcp, pcp = map(int, layout.split("x"))
        done = subprocess.run(
            [sys.executable, "-c", _RUN, args.model, str(dcp), str(pcp), str(args.prompt_len), str(args.tokens)],
            capture_output=True,
            text=True,
            check=False,
        )
        lines = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
        if not lines:
            sys.exit(done.stderr[-3000:])
        r = json.loads(lines[0][len("RESULT ") :])
        want_prefill, want_decode = expected(r, dcp, pcp, args.prompt_len)
        decoded = args.tokens - 1  # the prefill step sampled the first
        print(
            f"| {layout} | {r['kv_bytes_per_token']:,} | {r['prefill'] / args.prompt_len:,.0f} "
            f"({want_prefill:,.0f}) | {r['decode'] / decoded:,.0f} ({want_decode:,.0f}) |"
        )


if __name__ == "__main__":
    main()
