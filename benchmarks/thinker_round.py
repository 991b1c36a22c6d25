"""One round of the thinker cache benchmark: the modes' engines side by side, every workload's
warm-ups, then its measured requests interleaved across the engines, a contended request retried,
an idle machine waited for (optionally)."""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.thinker_engine import start_engines
from benchmarks.thinker_prompts import Prompt, random_tokens, spare_prompt
from benchmarks.thinker_requests import RequestResult, check_request
from benchmarks.thinker_specs import EXTRA_WARMUPS, MODES, RETRY_WAIT_FRACTION, ModelSpec, model_spec


def wait_for_idle(max_s: float, busy_cores: float = 0.2, window_s: float = 0.5) -> dict[str, float] | None:
    """Before a request (untimed): wait until other jobs use less than `busy_cores` CPUs over a
    `window_s` window (from /proc/stat, minus this process's own CPU time), at most `max_s` seconds.
    Returns {"waited_s", "others_busy_cores"} (the last window), or None when off."""
    if max_s <= 0:
        return None

    def sample() -> tuple[float, float]:
        with open("/proc/stat") as f:
            vals = [int(x) for x in f.readline().split()[1:]]
        tick = os.sysconf("SC_CLK_TCK")
        busy = (sum(vals) - vals[3] - vals[4]) / tick  # all but idle and iowait
        return busy, time.process_time()

    t0 = time.perf_counter()
    while True:
        b0, c0 = sample()
        w0 = time.perf_counter()
        time.sleep(window_s)
        b1, c1 = sample()
        others = max(0.0, (b1 - b0) - (c1 - c0)) / (time.perf_counter() - w0)
        waited = time.perf_counter() - t0
        if others < busy_cores or waited >= max_s:
            return {"waited_s": waited, "others_busy_cores": others}


def request_order(modes: list[str], i: int) -> list[str]:
    """The engines' order for measured request i: `modes` rotated by i, so over len(modes)
    consecutive requests every mode runs first, second, ... once."""
    k = i % len(modes)
    return modes[k:] + modes[:k]


def measure_with_retries(
    attempt: Callable[[int], RequestResult], retries: int, budget: dict[str, float]
) -> list[RequestResult]:
    """Attempts 0, 1, ... of one measured request (`attempt(k)` runs and checks attempt k): again
    while an attempt waited for a CPU more than RETRY_WAIT_FRACTION of its TTFT, up to `retries`
    times and while the retry budget lasts (retries spend it)."""
    tries: list[RequestResult] = []
    for k in range(1 + retries):
        if k > 0 and budget["retry_s"] <= 0:
            break
        t_try = time.perf_counter()
        r = attempt(k)
        tries.append(r)
        if k > 0:
            budget["retry_s"] -= time.perf_counter() - t_try
        if r.ttft_wait_s <= RETRY_WAIT_FRACTION * r.ttft_s:
            break
    return tries


