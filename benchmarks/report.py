"""Statistics, on/off ratios, the terminal table and the JSON of ``python -m benchmarks`` (its PNG:
:mod:`benchmarks.report_plot`).

Everything here works on plain dicts (a sample is :meth:`benchmarks.client.Sample.to_dict`), so it
can be tested, and re-run on a saved JSON, without engines.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from benchmarks.paired_stats import METHOD, log_t_interval

__all__ = [
    "LATENCIES",
    "distribution",
    "evaluate_targets",
    "fmt_number",
    "format_table",
    "paired_interval",
    "paired_ratios",
    "percentile",
    "ratios",
    "summarize_side",
    "write_json",
]

#: sample key -> label, in the order tables and plots show them.
LATENCIES = {"ttfa_s": "time to first audio", "ttft_s": "time to first text", "e2e_s": "end-to-end"}
SIDES = ("on", "off")
LABELS = {"on": "prefix cache on", "off": "prefix cache off", "server": "server"}

#: Issue 5's target: shared-prefix, median TTFA, off / on.
TARGET_TTFA_SPEEDUP = 5.0
#: Issue 37's target: with nothing to reuse, cache on and off are the same pipeline: the median of
#: the per-round on/off ratios of TTFT, TTFA and end-to-end p50 and of requests/s within this
#: fraction of 1 either way.
TARGET_ZERO_REUSE_SPREAD = 0.03


#: The one percentile definition every benchmark and summary uses: numpy's "linear" method
#: (interpolation between the closest ranks; numpy's default, Hyndman & Fan type 7).
PERCENTILE_METHOD = "linear"


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) by :data:`PERCENTILE_METHOD`; NaN when there are no values."""
    if len(values) == 0:
        return math.nan
    return float(np.percentile(np.asarray(values, dtype=float), q, method=PERCENTILE_METHOD))


def distribution(values: Iterable[float | None]) -> dict[str, float | int]:
    xs = [float(v) for v in values if v is not None]
    if not xs:
        return {
            "n": 0,
            "p50": math.nan,
            "p90": math.nan,
            "p99": math.nan,
            "mean": math.nan,
            "min": math.nan,
            "max": math.nan,
        }
    return {
        "n": len(xs),
        "p50": percentile(xs, 50),
        "p90": percentile(xs, 90),
        "p99": percentile(xs, 99),
        "mean": sum(xs) / len(xs),
        "min": min(xs),
        "max": max(xs),
    }


def _rate(num: float, den: float) -> float:
    return num / den if den else math.nan


