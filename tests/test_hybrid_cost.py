"""The no-reuse cost part of benchmarks/hybrid_block_states.py without engines
(benchmarks/hybrid_cost.py): the interleaved order, the paired statistics and the run loop."""

from __future__ import annotations

from collections import Counter

import pytest

from benchmarks.hybrid_cost import cost_lines, interleaved_order, no_reuse_cost, paired_summary, quartiles


def test_two_engines_alternate_abab_baba():
    assert ["".join(interleaved_order("AB", r)) for r in range(8)] == ["AB", "BA", "BA", "AB"] * 2


def test_every_engine_takes_every_position_equally_often():
    for engines in ("AB", "ABC", "ABCD"):
        rounds = 2 * len(engines) * 3
        orders = [interleaved_order(engines, r) for r in range(rounds)]
        assert all(sorted(o) == sorted(engines) for o in orders)
        for position in range(len(engines)):
            assert Counter(o[position] for o in orders) == {e: rounds // len(engines) for e in engines}


def test_paired_ratio_is_the_median_of_per_round_ratios():
    # Round 2 is a slow spell for both engines: the paired ratio ignores it, the medians do not.
    samples = {"align": [1.0, 1.0, 3.0, 1.0, 1.0], "ours": [1.02, 1.01, 3.3, 1.03, 1.0]}
    s = paired_summary(samples, "align")
    assert s["align"]["paired_vs_base"] == 1.0 and s["align"]["median_vs_base"] == 1.0
    assert s["ours"]["paired_vs_base"] == pytest.approx(1.02)
    assert s["ours"]["median_s"] == pytest.approx(1.02)
    assert (s["ours"]["paired_q1"], s["ours"]["paired_q3"]) == pytest.approx((1.01, 1.03))


def test_paired_summary_refuses_uneven_rounds():
    with pytest.raises(ValueError, match="different numbers of rounds"):
        paired_summary({"align": [1.0, 1.0], "ours": [1.0]}, "align")


def test_quartiles_of_one_value():
    assert quartiles([2.0]) == (2.0, 2.0)


def test_no_reuse_cost_sends_fresh_prompts_and_skips_the_warm_up_round():
    calls = []

    def prefill(engine, rid, prompt):
        calls.append((engine, rid, tuple(prompt)))
        cost = {"align": 1.0, "ours": 1.05}[engine] * len(prompt) / 100
        return {"ttft_s": 2 * cost, "ttft_cpu_s": cost}

    result = no_reuse_cost(prefill, ["align", "ours"], [100, 300], rounds=4, seed=0)
    assert len(calls) == 2 * 2 * 5  # engines x lengths x (rounds + warm-up)
    assert len({c[1] for c in calls}) == len(calls)  # request ids unique within an engine
    assert len({c[2] for c in calls}) == len(calls)  # no prompt twice: nothing to reuse
    for n in ("100", "300"):
        r = result["lengths"][n]
        assert len(r["cpu_s"]["ours"]) == 4
        assert r["cpu"]["ours"]["paired_vs_base"] == pytest.approx(1.05)
        assert r["wall"]["ours"]["median_s"] == pytest.approx(2 * 1.05 * int(n) / 100)
    assert any(" 3 blocks (  300 tokens) ours " in line for line in cost_lines(result, 100))


def test_no_reuse_cost_needs_its_base_engine():
    with pytest.raises(ValueError, match="base engine"):
        no_reuse_cost(lambda *a: {}, ["ours"], [10], rounds=1, seed=0)
