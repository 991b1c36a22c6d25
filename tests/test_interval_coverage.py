"""The paired interval's "95%" covers as it says at the round counts runs have (8-24), by a seeded
simulation (benchmarks/interval_coverage.py; benchmarks/paired_stats.py is the interval), and the
percentile bootstrap it replaced did not."""

from __future__ import annotations

import math

import pytest

from benchmarks import interval_coverage as sim
from benchmarks.paired_stats import log_t_interval, t_quantile

TRIALS = 3000  # coverage's standard error 0.004 at 95%


@pytest.mark.parametrize("model", ["lognormal", "t3", "contaminated"])
@pytest.mark.parametrize("rounds", sim.ROUNDS)
def test_the_t_interval_covers_the_true_ratio_95_percent_of_the_time(model: str, rounds: int) -> None:
    logs = sim.draw_logs(model, rounds, TRIALS, seed=rounds)
    assert 0.93 <= sim.t_covers(logs).mean() <= 0.98


def test_the_percentile_bootstrap_it_replaced_covered_too_little_at_8_rounds() -> None:
    logs = sim.draw_logs("lognormal", 8, 1000, seed=8)
    assert sim.bootstrap_covers(logs, draws=1000).mean() < 0.91  # 0.885 in the full table
    assert sim.t_covers(logs).mean() > 0.93


def test_the_vectorized_simulation_is_the_reports_interval() -> None:
    logs = sim.draw_logs("t3", 8, 50, seed=1)
    covers = sim.t_covers(logs)
    for row, covered in zip(logs, covers, strict=True):
        low, high = log_t_interval([math.exp(x) for x in row])
        assert (low <= sim.TRUE_RATIO <= high) == covered


def test_t_quantiles() -> None:
    # Student's t two-sided 95% critical values (tables; scipy.stats.t.ppf(0.975, df))
    for df, t in ((1, 12.7062), (2, 4.3027), (7, 2.3646), (15, 2.1314), (23, 2.0687), (47, 2.0117)):
        assert t_quantile(0.95, df) == pytest.approx(t, abs=1e-4)
    assert t_quantile(0.90, 10) == pytest.approx(1.8125, abs=1e-4)
    assert log_t_interval([1.2]) is None and log_t_interval([1.0, math.nan, 1.1]) is None
    low, high = log_t_interval([1.0, 1.21])  # logs 0 and 2 log 1.1: mean log 1.1, sd log(1.21) / sqrt(2)
    assert math.sqrt(low * high) == pytest.approx(1.1)
