"""Compare two lm-eval runs of the same tasks item by item (their --log_samples files).

    python eval/compare_lm_eval.py RUN_A_DIR RUN_B_DIR [--tolerance 1e-3]

Log-likelihood and multiple-choice samples: every (loglikelihood, is_greedy) pair must agree, the
log-likelihoods within the tolerance. generate_until samples: the generated texts must be equal.
Also compares each task's metrics. Prints a table and exits 1 on any difference.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def load_run(directory: Path) -> tuple[dict[str, dict[int, dict]], dict]:
    samples: dict[str, dict[int, dict]] = {}
    for path in sorted(directory.rglob("samples_*.jsonl")):
        task = path.name[len("samples_") :].rsplit("_", 1)[0]
        with open(path) as f:
            samples[task] = {s["doc_id"]: s for s in map(json.loads, f)}
    results = [json.loads(p.read_text())["results"] for p in sorted(directory.rglob("results_*.json"))]
    if not samples or not results:
        raise SystemExit(f"{directory}: no lm-eval samples/results (run lm_eval with --log_samples)")
    return samples, {k: v for r in results for k, v in r.items()}


def compare(a: Path, b: Path, tolerance: float) -> int:
    (sa, ra), (sb, rb) = load_run(a), load_run(b)
    failures = 0
    for task in sorted(set(sa) | set(sb)):
        if task not in sa or task not in sb or set(sa[task]) != set(sb[task]):
            print(f"{task}: the runs scored different items")
            failures += 1
            continue
        worst, mismatched, scored = 0.0, 0, False
        for doc_id, x in sa[task].items():
            y = sb[task][doc_id]
            for rx, ry in zip(x["filtered_resps"], y["filtered_resps"]):
                if isinstance(rx, list) and len(rx) == 2 and not isinstance(rx[0], list):  # (loglikelihood, greedy)
                    scored, diff = True, abs(float(rx[0]) - float(ry[0]))
                    worst = max(worst, diff)
                    mismatched += diff > tolerance or rx[1] != ry[1]
                else:
                    mismatched += rx != ry
        metrics = {k: (ra[task][k], rb[task][k]) for k in ra.get(task, {}) if "," in k and "stderr" not in k}
        what = f"largest loglikelihood difference {worst:.2e}" if scored else "generated texts compared"
        print(
            f"{task}: {len(sa[task])} items, {mismatched} differ, {what}; "
            + ", ".join(f"{k} {x} vs {y}" for k, (x, y) in metrics.items())
        )
        failures += mismatched + sum(x != y for x, y in metrics.values())
    return failures


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_a", type=Path, help="an lm-eval --output_path of one backend")
    p.add_argument("run_b", type=Path, help="the same tasks through another backend")
    p.add_argument(
        "--tolerance", type=float, default=1e-3, help="largest allowed loglikelihood difference (default: %(default)s)"
    )
    args = p.parse_args()
    sys.exit(1 if compare(args.run_a, args.run_b, args.tolerance) else 0)


if __name__ == "__main__":
    main()
