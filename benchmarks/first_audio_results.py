"""What a first-audio run's points (python -m benchmarks.first_audio) come to: one row per side,
workload, arrival mode and level (listeners' time to first audio and stalls, throughput, the stages'
counters), each side's capacity, issue 36's verdicts, the JSON document, its table and its plot."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

from benchmarks.listener import listen
from benchmarks.report import distribution

__all__ = ["assemble", "capacity", "format_table", "plot", "summarize", "verdicts"]

LABELS = {"on": "pacing on", "off": "pacing off", "capped": "pacing capped", "server": "server"}
#: Issue 36's targets.
TARGET_TTFA_P90_RATIO = 1.5  # TTFA p90 at concurrency 8 / at 1
TARGET_LEVEL = 8


def _sum_counters(points: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for p in points:
        for stage, values in (p.get("counters") or {}).items():
            acc = out.setdefault(stage, {})
            for k, v in values.items():
                if k != "fresh":
                    acc[k] = acc.get(k, 0.0) + v
    return out


def summarize(points: Sequence[Mapping[str, Any]], jitter_s: float) -> list[dict[str, Any]]:
    """One row per (side, workload, arrival, level), its rounds pooled."""
    groups: dict[tuple, list[Mapping[str, Any]]] = {}
    for p in points:
        groups.setdefault((p["side"], p["workload"], p["arrival"], p["level"]), []).append(p)
    rows = []
    for (side, workload, arrival, level), mine in sorted(groups.items()):
        samples = [s for p in mine for s in p["samples"]]
        ok = [s for s in samples if s.get("ok")]
        plays = [listen(s, jitter_s) for s in ok]
        duration = sum(p["duration_s"] for p in mine)
        audio = sum(pl.audio_s for pl in plays)
        cpu = [p["resources"] for p in mine if p.get("resources")]
        rows.append(
            {
                "side": side,
                "workload": workload,
                "arrival": arrival,
                "level": level,
                "rounds": len(mine),
                "rate": mine[0].get("rate"),
                "requests": len(samples),
                "ok": len(ok),
                "duration_s": duration,
                "ttfa_s": distribution(pl.ttfa_s for pl in plays),
                "missing_audio": sum(pl.ttfa_s is None for pl in plays),
                "stalls": sum(pl.stalls for pl in plays),
                "stall_s": sum(pl.stall_s for pl in plays),
                "answers_stalled": sum(pl.stalls > 0 for pl in plays),
                "min_buffer_s": distribution(pl.min_buffer_s for pl in plays),
                "requests_per_s": len(ok) / duration if duration else math.nan,
                "audio_s_per_s": audio / duration if duration else math.nan,
                "audio_s": audio,
                "counters": _sum_counters(mine),
                "stage_cpu_s": sum(c.get("stage_cpu_s", 0.0) for c in cpu) if cpu else None,
                "stage_runqueue_wait_s": sum(c.get("stage_runqueue_wait_s", 0.0) for c in cpu) if cpu else None,
                "loadavg_mean": sum(c.get("loadavg_mean", 0.0) for c in cpu) / len(cpu) if cpu else None,
            }
        )
    return rows


def _row(
    rows: Sequence[Mapping[str, Any]], side: str, workload: str, arrival: str, level: int
) -> Mapping[str, Any] | None:
    for r in rows:
        if (r["side"], r["workload"], r["arrival"], r["level"]) == (side, workload, arrival, level):
            return r
    return None


def capacity(rows: Sequence[Mapping[str, Any]], side: str, workload: str, arrival: str) -> int:
    """The highest level up to which every answer was served without a stall (0: none)."""
    best = 0
    for r in sorted(
        (r for r in rows if (r["side"], r["workload"], r["arrival"]) == (side, workload, arrival)),
        key=lambda r: r["level"],
    ):
        if r["stalls"] or r["ok"] < r["requests"] or r["missing_audio"]:
            break
        best = r["level"]
    return best


def _total(rows: Sequence[Mapping[str, Any]], side: str, workload: str, arrival: str) -> dict[str, float]:
    mine = [r for r in rows if (r["side"], r["workload"], r["arrival"]) == (side, workload, arrival)]
    duration = sum(r["duration_s"] for r in mine)
    return {
        "requests_per_s": sum(r["ok"] for r in mine) / duration if duration else math.nan,
        "audio_s_per_s": sum(r["audio_s"] for r in mine) / duration if duration else math.nan,
    }


def verdicts(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Issue 36's targets per workload (closed loop), where the run has what they need."""
    out = []
    for workload in sorted({r["workload"] for r in rows}):
        for side in ("on", "capped"):
            on1, on8 = (_row(rows, side, workload, "closed", c) for c in (1, TARGET_LEVEL))
            if on1 and on8:
                ratio = on8["ttfa_s"]["p90"] / on1["ttfa_s"]["p90"]
                out.append(
                    {
                        "workload": workload,
                        "value": ratio,
                        "stalls": on8["stalls"],
                        "name": f"TTFA p90 at 8 / at 1 ({LABELS[side]}), 0 stalls at 8",
                        "target": f"<= {TARGET_TTFA_P90_RATIO:g}, 0 stalls",
                        "met": bool(ratio <= TARGET_TTFA_P90_RATIO and on8["stalls"] == 0),
                    }
                )
        if any(r["side"] == "off" and r["workload"] == workload for r in rows) and any(
            r["side"] == "on" and r["workload"] == workload for r in rows
        ):
            for arrival in sorted({r["arrival"] for r in rows if r["workload"] == workload}):
                con, coff = capacity(rows, "on", workload, arrival), capacity(rows, "off", workload, arrival)
                out.append(
                    {
                        "workload": workload,
                        "name": f"capacity ({arrival}): highest level with 0 stalls",
                        "value": con,
                        "baseline": coff,
                        "target": ">= pacing off",
                        "met": con >= coff,
                    }
                )
                ton, toff = _total(rows, "on", workload, arrival), _total(rows, "off", workload, arrival)
                for key in ("requests_per_s", "audio_s_per_s"):
                    out.append(
                        {
                            "workload": workload,
                            "name": f"throughput ({arrival}, {key}, whole sweep)",
                            "value": ton[key],
                            "baseline": toff[key],
                            "target": ">= pacing off",
                            "change": ton[key] / toff[key] - 1 if toff[key] else math.nan,
                            "met": ton[key] >= toff[key],
                        }
                    )
    return out


