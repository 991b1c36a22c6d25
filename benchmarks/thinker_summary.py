"""The thinker cache benchmark's statistics (per mode and workload, the ratios, the targets) and
the table it prints."""

from __future__ import annotations

import statistics
from typing import Any

from benchmarks.path_timers import ENTRY, FORWARD
from benchmarks.report import percentile
from benchmarks.thinker_specs import (
    MIN_QUIET,
    MODES,
    QUIET_WAIT_FRACTION,
    SHARED_WORKLOADS,
    TARGET_SPEEDUP_FRACTION,
    TARGET_ZERO_REUSE_OVERHEAD,
    VERDICT_MIN_REQUESTS,
    VERDICT_MIN_ROUNDS,
)


def _p90(xs: list[float]) -> float:
    return percentile(xs, 90)


def summarize(
    rounds: list[dict[str, Any]], judge: bool = True, target_fraction: float = TARGET_SPEEDUP_FRACTION
) -> dict[str, Any]:
    workloads = list(rounds[0]["modes"]["plain"]["workloads"])
    modes: dict[str, Any] = {}
    for mode in MODES:
        modes[mode] = {}
        for wl in workloads:
            per_round = [r["modes"][mode]["workloads"][wl]["ttft_s"] for r in rounds]
            pooled = [x for xs in per_round for x in xs]
            cpu = [x for r in rounds for x in r["modes"][mode]["workloads"][wl]["ttft_cpu_s"]]
            wait = [x for r in rounds for x in r["modes"][mode]["workloads"][wl]["ttft_runqueue_wait_s"]]
            quiet = [t for t, w in zip(pooled, wait) if w <= QUIET_WAIT_FRACTION * t]
            entry = {
                "median_ttft_cpu_s": statistics.median(cpu),
                "median_runqueue_wait_fraction": statistics.median(w / t for t, w in zip(pooled, wait)),
                "quiet_requests": len(quiet),
                "quiet_median_ttft_s": statistics.median(quiet) if len(quiet) >= MIN_QUIET else None,
                "median_ttft_s": statistics.median(pooled),
                "p90_ttft_s": _p90(pooled),
                "min_ttft_s": min(pooled),
                "round_median_ttft_s": [statistics.median(xs) for xs in per_round],
                "ttft_s": per_round,
                "num_cached_tokens": [r["modes"][mode]["workloads"][wl]["num_cached_tokens"] for r in rounds],
            }
            prompt = [x for r in rounds for x in r["modes"][mode]["workloads"][wl].get("num_prompt_tokens", [])]
            hit = [x for r in rounds for x in r["modes"][mode]["workloads"][wl]["num_cached_tokens"]]
            if prompt:
                entry["hit_rate"] = sum(hit) / sum(prompt)
            enc = [x for r in rounds for x in r["modes"][mode]["workloads"][wl].get("encoder_runs", [])]
            entry["encoder_runs"] = sum(enc)
            faults = [x for r in rounds for x in r["modes"][mode]["workloads"][wl].get("ttft_minor_faults", [])]
            if faults:
                entry["median_ttft_minor_faults"] = statistics.median(faults)
            timers = [r["modes"][mode]["workloads"][wl]["timers_s"] for r in rounds]
            keys = sorted({k for t in timers for k in t})
            col = {k: [x for t in timers for x in t.get(k, [0.0] * len(t[FORWARD]))] for k in keys}
            entry["timers_median_s"] = {k: statistics.median(v) for k, v in col.items() if any(x > 0 for x in v)}
            around = [sum(col[e][i] for e in ENTRY) - col[FORWARD][i] for i in range(len(pooled))]
            entry["around_forward_median_s"] = statistics.median(around)
            entry["forward_median_s"] = statistics.median(col[FORWARD])
            modes[mode][wl] = entry

    def ratio(num: str, den: str, wl: str, minus_one: bool) -> dict[str, Any]:
        per_round = []
        for i in range(len(rounds)):
            a = modes[num][wl]["round_median_ttft_s"][i]
            b = modes[den][wl]["round_median_ttft_s"][i]
            per_round.append(a / b - (1 if minus_one else 0))
        m1 = 1 if minus_one else 0
        a, b = modes[num][wl], modes[den][wl]
        # Request i of a round ran on both engines next to each other (interleaved rounds).
        pairs = [x / y for xs, ys in zip(a["ttft_s"], b["ttft_s"]) for x, y in zip(xs, ys)]
        return {
            "value": statistics.median(per_round),
            "per_round": per_round,
            "paired_medians": statistics.median(pairs) - m1,
            "pooled_medians": a["median_ttft_s"] / b["median_ttft_s"] - m1,
            "pooled_mins": a["min_ttft_s"] / b["min_ttft_s"] - m1,
            "pooled_cpu_time_medians": a["median_ttft_cpu_s"] / b["median_ttft_cpu_s"] - m1,
            "quiet_medians": (
                a["quiet_median_ttft_s"] / b["quiet_median_ttft_s"] - m1
                if a["quiet_median_ttft_s"] and b["quiet_median_ttft_s"]
                else None
            ),
        }

    ratios = {
        "apc_speedup": ratio("plain", "plain_apc", "shared_prefix", False),
        "hidden_cache_speedup": ratio("latents", "latents_cache", "shared_prefix", False),
        "zero_reuse_overhead": ratio("latents_cache", "latents", "zero_reuse", True),
        "latents_overhead": ratio("latents", "plain", "zero_reuse", True),
        "apc_zero_reuse_overhead": ratio("plain_apc", "plain", "zero_reuse", True),
        "latents_overhead_shared_prefix_apc": ratio("latents_cache", "plain_apc", "shared_prefix", True),
    }

    # The same overheads without the forward pass: what a mode adds around the model runner's
    # execute_model (stage add + step - execute_model, timed in process, medians), as a fraction of
    # the reference mode's median TTFT. The forward is the same work in every mode, so this is the
    # mode's own cost with most of the machine's noise taken out.
    def around(num: str, den: str, wl: str) -> dict[str, Any]:
        a, b = modes[num][wl], modes[den][wl]
        return {
            "value": (a["around_forward_median_s"] - b["around_forward_median_s"]) / b["median_ttft_s"],
            "per_round": [],
            "paired_medians": None,
            "pooled_medians": None,
            "pooled_mins": None,
            "pooled_cpu_time_medians": None,
            "quiet_medians": None,
        }

    ratios["zero_reuse_overhead_around_forward"] = around("latents_cache", "latents", "zero_reuse")
    ratios["latents_overhead_around_forward"] = around("latents", "plain", "zero_reuse")
    ratios["apc_zero_reuse_overhead_around_forward"] = around("plain_apc", "plain", "zero_reuse")
    # The same pair of ratios for each shared workload beyond the text one (image, audio).
    for wl, modality in SHARED_WORKLOADS.items():
        if wl != "shared_prefix" and wl in workloads:
            ratios[f"apc_speedup_{modality}"] = ratio("plain", "plain_apc", wl, False)
            ratios[f"hidden_cache_speedup_{modality}"] = ratio("latents", "latents_cache", wl, False)
    zro = ratios["zero_reuse_overhead"]["value"]
    targets = {}
    for wl, modality in SHARED_WORKLOADS.items():
        if wl not in workloads:
            continue
        suffix = "" if wl == "shared_prefix" else f"_{modality}"
        apc, hid = ratios[f"apc_speedup{suffix}"]["value"], ratios[f"hidden_cache_speedup{suffix}"]["value"]
        targets[f"hidden_cache_speedup{suffix} >= {target_fraction} * apc_speedup{suffix}"] = {
            "holds": hid >= target_fraction * apc if judge else None,
            "lhs": hid,
            "rhs": target_fraction * apc,
            "fraction_kept": hid / apc,
        }
    targets.update(
        {
            "zero_reuse_overhead <= 0.02": {
                "holds": zro <= TARGET_ZERO_REUSE_OVERHEAD if judge else None,
                "lhs": zro,
                "rhs": TARGET_ZERO_REUSE_OVERHEAD,
            },
        }
    )
    return {"modes": modes, "ratios": ratios, "targets": targets}


