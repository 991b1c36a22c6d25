"""Routing between two thinker replicas: ``prefix`` against ``round_robin`` and ``least_loaded``
(issue 22's benchmark), through the HTTP API of the real tiny pipeline.

    .venv/bin/python -m benchmarks.routing --json routing.json [--rounds 2]

Workload: ``--tenants`` (8) tenants, each with its own ``--shared-tokens`` (2,000) token prefix
(system prompt + the user message's header); every request is one tenant's prefix + its own
``--unique-tokens`` (100) tokens, ``--num-requests`` (64) of them, the same number per tenant, in a
seeded random tenant order, streamed (text + audio) at ``--concurrency`` (4).

Pipelines (one at a time, each a private copy of ``--stage-config``):

* **two replicas**: the thinker runs as 2 replicas, each with a KV pool of ``--pool-blocks``
  blocks (``engine_args.extra.num_gpu_blocks_override``; default: half the tenants' whole prompts,
  so each replica holds about half of the prefixes); talker and decoder as configured. It starts
  with ``server.routing: prefix``, so its thinker replicas report their block hashes; each policy
  then gets its turn on the same running pipeline, the orchestrator's router swapped for one of
  that policy (the replicas go on reporting, which only the ``prefix`` router reads). Every turn
  sends tenants whose prefixes are new to the pipeline (seeded per round and policy), so nothing
  cached by an earlier turn can hit; what earlier turns left in the pools is evicted as any cold
  block is. Policies are interleaved by round (round r starts with policy r mod 3).
* **reference**: ONE thinker replica whose pool is both pools combined (2 x pool - 1 blocks: each
  pool keeps one null block), same requests: the hit rate a single cache that size reaches.

``--workload media`` (issue 42): the tenants take turns being a text tenant (its system prompt
as above), an image tenant (one image of about ``--shared-tokens`` vision tokens), a clip tenant
(one WAV clip of about as many audio tokens) and a video tenant (one MP4 with its sound track,
read with ``use_audio_in_video``); a media tenant's requests are its medium then a question of
their own, without a system prompt, so what a replica can hold of them is the medium's blocks,
keyed by its content digest (omni_cache/runtime/media_layouts.py). Run it on the Qwen3-Omni
pipeline: ``--stage-config stage_configs/qwen3_omni.yaml --workload media --thinker-only``
(``--thinker-only``: the entry stage alone, text answers). The hit rate is also reported per
tenant kind.

With ``--ray``, every round also runs the ``prefix`` turn on the same two-replica pipeline placed
by Ray (``server.ray_address``) on a two-node cluster the benchmark starts on this machine
(``ray.cluster_utils``; thinker#0 pinned to one node, thinker#1 to the other): label ``prefix
(ray)``, against local spawn's ``prefix``, Ray's own cost per request.

Reported per policy (median over rounds, each round's value in the JSON): thinker prefix hit rate
(cached prompt tokens / prompt tokens, from each response's ``usage``, i.e. the thinker's own
count; the stage counters from ``/metrics`` are in the JSON too), time to first text and first
audio p50 / p90, how many requests each replica got; targets: ``prefix`` hit rate >= 0.9 of the
reference's, and TTFA p50 of ``round_robin`` / ``prefix`` >= 3.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import yaml  # noqa: E402

from benchmarks.routing_pipelines import RayServer, ray_cluster, ray_config, routing_config  # noqa: E402
from benchmarks.workloads import Session, content_sizes, random_text  # noqa: E402

POLICIES = ("prefix", "round_robin", "least_loaded")
WORKLOADS = {"text": ("text",), "media": ("text", "image", "audio", "video")}
#: Audio tokens per second of a clip in Qwen3-Omni's thinker (16 kHz, 100 feature frames a second,
#: downsampled 8x), to size a clip tenant's medium like the others' prefixes.
AUDIO_TOKENS_PER_S = 12.5
#: The policy label of the prefix turn on the Ray-placed pipeline (--ray).
RAY_LABEL = "prefix (ray)"


# ---- the workload -------------------------------------------------------------------------------

def tenant_order(tenants: int, num_requests: int, seed: int, round_: int) -> list[int]:
    """Which tenant each request belongs to: every tenant equally often (the remainder to the
    lowest), shuffled with a seed of its own per round (all policies of a round get this order)."""
    order = [i % tenants for i in range(num_requests)]
    random.Random(f"omni_cache-routing/order/{seed}/{round_}").shuffle(order)
    return order


def build_requests(order: list[int], *, shared_tokens: int, unique_tokens: int, max_tokens: int,
                   seed: int, round_: int, label: str, kinds: tuple[str, ...] = ("text",)
                   ) -> list[Session]:
    """The sessions of one turn: tenant prefixes seeded by (seed, round, label), so each policy's
    turn has prefixes no earlier turn cached; the unique parts are the round's (same per policy).
    Tenant ``t`` is of kind ``kinds[t % len(kinds)]``: its prefix is a system prompt (text) or
    its medium (image, audio, video; no system prompt)."""
    sys_chars, user_chars = content_sizes(shared_tokens, unique_tokens)
    prefix_rng = random.Random(f"omni_cache-routing/tenants/{seed}/{round_}/{label}")
    tenants = [tenant_prefix(kinds[t % len(kinds)], prefix_rng, shared_tokens, sys_chars)
               for t in range(max(order) + 1)]
    user_rng = random.Random(f"omni_cache-routing/users/{seed}/{round_}")
    return [Session(i, f"tenant{t}" if kinds == ("text",) else f"tenant{t}-{kinds[t % len(kinds)]}",
                    users=[random_text(user_rng, user_chars)], max_tokens=max_tokens, **tenants[t])
            for i, t in enumerate(order)]


def tenant_prefix(kind: str, rng: random.Random, shared_tokens: int, sys_chars: int) -> dict[str, Any]:
    """A tenant's shared part as Session fields: a system prompt, or a medium of about
    ``shared_tokens`` tokens (seeded by ``rng``)."""
    from benchmarks.workloads import image_data_url, video_data_url

    if kind == "text":
        return {"system": random_text(rng, sys_chars)}
    seed = rng.randrange(1 << 30)
    if kind == "image":
        return {"system": "", "image": image_data_url(shared_tokens, seed)}
    if kind == "audio":
        return {"system": "", "audio": clip_b64(shared_tokens / AUDIO_TOKENS_PER_S, seed)}
    if kind == "video":
        return {"system": "", "video": video_data_url(seed, seconds=4.0, width=192, height=128)}
    raise ValueError(f"unknown tenant kind {kind!r}")


def clip_b64(seconds: float, seed: int, rate: int = 16000) -> str:
    """A WAV clip (base64) of ``seconds`` of seeded noise under a tone: its content differs by seed."""
    import base64
    import io

    import numpy as np
    import soundfile as sf

    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    x = 0.2 * np.sin(2 * np.pi * rng.uniform(200, 800) * t) + 0.05 * rng.standard_normal(t.size)
    buf = io.BytesIO()
    sf.write(buf, x.astype(np.float32), rate, format="WAV")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def warmup_requests(n: int, max_tokens: int, seed: int) -> list[Session]:
    """Short prompts nobody else sends, one per replica, sent at once (least loaded and prefix
    put them on different replicas, round robin in turn): the first request of an engine pays
    one-time costs that should not land in any policy's numbers."""
    rng = random.Random(f"omni_cache-routing/warmup/{seed}")
    return [Session(i, "warmup", random_text(rng, 200), [random_text(rng, 40)], max_tokens, warmup=True)
            for i in range(n)]


