"""The interval of a paired figure: where the geometric mean of per-round ratios could lie, by the
luck of which rounds ran (benchmarks/report.py ``paired_interval``).

A run has 3-48 rounds, each giving one on/off (or A/A) ratio. The figure is the ratios' geometric
mean, the exponential of their logs' mean; its interval is Student's t-interval on those logs,
``exp(mean +- t(level, n - 1) * sd / sqrt(n))``. Exact when the log ratios are normal (a
round's ratio lognormal about the true one), and within about a point of its level at 8-24
rounds for heavy-tailed noise (``python -m benchmarks.interval_coverage`` simulates both).

What it replaced, the percentile bootstrap (resample the rounds, read the central 95% of the
resampled geometric means), is too narrow with few rounds: it uses the normal quantile instead of
t's and the plug-in spread (``sd * sqrt((n - 1) / n)``), so at 8 rounds its "95%" covered the
true ratio about 89% of the time (``interval_coverage``'s table).

No SciPy in the environment: :func:`t_quantile` computes t's quantile from its distribution
function in closed form for whole degrees of freedom (Abramowitz & Stegun 26.7.3-4).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["METHOD", "log_t_interval", "t_quantile"]

#: How :func:`log_t_interval` computes, as the result JSON names it.
METHOD = "t-interval on the per-round log ratios"


def _t_central(t: float, df: int) -> float:
    """P(-t < T < t) for Student's T with ``df`` degrees of freedom (A&S 26.7.3, 26.7.4)."""
    theta = math.atan(t / math.sqrt(df))
    s, c2 = math.sin(theta), math.cos(theta) ** 2
    if df % 2:  # odd: (2/pi) (theta + sin cos (1 + 2/3 cos^2 + 2*4/(3*5) cos^4 + ...))
        term, total = math.cos(theta), 0.0
        for j in range(1, (df - 1) // 2 + 1):
            total += term
            term *= c2 * (2 * j) / (2 * j + 1)
        return 2 / math.pi * (theta + s * total)
    term, total = 1.0, 0.0  # even: sin (1 + 1/2 cos^2 + 1*3/(2*4) cos^4 + ...)
    for j in range(df // 2):
        total += term
        term *= c2 * (2 * j + 1) / (2 * j + 2)
    return s * total


def t_quantile(level: float, df: int) -> float:
    """The t with P(-t < T < t) = ``level`` (the two-sided critical value: 2.365 for 95% at 7
    degrees of freedom), by bisection on the closed form."""
    if df < 1 or not 0 < level < 1:
        raise ValueError(f"t_quantile needs df >= 1 and 0 < level < 1, got {df}, {level}")
    low, high = 0.0, 1.0
    while _t_central(high, df) < level:
        high *= 2
    for _ in range(100):
        mid = (low + high) / 2
        low, high = (mid, high) if _t_central(mid, df) < level else (low, mid)
    return (low + high) / 2


def log_t_interval(values: Sequence[float], level: float = 0.95) -> tuple[float, float] | None:
    """The ``level`` t-interval of the geometric mean of positive ``values`` (per-round ratios):
    ``exp(mean(log) +- t * sd(log) / sqrt(n))``, sd with n - 1. None with fewer than 2 values or
    any that is not a positive finite number."""
    n = len(values)
    if n < 2 or not all(v > 0 and math.isfinite(v) for v in values):
        return None
    logs = [math.log(v) for v in values]
    mean = sum(logs) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / (n - 1))
    half = t_quantile(level, n - 1) * sd / math.sqrt(n)
    return math.exp(mean - half), math.exp(mean + half)