def print_table(res: dict[str, Any]) -> None:
    s = res["summary"]
    workloads = res["config"]["workloads"]
    print()
    print(
        f"Thinker cache benchmark ({res['config']['rounds']} round(s) x {res['config']['requests']} "
        f"requests per workload; TTFT in ms, median / p90 over all rounds)"
    )
    print(
        f"{'mode':<15}"
        + "".join(f"{wl + ' med':>20}{'p90':>9}{'wait%':>7}{'quiet':>6}" for wl in workloads)
        + f"{'startup s':>11}"
    )
    for mode in MODES:
        row = f"{mode:<15}"
        for wl in workloads:
            e = s["modes"][mode][wl]
            row += (
                f"{e['median_ttft_s'] * 1e3:>20.1f}{e['p90_ttft_s'] * 1e3:>9.1f}"
                f"{e['median_runqueue_wait_fraction'] * 100:>7.1f}{e['quiet_requests']:>6}"
            )
        st = statistics.median(r["modes"][mode]["startup_s"] for r in res["rounds"])
        print(row + f"{st:>11.1f}")
    print(
        "(wait% = median share of TTFT this process's threads waited for a CPU taken by other jobs; "
        "quiet = requests that waited < 25%)"
    )
    print("prefix hit rate (cached / prompt tokens) and encoder inputs run, measured requests of all rounds:")
    for mode in MODES:
        m = s["modes"][mode]
        print(
            f"  {mode:<15}"
            + "; ".join(
                f"{wl} hit {m[wl].get('hit_rate', 0.0):.1%} encoder {m[wl]['encoder_runs']}" for wl in workloads
            )
        )
    print()
    for name, r in s["ratios"].items():
        per = ", ".join(f"{x:.3f}" for x in r["per_round"])
        if not r["per_round"]:
            print(f"{name:<40} {r['value']:>8.4f}   (add + step - forward, timed in process)")
            continue
        q = f"{r['quiet_medians']:.3f}" if r["quiet_medians"] is not None else "n/a"
        print(
            f"{name:<40} {r['value']:>8.3f}   (per round: {per}; paired {r['paired_medians']:.3f}, "
            f"pooled medians {r['pooled_medians']:.3f}, "
            f"mins {r['pooled_mins']:.3f}, CPU-time medians {r['pooled_cpu_time_medians']:.3f}, "
            f"quiet medians {q})"
        )
    print()
    for name, t in s["targets"].items():
        extra = f", keeps {t['fraction_kept']:.1%} of APC's speedup" if "fraction_kept" in t else ""
        verdict = {True: "HOLDS", False: "FAILS"}.get(
            t["holds"],
            f"no verdict ({res['config']['rounds']} round(s) x {res['config']['requests']} "
            f"requests is within this machine's noise; a verdict needs at least "
            f"{VERDICT_MIN_ROUNDS} x {VERDICT_MIN_REQUESTS}, the default)",
        )
        print(f"target {name}: {verdict} ({t['lhs']:.3f} vs {t['rhs']:.3f}{extra})")
    print("\nin-process time per request up to its first token (medians, ms):")
    for mode in MODES:
        for wl in workloads:
            e = s["modes"][mode][wl]
            parts = ", ".join(f"{k} {v * 1e3:.2f}" for k, v in e["timers_median_s"].items())
            print(f"  {mode}/{wl}: around forward {e['around_forward_median_s'] * 1e3:.2f}; {parts}")
    for mode in ("latents", "latents_cache"):
        c = [r["modes"][mode]["latents_vs_other_latents_mode"] for r in res["rounds"]]
        print(
            f"latents check {mode}: {sum(x['compared'] for x in c)} requests compared with the other "
            f"latents mode, max row rel. error {max(x['max_rel_err'] for x in c):.2e} "
            f"(<= {res['config']['row_rtol']:.2e}), "
            f"generated-token flips {sum(x['token_divergences'] for x in c)}"
        )
    tries = [
        len(a)
        for r in res["rounds"]
        for m in r["modes"].values()
        for w in m["workloads"].values()
        for a in w["attempts"]
    ]
    print(
        f"measured requests {len(tries)}, attempts {sum(tries)} (retries when contended; "
        f"retry budget left {res['retry_budget_left_s']:.0f} s)"
    )
    print(f"\nwall time {res['wall_s']:.0f} s")