def summarize_side(
    samples: Sequence[Mapping[str, Any]],
    duration_s: float,
    counters: Mapping[str, Mapping[str, float]] | None = None,
    resources: Mapping[str, float] | None = None,
    entry_stage: str = "thinker",
) -> dict[str, Any]:
    """One side's numbers: latency distributions of the successful requests, throughput over the
    measured phase's wall time, prefix-cache hit rates (server counters and usage), errors."""
    ok = [s for s in samples if s.get("ok")]
    errors = [s for s in samples if not s.get("ok")]
    out: dict[str, Any] = {
        "requests": len(samples),
        "ok": len(ok),
        "errors": len(errors),
        "error_examples": sorted({str(s.get("error")) for s in errors})[:3],
        "duration_s": duration_s,
    }
    for key in (*LATENCIES, "first_chunk_s"):
        out[key] = distribution(s.get(key) for s in ok)
    out["missing_ttft"] = sum(1 for s in ok if s.get("ttft_s") is None)
    out["missing_ttfa"] = sum(1 for s in ok if s.get("ttfa_s") is None)
    audio_s = sum(float(s.get("audio_s") or 0.0) for s in ok)
    tokens = sum(int(s.get("completion_tokens") or 0) for s in ok)
    out["throughput"] = {
        "requests_per_s": _rate(len(ok), duration_s),
        "audio_s_per_s": _rate(audio_s, duration_s),
        "completion_tokens_per_s": _rate(tokens, duration_s),
    }
    out["audio_s_total"] = audio_s
    prompt = sum(int(s.get("prompt_tokens") or 0) for s in ok)
    cached = sum(int(s.get("cached_tokens") or 0) for s in ok)
    cache: dict[str, Any] = {
        "usage_prompt_tokens": prompt,
        "usage_cached_tokens": cached,
        "usage_hit_rate": _rate(cached, prompt),
    }
    if counters:
        for stage, c in counters.items():
            cache[stage] = {
                "queried_tokens": c.get("queried", 0.0),
                "hit_tokens": c.get("hit", 0.0),
                "hit_rate": _rate(c.get("hit", 0.0), c.get("queried", 0.0)),
                "latent_rows_served": c.get("latent_rows", 0.0),
                "restarts": c.get("restarts", 0.0),
                "fresh": c.get("fresh", 1.0),
            }
        e = cache.get(entry_stage, {})
        cache["thinker_hit_rate"] = e.get("hit_rate", math.nan)
        cache["latent_rows_served"] = sum(
            v.get("latent_rows_served", 0.0) for k, v in cache.items() if isinstance(v, dict)
        )
    else:
        cache["thinker_hit_rate"] = cache["usage_hit_rate"]
        cache["latent_rows_served"] = math.nan
    out["cache"] = cache
    expected = [(s.get("prompt_tokens"), s.get("prompt_tokens_expected")) for s in ok]
    diffs = [a - b for a, b in expected if a is not None and b is not None]
    out["prompt_tokens_minus_expected"] = distribution(diffs)
    if resources:
        out["resources"] = dict(resources)
        if ok and "stage_cpu_s" in resources:
            out["resources"]["stage_cpu_s_per_request"] = resources["stage_cpu_s"] / len(ok)
    return out


def _ratio(a: float, b: float) -> float:
    if a is None or b is None or not b or math.isnan(a) or math.isnan(b):
        return math.nan
    return a / b


def ratios(on: Mapping[str, Any], off: Mapping[str, Any]) -> dict[str, Any]:
    """On/off comparison of two summaries: ``speedup`` = off / on for latencies (> 1: the cache
    helps), ``throughput_change`` = on / off - 1 (< 0: the cache costs throughput)."""
    out: dict[str, Any] = {"speedup": {}, "throughput_change": {}}
    for key in (*LATENCIES, "first_chunk_s"):
        out["speedup"][key] = {p: _ratio(off[key][p], on[key][p]) for p in ("p50", "p90", "p99", "mean")}
    for key in ("requests_per_s", "audio_s_per_s", "completion_tokens_per_s"):
        out["throughput_change"][key] = _ratio(on["throughput"][key], off["throughput"][key]) - 1
    ron, roff = on.get("resources") or {}, off.get("resources") or {}
    if "stage_cpu_s_per_request" in ron and "stage_cpu_s_per_request" in roff:
        out["stage_cpu_per_request_change"] = (
            _ratio(ron["stage_cpu_s_per_request"], roff["stage_cpu_s_per_request"]) - 1
        )
    return out


def paired_ratios(per_round: Sequence[Mapping[str, Any]], how: str = "geomean") -> dict[str, Any]:
    """Each per-round ratio (:func:`ratios` of one round's on and off runs, which ran in the
    same minutes) averaged over the rounds: what a drift of the machine's speed between rounds
    does not move. ``how``: ``geomean``, the geometric mean (a ratio's own mean: a round with
    one side twice as fast and one with the other twice as fast cancel; changes as ``1 + x``),
    or ``median``. Empty without rounds."""
    if not per_round:
        return {}

    def average(path: tuple[str, ...], change: bool = False) -> float:
        vals = []
        for r in per_round:
            v: Any = r
            for k in path:
                v = v.get(k) if isinstance(v, Mapping) else None
            if v is not None and not math.isnan(v):
                vals.append(float(v) + change)
        if not vals:
            return math.nan
        if how == "median":
            return percentile(vals, 50) - change
        if min(vals) <= 0:
            return math.nan
        return math.exp(sum(math.log(v) for v in vals) / len(vals)) - change

    first = per_round[0]
    out: dict[str, Any] = {"rounds": len(per_round), "average": how, "speedup": {}, "throughput_change": {}}
    for key, by_p in first["speedup"].items():
        out["speedup"][key] = {p: average(("speedup", key, p)) for p in by_p}
    for key in first["throughput_change"]:
        out["throughput_change"][key] = average(("throughput_change", key), change=True)
    if "stage_cpu_per_request_change" in first:
        out["stage_cpu_per_request_change"] = average(("stage_cpu_per_request_change",), change=True)
    return out