def default_pool_blocks(tenants: int, shared: int, unique: int, max_tokens: int, block_size: int) -> int:
    """Blocks of one replica's pool that hold half of the tenants' whole requests (prompt and
    answer), plus the null block vLLM keeps for itself."""
    per_request = math.ceil((shared + unique + max_tokens) / block_size)
    return math.ceil(tenants / 2) * per_request + 1


# ---- the pipelines ------------------------------------------------------------------------------

def _decisions(text: str) -> dict[str, float]:
    """"replica/decision" -> the thinker's routing decisions so far (from /metrics)."""
    from omni_cache.runtime.metrics import parse_metrics

    return {f"{lab['replica']}/{lab['decision']}": v for n, lab, v in parse_metrics(text)
            if n == "omni_cache_routing_decisions_total" and lab.get("stage") == "thinker"}


async def _metrics_text(url: str) -> str:
    import httpx

    async with httpx.AsyncClient(timeout=30.0) as client:
        r = await client.get(url + "/metrics")
        r.raise_for_status()
        return r.text


def run_turn(srv: Any, model: str, sessions: list[Session], *, concurrency: int, label: str,
             policy: str | None, audio: bool) -> dict[str, Any]:
    """Send ``sessions`` to a running pipeline with the router set to ``policy`` (None: leave it)."""
    from benchmarks.client import Driver, counter_deltas, metric_counters
    from benchmarks.harness import log

    orch = srv.server.orchestrator
    if policy is not None:
        orch.routes.use_policy(policy)
    before_text = asyncio.run(_metrics_text(srv.url))
    driver = Driver(srv.url, model, concurrency=concurrency, audio=audio, request_timeout_s=900.0)
    t0 = time.monotonic()
    samples = asyncio.run(driver.run(sessions))
    wall = time.monotonic() - t0
    after_text = asyncio.run(_metrics_text(srv.url))
    before, after = _decisions(before_text), _decisions(after_text)
    out = {
        "label": label, "policy": policy, "duration_s": wall,
        "samples": [s.to_dict() for s in sorted(samples, key=lambda s: s.start_s)],
        "counters": counter_deltas(metric_counters(before_text), metric_counters(after_text)),
        "decisions": {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)},
    }
    out["summary"] = summarize_turn(out["samples"])
    s = out["summary"]
    log(f"{label}: hit rate {s['hit_rate']:.3f}, TTFT p50 {s['ttft_p50_s']}, TTFA p50 "
        f"{s['ttfa_p50_s']}, {s['errors']} error(s), {wall:.0f} s; decisions {out['decisions']}")
    return out


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
        "requests": len(samples), "errors": len(samples) - len(ok),
        "prompt_tokens": prompt, "cached_tokens": cached,
        "hit_rate": cached / prompt if prompt else 0.0,
        "ttft_p50_s": pct("ttft_s", 50), "ttft_p90_s": pct("ttft_s", 90),
        "ttfa_p50_s": pct("ttfa_s", 50), "ttfa_p90_s": pct("ttfa_s", 90),
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
        policies[policy]["hit_rate_by_kind"] = {
            k: _median([m["hit_rate_by_kind"].get(k) for m in mine]) for k in kinds}
    ref_hit = _median([r["summary"]["hit_rate"] for r in reference]) if reference else None
    ref_kinds = sorted({k for r in reference for k in r["summary"].get("hit_rate_by_kind", {})})
    ref_by_kind = {k: _median([r["summary"]["hit_rate_by_kind"].get(k) for r in reference])
                   for k in ref_kinds}
    targets = []
    p = policies.get("prefix")
    if p and ref_hit:
        value = p["hit_rate"] / ref_hit
        targets.append({"target": "prefix hit rate >= 0.9 x one replica with both pools",
                        "value": value, "met": value >= 0.9})
    rr = policies.get("round_robin")
    if p and rr and p["ttfa_p50_s"] and rr["ttfa_p50_s"]:
        value = rr["ttfa_p50_s"] / p["ttfa_p50_s"]
        targets.append({"target": "TTFA p50 round_robin / prefix >= 3", "value": value,
                        "met": value >= 3.0})
    ray = policies.get(RAY_LABEL)
    ray_vs_local = None
    if p and ray:
        ray_vs_local = {k: ray[k] / p[k] for k in ("ttft_p50_s", "ttfa_p50_s", "e2e_p50_s")
                        if ray[k] and p[k]}
    ll = policies.get("least_loaded")
    if p and ll and ref_hit:
        targets.append({"target": "least_loaded hit rate / one replica's (reported beside prefix's)",
                        "value": ll["hit_rate"] / ref_hit, "met": None})
    return {"policies": policies, "reference_hit_rate": ref_hit, "reference_hit_rate_by_kind": ref_by_kind,
            "targets": targets, "ray_vs_local": ray_vs_local}


