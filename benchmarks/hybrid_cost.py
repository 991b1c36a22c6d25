"""What block states cost a hybrid thinker on a workload with no reuse, robust to a shared machine.

    python -m benchmarks.hybrid_block_states --model qwen3.5 --cost-only [--cost-blocks 4,16,32] [--rounds 41]

Every round, for each prompt length (a number of blocks of the engine's block size), each engine
prefills a fresh random prompt (nothing cached, max_tokens=1), the engines interleaved in an order
that alternates from round to round (ABAB, BABA, ...), so a slow spell of the machine falls on both
sides of a ratio. Two clocks per prefill: wall time to the first token, and the CPU time this
process spent on it (`time.process_time`: the engines run in-process, on one compute thread, so it
is the engine's own work and barely moves when other processes load the machine). Per length and
engine: the median of times and the median of the per-round ratios to the baseline (with their
interquartile range). A first round per length warms every engine up and is not counted.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable, Sequence
from typing import Any

# A prefill: (engine name, request id, prompt) -> {"ttft_s": wall seconds, "ttft_cpu_s": CPU seconds}.
Prefill = Callable[[str, str, list[int]], dict[str, Any]]


def interleaved_order(engines: Sequence[str], round_index: int) -> list[str]:
    """The engines' order in a round: rotated every second round and reversed every other round,
    so each engine runs first, last and in between equally often (two engines: AB, BA, BA, AB, ...;
    three: all six orders in six rounds)."""
    k = round_index // 2 % len(engines)
    order = list(engines[k:]) + list(engines[:k])
    return order[::-1] if round_index % 2 else order


def quartiles(values: Sequence[float]) -> tuple[float, float]:
    """The first and third quartile (what statistics.quantiles calls 'inclusive')."""
    if len(values) < 2:
        return values[0], values[0]
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q3


def paired_summary(samples: dict[str, list[float]], base: str) -> dict[str, dict[str, Any]]:
    """Per engine: the median of its times, and the median (and quartiles) of its per-round ratio
    to the base engine's time of the same round. ``samples``: engine -> one time per round."""
    rounds = {len(v) for v in samples.values()}
    if len(rounds) != 1:
        raise ValueError(f"engines have different numbers of rounds: { {k: len(v) for k, v in samples.items()} }")
    out = {}
    for name, times in samples.items():
        ratios = [t / b for t, b in zip(times, samples[base])]
        q1, q3 = quartiles(ratios)
        out[name] = {
            "median_s": statistics.median(times),
            "median_vs_base": statistics.median(times) / statistics.median(samples[base]),
            "paired_vs_base": statistics.median(ratios),
            "paired_q1": q1,
            "paired_q3": q3,
        }
    return out


def no_reuse_cost(
    prefill: Prefill, engines: Sequence[str], lengths: Sequence[int], rounds: int, seed: int, base: str = "align"
) -> dict[str, Any]:
    """Cold prefills of fresh prompts of each length (tokens), `rounds` counted rounds after one
    warm-up round; per length the wall and CPU times per engine and their paired summaries."""
    if base not in engines:
        raise ValueError(f"the base engine {base!r} is not among {list(engines)}")
    rng = random.Random(f"no-reuse-{seed}")
    wall = {n: {e: [] for e in engines} for n in lengths}
    cpu = {n: {e: [] for e in engines} for n in lengths}
    for r in range(rounds + 1):  # round 0 warms each engine up at each length
        for i, n in enumerate(lengths):
            for engine in interleaved_order(engines, r + i):
                prompt = [rng.randrange(256) for _ in range(n)]  # fresh: no prefix any engine holds
                timing = prefill(engine, f"cost{r}-{n}-{engine}", prompt)
                if r:
                    wall[n][engine].append(timing["ttft_s"])
                    cpu[n][engine].append(timing["ttft_cpu_s"])
    return {
        "rounds": rounds,
        "base": base,
        "lengths": {
            str(n): {
                "wall_s": wall[n],
                "cpu_s": cpu[n],
                "wall": paired_summary(wall[n], base),
                "cpu": paired_summary(cpu[n], base),
            }
            for n in lengths
        },
    }


def cost_lines(result: dict[str, Any], block: int) -> list[str]:
    """The printed table: one line per length and engine."""
    lines = [f"no-reuse cold prefill, {result['rounds']} interleaved rounds, ratios to {result['base']}:"]
    for n, r in result["lengths"].items():
        for engine in r["cpu"]:
            c, w = r["cpu"][engine], r["wall"][engine]
            lines.append(
                f"  {int(n) // block:3d} blocks ({n:>5s} tokens) {engine:13s} CPU {c['median_s']:.3f} s "
                f"paired x{c['paired_vs_base']:.3f} (IQR {c['paired_q1']:.3f}-{c['paired_q3']:.3f}), "
                f"x{c['median_vs_base']:.3f} by medians | wall {w['median_s']:.3f} s "
                f"paired x{w['paired_vs_base']:.3f} (IQR {w['paired_q1']:.3f}-{w['paired_q3']:.3f})"
            )
    return lines
