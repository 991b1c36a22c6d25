"""The pipeline against the engine's limit: first text from ``omni-serve`` beside ``vllm serve`` on
the pipeline's thinker alone.

    .venv/bin/python -m benchmarks.engine_limit --stage-config stage_configs/qwen3_omni.yaml \\
        --rounds 8 --num-requests 8 --json OUT.json

First text from a pipeline can come no sooner than from its thinker's engine served alone. This
starts both once, side by side (the harness's ``vllm`` side, :mod:`benchmarks.vllm_serve_side`:
the entry stage's checkpoint, engine arguments, prefix-cache setting and env; and the pipeline as
shipped, cache on, with request timelines on), then for each setting of :data:`SETTINGS`
(workload without reuse and with a shared prefix, concurrency 1 and 4) warms both up and runs
interleaved rounds (the sides take turns, the order alternating), every round with fresh text-only
requests (``"modalities": ["text"]``). Per setting: time to first text p50 of each side, the ratio
pipeline / vllm serve pooled, per round and paired (the rounds' geometric mean); and where the time
went: on the pipeline side its timeline's segments, on both sides the thinker engine's own queue
and prefill time (the pipeline's from its timeline, vLLM's from its ``/metrics`` histograms), so
that what the pipeline adds is split into "inside the engine" and "outside it". The JSON holds
every setting's full harness result (:func:`benchmarks.harness_results.assemble`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import shutil
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

#: (workload, concurrency) of every setting, in the order they run.
SETTINGS: tuple[tuple[str, int], ...] = (
    ("zero-reuse", 1),
    ("zero-reuse", 4),
    ("shared-prefix", 1),
    ("shared-prefix", 4),
)
#: The two sides: the engine alone, then the pipeline as shipped (prefix cache on).
SIDES = ("vllm", "on")
#: Where the pipeline's overhead is broken down (issue 44: within 10% of the engine, or named).
LIMIT_RATIO = 1.1

#: vLLM's per-request histograms (seconds) read from ``vllm serve``'s /metrics.
VLLM_HISTOGRAMS = {
    "ttft": "vllm:time_to_first_token_seconds",
    "queue": "vllm:request_queue_time_seconds",
    "prefill": "vllm:request_prefill_time_seconds",
}


def histogram_means(before: str, after: str) -> dict[str, float]:
    """Mean seconds per request of each :data:`VLLM_HISTOGRAMS` between two /metrics texts (sum
    and count deltas, summed over label sets); NaN where nothing was counted."""
    from omni_cache.runtime.metrics.prometheus import parse_metrics

    def totals(text: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, _labels, value in parse_metrics(text):
            out[name] = out.get(name, 0.0) + value
        return out

    a, b = totals(before), totals(after)
    out = {}
    for key, name in VLLM_HISTOGRAMS.items():
        n = b.get(name + "_count", 0.0) - a.get(name + "_count", 0.0)
        s = b.get(name + "_sum", 0.0) - a.get(name + "_sum", 0.0)
        out[key] = s / n if n > 0 else math.nan
    return out


def timeline_engine_means(
    samples: Sequence[Mapping[str, Any]], timelines: Mapping[str, Mapping[str, Mapping[str, float]]]
) -> dict[str, float]:
    """The pipeline thinker's engine queue (vLLM's queued -> scheduled) and prefill (scheduled ->
    first token) in seconds, mean over the samples whose request has both in its timeline: the
    quantities of :func:`histogram_means` on the other side."""
    from benchmarks.breakdown import request_id_of

    queue, prefill = [], []
    for s in samples:
        think = timelines.get(request_id_of(s) or "", {}).get("thinker", {})
        if s.get("ok") and all(k in think for k in ("queued", "scheduled", "first_token")):
            queue.append(think["scheduled"] - think["queued"])
            prefill.append(think["first_token"] - think["scheduled"])

    def mean(xs):
        return sum(xs) / len(xs) if xs else math.nan

    return {"queue": mean(queue), "prefill": mean(prefill), "requests": len(queue)}


def ttft_row(workload: str, concurrency: int, result: Mapping[str, Any]) -> dict[str, Any]:
    """One setting's line: TTFT p50 of both sides (s), the ratio pipeline / vllm serve pooled,
    paired (geometric mean of the rounds') and per round, and the rounds the pipeline was slower."""
    sides = result["sides"]
    per_round = [r["speedup"]["ttft_s"]["p50"] for r in result.get("ratios_per_round", [])]
    return {
        "workload": workload,
        "concurrency": concurrency,
        "ttft_p50_vllm_s": sides["vllm"]["ttft_s"]["p50"],
        "ttft_p50_pipeline_s": sides["on"]["ttft_s"]["p50"],
        "ratio_pooled": result["ratios"]["speedup"]["ttft_s"]["p50"],
        "ratio_paired": result["paired_ratios"]["speedup"]["ttft_s"]["p50"],
        "ratio_rounds": per_round,
        "rounds_pipeline_slower": sum(1 for r in per_round if r > 1),
        "requests_with_text": [sides["vllm"]["ttft_s"].get("n"), sides["on"]["ttft_s"].get("n")],
        # Beside TTFT (kept in the summary): means, the engine split, end to end and throughput.
        "ttft_mean_s": {side: sides[side]["ttft_s"].get("mean") for side in SIDES},
        "engine_s": result.get("engine"),
        "e2e_p50_s": {side: sides[side].get("e2e_s", {}).get("p50") for side in SIDES},
        "requests_per_s": {side: sides[side].get("throughput", {}).get("requests_per_s") for side in SIDES},
        "loadavg": {side: (sides[side].get("resources") or {}).get("loadavg_mean") for side in SIDES},
    }


def _ms(v: float | None) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v * 1000:.0f}"