def format_table(agg: dict[str, Any]) -> str:
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1000:.0f}"

    lines = ["| policy | thinker hit rate | TTFT p50 / p90 (ms) | TTFA p50 / p90 (ms) | e2e p50 (ms) | rounds |",
             "|---|---|---|---|---|---|"]
    for name, p in agg["policies"].items():
        lines.append(f"| {name} | {p['hit_rate']:.3f} | {ms(p['ttft_p50_s'])} / {ms(p['ttft_p90_s'])} | "
                     f"{ms(p['ttfa_p50_s'])} / {ms(p['ttfa_p90_s'])} | {ms(p['e2e_p50_s'])} | {p['rounds']} |")
    if agg["reference_hit_rate"] is not None:
        lines.append(f"| one replica, both pools (reference) | {agg['reference_hit_rate']:.3f} | | | | |")
    kinds = sorted({k for p in agg["policies"].values() for k in p.get("hit_rate_by_kind") or {}})
    if kinds:
        rows = [(name, p.get("hit_rate_by_kind") or {}) for name, p in agg["policies"].items()]
        rows.append(("one replica (reference)", agg.get("reference_hit_rate_by_kind") or {}))
        lines += ["", "| policy | " + " | ".join(f"hit rate, {k}" for k in kinds) + " |",
                  "|---|" + "---|" * len(kinds)]
        lines += [f"| {name} | " + " | ".join("-" if by.get(k) is None else f"{by[k]:.3f}" for k in kinds)
                  + " |" for name, by in rows]
    if agg.get("ray_vs_local"):
        lines.append("\nprefix placed by Ray / local spawn: " + ", ".join(
            f"{k.removesuffix('_s')} {v:.2f}x" for k, v in agg["ray_vs_local"].items()))
    for t in agg["targets"]:
        verdict = "" if t["met"] is None else f" ({'met' if t['met'] else 'NOT met'})"
        lines.append(f"\n{t['target']}: {t['value']:.2f}{verdict}")
    return "\n".join(lines)


