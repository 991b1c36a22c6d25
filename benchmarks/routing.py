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
keyed by its content digest (omni_cache/runtime/routing/media_layouts.py). Run it on the Qwen3-Omni
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
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import yaml  # noqa: E402

from benchmarks.routing_pipelines import RayServer, ray_cluster, ray_config, routing_config  # noqa: E402
from benchmarks.routing_summary import RAY_LABEL, aggregate, format_table, summarize_turn  # noqa: E402
from benchmarks.routing_workload import WORKLOADS, build_requests, default_pool_blocks, tenant_order, warmup_requests  # noqa: E402
from benchmarks.workloads import Session  # noqa: E402

POLICIES = ("prefix", "round_robin", "least_loaded")


# ---- the pipelines ------------------------------------------------------------------------------


def _decisions(text: str) -> dict[str, float]:
    """ "replica/decision" -> the thinker's routing decisions so far (from /metrics)."""
    from omni_cache.runtime.metrics.prometheus import parse_metrics

    return {
        f"{lab['replica']}/{lab['decision']}": v
        for n, lab, v in parse_metrics(text)
        if n == "omni_cache_routing_decisions_total" and lab.get("stage") == "thinker"
    }


async def _metrics_text(url: str) -> str:
    import httpx

    async with httpx.AsyncClient(timeout=30.0) as client:
        r = await client.get(url + "/metrics")
        r.raise_for_status()
        return r.text


def run_turn(
    srv: Any, model: str, sessions: list[Session], *, concurrency: int, label: str, policy: str | None, audio: bool
) -> dict[str, Any]:
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
        "label": label,
        "policy": policy,
        "duration_s": wall,
        "samples": [s.to_dict() for s in sorted(samples, key=lambda s: s.start_s)],
        "counters": counter_deltas(metric_counters(before_text), metric_counters(after_text)),
        "decisions": {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)},
    }
    out["summary"] = summarize_turn(out["samples"])
    s = out["summary"]
    log(
        f"{label}: hit rate {s['hit_rate']:.3f}, TTFT p50 {s['ttft_p50_s']}, TTFA p50 "
        f"{s['ttfa_p50_s']}, {s['errors']} error(s), {wall:.0f} s; decisions {out['decisions']}"
    )
    return out


def _git_commit() -> str | None:
    """The checkout's commit (which router was measured), None outside a git checkout."""
    import subprocess

    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            cwd=Path(__file__).resolve().parent,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


