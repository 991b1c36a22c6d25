"""End-to-end benchmark of the serving pipeline, prefix cache on vs off, through the HTTP API.

    .venv/bin/python -m benchmarks --stage-config stage_configs/tiny_omni.yaml \\
        --workload shared-prefix --json OUT.json --plot OUT.png [--quick]

By default it starts the pipeline of ``--stage-config`` twice, prefix cache on and off
(``--sides``), each as ``omni-serve`` in a process of its own on a private copy of the config (own
socket paths, HTTP port 0); both stay up for the whole run. Each gets the same warm-up (not
measured), then the workload's requests go in ``--rounds`` rounds: every round's requests (fresh
ones, ``--num-requests`` of them) to one side, then the same to the other, the order alternating
from round to round; ratios are taken per round (the two sides of a round ran minutes apart at
most) and their median reported beside the pooled ones. Requests are streamed (``"stream": true``,
text + audio). ``--url`` measures an already running server instead (one side, whatever its cache
setting).

Per side: time to first text / first audio / end of stream (p50, p90, p99), throughput (requests/s,
audio seconds/s), the thinker's prefix-cache hit rate and hidden-state rows served from the cache
(``/metrics`` deltas over the measured phase), stage CPU time per request; on/off ratios: speedup =
off / on (latencies), throughput change = on / off - 1. Prints a table, writes ``--json`` (every
sample, the machine, the command, the config) and ``--plot`` (latency CDFs of both sides).
Results: docs/benchmarks.md (tables) and benchmarks/results/ (run logs).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import math
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

# Quiet: vLLM in the stage processes (they inherit the environment) and transformers here.
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from benchmarks import profiles  # noqa: E402
from benchmarks.breakdown import format_breakdown, summarize_breakdown  # noqa: E402
from benchmarks.workloads import WORKLOADS, Sizes, arrival_times, build_workload, parse_mix, split_rounds  # noqa: E402
from omni_cache import timeline  # noqa: E402

DEFAULTS = dict(num_requests=32, shared_tokens=4000, unique_tokens=100, turns=3, max_tokens=32)
QUICK = dict(num_requests=6, shared_tokens=2000, unique_tokens=100, turns=2, max_tokens=24)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    target = p.add_argument_group("what to measure")
    target.add_argument(
        "--stage-config", default="stage_configs/tiny_omni.yaml", help="pipeline to start (default: %(default)s)"
    )
    target.add_argument("--url", help="measure this running server instead (e.g. http://127.0.0.1:8091)")
    target.add_argument(
        "--api-key",
        default=os.environ.get("OMNI_CACHE_API_KEY"),
        help="API key of --url (default: $OMNI_CACHE_API_KEY)",
    )
    target.add_argument("--model", help="model name for --url (default: the first of /v1/models)")
    target.add_argument(
        "--sides",
        default="on,off",
        help="which pipelines to start, in order: on, off or both (default: %(default)s); "
        "off,off2 (or on,on2) starts two of the same setting: an A/A run, whose "
        "ratios show what the machine alone moves; vllm starts `vllm serve` on the "
        "pipeline's entry stage (its checkpoint, engine arguments and env; needs "
        "--text-only): vllm,on measures the pipeline against the engine's limit",
    )
    target.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="rounds of --num-requests fresh requests per side, the sides' order "
        "alternating (on,off / off,on / ...); both pipelines stay up throughout; "
        "per-round ratios and their median are reported (default: 1)",
    )
    target.add_argument(
        "--order",
        choices=("alternate", "same"),
        default="alternate",
        help="the sides' turns per round: alternate (A B, B A, ...) or same (A B, A B, ...) (default: %(default)s)",
    )
    target.add_argument(
        "--restart-every",
        type=int,
        default=0,
        metavar="K",
        help="stop and start every side's pipeline afresh every K rounds, the start order "
        "alternating, so that no pipeline instance's own luck (where its memory and "
        "processes landed) runs through the whole comparison; 0: never (default: "
        "%(default)s)",
    )
    target.add_argument("--checkpoint-dir", help="where tiny checkpoints live (default: the config's)")
    target.add_argument(
        "--stage-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="add KEY=VALUE to every stage's env in the private config copy (repeatable; e.g. OMP_NUM_THREADS=1)",
    )
    wl = p.add_argument_group("workload")
    wl.add_argument("--workload", choices=WORKLOADS, default="shared-prefix")
    wl.add_argument(
        "--num-requests",
        type=int,
        help=f"measured requests per side and round "
        f"(default {DEFAULTS['num_requests']}, "
        f"--quick {QUICK['num_requests']})",
    )
    wl.add_argument(
        "--shared-tokens",
        type=int,
        help="S: shared system-prompt tokens (shared-prefix), "
        "image tokens (image), opening "
        f"tokens (multi-turn, zero-reuse) (default {DEFAULTS['shared_tokens']}, "
        f"--quick {QUICK['shared_tokens']})",
    )
    wl.add_argument(
        "--unique-tokens",
        type=int,
        help=f"U: unique tokens per request / turn (default "
        f"{DEFAULTS['unique_tokens']}, --quick {QUICK['unique_tokens']})",
    )
    wl.add_argument(
        "--turns",
        type=int,
        help=f"turns per conversation (multi-turn) (default {DEFAULTS['turns']}, --quick {QUICK['turns']})",
    )
    wl.add_argument(
        "--max-tokens",
        type=int,
        help=f"text tokens per answer (default {DEFAULTS['max_tokens']}, --quick {QUICK['max_tokens']})",
    )
    wl.add_argument(
        "--mix",
        default="shared-prefix=2,multi-turn=1,zero-reuse=1",
        help="weights of the mixed workload (default: %(default)s)",
    )
    load = wl.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=int, help="requests in flight (closed loop; default 1)")
    load.add_argument(
        "--rate",
        type=float,
        help="Poisson arrivals: new sessions (requests, or conversations for multi-turn) per second",
    )
    wl.add_argument(
        "--stagger",
        type=float,
        default=0.0,
        metavar="S",
        help="closed loop: client k sends its first request k * S seconds after the round "
        "starts (default 0: all at once). With all c clients opening together, the first "
        "c requests of a round share one batched prefill and their time to first text is "
        "2-4x the later ones'; set S near the end-to-end time / c to compare sides at "
        "concurrency > 1 (docs/benchmarks.md)",
    )
    wl.add_argument(
        "--text-only",
        action="store_true",
        help='text-only requests ("modalities": ["text"]), like vllm bench serve sends them',
    )
    wl.add_argument(
        "--one-message",
        action="store_true",
        help="single-turn requests as one user message (system + user text), as vllm bench serve "
        "sends the prompts of benchmarks.export_prompts",
    )
    wl.add_argument(
        "--cpu-burners",
        type=int,
        default=0,
        metavar="N",
        help="keep N cores busy beside the pipelines while they are measured (one process "
        "each: float32 matrix products on one torch thread), to measure them with the "
        "cores contended (default: 0)",
    )
    wl.add_argument("--seed", type=int, default=0)
    wl.add_argument(
        "--quick",
        action="store_true",
        help="small sizes (whole run incl. both start-ups well under 10 minutes on 2 cores)",
    )
    out = p.add_argument_group("output")
    out.add_argument("--json", help="write every number and sample here")
    out.add_argument("--plot", help="write the latency plot (PNG) here")
    out.add_argument("--no-progress", action="store_true", help="no progress bar")
    out.add_argument(
        "--profile",
        metavar="DIR",
        help="sample the server and every stage with py-spy while each side is measured "
        "(raw stacks in DIR, a summary per side and process in the JSON)",
    )
    out.add_argument("--profile-rate", type=int, default=100, help="py-spy samples per second (default: %(default)s)")
    out.add_argument(
        "--timeline",
        action="store_true",
        help="record every request's way through the server and the stages "
        "(omni_cache/timeline.py) and report where its time to first audio / text went",
    )
    args = p.parse_args(argv)
    base = QUICK if args.quick else DEFAULTS
    for k, v in base.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.rate is None and args.concurrency is None:
        args.concurrency = 1
    if args.concurrency is not None and args.concurrency < 1:
        p.error("--concurrency must be >= 1")
    if args.rate is not None and not (args.rate > 0 and math.isfinite(args.rate)):
        p.error("--rate must be > 0")
    if not (args.stagger >= 0 and math.isfinite(args.stagger)):
        p.error("--stagger must be >= 0")
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    if args.restart_every < 0:
        p.error("--restart-every must be >= 0 (0: never)")
    if args.url and (args.rounds > 1 or args.profile or args.timeline or args.restart_every):
        p.error(
            "--rounds, --restart-every, --profile and --timeline apply to the pipelines this command "
            "starts, not to --url"
        )
    sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    if not sides or any(not re.fullmatch(r"(on|off)\d*|vllm", s) for s in sides) or len(set(sides)) != len(sides):
        p.error(
            "--sides: a comma-separated list of 'on' and 'off' (or on2, off2, ...: a second "
            "pipeline of the same setting, for an A/A run) and 'vllm' (vllm serve on the entry stage)"
        )
    if "vllm" in sides and not args.text_only:
        p.error("--sides vllm: vllm serve answers text only; add --text-only")
    args.sides = sides
    env = {}
    for item in args.stage_env:
        key, sep, value = item.partition("=")
        if not sep or not key:
            p.error(f"--stage-env: expected KEY=VALUE, got {item!r}")
        env[key] = value
    args.stage_env = env
    if env and args.url:
        p.error("--stage-env applies to the pipelines this command starts, not to --url")
    try:
        args.mix = parse_mix(args.mix)
    except ValueError as e:
        p.error(str(e))
    if not args.url and not Path(args.stage_config).is_file():
        p.error(f"--stage-config {args.stage_config}: no such file")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    for name in ("omni_cache", "uvicorn", "httpx", "vllm"):
        logging.getLogger(name).setLevel(logging.WARNING)

    from benchmarks import harness, harness_results, report, report_plot

    sizes = Sizes(
        num_requests=args.num_requests,
        shared_tokens=args.shared_tokens,
        unique_tokens=args.unique_tokens,
        turns=args.turns,
        max_tokens=args.max_tokens,
        mix=args.mix,
    )
    try:
        # Every round gets fresh requests: the workload of all rounds, cut into rounds.
        every = dataclasses.replace(sizes, num_requests=sizes.num_requests * args.rounds)
        warmup, sessions = build_workload(args.workload, every, args.seed)
        rounds = split_rounds(sessions, args.rounds)
    except ValueError as e:
        print(f"benchmarks: {e}", file=sys.stderr)
        return 2
    if args.rate is not None:
        for group in rounds:  # every round's arrivals start at its own measured phase
            for s, t in zip(group, arrival_times(len(group), args.rate, args.seed)):
                s.arrival_s = t
    config: dict[str, Any] = {
        "workload": args.workload,
        "sizes": {
            k: getattr(sizes, k) for k in ("num_requests", "shared_tokens", "unique_tokens", "turns", "max_tokens")
        },
        "requests_per_round": [sum(s.turns for s in group) for group in rounds],
        "mix": args.mix if args.workload == "mixed" else None,
        "concurrency": args.concurrency,
        "rate": args.rate,
        "seed": args.seed,
        "quick": args.quick,
        "text_only": args.text_only,
        "one_message": args.one_message,
        "stagger_s": args.stagger,
        "sessions": len(sessions),
        "warmup_requests": sum(s.turns for s in warmup),
        "sides": ["server"] if args.url else args.sides,
        "rounds": len(rounds),
        "url": args.url,
        "stage_config": None if args.url else os.path.abspath(args.stage_config),
        "stage_config_yaml": None if args.url else Path(args.stage_config).read_text(encoding="utf-8"),
        "private_copy": None
        if args.url
        else "omni-serve per side in a process of its own; name "
        "bench-<pid>-<side>, ipc sockets under /tmp/omni_cache/bench-<pid>-<side>/, server.port 0",
        "stage_env": args.stage_env or None,
        "profile": {"dir": os.path.abspath(args.profile), "rate": args.profile_rate} if args.profile else None,
        "timeline": args.timeline,
        "cpu_burners": args.cpu_burners,
        "order": args.order,
        "restart_every": args.restart_every,
    }
    machine = harness.machine_info()
    runs: list[dict[str, Any]] = []
    sides_info: dict[str, Any] = {}
    progress = not args.no_progress
    profile = profiles.Recorder(args.profile, args.profile_rate) if args.profile else None
    with contextlib.ExitStack() as stack:
        timeline_dir = (
            stack.enter_context(tempfile.TemporaryDirectory(prefix="omni_cache_timeline_")) if args.timeline else None
        )
        monitor = stack.enter_context(harness.Monitor())
        try:
            if args.url:
                harness.log(f"measuring {args.url}: warm-up, then {sum(s.turns for s in sessions)} request(s)")
                r = harness.drive(
                    args.url,
                    args.model,
                    warmup,
                    sessions,
                    api_key=args.api_key,
                    concurrency=args.concurrency,
                    rate=args.rate,
                    label="server",
                    progress=progress,
                    audio=not args.text_only,
                    one_message=args.one_message,
                    stagger_s=args.stagger,
                )
                runs.append({"side": "server", "round": 0, **r})
            else:
                _, sides_info = harness.run_rounds(
                    args.stage_config,
                    args.sides,
                    warmup,
                    rounds,
                    concurrency=args.concurrency,
                    rate=args.rate,
                    progress=progress,
                    monitor=monitor,
                    checkpoint_dir=args.checkpoint_dir,
                    stage_env=args.stage_env or None,
                    audio=not args.text_only,
                    one_message=args.one_message,
                    profile=profile,
                    timeline_dir=timeline_dir,
                    cpu_burners=args.cpu_burners,
                    order=args.order,
                    restart_every=args.restart_every,
                    stagger_s=args.stagger,
                    on_run=runs.append,
                )
        except KeyboardInterrupt:
            print("benchmarks: interrupted", file=sys.stderr)
            if not runs:
                return 130
        except Exception as e:  # noqa: BLE001 -- start-up failures etc.: say what, keep what was measured
            print(f"benchmarks: {type(e).__name__}: {e}", file=sys.stderr)
            if not runs:
                return 1
        timelines = (
            {side: timeline.read(os.path.join(timeline_dir, side)) for side in args.sides} if timeline_dir else None
        )
    result = harness_results.assemble(config, machine, runs, monitor)
    result["sides_started"] = sides_info
    if timelines is not None:
        result["breakdown"] = {
            side: summarize_breakdown(result["samples"].get(side, []), timelines[side]) for side in args.sides
        }
    if profile is not None:
        result["profile"] = profiles.summarize_dir(args.profile, args.profile_rate)
    print()
    print(
        f"omni_cache end to end: {args.workload}, {config['sizes']}, "
        + (f"rate {args.rate}/s" if args.rate else f"concurrency {args.concurrency}")
        + f"; {machine['cpu_model']}, {machine['nproc']} CPUs"
    )
    print(report.format_table(result))
    if "answers_identical" in result:
        a = result["answers_identical"]
        print(f"answers identical on/off: {a['identical']} of {a['compared']}")
    if "profile" in result:
        print()
        print(profiles.format_summary(result["profile"]))
    if "breakdown" in result:
        print()
        print(format_breakdown(result["breakdown"], "audio"))
        print(format_breakdown(result["breakdown"], "text"))
    if args.json:
        report.write_json(args.json, result)
        print(f"wrote {args.json}")
    if args.plot:
        report_plot.plot(args.plot, result)
        print(f"wrote {args.plot}")
    failed = any(r["samples"] and not any(s["ok"] for s in r["samples"]) for r in runs)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