def run_round(
    modes: list[str],
    model: str,
    prompts: dict[str, list[Prompt]],
    round_index: int,
    idle_wait: float = 0.0,
    retries: int = 0,
    seed: int = 0,
    budget: dict[str, float] | None = None,
    mspec: ModelSpec | None = None,
    latents: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One round: the modes' engines side by side; every workload's warm-up on each, then its
    measured requests interleaved: request i runs on every engine before request i + 1 runs on
    any, starting at engine i mod 4 of `modes` (so each mode goes first, second, ... equally often).
    Returns {mode: that mode's figures} (the layout `summarize` reads)."""
    mspec = mspec or model_spec("thinker")
    budget = budget if budget is not None else {"retry_s": float("inf")}
    block = mspec.engine_args["block_size"]
    reference: dict[tuple, tuple[dict[str, torch.Tensor], list[int]]] = {}
    checks = {m: {"max_rel_err": 0.0, "compared": 0, "token_divergences": 0} for m in modes}
    out: dict[str, Any] = {}
    engines = start_engines(modes, model, mspec, latents or {"hidden": True})
    try:
        for m, e in engines.items():
            out[m] = {**e.info, "workloads": {}}
            # Engine warm-up (first forward passes pay one-off initialisation); short, distinct tokens.
            warm_rng = random.Random(f"engine-warmup/{round_index}")
            for i in range(2):
                e.run(f"{m}-r{round_index}-engine-warmup-{i}", random_tokens(warm_rng, 256), False)
        for wl, wl_prompts in prompts.items():
            per_mode: dict[str, dict[str, list]] = {m: {"reqs": [], "idle": [], "attempts": []} for m in modes}
            warm = {}
            for m, e in engines.items():
                wait_for_idle(idle_wait)
                # The warm-up also pays the first run of this workload's encoder (and, with prefix
                # caching, fills the cache).
                warm[m] = e.run(f"{m}-r{round_index}-{wl}-warmup", wl_prompts[0], True)
                # Then a few requests of the measured shape (hits where the cache is on): the first
                # requests of an image or clip page-fault in the HF processor's buffers (26 MB of
                # fresh pages, 20-40 ms, measured), until glibc keeps them on its heap.
                for j in range(EXTRA_WARMUPS):
                    e.run(
                        f"{m}-r{round_index}-{wl}-warmup{j + 1}",
                        spare_prompt(wl_prompts, wl, seed, round_index, -1, j),
                        False,
                    )
            for i in range(len(wl_prompts) - 1):
                for m in request_order(modes, i):
                    acc = per_mode[m]

                    def attempt(k: int, m: str = m, i: int = i, wl=wl, wl_prompts=wl_prompts, acc=acc) -> RequestResult:
                        prompt = wl_prompts[1 + i] if k == 0 else spare_prompt(wl_prompts, wl, seed, round_index, i, k)
                        acc["idle"].append(wait_for_idle(idle_wait))
                        r = engines[m].run(f"{m}-r{round_index}-{wl}-{i}-{k}", prompt, True)
                        check_request(m, wl, i, k, MODES[m], r, prompt, reference, checks[m], mspec.row_rtol, block)
                        return r

                    tries = measure_with_retries(attempt, retries, budget)
                    acc["attempts"].append([{"ttft_s": t.ttft_s, "runqueue_wait_s": t.ttft_wait_s} for t in tries])
                    acc["reqs"].append(min(tries, key=lambda t: t.ttft_wait_s / t.ttft_s))
            for m in modes:
                reqs = per_mode[m]["reqs"]
                keys = sorted({k for r in reqs for k in r.path_s})
                out[m]["workloads"][wl] = {
                    "warmup_ttft_s": warm[m].ttft_s,
                    "ttft_s": [r.ttft_s for r in reqs],
                    "ttft_cpu_s": [r.ttft_cpu_s for r in reqs],
                    "ttft_runqueue_wait_s": [r.ttft_wait_s for r in reqs],
                    "ttft_minor_faults": [r.ttft_minor_faults for r in reqs],
                    "total_s": [r.total_s for r in reqs],
                    "num_prompt_tokens": [r.num_prompt_tokens for r in reqs],
                    "num_cached_tokens": [r.num_cached_tokens for r in reqs],
                    "encoder_runs": [r.encoder_runs for r in reqs],
                    "warmup_encoder_runs": warm[m].encoder_runs,
                    "latent_rows": [r.latent_rows for r in reqs] if MODES[m]["latents"] else None,
                    "timers_s": {k: [r.path_s.get(k, 0.0) for r in reqs] for k in keys},
                    "idle_wait": per_mode[m]["idle"],
                    "attempts": per_mode[m]["attempts"],
                }
        for m, e in engines.items():
            out[m].update(e.counters())
            out[m]["latents_vs_other_latents_mode"] = checks[m] if MODES[m]["latents"] else None
    finally:
        for e in engines.values():
            e.stop()
    return out