def assemble(
    points: list[dict[str, Any]],
    config: Mapping[str, Any],
    note: str,
    machine: Mapping[str, Any],
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    from benchmarks.harness import command_line

    rows = summarize(points, config["jitter_s"])
    return {
        "benchmark": "omni_cache first audio under load (python -m benchmarks.first_audio)",
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": command_line("benchmarks.first_audio"),
        "note": note,
        "machine": dict(machine),
        "config": {**config, "sides": sorted({p["side"] for p in points})},
        **(extra or {}),
        "rows": rows,
        "capacity": {
            f"{s}/{w}/{a}": capacity(rows, s, w, a)
            for s, w, a in sorted({(r["side"], r["workload"], r["arrival"]) for r in rows})
        },
        "targets": verdicts(rows),
        "points": points,
    }


def _ms(v: float | None) -> str:
    return "-" if v is None or math.isnan(v) else f"{v * 1000:.0f}"


def format_table(result: Mapping[str, Any]) -> str:
    lines = [
        (
            f"{'side':<10} {'workload':<14} {'arrival':<8} {'C':>3} {'ok':>7} {'TTFA p50':>9} "
            f"{'p90':>6} {'p99':>6} {'stalls':>6} {'stall s':>8} {'req/s':>6} {'audio s/s':>9} "
            f"{'paced':>5} {'shared':>6}"
        )
    ]
    for r in result["rows"]:
        t = r["ttfa_s"]
        talker = r["counters"].get("talker", {})
        lines.append(
            f"{LABELS.get(r['side'], r['side']):<10} {r['workload']:<14} {r['arrival']:<8} {r['level']:>3} "
            f"{str(r['ok']) + '/' + str(r['requests']):>7} {_ms(t['p50']):>9} {_ms(t['p90']):>6} "
            f"{_ms(t['p99']):>6} {r['stalls']:>6} {r['stall_s']:>8.2f} {r['requests_per_s']:>6.3f} "
            f"{r['audio_s_per_s']:>9.2f} {talker.get('paced', 0):>5.0f} "
            f"{talker.get('first_audio_shared_steps', 0):>6.0f}"
        )
    lines.append(
        "capacity (highest level with 0 stalls): " + ", ".join(f"{k} {v}" for k, v in result["capacity"].items())
    )
    for t in result["targets"]:
        base = f" (pacing off {t['baseline']:.3g})" if "baseline" in t else ""
        lines.append(
            f"target [{t['workload']}] {t['name']}: {t['value']:.3g}{base}, want {t['target']}: "
            + ("MET" if t["met"] else "NOT MET")
        )
    return "\n".join(lines)


def plot(path: str | os.PathLike[str], result: Mapping[str, Any]) -> None:
    """TTFA p50/p90 and stall seconds against the level: one row per workload, solid closed
    loop, dashed Poisson; one colour per side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    workloads = sorted({r["workload"] for r in rows})
    colors = {"on": "#1f77b4", "off": "#d62728", "capped": "#9467bd", "server": "#2ca02c"}
    fig, axes = plt.subplots(len(workloads), 2, figsize=(11, 3.8 * len(workloads)), squeeze=False)
    for i, workload in enumerate(workloads):
        ax_t, ax_s = axes[i]
        for side in sorted({r["side"] for r in rows}):
            for arrival, style in (("closed", "-"), ("poisson", "--")):
                mine = sorted(
                    (r for r in rows if (r["side"], r["workload"], r["arrival"]) == (side, workload, arrival)),
                    key=lambda r: r["level"],
                )
                if not mine:
                    continue
                xs = [r["level"] for r in mine]
                label = f"{LABELS.get(side, side)}, {arrival}"
                ax_t.plot(
                    xs,
                    [r["ttfa_s"]["p90"] * 1000 for r in mine],
                    style,
                    marker="o",
                    color=colors.get(side),
                    label=label + " p90",
                )
                ax_t.plot(
                    xs,
                    [r["ttfa_s"]["p50"] * 1000 for r in mine],
                    style,
                    marker=".",
                    color=colors.get(side),
                    alpha=0.45,
                    label=label + " p50",
                )
                ax_s.plot(
                    xs,
                    [r["stall_s"] for r in mine],
                    style,
                    marker="o",
                    color=colors.get(side),
                    label=f"{label} ({sum(r['stalls'] for r in mine)} stalls)",
                )
        for ax in (ax_t, ax_s):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrency (streams)")
            ax.grid(alpha=0.3)
        ax_t.set_yscale("log")
        ax_t.set_ylabel("time to first audio (ms)")
        ax_t.set_title(f"{workload}: time to first audio")
        ax_s.set_ylabel(f"stall seconds (all answers, jitter buffer {result['config']['jitter_s'] * 1000:.0f} ms)")
        ax_s.set_title(f"{workload}: playback stalls")
        ax_t.legend(fontsize=7)
        ax_s.legend(fontsize=7)
    fig.suptitle(f"{result['benchmark']}, {result['machine'].get('cpu_model', '')}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
