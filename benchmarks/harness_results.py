"""The end-to-end benchmark's result (python -m benchmarks): the runs of a side pooled, the
per-side summaries, the ratios of the two compared sides (pooled, per round, paired), the targets
and every sample, as one JSON document."""

from __future__ import annotations

import os
import time
from typing import Any

from benchmarks.harness import command_line, compared_sides
from benchmarks.machine_monitor import Monitor
from benchmarks.report import (
    answers_identical,
    evaluate_targets,
    paired_interval,
    paired_ratios,
    ratios,
    summarize_side,
)


def _sum_resources(dicts: list[dict[str, Any]]) -> dict[str, Any]:
    """Resources of several runs as one: summed (per process where they are by process), the
    load averaged, resident memory (taken at each run's end) the largest."""
    out: dict[str, Any] = {}
    for k in dicts[0]:
        vals = [d[k] for d in dicts if k in d]
        if k == "rss_mib_by_process":
            out[k] = {n: max(v.get(n, 0.0) for v in vals) for n in vals[0]}
        elif isinstance(vals[0], dict):
            out[k] = _sum_resources(vals)
        elif k in ("loadavg_mean", "cpu_busy_pct_mean"):
            out[k] = sum(vals) / len(vals)
        else:
            out[k] = sum(vals)
    return out


def pool_runs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Several runs of one side as one: samples concatenated, durations, counters and
    resources summed (load averaged)."""
    samples = [s for r in runs for s in r["samples"]]
    duration = sum(r["duration_s"] for r in runs)
    counters: dict[str, dict[str, float]] | None = {}
    for r in runs:
        if r.get("counters") is None:
            counters = None
            break
        for stage, vals in r["counters"].items():
            acc = counters.setdefault(stage, {})
            for k, v in vals.items():
                acc[k] = min(acc.get(k, v), v) if k == "fresh" else acc.get(k, 0.0) + v
    resources: dict[str, Any] | None = None
    if all(r.get("resources") for r in runs):
        resources = _sum_resources([r["resources"] for r in runs])
    return {"samples": samples, "duration_s": duration, "counters": counters, "resources": resources}


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    pooled = pool_runs(runs)
    return summarize_side(pooled["samples"], pooled["duration_s"], pooled["counters"], pooled["resources"])


def assemble(
    config: dict[str, Any], machine: dict[str, Any], runs: list[dict[str, Any]], monitor: Monitor | None
) -> dict[str, Any]:
    """The JSON document: per-side pooled summaries, ratios (pooled, per round, and the median of
    the per-round ratios), targets, every sample."""
    sides: dict[str, Any] = {}
    samples: dict[str, list[dict[str, Any]]] = {}
    for side in dict.fromkeys(r["side"] for r in runs):
        mine = [r for r in runs if r["side"] == side]
        sides[side] = _summary(mine)
        samples[side] = [s for r in mine for s in r["samples"]]
    result: dict[str, Any] = {
        "benchmark": "omni_cache end-to-end (python -m benchmarks)",
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": command_line(),
        "machine": {**machine, "loadavg_end": list(os.getloadavg())},
        "config": config,
        "sides": sides,
    }
    pair = compared_sides(list(sides))
    if pair is not None:
        first, second = pair
        result["compared"] = {"first": first, "second": second}
        result["ratios"] = ratios(sides[first], sides[second])
        per_round = []
        for rnd in sorted({r["round"] for r in runs}):
            a = [r for r in runs if r["side"] == first and r["round"] == rnd]
            b = [r for r in runs if r["side"] == second and r["round"] == rnd]
            if a and b:  # "start": which start of the pipelines served the round (--restart-every)
                per_round.append({"round": rnd, "start": a[0].get("start", 0), **ratios(_summary(a), _summary(b))})
        result["ratios_per_round"] = per_round
        result["paired_ratios"] = paired_ratios(per_round)
        result["paired_ratios_median"] = paired_ratios(per_round, "median")
        result["paired_intervals"] = paired_interval(per_round)
        result["answers_identical"] = answers_identical(samples[first], samples[second])
        result["targets"] = evaluate_targets(
            config.get("workload", ""), result["paired_ratios"], config.get("sizes"), sides=sides
        )
    result["runs"] = [{k: v for k, v in r.items() if k != "samples"} for r in runs]
    result["samples"] = samples
    if monitor is not None:
        result["machine_timeline"] = [{"t": t, "loadavg1": la, "cpu_busy_pct": c} for t, la, c in monitor.timeline]
    return result
