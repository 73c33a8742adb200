"""PNG figures of the paper reproduction, drawn from `PaperResults` runs.

matplotlib through `Figure` objects only (no pyplot): no global figure state, no GUI backend,
PNGs rendered by Agg, so plotting is safe inside a server process or a test.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Any, Sequence

from matplotlib.figure import Figure

from llumdask.benchmarks.paper import AUTOSCALING, PRIORITIES, SERVING, PaperResults

# One colour and marker per policy preset, the same in every figure.
STYLE = {
    "round_robin": ("tab:gray", "x"),
    "infaas": ("tab:red", "s"),
    "lmetric": ("tab:purple", "v"),
    "power_of_two": ("tab:brown", "^"),
    "llumnix_base": ("tab:cyan", "D"),
    "llumnix": ("tab:blue", "o"),
    "oracle": ("tab:green", "*"),
}
SERVING_PANELS = (
    ("prefill_mean", "prefill mean (s)", True),
    ("prefill_p99", "prefill P99 (s)", True),
    ("decode_mean", "decode mean (s/token)", False),
    ("decode_p99", "decode P99 (s/token)", False),
    ("e2e_mean", "end-to-end mean (s)", True),
    ("preemption_loss_mean", "preemption loss mean (s)", False),
)
_DPI = 100


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def _series(runs: Sequence[dict[str, Any]], x: str, y: str) -> tuple[list[float], list[float]]:
    points = sorted((r[x], r[y]) for r in runs if _finite(r.get(y)))
    return [p[0] for p in points], [p[1] for p in points]


def _style_axes(ax, title: str, xlabel: str, log: bool) -> None:
    ax.set_title(title, fontsize=9)
    ax.set_xlabel(xlabel, fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(True, alpha=0.3)
    if log:
        ax.set_yscale("log")


def _policy_lines(ax, runs: Sequence[dict[str, Any]], x: str, y: str) -> None:
    by_policy: dict[str, list[dict[str, Any]]] = {}
    for run in runs:
        by_policy.setdefault(run["policy"], []).append(run)
    for policy, group in by_policy.items():
        color, marker = STYLE.get(policy, ("black", "."))
        xs, ys = _series(group, x, y)
        ax.plot(xs, ys, color=color, marker=marker, markersize=4, linewidth=1.2, label=policy)


def _save(fig: Figure, path: Path) -> Path:
    fig.savefig(path, dpi=_DPI)
    return path


def serving_figure(results: PaperResults, trace: str, path: Path) -> Path:
    """Six metrics against the load, one line per policy (the paper's serving figures plot the rate;
    each seed's rate is its own requests' capacity times the load)."""
    runs = results.select(SERVING, trace=trace)
    fig = Figure(figsize=(12, 6.5), layout="constrained")
    axes = fig.subplots(2, 3).flat
    for ax, (metric, title, log) in zip(axes, SERVING_PANELS):
        _policy_lines(ax, runs, "load", metric)
        _style_axes(ax, title, "load (fraction of ideal capacity)", log and all(r[metric] > 0 for r in runs if _finite(r.get(metric))))
    axes_list = fig.axes
    axes_list[0].legend(fontsize=7)
    fig.suptitle(f"{trace}: {results.plan.instances} instances, {results.plan.requests} requests per run", fontsize=10)
    return _save(fig, path)


def fragmentation_figure(results: PaperResults, path: Path) -> Path:
    """Fragmented share of cluster memory over time at the plan's timeline setting."""
    trace, load = results.plan.timeline
    fig = Figure(figsize=(9, 3.5), layout="constrained")
    ax = fig.subplots()
    for run in results.select(SERVING, trace=trace, load=load):
        if "timeline" in run:
            color, _ = STYLE.get(run["policy"], ("black", "."))
            series = run["timeline"]
            ax.plot(series["time"], [100 * f for f in series["fragmentation"]], color=color, linewidth=0.8,
                    label=f"{run['policy']} (mean {100 * run['fragmentation_mean']:.2f}%)")
    _style_axes(ax, f"fragmentation over time, {trace} at load {load:g}", "time (s)", False)
    ax.set_ylabel("fragmented memory (% of cluster)", fontsize=8)
    ax.legend(fontsize=7)
    return _save(fig, path)


def priorities_figure(results: PaperResults, path: Path) -> Path:
    """High- and normal-priority latencies against the arrival CV, with and without priorities."""
    runs = results.select(PRIORITIES)
    fig = Figure(figsize=(12, 3.5), layout="constrained")
    for ax, metric in zip(fig.subplots(1, 3), ("prefill_mean", "decode_mean", "e2e_mean")):
        for policy in dict.fromkeys(r["policy"] for r in runs):
            color, marker = STYLE.get(policy, ("black", "."))
            group = [r for r in runs if r["policy"] == policy]
            for priority, dash in (("high", "-"), ("normal", "--")):
                xs, ys = _series(group, "cv", f"{priority}_{metric}")
                ax.plot(xs, ys, dash, color=color, marker=marker, markersize=4, label=f"{policy} {priority}")
        _style_axes(ax, metric.replace("_", " ") + " (s)", "arrival CV (Gamma)", False)
    fig.axes[0].legend(fontsize=7)
    return _save(fig, path)


