"""The routing benchmark's numbers (python -m benchmarks.routing): one turn's hit rate and latency
percentiles, their medians over rounds per policy against the one-replica reference and the
targets, and the table printed at the end of a run.
"""

from __future__ import annotations

import statistics
from typing import Any

#: The policy label of the prefix turn on the Ray-placed pipeline (--ray).
RAY_LABEL = "prefix (ray)"


def summarize_turn(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Hit rate and latency percentiles of one turn's requests (and the hit rate per tenant kind,
    for kinds named ``tenant<t>-<kind>``)."""
    from benchmarks.report import percentile

    ok = [s for s in samples if s["ok"]]
    prompt = sum(s["prompt_tokens"] or 0 for s in ok)
    cached = sum(s["cached_tokens"] or 0 for s in ok)
    by_kind: dict[str, list[int]] = {}
    for s in ok:
        if "-" in s.get("kind", ""):
            tally = by_kind.setdefault(s["kind"].split("-", 1)[1], [0, 0])
            tally[0] += s["cached_tokens"] or 0
            tally[1] += s["prompt_tokens"] or 0

    def pct(key: str, q: float) -> float | None:
        vals = [s[key] for s in ok if s.get(key) is not None]
        return percentile(vals, q) if vals else None

    return {
        "requests": len(samples),
        "errors": len(samples) - len(ok),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "hit_rate": cached / prompt if prompt else 0.0,
        "ttft_p50_s": pct("ttft_s", 50),
        "ttft_p90_s": pct("ttft_s", 90),
        "ttfa_p50_s": pct("ttfa_s", 50),
        "ttfa_p90_s": pct("ttfa_s", 90),
        "e2e_p50_s": pct("e2e_s", 50),
        "hit_rate_by_kind": {k: c / p if p else 0.0 for k, (c, p) in sorted(by_kind.items())},
        "prompt_tokens_by_kind": {k: p for k, (_, p) in sorted(by_kind.items())},
    }


def _median(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def aggregate(turns: list[dict[str, Any]], reference: list[dict[str, Any]]) -> dict[str, Any]:
    """Per policy the median over rounds of every summary number; the reference's hit rate; the
    targets."""
    keys = ("hit_rate", "ttft_p50_s", "ttft_p90_s", "ttfa_p50_s", "ttfa_p90_s", "e2e_p50_s")
    policies: dict[str, Any] = {}
    for policy in dict.fromkeys(t["policy"] for t in turns):
        mine = [t["summary"] for t in turns if t["policy"] == policy]
        policies[policy] = {k: _median([m[k] for m in mine]) for k in keys}
        policies[policy]["rounds"] = len(mine)
        policies[policy]["errors"] = sum(m["errors"] for m in mine)
        kinds = sorted({k for m in mine for k in m.get("hit_rate_by_kind", {})})
        policies[policy]["hit_rate_by_kind"] = {k: _median([m["hit_rate_by_kind"].get(k) for m in mine]) for k in kinds}
    ref_hit = _median([r["summary"]["hit_rate"] for r in reference]) if reference else None
    ref_kinds = sorted({k for r in reference for k in r["summary"].get("hit_rate_by_kind", {})})
    ref_by_kind = {k: _median([r["summary"]["hit_rate_by_kind"].get(k) for r in reference]) for k in ref_kinds}
    targets = []
    p = policies.get("prefix")
    if p and ref_hit:
        value = p["hit_rate"] / ref_hit
        targets.append(
            {"target": "prefix hit rate >= 0.9 x one replica with both pools", "value": value, "met": value >= 0.9}
        )
    rr = policies.get("round_robin")
    if p and rr and p["ttfa_p50_s"] and rr["ttfa_p50_s"]:
        value = rr["ttfa_p50_s"] / p["ttfa_p50_s"]
        targets.append({"target": "TTFA p50 round_robin / prefix >= 3", "value": value, "met": value >= 3.0})
    ray = policies.get(RAY_LABEL)
    ray_vs_local = None
    if p and ray:
        ray_vs_local = {k: ray[k] / p[k] for k in ("ttft_p50_s", "ttfa_p50_s", "e2e_p50_s") if ray[k] and p[k]}
    ll = policies.get("least_loaded")
    if p and ll and ref_hit:
        targets.append(
            {
                "target": "least_loaded hit rate / one replica's (reported beside prefix's)",
                "value": ll["hit_rate"] / ref_hit,
                "met": None,
            }
        )
    return {
        "policies": policies,
        "reference_hit_rate": ref_hit,
        "reference_hit_rate_by_kind": ref_by_kind,
        "targets": targets,
        "ray_vs_local": ray_vs_local,
    }


def format_table(agg: dict[str, Any]) -> str:
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1000:.0f}"

    lines = [
        "| policy | thinker hit rate | TTFT p50 / p90 (ms) | TTFA p50 / p90 (ms) | e2e p50 (ms) | rounds |",
        "|---|---|---|---|---|---|",
    ]
    for name, p in agg["policies"].items():
        lines.append(
            f"| {name} | {p['hit_rate']:.3f} | {ms(p['ttft_p50_s'])} / {ms(p['ttft_p90_s'])} | "
            f"{ms(p['ttfa_p50_s'])} / {ms(p['ttfa_p90_s'])} | {ms(p['e2e_p50_s'])} | {p['rounds']} |"
        )
    if agg["reference_hit_rate"] is not None:
        lines.append(f"| one replica, both pools (reference) | {agg['reference_hit_rate']:.3f} | | | | |")
    kinds = sorted({k for p in agg["policies"].values() for k in p.get("hit_rate_by_kind") or {}})
    if kinds:
        rows = [(name, p.get("hit_rate_by_kind") or {}) for name, p in agg["policies"].items()]
        rows.append(("one replica (reference)", agg.get("reference_hit_rate_by_kind") or {}))
        lines += ["", "| policy | " + " | ".join(f"hit rate, {k}" for k in kinds) + " |", "|---|" + "---|" * len(kinds)]
        lines += [
            f"| {name} | " + " | ".join("-" if by.get(k) is None else f"{by[k]:.3f}" for k in kinds) + " |"
            for name, by in rows
        ]
    if agg.get("ray_vs_local"):
        lines.append(
            "\nprefix placed by Ray / local spawn: "
            + ", ".join(f"{k.removesuffix('_s')} {v:.2f}x" for k, v in agg["ray_vs_local"].items())
        )
    for t in agg["targets"]:
        verdict = "" if t["met"] is None else f" ({'met' if t['met'] else 'NOT met'})"
        lines.append(f"\n{t['target']}: {t['value']:.2f}{verdict}")
    return "\n".join(lines)
