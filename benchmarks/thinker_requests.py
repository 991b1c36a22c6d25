"""One measured request of the thinker cache benchmark: run on an `LLMStage` up to its end (TTFT,
CPU time, run-queue wait, in-process timers, latents), and checked (prefix hits, encoder runs, the
same latents from both latents modes)."""

from __future__ import annotations

import resource
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from benchmarks.path_timers import PathTimers, runqueue_wait_s
from benchmarks.thinker_prompts import Prompt, engine_prompt
from benchmarks.thinker_specs import ROW_RTOL


@dataclass
class RequestResult:
    ttft_s: float
    ttft_cpu_s: float  # process CPU time (all threads) over the same span: less sensitive to contention
    ttft_wait_s: float  # run-queue wait of this process's threads over the same span (contention)
    total_s: float
    num_cached_tokens: int
    generated: int
    token_ids: list[int] = field(default_factory=list)
    num_prompt_tokens: int = 0  # after vLLM expanded image / audio placeholders
    encoder_runs: int = 0  # encoder inputs the scheduler scheduled for this request
    latent_rows: int | None = None
    latents: dict[str, torch.Tensor] | None = None
    path_s: dict[str, float] = field(default_factory=dict)
    # Minor page faults of this process over the TTFT span: memory the request touched for the
    # first time (fresh heap pages, a first-touched mirror region).
    ttft_minor_faults: int = 0


def run_request(
    stage: Any,
    rid: str,
    prompt: Prompt | list[int],
    params: Any,
    with_latents: bool,
    timers: PathTimers | None,
    prefix_cache: bool = True,
) -> RequestResult:
    if not isinstance(prompt, Prompt):
        prompt = Prompt(list(prompt))
    chunks: list[tuple[int, dict[str, torch.Tensor]]] = []
    token_ids: list[int] = []
    generated = 0
    cached = 0
    num_prompt = 0
    ttft = ttft_cpu = None
    before = timers.snapshot() if timers else {}
    encoder_before = stage.counters()["encoder_runs"]
    request = engine_prompt(prompt, rid, prefix_cache)
    w0 = runqueue_wait_s()
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    c0 = time.process_time()
    t0 = time.perf_counter()
    stage.add(rid, request, params)
    finished = False
    while not finished:
        for out in stage.step():
            if out.error is not None:
                raise out.error
            if out.request_id != rid:
                continue
            if out.token_ids and ttft is None:
                ttft = time.perf_counter() - t0
                ttft_cpu = time.process_time() - c0
                ttft_wait = runqueue_wait_s() - w0
                ttft_faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
                at_ttft = timers.snapshot() if timers else {}
            generated += len(out.token_ids)
            token_ids += out.token_ids
            cached = max(cached, out.num_cached_tokens)
            num_prompt = out.num_prompt_tokens or num_prompt
            if out.latents:
                chunks.append((out.latent_start, out.latents))
            finished = finished or out.finished
    total = time.perf_counter() - t0
    if ttft is None:
        raise RuntimeError(f"{rid}: finished without a token")
    res = RequestResult(
        ttft,
        ttft_cpu,
        ttft_wait,
        total,
        cached,
        generated,
        token_ids,
        num_prompt,
        stage.counters()["encoder_runs"] - encoder_before,
        ttft_minor_faults=ttft_faults,
    )
    if timers:
        res.path_s = {k: at_ttft[k] - before.get(k, 0.0) for k in at_ttft}
    if with_latents:
        pos = 0
        for start, rows in chunks:
            if start != pos:
                raise RuntimeError(f"{rid}: latent chunk starts at {start}, expected {pos}")
            lengths = {name: t.shape[0] for name, t in rows.items()}
            if len(set(lengths.values())) != 1:
                raise RuntimeError(f"{rid}: latent chunk at {start} has rows {lengths}")
            pos += next(iter(lengths.values()))
        expected = num_prompt + generated - 1
        if pos != expected:
            raise RuntimeError(
                f"{rid}: {pos} latent rows, expected {expected} (prompt {num_prompt} + generated {generated} - 1)"
            )
        res.latent_rows = pos
        names = chunks[0][1].keys() if chunks else ()
        res.latents = {n: torch.cat([rows[n] for _, rows in chunks]) for n in names}
    return res


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float(((a - b).norm(dim=1) / b.norm(dim=1).clamp_min(1e-6)).max())


def expected_hit(prompt: Prompt, r: RequestResult, block_size: int) -> int:
    """Prompt tokens an APC hit must cover: the shared prefix after vLLM expanded its media
    placeholder (each placeholder id became the encoder's output length), down to whole blocks."""
    expanded = r.num_prompt_tokens - len(prompt.token_ids)  # tokens the placeholders added
    return (prompt.shared + expanded) // block_size * block_size


def check_request(
    mode: str,
    wl: str,
    i: int,
    k: int,
    spec: dict[str, Any],
    r: RequestResult,
    prompt: Prompt,
    reference: dict[tuple, tuple[dict[str, torch.Tensor], list[int]]],
    checks: dict[str, Any],
    row_rtol: float = ROW_RTOL,
    block_size: int = 32,
) -> None:
    """Fail loudly if the benchmark is not measuring what it claims: prefix hits where they must be
    (the whole shared prefix, its image / clip included; nothing on zero reuse), the encoder run
    exactly when it must (every request without prefix caching, never on a prefix hit over the
    media), and the same latents from both latents modes. Rows are compared where both engines fed
    the same token: all prompt rows, and generated-token rows up to the first generated token that
    differs (greedy argmax can flip on a near tie)."""
    label = f"{mode} {wl}[{i}/{k}]"
    if spec["prefix_cache"] and prompt.shared:
        need = expected_hit(prompt, r, block_size)
        if r.num_cached_tokens < need:
            raise RuntimeError(f"{label}: only {r.num_cached_tokens} prompt tokens cached, expected >= {need}")
    if wl == "zero_reuse" and r.num_cached_tokens:
        raise RuntimeError(f"{label}: {r.num_cached_tokens} tokens cached on zero reuse")
    items = len(prompt.media or {})
    want = 0 if spec["prefix_cache"] else items
    if r.encoder_runs != want:
        raise RuntimeError(f"{label}: the encoder ran for {r.encoder_runs} item(s), expected {want}")
    if r.latents is None:
        return
    key = (wl, i, k)
    if key not in reference:
        reference[key] = (r.latents, r.token_ids)
    else:
        ref_latents, ref_tokens = reference[key]
        agree = 0
        while agree < min(len(r.token_ids), len(ref_tokens)) and r.token_ids[agree] == ref_tokens[agree]:
            agree += 1
        if agree < max(len(r.token_ids), len(ref_tokens)):
            checks["token_divergences"] += 1
        for name, rows in r.latents.items():
            ref = ref_latents[name]
            n = min(r.num_prompt_tokens + agree, rows.shape[0], ref.shape[0])
            err = _rel_err(rows[:n], ref[:n])
            checks["max_rel_err"] = max(checks["max_rel_err"], err)
            per = checks.setdefault("max_rel_err_by_latent", {})
            per[name] = max(per.get(name, 0.0), err)
            if err > row_rtol:
                raise RuntimeError(
                    f"{label}: latent {name!r} differs from the other latents mode's by "
                    f"{err:.2e} (> {row_rtol:.0e}) over its first {n} rows"
                )
        checks["compared"] += 1
    r.latents = None
