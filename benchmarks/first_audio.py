"""Time to first audio and playback stalls as listeners hear them, over a concurrency sweep, with
playback pacing on and off (issue 36; docs/pacing.md).

    .venv/bin/python -m benchmarks.first_audio --stage-config stage_configs/qwen3_omni.yaml \\
        --workloads shared-prefix,image --concurrency 1,2,4,8,16 --arrivals closed,poisson \\
        --sides on,off --rounds 2 --json OUT.json --plot OUT.png

Each round starts the pipeline once per side (``on``: the config's ``pacing`` blocks enabled;
``off``: ``enabled: false``, so the stages still count slack and underruns but change no order),
the sides alternating (on, off, then off, on, ...). Per side and workload: a warm-up request, then
the sweep: for each arrival mode (``closed``: C streams in flight, the C clients starting
1 / ``--rate-per-stream`` / C seconds apart; ``poisson``: sessions arrive at C times
``--rate-per-stream``) and each level C, ``max(--min-requests, --requests-per-stream x C)``
streamed spoken answers (``"stream": true``, text + audio), prompts distinct across the points of
a round and the same on both sides. ``--url`` runs the same sweep against any running
OpenAI-compatible server (one side, "server"). ``--merge A.json B.json`` pools runs made
separately (e.g. one command per round) into one result.

Per answer, a listener (benchmarks/listener.py): time to first audio, and the stalls of a player
that starts ``--jitter-ms`` after the first audio (count and seconds). Per point: TTFA p50/p90/p99,
stalls, answers that stalled, requests/s and audio s/s over its wall time, the stages' pacing
counters (``/metrics`` deltas), stage CPU and run-queue time. Per side: capacity, the highest level
up to which no answer stalled. Verdicts (closed loop, pacing on): TTFA p90 at 8 within 1.5x of
1 with 0 stalls; capacity and throughput no lower than with pacing off.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from benchmarks import profiles
from benchmarks.client import Driver, counter_deltas, scrape_metrics, served_model
from benchmarks.first_audio_results import LABELS, assemble, format_table, plot
from benchmarks.listener import DEFAULT_JITTER_S
from benchmarks.report import write_json
from benchmarks.workloads import Sizes, arrival_times, build_workload
from omni_cache.config import PacingConfig

__all__ = ["main", "plan", "side_config"]

LEVELS = (1, 2, 4, 8, 16)
ARRIVALS = ("closed", "poisson")
SIDES = ("on", "off", "capped")
#: Side "capped": the max_lead_s of every paced stage (at least its lead_s), unless --max-lead-s.
DEFAULT_MAX_LEAD_S = 4.0


# ---- what to run --------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.first_audio",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--stage-config", default="stage_configs/qwen3_omni.yaml")
    p.add_argument("--url", help="sweep this running OpenAI-compatible server instead (one side)")
    p.add_argument("--api-key", default=os.environ.get("OMNI_CACHE_API_KEY"))
    p.add_argument("--model", help="model name for --url (default: the first of /v1/models)")
    p.add_argument(
        "--sides",
        default="on,off",
        help="pacing on, off, capped (on, with --max-lead-s), in this order (default: %(default)s)",
    )
    p.add_argument(
        "--max-lead-s",
        type=float,
        default=DEFAULT_MAX_LEAD_S,
        help="side capped: pacing.max_lead_s of every paced stage, at least its lead_s (default: %(default)s)",
    )
    p.add_argument("--rounds", type=int, default=1, help="rounds, sides alternating order (default: 1)")
    p.add_argument(
        "--first-round",
        type=int,
        default=0,
        help="index of the first round (its prompts and side order): runs made apart keep distinct rounds",
    )
    p.add_argument("--workloads", default="shared-prefix,image")
    p.add_argument("--concurrency", default=",".join(map(str, LEVELS)), help="levels (default: %(default)s)")
    p.add_argument("--arrivals", default=",".join(ARRIVALS), help="closed, poisson or both (default: %(default)s)")
    p.add_argument(
        "--requests-per-stream",
        type=int,
        default=3,
        help="requests per point: this many per stream of the level ... (default: 3)",
    )
    p.add_argument("--min-requests", type=int, default=8, help="... and at least this many (default: 8)")
    p.add_argument("--shared-tokens", type=int, default=4000)
    p.add_argument("--unique-tokens", type=int, default=100)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument(
        "--rate-per-stream",
        default="",
        help="Poisson sessions/s per stream of the level, per workload (shared-prefix=0.35,image=0.12); "
        "default: the first closed-loop concurrency-1 throughput of the run",
    )
    p.add_argument(
        "--no-stagger",
        dest="stagger",
        action="store_false",
        help="closed loop: start all C clients at once (default: 1 / rate-per-stream / C apart)",
    )
    p.add_argument("--jitter-ms", type=float, default=DEFAULT_JITTER_S * 1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--note", default="", help="said in the JSON (e.g. that the machine was shared)")
    p.add_argument("--merge", nargs="+", metavar="JSON", help="pool these results instead of running")
    p.add_argument(
        "--profile",
        metavar="DIR",
        help="py-spy profiles of the stages and of this process (the in-process server and "
        "the clients) at every point, one file per process in DIR (the bench extra)",
    )
    p.add_argument("--profile-rate", type=int, default=100, help="samples per second (default: %(default)s)")
    p.add_argument("--json")
    p.add_argument("--plot")
    args = p.parse_args(argv)
    args.workloads = [w for w in args.workloads.split(",") if w]
    args.levels = sorted({int(c) for c in args.concurrency.split(",") if c})
    args.arrivals = [a for a in args.arrivals.split(",") if a]
    args.sides = ["server"] if args.url else [s for s in args.sides.split(",") if s]
    if any(a not in ARRIVALS for a in args.arrivals):
        p.error(f"--arrivals: {', '.join(ARRIVALS)}")
    if not args.url and any(s not in SIDES for s in args.sides):
        p.error("--sides: on, off, capped")
    if args.url and args.profile:
        p.error("--profile: not with --url (its processes are not ours to sample)")
    if not args.levels or min(args.levels) < 1:
        p.error("--concurrency: levels >= 1")
    args.rates = {}
    for item in filter(None, args.rate_per_stream.split(",")):
        name, _, value = item.partition("=")
        args.rates[name] = float(value)
    return args


def requests_at(level: int, per_stream: int, minimum: int) -> int:
    return max(minimum, per_stream * level)


def plan(workload: str, args: argparse.Namespace, round_index: int) -> tuple[list, dict]:
    """The warm-up and, per (arrival, level), the sessions of one round of one workload: one
    workload built for all of them (one shared prefix or image, a distinct question each), the
    same on every side."""
    points = [(a, c) for a in args.arrivals for c in args.levels]
    sizes = [requests_at(c, args.requests_per_stream, args.min_requests) for _, c in points]
    warmup, sessions = build_workload(
        workload,
        Sizes(
            num_requests=sum(sizes),
            shared_tokens=args.shared_tokens,
            unique_tokens=args.unique_tokens,
            max_tokens=args.max_tokens,
        ),
        seed=args.seed * 1000 + round_index,
    )
    out, start = {}, 0
    for point, n in zip(points, sizes):
        out[point] = sessions[start : start + n]
        start += n
    return warmup, out


def side_config(
    src: str | os.PathLike[str], side: str, dst_dir: str | os.PathLike[str], max_lead_s: float = DEFAULT_MAX_LEAD_S
) -> Path:
    """A copy of the stage config whose pacing blocks are enabled (``on``), only measure
    (``off``), or are enabled with every answer capped at ``max_lead_s`` ahead of its playback
    (``capped``; at least each stage's ``lead_s``); ValueError if no stage paces."""
    data = yaml.safe_load(Path(src).read_text(encoding="utf-8"))
    paced = [s for s in data.get("stages") or [] if s.get("pacing") is not None]
    if not paced:
        raise ValueError(f"{src}: no stage has a pacing block: nothing to turn on or off")
    for stage in paced:
        stage["pacing"]["enabled"] = side in ("on", "capped")
        if side == "capped":
            lead_s = stage["pacing"].get("lead_s", PacingConfig().lead_s)
            stage["pacing"]["max_lead_s"] = max(max_lead_s, lead_s)
    path = Path(dst_dir) / f"pacing-{side}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return path


# ---- running ------------------------------------------------------------------------------------


def profile_tag(side: str, workload: str, arrival: str, level: int, round_index: int) -> str:
    """A point's profile file prefix: :func:`benchmarks.profiles.summarize_dir` pools the rounds
    of what precedes ``-r<k>-`` (so no dash before it), one summary per side and point."""
    return f"{side}_{workload.replace('-', '_')}_{arrival}{level}-r{round_index}"


def run_point(
    url: str,
    model: str,
    sessions: list,
    arrival: str,
    level: int,
    rate: float | None,
    args: argparse.Namespace,
    seed: int,
    monitor: Any = None,
    stage_pids: Any = None,
    profile: Any = None,
) -> dict[str, Any]:
    """One (arrival, level) point: drive its sessions, with /metrics and resources around it,
    sampled by ``profile`` (a :class:`benchmarks.profiles.Recorder` tagged for the point) when
    given."""
    from benchmarks.harness import log

    if arrival == "poisson":
        assert rate is not None
        for s, t in zip(sessions, arrival_times(len(sessions), rate * level, seed)):
            s.arrival_s = t
    # Closed loop: the clients start one unloaded answer time apart / C (1 / rate: rate is the
    # concurrency-1 throughput), as clients that came one by one would; started at once, answers
    # of equal length (the image workload's) keep ending, and starting again, in waves of C.
    stagger = 1.0 / rate / level if arrival == "closed" and rate and args.stagger else 0.0
    driver = Driver(
        url,
        model,
        api_key=args.api_key,
        concurrency=level if arrival == "closed" else None,
        rate=rate * level if arrival == "poisson" else None,
        stagger_s=stagger,
    )
    before = asyncio.run(scrape_metrics(url, args.api_key))
    if monitor is not None:
        monitor.begin(stage_pids())  # name -> pid (benchmarks.machine_monitor.Monitor)
    sampled = {"server": os.getpid(), **stage_pids()} if profile is not None and stage_pids is not None else None
    with profile.record(sampled) if sampled else contextlib.nullcontext():
        samples = asyncio.run(driver.run(sessions))
    resources = monitor.end() if monitor is not None else None
    after = asyncio.run(scrape_metrics(url, args.api_key))
    ok = sum(s.ok for s in samples)
    log(f"  {arrival} C={level}: {ok}/{len(samples)} ok in {driver.t_end - driver.t_base:.1f} s")
    return {
        "arrival": arrival,
        "level": level,
        "rate": rate * level if arrival == "poisson" else None,
        "stagger_s": stagger,
        "duration_s": driver.t_end - driver.t_base,
        "samples": [s.to_dict() for s in samples],
        "counters": counter_deltas(before, after),
        "resources": resources,
    }


def sweep(
    url: str,
    args: argparse.Namespace,
    side: str,
    round_index: int,
    rates: dict[str, float],
    monitor: Any = None,
    stage_pids: Any = None,
    profile: Any = None,
) -> list[dict[str, Any]]:
    """Every workload's warm-up and points on one running server."""
    from benchmarks.harness import log

    model = args.model or asyncio.run(served_model(url, args.api_key))
    points = []
    for workload in args.workloads:
        warmup, sessions = plan(workload, args, round_index)
        warm = asyncio.run(Driver(url, model, api_key=args.api_key).warmup(warmup))
        if not all(w.ok for w in warm):
            raise RuntimeError(f"{workload}: the warm-up request failed: {warm[0].error}")
        log(f"{LABELS.get(side, side)}, round {round_index}, {workload}")
        for (arrival, level), todo in sessions.items():
            if arrival == "poisson" and workload not in rates:
                raise RuntimeError(
                    f"{workload}: no --rate-per-stream and no closed-loop "
                    "concurrency-1 run before the Poisson points to derive it from"
                )
            if profile is not None:
                profile.tag = profile_tag(side, workload, arrival, level, round_index)
            point = run_point(
                url,
                model,
                todo,
                arrival,
                level,
                rates.get(workload),
                args,
                args.seed * 1000 + round_index * 100 + level,
                monitor,
                stage_pids,
                profile,
            )
            point.update(side=side, round=round_index, workload=workload)
            points.append(point)
            if arrival == "closed" and level == 1 and workload not in rates:
                ok = sum(s["ok"] for s in point["samples"])
                rates[workload] = ok / point["duration_s"]
                log(f"  Poisson rate per stream ({workload}): {rates[workload]:.3f}/s (closed loop, C=1)")
    return points


def run(args: argparse.Namespace) -> tuple[list[dict[str, Any]], dict[str, float]]:
    from benchmarks.machine_monitor import Monitor
    from benchmarks.side_processes import ManagedServer

    rates = dict(args.rates)
    points: list[dict[str, Any]] = []
    profile = profiles.Recorder(args.profile, args.profile_rate) if args.profile else None
    if args.url:
        for r in range(args.first_round, args.first_round + args.rounds):
            points += sweep(args.url, args, "server", r, rates)
        return points, rates
    with Monitor() as monitor, tempfile.TemporaryDirectory(prefix="omni_cache_pacing_") as tmp:
        for r in range(args.first_round, args.first_round + args.rounds):
            for side in args.sides if r % 2 == 0 else list(reversed(args.sides)):
                with ManagedServer(
                    side_config(args.stage_config, side, tmp, args.max_lead_s), prefix_cache=True, tag=f"pace-{side}"
                ) as srv:
                    points += sweep(srv.url, args, side, r, rates, monitor, srv.stage_pids, profile)
    return points, rates


def run_config(args: argparse.Namespace, rates: Mapping[str, float]) -> dict[str, Any]:
    return {
        "workloads": args.workloads,
        "levels": args.levels,
        "arrivals": args.arrivals,
        "jitter_s": args.jitter_ms / 1000,
        "requests_per_stream": args.requests_per_stream,
        "min_requests": args.min_requests,
        "shared_tokens": args.shared_tokens,
        "unique_tokens": args.unique_tokens,
        "max_tokens": args.max_tokens,
        "max_lead_s": args.max_lead_s,
        "rate_per_stream": dict(rates),
        "stagger": args.stagger,
        "url": args.url,
        "stage_config": None if args.url else os.path.abspath(args.stage_config),
        "stage_config_yaml": None if args.url else Path(args.stage_config).read_text(),
    }


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    args = parse_args(argv)
    from benchmarks.machine_monitor import machine_info

    if args.merge:
        parts = [json.loads(Path(f).read_text()) for f in args.merge]
        points = [p for part in parts for p in part["points"]]
        config = {
            **parts[0]["config"],
            "rate_per_stream": {k: v for part in parts for k, v in part["config"]["rate_per_stream"].items()},
        }
        if args.jitter_ms != DEFAULT_JITTER_S * 1000:
            config["jitter_s"] = args.jitter_ms / 1000
        machine = parts[0]["machine"]
        note = args.note or parts[0].get("note", "")
        extra = {
            "merged_from": [
                {
                    "file": str(f),
                    "date": part["date"],
                    "command": part["command"],
                    "note": part.get("note", ""),
                    "machine": part["machine"],
                }
                for f, part in zip(args.merge, parts)
            ]
        }
    else:
        machine = machine_info()
        points, rates = run(args)
        machine = {**machine, "loadavg_end": list(os.getloadavg())}
        config, note, extra = run_config(args, rates), args.note, None
    result = assemble(points, config, note, machine, extra)
    if args.profile and not args.merge:
        result["profile"] = {
            "dir": os.path.abspath(args.profile),
            "rate": args.profile_rate,
            "summary": profiles.summarize_dir(args.profile, args.profile_rate),
        }
    print(format_table(result))
    if result.get("profile"):
        print(profiles.format_summary(result["profile"]["summary"]))
    if args.json:
        write_json(args.json, result)
        print(f"wrote {args.json}")
    if args.plot:
        plot(args.plot, result)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
