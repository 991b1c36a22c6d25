"""The PNG of ``python -m benchmarks`` (``--plot``): each side's latency CDFs with their medians
marked, and every request's time to first audio in the order sent.

Like :mod:`benchmarks.report`, it works on the result's plain dicts, so a saved JSON can be
plotted again without engines.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

from benchmarks.report import LABELS, LATENCIES, fmt_number, percentile

__all__ = ["fmt_seconds", "plot"]

COLORS = {"on": "#1f77b4", "off": "#d62728", "server": "#2ca02c"}


def fmt_seconds(v: float) -> str:
    """0.0123 -> '12.3 ms', 0.68 -> '680 ms', 5.9 -> '5.90 s', 22.2 -> '22.2 s'."""
    if v is None or math.isnan(v):
        return "-"
    if v < 0.1:
        return f"{v * 1000:.1f} ms"
    if v < 1:
        return f"{v * 1000:.0f} ms"
    if v < 10:
        return f"{v:.2f} s"
    return f"{v:.1f} s"


def _scale_axis(ax: Any, which: str, values: Sequence[float]) -> str:
    """A log scale (plain-number ticks at 1, 2, 3, 5 x 10^k) when the values span more than 4x,
    else linear; returns the scale's name for the axis label."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    pos = [v for v in values if v > 0]
    if not pos or max(pos) / min(pos) <= 4:
        return "linear"
    (ax.set_xscale if which == "x" else ax.set_yscale)("log")
    axis = ax.xaxis if which == "x" else ax.yaxis
    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 3.0, 5.0)))
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(NullFormatter())
    return "log"


def plot(path: str | os.PathLike[str], result: Mapping[str, Any]) -> None:
    """CDFs of TTFA, TTFT and end-to-end latency per side (medians marked), and TTFA of every
    request over the run (to spot drift and outliers)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples: dict[str, list[Mapping[str, Any]]] = result["samples"]
    sides = [s for s in samples if samples[s]]
    fig, axes = plt.subplots(2, 2, figsize=(13, 9.5), constrained_layout=True)
    panels = [("ttfa_s", axes[0][0]), ("ttft_s", axes[0][1]), ("e2e_s", axes[1][0])]
    for key, ax in panels:
        every: list[float] = []
        medians: list[tuple[int, str, float]] = []
        for k, side in enumerate(sides):
            xs = sorted(float(s[key]) for s in samples[side] if s.get("ok") and s.get(key) is not None)
            if not xs:
                continue
            every += xs
            ys = [(i + 1) / len(xs) for i in range(len(xs))]
            ax.step(
                [xs[0], *xs],
                [0.0, *ys],
                where="post",
                color=COLORS.get(side),
                lw=2,
                label=f"{LABELS.get(side, side)} (n={len(xs)})",
            )
            med = percentile(xs, 50)
            ax.axvline(med, color=COLORS.get(side), ls="--", lw=1.2)
            medians.append((k, side, med))
        ax.set_title(LATENCIES[key], fontsize=12)
        scale = _scale_axis(ax, "x", every)
        ax.autoscale_view()
        for k, side, med in medians:
            # Label right of the median line, or left of it near the right edge.
            frac = ax.transAxes.inverted().transform(ax.transData.transform((med, 0.0)))[0]
            left = frac > 0.7
            ax.annotate(
                f"median {fmt_seconds(med)}",
                xy=(med, 0.62 - 0.2 * k),
                xytext=(-6 if left else 6, 0),
                textcoords="offset points",
                color=COLORS.get(side),
                fontsize=10,
                fontweight="bold",
                va="center",
                ha="right" if left else "left",
                bbox=dict(boxstyle="round,pad=0.25", fc="white", ec=COLORS.get(side), alpha=0.9),
            )
        ax.set_xlabel("seconds after the request was sent" + (" (log scale)" if scale == "log" else ""))
        ax.set_ylabel("fraction of requests (CDF)")
        ax.set_ylim(0, 1.02)
        if every:
            ax.legend(loc="best", fontsize=9)
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        ax.grid(True, which="major", alpha=0.3)
    ax = axes[1][1]
    every = []
    for side in sides:
        pts = [
            (float(s["start_s"]), float(s["ttfa_s"]))
            for s in samples[side]
            if s.get("ok") and s.get("ttfa_s") is not None
        ]
        if pts:
            every += [p[1] for p in pts]
            ax.scatter(
                [p[0] for p in pts],
                [p[1] for p in pts],
                s=20,
                color=COLORS.get(side),
                label=LABELS.get(side, side),
                alpha=0.8,
            )
    ax.set_title("time to first audio of each request, in the order sent", fontsize=12)
    ax.set_xlabel("request sent at (s after its side's measured phase started)")
    scale = _scale_axis(ax, "y", every)
    ax.set_ylabel("time to first audio (s" + (", log scale)" if scale == "log" else ")"))
    if every:
        ax.legend(fontsize=9)
    ax.grid(True, which="major", alpha=0.3)
    cfg = result.get("config", {})
    title = f"omni_cache end to end: workload {cfg.get('workload')}"
    sizes = cfg.get("sizes") or {}
    if sizes:
        title += (
            f"  (N={sizes.get('num_requests')}, S={sizes.get('shared_tokens')}, "
            f"U={sizes.get('unique_tokens')}, max_tokens={sizes.get('max_tokens')}, "
            + (f"rate {cfg['rate']}/s" if cfg.get("rate") else f"concurrency {cfg.get('concurrency')}")
            + ")"
        )
    rat = result.get("ratios")
    sub = []
    if rat:
        sp = rat["speedup"]
        sub.append(
            f"median speedup off/on: TTFA {fmt_number(sp['ttfa_s']['p50'])}x, TTFT {fmt_number(sp['ttft_s']['p50'])}x, "
            f"e2e {fmt_number(sp['e2e_s']['p50'])}x;  throughput on/off - 1: "
            f"{fmt_number(rat['throughput_change']['requests_per_s'] * 100, '+.1f')}%"
        )
    m = result.get("machine", {})
    if m:
        loads = []
        for side in sides:
            la = ((result.get("sides", {}).get(side) or {}).get("resources") or {}).get("loadavg_mean")
            if la is not None and not math.isnan(la):
                loads.append(f"{side} {la:.1f}")
        sub.append(
            f"{m.get('cpu_model')}, {m.get('nproc')} CPUs"
            + (f"; mean load average while measuring: {', '.join(loads)}" if loads else "")
        )
    fig.suptitle(title + ("\n" + "\n".join(sub) if sub else ""), fontsize=12)
    fig.savefig(path, dpi=110)
    plt.close(fig)
