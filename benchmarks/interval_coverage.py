"""How often the paired interval's "95%" holds the true ratio, by simulation: the t-interval on log
ratios the report uses (benchmarks/paired_stats.py) against the percentile bootstrap it replaced.

Each trial draws ``rounds`` per-round ratios around a known true ratio (1.1) under a noise model,
computes both intervals as ``paired_interval`` would, and counts whether each holds the truth.
The truth is the geometric mean's target, ``exp(E[log ratio])``: every model's log noise has mean 0.

    .venv/bin/python -m benchmarks.interval_coverage [--trials 4000] [--seed 0]

Noise models (per-round log ratio = log 1.1 + noise):

* ``lognormal``: noise N(0, 0.2), what a round's p50 ratio at concurrency 4 looks like on the
  2-vCPU guest (docs/benchmarks.md: per-round log ratio sd 0.11-0.26);
* ``t3``: 0.15 x Student's t with 3 degrees of freedom (heavy tails, infinite kurtosis);
* ``contaminated``: each side's latency lognormal (sd 0.1), and in 10% of rounds one side, either
  one, 2x slower (a round that lands on a busy machine);
* ``skewed``: 0.2 x (Exp(1) - 1), every round's noise leaning one way (skewness 2).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

import numpy as np

from benchmarks.paired_stats import t_quantile

TRUE_RATIO = 1.1
LEVEL = 0.95
ROUNDS = (8, 16, 24)
#: The bootstrap as the report ran it: resamplings of the rounds, numpy's percentile.
BOOTSTRAP_DRAWS = 4000


def _lognormal(rng: np.random.Generator, shape: tuple[int, int]) -> np.ndarray:
    return rng.normal(0.0, 0.2, shape)


def _t3(rng: np.random.Generator, shape: tuple[int, int]) -> np.ndarray:
    return 0.15 * rng.standard_t(3, shape)


def _contaminated(rng: np.random.Generator, shape: tuple[int, int]) -> np.ndarray:
    a, b = rng.normal(0.0, 0.1, shape), rng.normal(0.0, 0.1, shape)
    slow = rng.random(shape) < 0.10
    side = np.where(rng.random(shape) < 0.5, 1.0, -1.0)
    return a - b + slow * side * math.log(2.0)


def _skewed(rng: np.random.Generator, shape: tuple[int, int]) -> np.ndarray:
    return 0.2 * (rng.exponential(1.0, shape) - 1.0)


MODELS: dict[str, Callable[[np.random.Generator, tuple[int, int]], np.ndarray]] = {
    "lognormal": _lognormal,
    "t3": _t3,
    "contaminated": _contaminated,
    "skewed": _skewed,
}


def draw_logs(model: str, rounds: int, trials: int, seed: int) -> np.ndarray:
    """``trials`` x ``rounds`` per-round log ratios of ``model`` around log TRUE_RATIO."""
    rng = np.random.default_rng(seed)
    return math.log(TRUE_RATIO) + MODELS[model](rng, (trials, rounds))


def t_covers(logs: np.ndarray, level: float = LEVEL) -> np.ndarray:
    """Per trial (row): whether the t-interval on its log ratios holds log TRUE_RATIO
    (paired_stats.log_t_interval, vectorized over trials)."""
    n = logs.shape[1]
    half = t_quantile(level, n - 1) * logs.std(axis=1, ddof=1) / math.sqrt(n)
    return np.abs(logs.mean(axis=1) - math.log(TRUE_RATIO)) <= half


def bootstrap_covers(
    logs: np.ndarray, level: float = LEVEL, draws: int = BOOTSTRAP_DRAWS, seed: int = 0, chunk: int = 64
) -> np.ndarray:
    """Per trial: whether the percentile bootstrap the report used before (the rounds resampled
    ``draws`` times with replacement, the central ``level`` of the resampled log means) holds
    log TRUE_RATIO. Exponentiating does not move percentiles, so it works on the logs."""
    rng = np.random.default_rng(seed)
    trials, n = logs.shape
    q = [(1 - level) / 2 * 100, (1 + level) / 2 * 100]
    out = np.empty(trials, dtype=bool)
    for start in range(0, trials, chunk):
        block = logs[start : start + chunk]
        picks = rng.integers(0, n, size=(block.shape[0], draws, n))
        means = np.take_along_axis(block[:, None, :], picks, axis=2).mean(axis=2)
        low, high = np.percentile(means, q, axis=1)
        out[start : start + chunk] = (low <= math.log(TRUE_RATIO)) & (math.log(TRUE_RATIO) <= high)
    return out


def coverage_table(trials: int, seed: int, bootstrap: bool = True) -> list[dict[str, object]]:
    """One row per (model, rounds): the share of trials each method's interval held the truth."""
    rows: list[dict[str, object]] = []
    for i, model in enumerate(MODELS):
        for rounds in ROUNDS:
            logs = draw_logs(model, rounds, trials, seed + 1000 * i + rounds)
            row: dict[str, object] = {"model": model, "rounds": rounds, "t": float(t_covers(logs).mean())}
            if bootstrap:
                row["bootstrap"] = float(bootstrap_covers(logs, seed=seed).mean())
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=4000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    se = math.sqrt(LEVEL * (1 - LEVEL) / args.trials)
    print(f"nominal {LEVEL:.0%}, true ratio {TRUE_RATIO}, {args.trials} trials a cell (standard error {se:.3f})")
    print(f"{'noise':<14}{'rounds':>7}{'percentile bootstrap':>22}{'t on log ratios':>17}")
    for row in coverage_table(args.trials, args.seed):
        print(f"{row['model']:<14}{row['rounds']:>7}{row['bootstrap']:>22.3f}{row['t']:>17.3f}")


if __name__ == "__main__":
    main()