def _git_commit() -> str | None:
    """The checkout's commit (which router was measured), None outside a git checkout."""
    import subprocess

    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                             cwd=Path(__file__).resolve().parent)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


# ---- command line -------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.routing", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stage-config", default="stage_configs/tiny_omni.yaml")
    p.add_argument("--checkpoint-dir", help="where tiny checkpoints live (default: the config's)")
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="text",
                   help="text: tenants with system prompts; media: text, image, clip and video tenants in turn")
    p.add_argument("--thinker-only", action="store_true",
                   help="the entry stage alone, text answers (implies --text-only)")
    p.add_argument("--tenants", type=int, default=8)
    p.add_argument("--shared-tokens", type=int, default=2000)
    p.add_argument("--unique-tokens", type=int, default=100)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=16, help="text tokens per answer (default: %(default)s)")
    p.add_argument("--pool-blocks", type=int,
                   help="KV blocks of each thinker replica (default: half the tenants' whole requests + 1)")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--no-reference", action="store_true", help="skip the one-replica reference")
    p.add_argument("--dtype", default="float32",
                   help="dtype of the vLLM stages (default %(default)s: bfloat16 is emulated, ~3.5x "
                        "slower, on CPUs without AVX512-BF16/AMX; '' keeps the config's)")
    p.add_argument("--text-only", action="store_true", help="no audio (no TTFA)")
    p.add_argument("--ray", action="store_true",
                   help="also run the prefix turn with the replicas placed by Ray on a two-node "
                        "cluster started here, against local spawn (Ray's own cost)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write every number and sample here")
    args = p.parse_args(argv)
    args.policies = [x.strip() for x in args.policies.split(",") if x.strip()]
    args.text_only = args.text_only or args.thinker_only
    if not args.policies or any(x not in POLICIES for x in args.policies):
        p.error(f"--policies: a comma-separated list of {', '.join(POLICIES)}")
    if args.tenants < 1 or args.num_requests < 1 or args.concurrency < 1 or args.rounds < 1:
        p.error("--tenants, --num-requests, --concurrency and --rounds must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from benchmarks import harness, report
    from benchmarks.client import served_model

    src = yaml.safe_load(Path(args.stage_config).read_text(encoding="utf-8"))
    [entry] = [s for s in src["stages"] if not s.get("inputs")]
    block_size = int((entry.get("engine_args") or {}).get("block_size") or 16)
    pool = args.pool_blocks or default_pool_blocks(args.tenants, args.shared_tokens, args.unique_tokens,
                                                   args.max_tokens, block_size)
    tmp = Path(tempfile.mkdtemp(prefix="omni_cache_routing_"))
    two = routing_config(args.stage_config, tmp / "two.yaml", replicas=2, pool_blocks=pool,
                         dtype=args.dtype or None, request_timeout_s=900.0, thinker_only=args.thinker_only)
    one = routing_config(args.stage_config, tmp / "one.yaml", replicas=1, pool_blocks=2 * pool - 1,
                         dtype=args.dtype or None, request_timeout_s=900.0, thinker_only=args.thinker_only)
    config = {k: getattr(args, k) for k in ("tenants", "shared_tokens", "unique_tokens", "num_requests",
                                            "concurrency", "max_tokens", "policies", "rounds", "dtype",
                                            "text_only", "seed", "ray", "workload", "thinker_only")}
    config.update(pool_blocks_per_replica=pool, reference_pool_blocks=2 * pool - 1, block_size=block_size,
                  stage_config=os.path.abspath(args.stage_config),
                  two_replica_yaml=two.read_text(), reference_yaml=one.read_text())
    machine = harness.machine_info()
    turns: list[dict[str, Any]] = []
    reference: list[dict[str, Any]] = []
    audio = not args.text_only
    t_start = time.monotonic()
    stack = contextlib.ExitStack()
    try:
        ray_address = stack.enter_context(ray_cluster()) if args.ray else None
        for rnd in range(args.rounds):
            order = tenant_order(args.tenants, args.num_requests, args.seed, rnd)
            k = rnd % len(args.policies)
            policies = args.policies[k:] + args.policies[:k]

            def sessions(label: str, order=order, rnd=rnd) -> list[Session]:
                return build_requests(order, shared_tokens=args.shared_tokens, unique_tokens=args.unique_tokens,
                                      max_tokens=args.max_tokens, seed=args.seed, round_=rnd, label=label,
                                      kinds=WORKLOADS[args.workload])

            harness.log(f"round {rnd}: two thinker replicas of {pool} blocks each; policies {policies}")
            with harness.ManagedServer(two, prefix_cache=True, tag=f"routing2-{rnd}",
                                       checkpoint_dir=args.checkpoint_dir) as srv:
                harness.log(f"ready after {srv.startup_s:.0f} s")
                model = asyncio.run(served_model(srv.url, None))
                run_turn(srv, model, warmup_requests(2, args.max_tokens, args.seed), concurrency=2,
                         label="warm-up", policy="least_loaded", audio=audio)
                for policy in policies:
                    r = run_turn(srv, model, sessions(policy), concurrency=args.concurrency,
                                 label=f"round {rnd} {policy}", policy=policy, audio=audio)
                    r["round"] = rnd
                    turns.append(r)
            if not args.no_reference:
                harness.log(f"round {rnd}: reference, one thinker of {2 * pool - 1} blocks")
                with harness.ManagedServer(one, prefix_cache=True, tag=f"routing1-{rnd}",
                                           checkpoint_dir=args.checkpoint_dir) as srv:
                    model = asyncio.run(served_model(srv.url, None))
                    run_turn(srv, model, warmup_requests(2, args.max_tokens, args.seed), concurrency=2,
                             label="warm-up", policy=None, audio=audio)
                    r = run_turn(srv, model, sessions("reference"), concurrency=args.concurrency,
                                 label=f"round {rnd} reference", policy=None, audio=audio)
                    r["round"] = rnd
                    reference.append(r)
            if ray_address is not None:
                harness.log(f"round {rnd}: the same two replicas placed by Ray")
                placed = ray_config(two, tmp / f"ray-{rnd}.yaml", ray_address, f"routing-ray-{rnd}")
                with RayServer(placed) as srv:
                    harness.log(f"ready after {srv.startup_s:.0f} s")
                    model = asyncio.run(served_model(srv.url, None))
                    run_turn(srv, model, warmup_requests(2, args.max_tokens, args.seed), concurrency=2,
                             label="warm-up", policy="least_loaded", audio=audio)
                    # the local prefix turn's requests, on a pipeline as cold as its was
                    r = run_turn(srv, model, sessions("prefix"), concurrency=args.concurrency,
                                 label=f"round {rnd} prefix (ray)", policy="prefix", audio=audio)
                    r["round"], r["policy"] = rnd, RAY_LABEL
                    turns.append(r)
    except KeyboardInterrupt:
        print("benchmarks.routing: interrupted", file=sys.stderr)
    except Exception as e:  # noqa: BLE001 -- keep what was measured, say what failed
        print(f"benchmarks.routing: {type(e).__name__}: {e}", file=sys.stderr)
        if not turns:
            return 1
    finally:
        stack.close()
        shutil.rmtree(tmp, ignore_errors=True)
    agg = aggregate(turns, reference)
    result = {
        "benchmark": "omni_cache routing between thinker replicas (python -m benchmarks.routing)",
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": harness.command_line("benchmarks.routing"),
        "git_commit": _git_commit(),
        "wall_s": time.monotonic() - t_start,
        "machine": {**machine, "loadavg_end": list(os.getloadavg())},
        "config": config, **agg,
        "per_round": [{"round": t["round"], "label": t["label"], **t["summary"], "decisions": t["decisions"],
                       "counters": t["counters"], "duration_s": t["duration_s"]} for t in turns + reference],
        "samples": {t["label"]: t["samples"] for t in turns + reference},
    }
    print()
    print(f"routing ({args.workload}): {args.tenants} tenants x {args.shared_tokens} shared + "
          f"{args.unique_tokens} unique tokens, "
          f"{args.num_requests} requests at concurrency {args.concurrency}, pool {pool} blocks per replica; "
          f"{machine['cpu_model']}, {machine['nproc']} CPUs")
    print(format_table(agg))
    if args.json:
        report.write_json(args.json, result)
        print(f"wrote {args.json}")
    return 0 if turns and all(t["summary"]["errors"] == 0 for t in turns + reference) else 1


if __name__ == "__main__":
    sys.exit(main())
