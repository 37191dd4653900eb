"""PNG charts (matplotlib, Agg: no display needed): latency CDFs, sweep curves and run comparisons.

Figures are built with `matplotlib.figure.Figure` directly, not pyplot, so no global state is touched.
"""

from __future__ import annotations

import math
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import FuncFormatter, MaxNLocator

from tokenmill.bench.report import LATENCY_NAMES, runs_of

_CDF_METRICS = ("ttft", "itl", "tpot", "e2el")


def _figure(ncols: int, nrows: int = 1, width: float = 4.6, height: float = 3.6) -> tuple[Figure, list]:
    fig = Figure(figsize=(width * ncols, height * nrows), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=False)
    return fig, [ax for row in axes for ax in row]


def _save(fig: Figure, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


def latency_samples(result: dict, metric: str) -> list[float]:
    """Per-request (per-gap for ITL) latencies in ms of the successful requests of a run."""
    ok = [r for r in result["requests"] if r["success"]]
    if metric == "itl":
        return [1000 * g for r in ok for g in r["itl"]]
    key = {"ttft": "ttft", "tpot": "tpot", "e2el": "e2e"}[metric]
    return [1000 * r[key] for r in ok if r.get(key) is not None]


def plot_latency_cdfs(named: list[tuple[str, dict]], path: str | Path) -> Path:
    """Empirical CDFs of TTFT, ITL, TPOT and E2E latency, one line per run."""
    fig, axes = _figure(2, 2)
    for ax, metric in zip(axes, _CDF_METRICS):
        for name, result in named:
            xs = sorted(latency_samples(result, metric))
            if xs:  # the empirical CDF: 0 before the smallest sample, k/n from the k-th
                ax.step([xs[0], *xs], [0.0, *((i + 1) / len(xs) for i in range(len(xs)))], where="post", label=name)
        ax.set_title(f"{LATENCY_NAMES[metric]} CDF")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of requests" if metric != "itl" else "fraction of token gaps")
        ax.set_ylim(0, 1.02)
        ax.ticklabel_format(axis="x", useOffset=False, style="plain")
        ax.xaxis.set_major_locator(MaxNLocator(6))
        ax.grid(alpha=0.3)
    if any(name for name, _ in named) and axes[0].get_legend_handles_labels()[0]:
        axes[0].legend(fontsize="small")
    return _save(fig, path)


_P99_STYLES = {"ttft": "-", "tpot": "--", "itl": ":", "e2el": "-."}


def _has_data(ax) -> bool:
    """Some line of `ax` has a positive, finite point (what a log scale needs)."""
    return any(
        x > 0 and y > 0 and math.isfinite(y)
        for line in ax.get_lines()
        for x, y in zip(line.get_xdata(), line.get_ydata())
    )


def _p99(points: list[dict], metric: str) -> list[float]:
    """P99 of `metric` (ms) at each point; NaN (a gap in the line) where no request succeeded."""
    values = [p["summary"][f"{metric}_ms"]["p99"] for p in points]
    return [math.nan if v is None else v for v in values]


def plot_sweeps(named: list[tuple[str, dict]], path: str | Path) -> Path:
    """Throughput vs load, P99 latencies vs load and the throughput-latency curve; one color per sweep,
    one line style per latency metric. The knee is circled and SLO thresholds are dashed red lines."""
    fig, (ax_tput, ax_p99, ax_curve) = _figure(3)
    by = named[0][1]["sweep_by"]
    for name, sweep in named:
        pts = sweep["points"]
        loads = [p["load"] for p in pts]
        tput = [p["summary"]["output_throughput"] for p in pts]
        (line,) = ax_tput.plot(loads, tput, marker="o", label=name)
        for metric, style in _P99_STYLES.items():
            ax_p99.plot(loads, _p99(pts, metric), style, marker=".", color=line.get_color())
        ax_curve.plot(tput, _p99(pts, "e2el"), marker="o", color=line.get_color())
        knee = sweep.get("knee")
        if knee and knee["load"] in loads:
            k = loads.index(knee["load"])
            ax_tput.plot(
                [loads[k]],
                [tput[k]],
                "o",
                markersize=14,
                fillstyle="none",
                color="green",
                label="knee" if name == named[0][0] else None,
            )
    log_ok = {ax: _has_data(ax) for ax in (ax_tput, ax_p99)}  # before the SLO lines, which are not data
    for metric, limit in (named[0][1].get("slo") or {}).items():
        ax_p99.axhline(limit, color="red", linestyle=_P99_STYLES[metric], linewidth=0.8, alpha=0.7)
    ax_tput.set(title="output throughput", xlabel=by.replace("_", " "), ylabel="tokens/s")
    ax_p99.set(title="P99 latency (red: SLO)", xlabel=by.replace("_", " "), ylabel="ms")
    if log_ok[ax_p99]:
        ax_p99.set_yscale("log")
    ax_curve.set(title="throughput vs latency", xlabel="output tokens/s", ylabel="P99 E2E latency (ms)")
    for ax in (ax_tput, ax_p99, ax_curve):
        ax.grid(alpha=0.3)
    if by == "max_concurrency":
        for ax in (ax_tput, ax_p99):
            if log_ok[ax]:  # a log axis with nothing on it cannot place ticks
                ax.set_xscale("log", base=2)
            ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))
    ax_tput.legend(fontsize="small")
    ax_p99.legend(
        [Line2D([], [], color="black", linestyle=s) for s in _P99_STYLES.values()],
        [LATENCY_NAMES[m] for m in _P99_STYLES],
        fontsize="small",
    )
    return _save(fig, path)


_BAR_PANELS = [
    ("throughput (req/s)", [("req/s", lambda s: s["request_throughput"]), ("goodput", lambda s: s["goodput"])]),
    (
        "throughput (tokens/s)",
        [("output", lambda s: s["output_throughput"]), ("total", lambda s: s["total_token_throughput"])],
    ),
    *[
        (f"{LATENCY_NAMES[m]} (ms)", [(stat, lambda s, m=m, stat=stat: s[f"{m}_ms"][stat]) for stat in ("p50", "p99")])
        for m in ("ttft", "tpot", "itl", "e2el")
    ],
]


def plot_compare(named: list[tuple[str, dict]], path: str | Path) -> Path:
    """Side-by-side bars of throughput and latency for several runs (sweeps contribute every point)."""
    runs = [run for name, r in named for run in runs_of(r, name)]
    fig, axes = _figure(3, 2, width=5.2)
    width = 0.8 / max(1, len(runs))
    for ax, (title, series) in zip(axes, _BAR_PANELS):
        for i, (run_name, run) in enumerate(runs):
            values = [get(run["summary"]) or 0.0 for _, get in series]
            xs = [j + (i - (len(runs) - 1) / 2) * width for j in range(len(series))]
            ax.bar(xs, values, width, label=run_name)
        ax.set_xticks(range(len(series)), [label for label, _ in series])
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
    fig.legend(
        *axes[0].get_legend_handles_labels(), loc="outside lower center", ncols=min(len(runs), 4), fontsize="small"
    )
    return _save(fig, path)


def write_plots(result: dict, prefix: str | Path) -> list[Path]:
    """The charts of a run or a sweep, as `<prefix>_*.png`."""
    prefix = str(prefix)
    if result["kind"] == "sweep":
        return [
            plot_sweeps([(result.get("label") or "sweep", result)], f"{prefix}_sweep.png"),
            plot_latency_cdfs([(p["label"], p) for p in result["points"]], f"{prefix}_latency_cdf.png"),
        ]
    return [plot_latency_cdfs([(result.get("label") or "", result)], f"{prefix}_latency_cdf.png")]