def autoscaling_figure(results: PaperResults, path: Path) -> Path:
    """Cost (mean instances) against P99 prefill over the band sweep, one curve per policy and load
    (the saving at equal P99 is read between them); instance count over time at the paper's band."""
    runs = results.select(AUTOSCALING)
    fig = Figure(figsize=(12, 3.8), layout="constrained")
    curves, over_time = fig.subplots(1, 2, width_ratios=(1.2, 1))
    loads = sorted(dict.fromkeys(r["load"] for r in runs))
    for load, dash in zip(loads, ("-", "--", ":", "-.")):
        for policy in dict.fromkeys(r["policy"] for r in runs):
            color, marker = STYLE.get(policy, ("black", "."))
            points = sorted((r["prefill_p99"], r["instances_serving_mean"]) for r in runs
                            if r["policy"] == policy and r["load"] == load and _finite(r.get("prefill_p99")))
            curves.plot([p for p, _ in points], [c for _, c in points], dash, color=color, marker=marker, markersize=4,
                        label=f"{policy}, load {load:g}")
    _style_axes(curves, "cost vs P99 prefill over the band sweep", "prefill P99 (s)", False)
    curves.set_xscale("log")
    curves.set_ylabel("mean instances", fontsize=8)
    paper_band = next((b for b in results.plan.autoscale_bands if tuple(b) == (10.0, 60.0)), results.plan.autoscale_bands[0])
    middle = loads[len(loads) // 2] if loads else None
    for run in (r for r in runs if r["load"] == middle and tuple(r["band"]) == tuple(paper_band) and "timeline" in r):
        color, _ = STYLE.get(run["policy"], ("black", "."))
        over_time.step(run["timeline"]["time"], run["timeline"]["instances"], where="post", color=color,
                       linewidth=0.9, label=run["policy"])
    title = f"instances over time, load {middle:g}, band [{paper_band[0]:g}, {paper_band[1]:g}]" if middle is not None else ""
    _style_axes(over_time, title, "time (s)", False)
    for ax in (curves, over_time):
        ax.legend(fontsize=7)
    return _save(fig, path)


def autoscaling_frontier_figure(results: PaperResults, path: Path) -> Path:
    """Every (band, scale-in period) setting as a point of cost against P99 prefill, one panel per
    load, and each policy's frontier: its cheapest setting meeting each P99 (the step line), which
    the saving at equal P99 is read between."""
    runs = [r for r in results.select(AUTOSCALING) if _finite(r.get("prefill_p99"))]
    loads = sorted(dict.fromkeys(r["load"] for r in runs))
    periods = sorted(dict.fromkeys(r["scale_in_period"] for r in runs))
    fig = Figure(figsize=(5.5 * max(len(loads), 1), 3.8), layout="constrained")
    for ax, load in zip(fig.subplots(1, max(len(loads), 1), squeeze=False)[0], loads):
        for policy in dict.fromkeys(r["policy"] for r in runs):
            color, _ = STYLE.get(policy, ("black", "."))
            mine = sorted((r["prefill_p99"], r["instances_serving_mean"], r["scale_in_period"]) for r in runs
                          if r["policy"] == policy and r["load"] == load)
            for period, marker in zip(periods, "osD^v"):
                ax.scatter([p for p, _, q in mine if q == period], [c for _, c, q in mine if q == period], color=color,
                           marker=marker, s=18, label=f"{policy}, in after {period:g} s")
            cheapest = list(itertools.accumulate((c for _, c, _ in mine), min))
            ax.step([p for p, _, _ in mine], cheapest, where="post", color=color, linewidth=1.0)
        _style_axes(ax, f"load {load:g}: cost vs P99 prefill, bands x scale-in periods", "prefill P99 (s)", False)
        ax.set_xscale("log")
        ax.set_ylabel("mean instances", fontsize=8)
        ax.legend(fontsize=6)
    return _save(fig, path)


def scalability_figure(results: PaperResults, path: Path) -> Path:
    """Per-call scheduler times against the number of instances, with the goals."""
    rows = results.scalability
    sizes = [r["instances"] for r in rows]
    fig = Figure(figsize=(9, 3.5), layout="constrained")
    dispatch, pairing = fig.subplots(1, 2)
    for ax, keys, goal, unit in (
        (dispatch, ("dispatch_p50_us", "dispatch_p99_us"), 200.0, "us"),
        (pairing, ("pairing_p50_ms", "pairing_p99_ms"), 5.0, "ms"),
    ):
        for key, marker in zip(keys, ("o", "s")):
            ax.plot(sizes, [r[key] for r in rows], marker=marker, label=key.rsplit("_", 2)[1])
        ax.axhline(goal, color="tab:red", linestyle=":", label=f"goal {goal:g} {unit}")
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, labels=[str(n) for n in sizes])
        _style_axes(ax, f"{keys[0].split('_')[0]} time per call ({unit})", "instances", True)
        ax.legend(fontsize=7)
    return _save(fig, path)


def write_figures(results: PaperResults, out: Path) -> dict[str, str]:
    """Every figure the results allow, as {name: file name inside `out`}."""
    out.mkdir(parents=True, exist_ok=True)
    figures: dict[str, Path] = {}
    for trace in results.plan.traces:
        figures[f"serving-{trace}"] = serving_figure(results, trace, out / f"serving-{trace}.png")
    figures["fragmentation"] = fragmentation_figure(results, out / "fragmentation.png")
    figures["priorities"] = priorities_figure(results, out / "priorities.png")
    figures["autoscaling"] = autoscaling_figure(results, out / "autoscaling.png")
    figures["scalability"] = scalability_figure(results, out / "scalability.png")
    return {name: path.name for name, path in figures.items()}