def format_rows(rows: Sequence[Mapping[str, Any]]) -> str:
    """The per-setting TTFT table (milliseconds, ratios pipeline / vllm serve)."""
    head = f"{'setting':<22}{'vllm p50':>10}{'pipe p50':>10}{'pooled':>8}{'paired':>8}{'slower':>8}  per round"
    lines = [head, "-" * len(head)]
    for r in rows:
        rounds = " ".join(f"{x:.2f}" for x in r["ratio_rounds"])
        lines.append(
            f"{r['workload'] + ', c=' + str(r['concurrency']):<22}{_ms(r['ttft_p50_vllm_s']):>10}"
            f"{_ms(r['ttft_p50_pipeline_s']):>10}{r['ratio_pooled']:>8.3f}{r['ratio_paired']:>8.3f}"
            f"{str(r['rounds_pipeline_slower']) + '/' + str(len(r['ratio_rounds'])):>8}  {rounds}"
        )
    return "\n".join(lines)


def format_engine_split(
    row: Mapping[str, Any], engine: Mapping[str, Mapping[str, float]], ttft_mean: Mapping[str, float]
) -> str:
    """Mean TTFT of each side split into the engine's queue, its prefill, and the rest (outside
    the engine: HTTP, tokenizing, hand-offs, detokenizing), milliseconds."""
    lines = [f"{row['workload']}, c={row['concurrency']}: mean ms   {'vllm':>8}{'pipeline':>10}{'diff':>8}"]
    parts = {}
    for side in SIDES:
        e = engine[side]
        parts[side] = {
            "engine: queue": e["queue"],
            "engine: prefill": e["prefill"],
            "outside the engine": ttft_mean[side] - e["queue"] - e["prefill"],
            "time to first text": ttft_mean[side],
        }
    for name in parts["vllm"]:
        a, b = parts["vllm"][name], parts["on"][name]
        lines.append(f"  {name:<30}{_ms(a):>8}{_ms(b):>10}{_ms(b - a):>8}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.engine_limit",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--stage-config",
        default="stage_configs/qwen3_omni.yaml",
        help="the pipeline; its entry stage is what vllm serve runs (default: %(default)s)",
    )
    p.add_argument("--checkpoint-dir", help="where tiny checkpoints live (default: the config's)")
    p.add_argument("--rounds", type=int, default=8, help="interleaved rounds per setting (default: %(default)s)")
    p.add_argument(
        "--num-requests", type=int, default=8, help="fresh requests per side and round (default: %(default)s)"
    )
    p.add_argument(
        "--shared-tokens",
        type=int,
        default=500,
        help="opening tokens of every prompt: distinct (zero-reuse) or one shared system "
        "prompt (shared-prefix) (default: %(default)s)",
    )
    p.add_argument("--unique-tokens", type=int, default=100, help="unique tokens per prompt (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=32, help="text tokens per answer (default: %(default)s)")
    p.add_argument(
        "--settings",
        default=",".join(f"{w}:{c}" for w, c in SETTINGS),
        help="workload:concurrency pairs to run, in order (default: %(default)s)",
    )
    p.add_argument(
        "--vllm-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="add KEY=VALUE to vllm serve's environment only (repeatable; e.g. "
        "VLLM_ENABLE_V1_MULTIPROCESSING=0: its worker in the engine core's process, as "
        "in the pipeline's thinker)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write every setting's full result here")
    args = p.parse_args(argv)
    try:
        args.settings = parse_settings(args.settings)
    except ValueError as e:
        p.error(f"--settings: {e}")
    env = {}
    for item in args.vllm_env:
        key, sep, value = item.partition("=")
        if not sep or not key:
            p.error(f"--vllm-env: expected KEY=VALUE, got {item!r}")
        env[key] = value
    args.vllm_env = env
    if args.rounds < 1 or args.num_requests < 1:
        p.error("--rounds and --num-requests must be >= 1")
    if not Path(args.stage_config).is_file():
        p.error(f"--stage-config {args.stage_config}: no such file")
    return args


def parse_settings(text: str) -> list[tuple[str, int]]:
    """``"zero-reuse:1,shared-prefix:4"`` -> [(workload, concurrency), ...]."""
    out = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        workload, sep, conc = item.partition(":")
        if not sep or workload not in ("zero-reuse", "shared-prefix") or not conc.isdigit() or int(conc) < 1:
            raise ValueError(f"expected zero-reuse:C or shared-prefix:C with C >= 1, got {item!r}")
        out.append((workload, int(conc)))
    if not out:
        raise ValueError("no setting given")
    return out


def _scrape(url: str) -> str:
    import httpx

    return httpx.get(url + "/metrics", timeout=10).text


def run_setting(
    servers: Mapping[str, Any],
    models: Mapping[str, str],
    workload: str,
    concurrency: int,
    args: argparse.Namespace,
    seed: int,
    monitor: Any,
    timeline_dir: str,
) -> dict[str, Any]:
    """Warm both sides up on the setting's workload, run its interleaved rounds; the harness's
    result document with the engine split added."""
    from benchmarks import harness, harness_results
    from benchmarks.workloads import Sizes, build_workload, split_rounds
    from omni_cache import timeline

    sizes = Sizes(
        num_requests=args.num_requests * args.rounds,
        shared_tokens=args.shared_tokens,
        unique_tokens=args.unique_tokens,
        turns=1,
        max_tokens=args.max_tokens,
    )
    warmup, sessions = build_workload(workload, sizes, seed)
    rounds = split_rounds(sessions, args.rounds)
    for side in SIDES:
        harness.warm_up(servers[side].url, models[side], warmup, api_key=None, label=side, audio=False)
    runs: list[dict[str, Any]] = []
    vllm_metrics = [_scrape(servers["vllm"].url), ""]
    for r, group in enumerate(rounds):
        for side in harness.side_order(list(SIDES), r):
            harness.log(f"{workload} c={concurrency}: round {r + 1}/{len(rounds)}, {side}")
            out = harness.measure(
                servers[side].url,
                models[side],
                group,
                api_key=None,
                concurrency=concurrency,
                rate=None,
                label=side,
                progress=False,
                monitor=monitor,
                processes=servers[side].processes,
                audio=False,
            )
            for sample in out["samples"]:
                sample["round"] = r
            runs.append({"side": side, "round": r, **out})
    vllm_metrics[1] = _scrape(servers["vllm"].url)
    config = {
        "workload": workload,
        "concurrency": concurrency,
        "rate": None,
        "seed": seed,
        "sizes": {
            "num_requests": args.num_requests,
            "shared_tokens": args.shared_tokens,
            "unique_tokens": args.unique_tokens,
            "max_tokens": args.max_tokens,
        },
        "sides": list(SIDES),
        "rounds": args.rounds,
        "text_only": True,
        "vllm_env": args.vllm_env,
        "stage_config": os.path.abspath(args.stage_config),
    }
    result = harness_results.assemble(config, harness.machine_info(), runs, monitor)
    timelines = timeline.read(os.path.join(timeline_dir, "on"))
    result["engine"] = {
        "vllm": histogram_means(*vllm_metrics),
        "on": timeline_engine_means(result["samples"]["on"], timelines),
    }
    from benchmarks.breakdown import summarize_breakdown

    result["breakdown"] = {"on": summarize_breakdown(result["samples"]["on"], timelines)}
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from benchmarks import harness, report
    from benchmarks.breakdown import format_breakdown
    from benchmarks.side_processes import socket_dir
    from benchmarks.vllm_serve_side import VllmServeProcess
    from omni_cache.timeline import TIMELINE_DIR_ENV

    machine = harness.machine_info()
    rows, results = [], []
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="omni_cache_limit_"))
        timeline_dir = os.path.join(tmp, "timelines")
        servers: dict[str, Any] = {}
        for side in SIDES:  # both start at once, as the harness starts its sides
            stack.callback(shutil.rmtree, socket_dir(side), True)
            path = harness.private_config(args.stage_config, tmp, side)
            servers[side] = (
                VllmServeProcess(path, checkpoint_dir=args.checkpoint_dir, env=args.vllm_env)
                if side == "vllm"
                else harness.ServerProcess(
                    path,
                    prefix_cache=True,
                    checkpoint_dir=args.checkpoint_dir,
                    env={TIMELINE_DIR_ENV: os.path.join(timeline_dir, side)},
                )
            )
            stack.push(servers[side])
            servers[side].start()
        harness.log(f"starting {' and '.join(SIDES)} at once ...")
        for side, srv in servers.items():
            srv.wait_ready()
            harness.log(f"{side}: ready after {srv.startup_s:.1f} s at {srv.url}")
        from benchmarks.client import served_model

        models = {side: asyncio.run(served_model(srv.url)) for side, srv in servers.items()}
        monitor = stack.enter_context(harness.Monitor())
        for k, (workload, concurrency) in enumerate(args.settings):
            result = run_setting(
                servers, models, workload, concurrency, args, args.seed + 1000 * k, monitor, timeline_dir
            )
            row = ttft_row(workload, concurrency, result)
            rows.append(row)
            results.append(result)
            ttft_mean = {side: result["sides"][side]["ttft_s"]["mean"] for side in SIDES}
            print(format_rows([row]), flush=True)
            print(format_engine_split(row, result["engine"], ttft_mean), flush=True)
            if row["ratio_paired"] > LIMIT_RATIO or row["ratio_pooled"] > LIMIT_RATIO:
                print(format_breakdown(result["breakdown"], "text"), flush=True)
    harness.log("servers stopped")
    print()
    print(
        f"first text, pipeline / vllm serve (p50); {machine['cpu_model']}, {machine['nproc']} CPUs, "
        f"load {os.getloadavg()[0]:.1f}"
    )
    print(format_rows(rows))
    if args.json:
        report.write_json(
            args.json,
            {
                "benchmark": "engine limit (python -m benchmarks.engine_limit)",
                "command": harness.command_line("benchmarks.engine_limit"),
                "machine": machine,
                "rows": rows,
                "settings": results,
            },
        )
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