def paired_interval(per_round: Sequence[Mapping[str, Any]], level: float = 0.95) -> dict[str, Any]:
    """How far :func:`paired_ratios`' geometric mean could move by the luck of which rounds ran:
    the ``level`` t-interval on the per-round log ratios (benchmarks/paired_stats.py, which says
    why not a bootstrap), for the p50 latencies and requests/s, as ``[low, high]``. An A/A run
    whose interval holds 1 does not tell its sides apart; one wider than a target band cannot
    show the target. Empty with fewer than 3 rounds."""
    if len(per_round) < 3:
        return {}

    def interval(values: list[float], change: float = 0.0) -> list[float] | None:
        # None: a round without the figure (no first text timed, say)
        found = log_t_interval([v + change for v in values], level)
        return None if found is None else [found[0] - change, found[1] - change]

    out: dict[str, Any] = {"rounds": len(per_round), "level": level, "method": METHOD, "speedup": {}}
    for key in LATENCIES:
        out["speedup"][key] = interval([r["speedup"][key]["p50"] for r in per_round])
    tp = [r["throughput_change"]["requests_per_s"] for r in per_round]
    out["throughput_change"] = {"requests_per_s": interval(tp, change=1.0)}
    return out


def answers_identical(on: Sequence[Mapping[str, Any]], off: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """How many requests got the same answer text on both sides (greedy decoding: the cache should
    not change it)."""
    a = {s["id"]: s.get("answer_sha1") for s in on if s.get("ok")}
    b = {s["id"]: s.get("answer_sha1") for s in off if s.get("ok")}
    both = sorted(set(a) & set(b))
    same = sum(1 for k in both if a[k] == b[k])
    return {"compared": len(both), "identical": same}


#: The shared-prefix target is stated for these sizes; the speedup grows with S, so a smaller run
#: (e.g. --quick, S=2000) reports the ratio but no verdict.
TARGET_SHARED_SIZES = {"shared_tokens": 4000, "unique_tokens": 100}


def _hit_rates(side: Mapping[str, Any]) -> dict[str, float]:
    """stage -> prefix-cache hit rate of a summary (the stages that reported counters)."""
    cache = side.get("cache") or {}
    return {k: v["hit_rate"] for k, v in cache.items() if isinstance(v, Mapping) and "hit_rate" in v}


def evaluate_targets(
    workload: str,
    rat: Mapping[str, Any] | None,
    sizes: Mapping[str, Any] | None = None,
    sides: Mapping[str, Mapping[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """The targets that apply to this workload (`met` is None where the sizes differ from the
    ones the target is stated for). ``rat``: the ratios judged (the paired ones of a run with
    rounds); ``sides``: the per-side summaries (hit rates)."""
    if not rat:
        return []
    out = []
    if workload == "shared-prefix":
        v = rat["speedup"]["ttfa_s"]["p50"]
        applies = sizes is None or all(sizes.get(k) == n for k, n in TARGET_SHARED_SIZES.items())
        out.append(
            {
                "name": "shared-prefix: median TTFA speedup (off / on)",
                "value": v,
                "target": f">= {TARGET_TTFA_SPEEDUP:g}",
                "met": bool(v >= TARGET_TTFA_SPEEDUP) if applies else None,
            }
        )
    if workload == "zero-reuse":
        spread = TARGET_ZERO_REUSE_SPREAD
        for key in ("ttft_s", "ttfa_s", "e2e_s"):
            v = rat["speedup"][key]["p50"]
            out.append(
                {
                    "name": f"zero-reuse: {LATENCIES[key]} p50, off / on",
                    "value": v,
                    "target": f"1 +- {spread:.0%}",
                    "met": None if math.isnan(v) else bool(abs(v - 1) <= spread),
                }
            )
        v = rat["throughput_change"]["requests_per_s"]
        out.append(
            {
                "name": "zero-reuse: throughput change (on / off - 1, requests/s)",
                "value": v,
                "target": f"0 +- {spread:.0%}",
                "met": None if math.isnan(v) else bool(abs(v) <= spread),
            }
        )
        if sides:
            rates = [r for side in sides.values() for r in _hit_rates(side).values() if not math.isnan(r)]
            out.append(
                {
                    "name": "zero-reuse: highest prefix-cache hit rate of any stage, either side",
                    "value": max(rates) if rates else math.nan,
                    "target": "0",
                    "met": bool(rates) and max(rates) == 0,
                }
            )
    return out


# ---- terminal -----------------------------------------------------------------------------------


def _per_request(side: Mapping[str, Any], key: str, name: str) -> float:
    value = (side.get("resources") or {}).get(key, {}).get(name)
    return value / side["ok"] if value is not None and side.get("ok") else math.nan


def _ms(v: float) -> str:
    return "-" if v is None or math.isnan(v) else f"{v * 1000:.0f}"


def fmt_number(v: float, fmt: str = ".2f") -> str:
    """``v`` formatted with ``fmt``; '-' for None or NaN (the table's and the plot's numbers)."""
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, fmt)


def format_table(result: Mapping[str, Any]) -> str:
    sides = [s for s in result["sides"]]
    summ = result["sides"]
    rat = result.get("ratios")
    # The per-round ratios' geometric mean, beside the pooled one, when there were rounds to pair.
    paired = result.get("paired_ratios") if (result.get("paired_ratios") or {}).get("rounds", 0) > 1 else None
    w0 = 30
    pair = result.get("compared") or {"first": "on", "second": "off"}
    head = (
        f"{'':<{w0}}"
        + "".join(f"{LABELS.get(s, s):>18}" for s in sides)
        + (f"{pair['second'] + '/' + pair['first']:>10}" if rat else "")
    )
    # Where the paired figure could lie, by the luck of the rounds (paired_interval).
    interval = result.get("paired_intervals") if paired else None
    if paired:
        head += f"{'paired':>10}"
    if interval:
        head += f"{'95%, rounds':>16}"
    lines = [head, "-" * len(head)]
    for key, label in LATENCIES.items():
        for p in ("p50", "p90", "p99"):
            row = f"{label + ' ' + p + ' (ms)':<{w0}}" + "".join(f"{_ms(summ[s][key][p]):>18}" for s in sides)
            if rat:
                row += f"{fmt_number(rat['speedup'][key][p]) + 'x':>10}"
            if paired:
                row += f"{fmt_number(paired['speedup'][key][p]) + 'x':>10}"
            if interval and p == "p50" and interval["speedup"].get(key):
                low, high = interval["speedup"][key]
                row += f"{fmt_number(low) + '-' + fmt_number(high) + 'x':>16}"
            lines.append(row)
    # What `vllm bench serve` reports as "Mean TTFT": the first chunk that has choices (this server
    # sends none before the first text or audio, or the finish when the answer has neither).
    lines.append(
        f"{'first chunk mean (ms)':<{w0}}" + "".join(f"{_ms(summ[s]['first_chunk_s']['mean']):>18}" for s in sides)
    )
    tp = [("requests/s", "requests_per_s", ".3f"), ("audio s/s", "audio_s_per_s", ".3f")]
    for label, key, fmt in tp:
        row = f"{'throughput ' + label:<{w0}}" + "".join(
            f"{fmt_number(summ[s]['throughput'][key], fmt):>18}" for s in sides
        )
        if rat:
            row += f"{fmt_number(rat['throughput_change'][key] * 100, '+.1f') + '%':>10}"
        if paired:
            row += f"{fmt_number(paired['throughput_change'][key] * 100, '+.1f') + '%':>10}"
        if interval and interval["throughput_change"].get(key):
            low, high = (fmt_number(v * 100, "+.1f") for v in interval["throughput_change"][key])
            row += f"{low + '..' + high + '%':>16}"
        lines.append(row)
    lines.append(
        f"{'thinker prefix-cache hit rate':<{w0}}"
        + "".join(f"{fmt_number(summ[s]['cache']['thinker_hit_rate'] * 100, '.1f') + '%':>18}" for s in sides)
    )
    if any("talker" in summ[s]["cache"] for s in sides):
        lines.append(
            f"{'talker prefix-cache hit rate':<{w0}}"
            + "".join(
                f"{fmt_number(summ[s]['cache'].get('talker', {}).get('hit_rate', math.nan) * 100, '.1f') + '%':>18}"
                for s in sides
            )
        )
    lines.append(
        f"{'hidden-state rows from cache':<{w0}}"
        + "".join(f"{fmt_number(summ[s]['cache']['latent_rows_served'], '.0f'):>18}" for s in sides)
    )
    if all("resources" in summ[s] for s in sides):
        row = f"{'stage CPU s / request':<{w0}}" + "".join(
            f"{fmt_number(summ[s]['resources'].get('stage_cpu_s_per_request', math.nan), '.2f'):>18}" for s in sides
        )
        if rat and "stage_cpu_per_request_change" in rat:
            row += f"{fmt_number(rat['stage_cpu_per_request_change'] * 100, '+.1f') + '%':>10}"
        lines.append(row)
        procs = sorted({n for s in sides for n in summ[s]["resources"].get("cpu_s_by_process", {})})
        for name in procs:
            lines.append(
                f"{'  CPU s / request, ' + name:<{w0}}"
                + "".join(f"{fmt_number(_per_request(summ[s], 'cpu_s_by_process', name), '.3f'):>18}" for s in sides)
            )
        for key, label, fmt in (
            ("system_cpu_s_by_process", "  of it in the kernel", ".3f"),
            ("minor_faults_by_process", "  page faults / request", ".0f"),
        ):
            if all(key in (summ[s].get("resources") or {}) for s in sides):
                lines.append(
                    f"{label:<{w0}}"
                    + "".join(
                        f"{fmt_number(sum(_per_request(summ[s], key, n) for n in procs), fmt):>18}" for s in sides
                    )
                )
        if all("rss_mib_by_process" in (summ[s].get("resources") or {}) for s in sides):
            lines.append(
                f"{'resident memory, MiB (largest)':<{w0}}"
                + "".join(
                    f"{fmt_number(sum(summ[s]['resources']['rss_mib_by_process'].values()), '.0f'):>18}" for s in sides
                )
            )
        lines.append(
            f"{'machine load (1-min avg)':<{w0}}"
            + "".join(f"{fmt_number(summ[s]['resources'].get('loadavg_mean', math.nan), '.1f'):>18}" for s in sides)
        )
    lines.append(
        f"{'ok requests without text/audio':<{w0}}"
        + "".join(f"{str(summ[s]['missing_ttft']) + ' / ' + str(summ[s]['missing_ttfa']):>18}" for s in sides)
    )
    lines.append(
        f"{'requests ok / errors':<{w0}}"
        + "".join(f"{str(summ[s]['ok']) + ' / ' + str(summ[s]['errors']):>18}" for s in sides)
    )
    for t in result.get("targets", []):
        verdict = (
            ("MET" if t["met"] else "NOT MET")
            if t["met"] is not None
            else "no verdict (the target is stated for S=4000, U=100)"
        )
        lines.append(f"target {t['name']}: {fmt_number(t['value'], '.3f')} (want {t['target']}): {verdict}")
    for s in sides:
        for e in summ[s]["error_examples"]:
            lines.append(f"error ({LABELS.get(s, s)}): {e}")
    return "\n".join(lines)


# ---- files --------------------------------------------------------------------------------------


def _clean(obj: Any) -> Any:
    """NaN/inf -> None (strict JSON)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


def write_json(path: str | os.PathLike[str], result: Mapping[str, Any]) -> None:
    tmp = f"{os.fspath(path)}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(_clean(result), f, indent=1, allow_nan=False)
        f.write("\n")
    os.replace(tmp, path)
