"""Realtime voice sessions, cache on vs off: time from commit to the first audio delta, by turn.

Workload: ``--sessions`` (4) sessions at once on ``/v1/realtime``, each ``--turns`` (10) turns long;
a turn is a 2-4 s speech-like clip (benchmarks/speech_clips.py) appended in 20 ms chunks, then
``input_audio_buffer.commit`` and ``response.create`` (manual turn detection, so the time measured is
the pipeline's and not the VAD's silence wait), then the whole answer is read before the next turn.
Every answer's prompt is the conversation so far, earlier clips included. ``--rounds`` repeats
the sessions on the same server (new conversations each round: the clips differ by seed).

Measured per turn (client side, the openai SDK's realtime client): commit -> first
``response.output_audio.delta``; the thinker's ``cached_tokens`` over its prompt tokens (from
``response.done``); per side the stages' prefix-cache hit rates (``/metrics`` deltas). The same
workload runs with the prefix caches on (thinker APC + hidden-state cache + talker APC) and off,
one pipeline alive at a time (benchmarks/harness.py). Target: with the cache, turn 10's p50 first
audio within 1.3x of turn 1's.

    .venv/bin/python -m benchmarks.realtime --json realtime.json \\
        --plot realtime.png
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from benchmarks import harness
from benchmarks.client import counter_deltas, scrape_metrics
from benchmarks.realtime_client import append_audio, connect, next_event, read_answer
from benchmarks.report import percentile
from benchmarks.speech_clips import turn_clip

__all__ = ["main", "summarize"]

TARGET_RATIO = 1.3


def bench_config(src: str, dst: Path, *, turns: int, talker_max_tokens: int) -> Path:
    """The pipeline with room for a whole session's clips in one prompt (the thinker's
    ``limit_mm_per_prompt.audio``) and answers of at most ``talker_max_tokens`` codec steps
    (the random talker otherwise speaks until its 1,024-step cap, ~80 s, every turn)."""
    data = yaml.safe_load(Path(src).read_text(encoding="utf-8"))
    for stage in data["stages"]:
        if not stage.get("inputs"):
            extra = stage.setdefault("engine_args", {}).setdefault("extra", {})
            limits = extra.setdefault("limit_mm_per_prompt", {})
            limits["audio"] = max(int(limits.get("audio", 1)), turns)
        elif stage.get("submodel") == "talker":
            stage.setdefault("sampling", {})["max_tokens"] = talker_max_tokens
    dst.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return dst


async def one_session(
    url: str, model: str, *, turns: int, max_tokens: int, clip_s: tuple[float, float], seed: int
) -> list[dict[str, Any]]:
    rng = np.random.default_rng(seed)
    out: list[dict[str, Any]] = []
    async with connect(url, model) as conn:
        assert (await next_event(conn)).type == "session.created"
        await conn.session.update(
            session={"type": "realtime", "max_output_tokens": max_tokens, "audio": {"input": {"turn_detection": None}}}
        )
        assert (await next_event(conn)).type == "session.updated"
        for turn in range(turns):
            seconds = float(rng.uniform(*clip_s))
            await append_audio(conn, turn_clip(seconds, seed=seed * 1000 + turn))
            t0 = time.monotonic()
            await conn.input_audio_buffer.commit()
            await conn.response.create()
            answer = await read_answer(conn, t0=t0)
            response = answer.done.response
            if response.status not in ("completed", "incomplete"):
                raise RuntimeError(f"turn {turn}: response {response.status}: {response.status_details}")
            usage = response.usage
            out.append(
                {
                    "turn": turn + 1,
                    "clip_s": round(seconds, 3),
                    "first_audio_s": answer.first_audio_s,
                    "response_s": time.monotonic() - t0,
                    "input_tokens": usage.input_tokens,
                    "cached_tokens": usage.input_token_details.cached_tokens,
                    "output_tokens": usage.output_tokens,
                    "audio_s": len(answer.audio) / 2 / 24000,
                }
            )
    return out


async def run_sessions(url: str, model: str, n: int, seed0: int, **kw: Any) -> list[list[dict[str, Any]]]:
    return list(await asyncio.gather(*(one_session(url, model, seed=seed0 + i, **kw) for i in range(n))))


def run_side(config: Path, side: str, args: argparse.Namespace, monitor: harness.Monitor) -> dict[str, Any]:
    kw = {"turns": args.turns, "max_tokens": args.max_tokens, "clip_s": tuple(args.clip_seconds)}
    with harness.ManagedServer(
        config, prefix_cache=side == "on", tag=f"realtime-{side}", checkpoint_dir=args.checkpoint_dir
    ) as srv:
        model = srv.server.orchestrator.served_model_name
        harness.log(f"cache {side}: ready after {srv.startup_s:.0f} s; warm-up session")
        asyncio.run(one_session(srv.url, model, turns=2, max_tokens=args.max_tokens, clip_s=kw["clip_s"], seed=10_000))
        before = asyncio.run(scrape_metrics(srv.url))
        monitor.begin(list(srv.stage_pids().values()))
        sessions = []
        t0 = time.monotonic()
        for rnd in range(args.rounds):
            harness.log(f"cache {side}: round {rnd + 1}/{args.rounds}, {args.sessions} sessions x {args.turns} turns")
            for i, turns in enumerate(
                asyncio.run(run_sessions(srv.url, model, args.sessions, args.seed + 100 * rnd, **kw))
            ):
                sessions.append({"round": rnd, "session": i, "turns": turns})
        resources = monitor.end()
        after = asyncio.run(scrape_metrics(srv.url))
    return {
        "side": side,
        "duration_s": time.monotonic() - t0,
        "sessions": sessions,
        "counters": counter_deltas(before, after),
        "resources": resources,
    }


def _quantile(values: list[float], q: float) -> float | None:
    return percentile(values, q * 100) if values else None


def summarize(side: dict[str, Any]) -> dict[str, Any]:
    """Per turn index: first-audio p50/p90 (s) and the thinker's cached share; per stage hit rates."""
    by_turn: dict[int, list[dict[str, Any]]] = {}
    for s in side["sessions"]:
        for t in s["turns"]:
            by_turn.setdefault(t["turn"], []).append(t)
    turns = []
    for k in sorted(by_turn):
        rows = by_turn[k]
        fa = [r["first_audio_s"] for r in rows if r["first_audio_s"] is not None]
        turns.append(
            {
                "turn": k,
                "n": len(rows),
                "first_audio_p50_s": _quantile(fa, 0.5),
                "first_audio_p90_s": _quantile(fa, 0.9),
                "prompt_tokens_mean": float(np.mean([r["input_tokens"] for r in rows])),
                "cached_share": float(
                    sum(r["cached_tokens"] for r in rows) / max(1, sum(r["input_tokens"] for r in rows))
                ),
            }
        )
    hit_rates = {}
    for stage, c in (side.get("counters") or {}).items():
        if c.get("queried"):
            hit_rates[stage] = c.get("hit", 0.0) / c["queried"]
    first, last = turns[0]["first_audio_p50_s"], turns[-1]["first_audio_p50_s"]
    # A line through every turn's p50 says the growth with less noise than two points do.
    xs = [t["turn"] for t in turns if t["first_audio_p50_s"] is not None]
    ys = [t["first_audio_p50_s"] for t in turns if t["first_audio_p50_s"] is not None]
    fit = None
    if len(xs) >= 2:
        slope, intercept = np.polyfit(xs, ys, 1)
        at_first, at_last = intercept + slope * xs[0], intercept + slope * xs[-1]
        fit = {
            "slope_ms_per_turn": 1000 * float(slope),
            "last_over_first": float(at_last / at_first) if at_first > 0 else None,
        }
    return {
        "turns": turns,
        "stage_hit_rates": hit_rates,
        "last_over_first_p50": (last / first) if first and last else None,
        "linear_fit": fit,
    }