# ---- command line -------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.routing",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--stage-config", default="stage_configs/tiny_omni.yaml")
    p.add_argument("--checkpoint-dir", help="where tiny checkpoints live (default: the config's)")
    p.add_argument(
        "--workload",
        choices=sorted(WORKLOADS),
        default="text",
        help="text: tenants with system prompts; media: text, image, clip and video tenants in turn",
    )
    p.add_argument(
        "--thinker-only", action="store_true", help="the entry stage alone, text answers (implies --text-only)"
    )
    p.add_argument("--tenants", type=int, default=8)
    p.add_argument("--shared-tokens", type=int, default=2000)
    p.add_argument("--unique-tokens", type=int, default=100)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=16, help="text tokens per answer (default: %(default)s)")
    p.add_argument(
        "--pool-blocks",
        type=int,
        help="KV blocks of each thinker replica (default: half the tenants' whole requests + 1)",
    )
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--no-reference", action="store_true", help="skip the one-replica reference")
    p.add_argument(
        "--dtype",
        default="float32",
        help="dtype of the vLLM stages (default %(default)s: bfloat16 is emulated, ~3.5x "
        "slower, on CPUs without AVX512-BF16/AMX; '' keeps the config's)",
    )
    p.add_argument("--text-only", action="store_true", help="no audio (no TTFA)")
    p.add_argument(
        "--ray",
        action="store_true",
        help="also run the prefix turn with the replicas placed by Ray on a two-node "
        "cluster started here, against local spawn (Ray's own cost)",
    )
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
    pool = args.pool_blocks or default_pool_blocks(
        args.tenants, args.shared_tokens, args.unique_tokens, args.max_tokens, block_size
    )
    tmp = Path(tempfile.mkdtemp(prefix="omni_cache_routing_"))
    two = routing_config(
        args.stage_config,
        tmp / "two.yaml",
        replicas=2,
        pool_blocks=pool,
        dtype=args.dtype or None,
        request_timeout_s=900.0,
        thinker_only=args.thinker_only,
    )
    one = routing_config(
        args.stage_config,
        tmp / "one.yaml",
        replicas=1,
        pool_blocks=2 * pool - 1,
        dtype=args.dtype or None,
        request_timeout_s=900.0,
        thinker_only=args.thinker_only,
    )
    config = {
        k: getattr(args, k)
        for k in (
            "tenants",
            "shared_tokens",
            "unique_tokens",
            "num_requests",
            "concurrency",
            "max_tokens",
            "policies",
            "rounds",
            "dtype",
            "text_only",
            "seed",
            "ray",
            "workload",
            "thinker_only",
        )
    }
    config.update(
        pool_blocks_per_replica=pool,
        reference_pool_blocks=2 * pool - 1,
        block_size=block_size,
        stage_config=os.path.abspath(args.stage_config),
        two_replica_yaml=two.read_text(),
        reference_yaml=one.read_text(),
    )
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
                return build_requests(
                    order,
                    shared_tokens=args.shared_tokens,
                    unique_tokens=args.unique_tokens,
                    max_tokens=args.max_tokens,
                    seed=args.seed,
                    round_=rnd,
                    label=label,
                    kinds=WORKLOADS[args.workload],
                )

            harness.log(f"round {rnd}: two thinker replicas of {pool} blocks each; policies {policies}")
            with harness.ManagedServer(
                two, prefix_cache=True, tag=f"routing2-{rnd}", checkpoint_dir=args.checkpoint_dir
            ) as srv:
                harness.log(f"ready after {srv.startup_s:.0f} s")
                model = asyncio.run(served_model(srv.url, None))
                run_turn(
                    srv,
                    model,
                    warmup_requests(2, args.max_tokens, args.seed),
                    concurrency=2,
                    label="warm-up",
                    policy="least_loaded",
                    audio=audio,
                )
                for policy in policies:
                    r = run_turn(
                        srv,
                        model,
                        sessions(policy),
                        concurrency=args.concurrency,
                        label=f"round {rnd} {policy}",
                        policy=policy,
                        audio=audio,
                    )
                    r["round"] = rnd
                    turns.append(r)
            if not args.no_reference:
                harness.log(f"round {rnd}: reference, one thinker of {2 * pool - 1} blocks")
                with harness.ManagedServer(
                    one, prefix_cache=True, tag=f"routing1-{rnd}", checkpoint_dir=args.checkpoint_dir
                ) as srv:
                    model = asyncio.run(served_model(srv.url, None))
                    run_turn(
                        srv,
                        model,
                        warmup_requests(2, args.max_tokens, args.seed),
                        concurrency=2,
                        label="warm-up",
                        policy=None,
                        audio=audio,
                    )
                    r = run_turn(
                        srv,
                        model,
                        sessions("reference"),
                        concurrency=args.concurrency,
                        label=f"round {rnd} reference",
                        policy=None,
                        audio=audio,
                    )
                    r["round"] = rnd
                    reference.append(r)
            if ray_address is not None:
                harness.log(f"round {rnd}: the same two replicas placed by Ray")
                placed = ray_config(two, tmp / f"ray-{rnd}.yaml", ray_address, f"routing-ray-{rnd}")
                with RayServer(placed) as srv:
                    harness.log(f"ready after {srv.startup_s:.0f} s")
                    model = asyncio.run(served_model(srv.url, None))
                    run_turn(
                        srv,
                        model,
                        warmup_requests(2, args.max_tokens, args.seed),
                        concurrency=2,
                        label="warm-up",
                        policy="least_loaded",
                        audio=audio,
                    )
                    # the local prefix turn's requests, on a pipeline as cold as its was
                    r = run_turn(
                        srv,
                        model,
                        sessions("prefix"),
                        concurrency=args.concurrency,
                        label=f"round {rnd} prefix (ray)",
                        policy="prefix",
                        audio=audio,
                    )
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
        "config": config,
        **agg,
        "per_round": [
            {
                "round": t["round"],
                "label": t["label"],
                **t["summary"],
                "decisions": t["decisions"],
                "counters": t["counters"],
                "duration_s": t["duration_s"],
            }
            for t in turns + reference
        ],
        "samples": {t["label"]: t["samples"] for t in turns + reference},
    }
    print()
    print(
        f"routing ({args.workload}): {args.tenants} tenants x {args.shared_tokens} shared + "
        f"{args.unique_tokens} unique tokens, "
        f"{args.num_requests} requests at concurrency {args.concurrency}, pool {pool} blocks per replica; "
        f"{machine['cpu_model']}, {machine['nproc']} CPUs"
    )
    print(format_table(agg))
    if args.json:
        report.write_json(args.json, result)
        print(f"wrote {args.json}")
    return 0 if turns and all(t["summary"]["errors"] == 0 for t in turns + reference) else 1


if __name__ == "__main__":
    sys.exit(main())