def plot(path: str, result: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5), constrained_layout=True)
    colors = {"on": "tab:blue", "off": "tab:red"}
    for side, summary in result["summary"].items():
        turns = summary["turns"]
        x = [t["turn"] for t in turns]
        ax1.plot(
            x, [t["first_audio_p50_s"] * 1000 for t in turns], "o-", color=colors.get(side), label=f"cache {side} p50"
        )
        ax1.plot(
            x,
            [t["first_audio_p90_s"] * 1000 for t in turns],
            "o--",
            color=colors.get(side),
            alpha=0.5,
            label=f"cache {side} p90",
        )
        ax2.plot(x, [100 * t["cached_share"] for t in turns], "o-", color=colors.get(side), label=f"cache {side}")
    ax1.set(
        xlabel="turn",
        ylabel="commit -> first audio delta (ms)",
        ylim=(0, None),
        title=f"{result['config']['sessions']} sessions at once, {result['config']['turns']} turns "
        f"of {result['config']['clip_seconds'][0]:g}-{result['config']['clip_seconds'][1]:g} s",
    )
    ax2.set(
        xlabel="turn", ylabel="thinker prompt tokens cached (%)", ylim=(0, 100), title="thinker cached share by turn"
    )
    from matplotlib.ticker import MaxNLocator

    for ax in (ax1, ax2):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(
        f"/v1/realtime, tiny Qwen3-Omni, {result['machine']['cpu_model']} "
        f"({result['machine']['nproc']} CPUs, shared machine)",
        fontsize=10,
    )
    fig.savefig(path, dpi=110)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.realtime", description=__doc__.split("\n\n")[0])
    p.add_argument("--stage-config", default="stage_configs/qwen3_omni.yaml")
    p.add_argument("--checkpoint-dir", help="where tiny checkpoints live (default: the config's)")
    p.add_argument("--sessions", type=int, default=4, help="sessions at once (default: %(default)s)")
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--clip-seconds", type=float, nargs=2, default=(2.0, 4.0), metavar=("MIN", "MAX"))
    p.add_argument("--max-tokens", type=int, default=8, help="thinker tokens per answer")
    p.add_argument(
        "--talker-max-tokens",
        type=int,
        default=64,
        help="codec steps per answer (12.5 per second of speech; default: %(default)s)",
    )
    p.add_argument("--sides", default="on,off", help="cache on, off or both (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--note", default="", help="added to the result file (e.g. the machine's load)")
    p.add_argument("--json", help="write every number and sample here")
    p.add_argument("--plot", help="write the by-turn plot here (PNG)")
    args = p.parse_args(argv)
    args.sides = [s for s in args.sides.split(",") if s]
    if not set(args.sides) <= {"on", "off"}:
        p.error("--sides takes on and/or off")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="omni_cache_realtime_"))
    sides: dict[str, Any] = {}
    machine = harness.machine_info()
    try:
        config = bench_config(
            args.stage_config, tmp / "realtime.yaml", turns=args.turns + 2, talker_max_tokens=args.talker_max_tokens
        )
        with harness.Monitor() as monitor:
            for side in args.sides:
                sides[side] = run_side(config, side, args, monitor)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    summary = {side: summarize(r) for side, r in sides.items()}
    on = summary.get("on", {}).get("last_over_first_p50")
    result = {
        "benchmark": "realtime",
        "command": harness.command_line("benchmarks.realtime"),
        "machine": machine,
        "machine_note": "shared: other sessions ran on this 2-core machine meanwhile (see loadavg and "
        "run-queue wait in resources). " + args.note,
        "config": {
            k: getattr(args, k)
            for k in (
                "stage_config",
                "sessions",
                "turns",
                "rounds",
                "clip_seconds",
                "max_tokens",
                "talker_max_tokens",
                "sides",
                "seed",
            )
        },
        "target": {
            "turn_last_over_first_p50_max": TARGET_RATIO,
            "cache_on": on,
            "met": None if on is None else on <= TARGET_RATIO,
            "cache_on_linear_fit": (summary.get("on", {}).get("linear_fit") or {}).get("last_over_first"),
        },
        "summary": summary,
        "sides": sides,
    }
    for side, s in summary.items():
        line = ", ".join(
            f"t{t['turn']} {t['first_audio_p50_s'] * 1000:.0f}/{t['first_audio_p90_s'] * 1000:.0f}" for t in s["turns"]
        )
        print(f"cache {side}: first audio p50/p90 ms by turn: {line}")
        fit = s["linear_fit"] or {}
        print(
            f"cache {side}: turn {s['turns'][-1]['turn']} / turn 1 (p50) = {s['last_over_first_p50']:.2f} "
            f"(line through the p50s: {fit.get('slope_ms_per_turn', float('nan')):+.1f} ms/turn, "
            f"{fit.get('last_over_first') or float('nan'):.2f}x); "
            f"hit rates {', '.join(f'{k} {v:.1%}' for k, v in s['stage_hit_rates'].items())}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1), encoding="utf-8")
    if args.plot:
        plot(args.plot, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
