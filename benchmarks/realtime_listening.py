"""End of speech -> first audio with the thinker listening while the user speaks, on vs off (issue 51).

Per side (``server.realtime.listen_while_speaking`` true / false, one server each, prefix caches on)
and per cell (turn length ``--seconds`` x sessions at once ``--sessions``): each session says
``--turns`` turns of speech-like audio (benchmarks/speech_clips.py) appended in real time (100 ms
appends, 100 ms apart, as a microphone sends them), then ``input_audio_buffer.commit`` and
``response.create`` (manual turn detection: the time measured is the pipeline's, not the VAD's
silence wait), and reads the whole answer before its next turn. Measured per turn, client side:
commit -> first ``response.output_audio.delta`` (end of speech to first audio), the thinker's
``cached_tokens`` over its prompt; per cell: the stage processes' CPU seconds (user + system, from
/proc) per second of speech, and the thinker's. With ``--timeline DIR`` the pipeline's request
timelines (omni_cache/timeline.py) are kept there and each cell also gets a per-stage breakdown
of its responses' way to the first audio (``stage_breakdown``: from the server taking the
response to its first audio coming back; listening requests have no audio and are left out).
Every side's server is up at once and the cells alternate sides (``--rounds``: the order flipped
each round), so on a shared host both sides of a cell meet about the same load.

``--bystander S`` adds one more session to each cell, starting 3 s in, that says turns of ``S``
seconds one after another for as long as the cell's first turn is being spoken (until 1 s before
its end): its first audio (``bystander`` in the cell) is another session's answer while the cell's
sessions speak, which listening loads (with ``--stagger 0`` they all speak at once, and no answer
of theirs runs meanwhile). ``--sessions 0`` gives the bystander alone.

    PYTHONPATH=. .venv/bin/python -m benchmarks.realtime_listening --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from benchmarks import harness
from benchmarks.breakdown import AUDIO_SEGMENTS, talker_start
from benchmarks.realtime_client import connect, next_event, read_answer
from benchmarks.report import percentile
from benchmarks.side_processes import ManagedServer
from benchmarks.speech_clips import RATE, pcm16, turn_clip

APPEND_S = 0.1


def side_config(src: str, dst: Path, listen: bool, talker_max_tokens: int) -> Path:
    data = yaml.safe_load(Path(src).read_text(encoding="utf-8"))
    for stage in data["stages"]:
        if stage.get("submodel") == "talker":
            stage.setdefault("sampling", {})["max_tokens"] = talker_max_tokens
    data.setdefault("server", {}).setdefault("realtime", {})["listen_while_speaking"] = listen
    dst.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return dst


async def speak(conn: Any, samples: np.ndarray) -> None:
    """``samples`` (24 kHz) appended in real time: 100 ms every 100 ms."""
    import base64

    data = pcm16(samples)
    step = int(APPEND_S * RATE) * 2
    t0 = time.monotonic()
    for k, i in enumerate(range(0, len(data), step)):
        await conn.input_audio_buffer.append(audio=base64.b64encode(data[i : i + step]).decode())
        delay = t0 + (k + 1) * APPEND_S - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)


async def one_session(
    url: str, model: str, *, seconds: float, turns: int, max_tokens: int, seed: int, delay_s: float = 0.0
) -> list[dict]:
    out = []
    await asyncio.sleep(delay_s)
    async with connect(url, model) as conn:
        assert (await next_event(conn)).type == "session.created"
        await conn.session.update(
            session={"type": "realtime", "max_output_tokens": max_tokens, "audio": {"input": {"turn_detection": None}}}
        )
        assert (await next_event(conn)).type == "session.updated"
        for turn in range(turns):
            await speak(conn, turn_clip(seconds, seed=seed * 1000 + turn))
            t0 = time.monotonic()
            await conn.input_audio_buffer.commit()
            await conn.response.create()
            first_text: list[float] = []

            def on_event(event: Any, _answer: Any, first_text: list[float] = first_text, t0: float = t0) -> None:
                # The transcript's first delta: the thinker's first token at the client (the
                # talker and decoder come after it).
                if event.type == "response.output_audio_transcript.delta" and not first_text:
                    first_text.append(time.monotonic() - t0)

            answer = await read_answer(conn, t0=t0, on_event=on_event)
            r = answer.done.response
            if r.status not in ("completed", "incomplete"):
                raise RuntimeError(f"turn {turn}: response {r.status}: {r.status_details}")
            out.append(
                {
                    "turn": turn + 1,
                    "first_audio_s": answer.first_audio_s,
                    "first_text_s": first_text[0] if first_text else None,
                    "input_tokens": r.usage.input_tokens,
                    "cached_tokens": r.usage.input_token_details.cached_tokens,
                    "text": answer.transcript,
                }
            )
    return out


async def bystander(url: str, model: str, *, seconds: float, until_s: float, max_tokens: int, seed: int) -> list[dict]:
    """Turns of ``seconds`` from 3 s on, one after another, each started while it can end (its
    speech) before ``until_s`` (from now): :func:`one_session`'s rows."""
    turns = max(1, int((until_s - 3.0) / (seconds + 0.5)))
    return await one_session(url, model, seconds=seconds, turns=turns, max_tokens=max_tokens, seed=seed, delay_s=3.0)


def _cpu(pids: dict[str, int | None]) -> dict[str, float]:
    import psutil

    out = {}
    for name, pid in pids.items():
        if pid is None:
            continue
        try:
            t = psutil.Process(pid).cpu_times()
            out[name] = t.user + t.system + t.children_user + t.children_system
        except psutil.Error:
            pass
    return out


#: The server-side part of the first audio's way (the client's two ends are not in the timeline).
SERVER_SIDE_SEGMENTS = tuple(seg for seg in AUDIO_SEGMENTS if not seg[1].startswith("client."))[:-1]


def stage_breakdown(directory: str, t0: float, t1: float) -> dict[str, Any]:
    """Per segment p50 / p90 (ms) over the responses the server received between t0 and t1
    (monotonic), from the request timelines in ``directory``."""
    from omni_cache import timeline

    rows = []
    for events in timeline.read(directory).values():
        points = {f"{proc}.{ev}": t for proc, evs in events.items() for ev, t in evs.items()}
        start = points.get("server.received")
        if start is None or not t0 <= start <= t1 or "server.audio_in" not in points:
            continue
        talker_start(points)
        seg = {n: points[b] - points[a] for n, a, b in SERVER_SIDE_SEGMENTS if a in points and b in points}
        if len(seg) == len(SERVER_SIDE_SEGMENTS):
            seg["total"] = points["server.audio_in"] - start
            rows.append(seg)
    names = [n for n, _, _ in SERVER_SIDE_SEGMENTS] + ["total"]
    return {
        "responses": len(rows),
        "ms": {
            n: [round(1000 * percentile([r[n] for r in rows], q), 2) for q in (50, 90)] if rows else None for n in names
        },
    }


def run_cell(srv: ManagedServer, seconds: float, sessions: int, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    from dataclasses import asdict

    from omni_cache.serving.realtime import listening

    model = srv.server.orchestrator.served_model_name
    stats0 = asdict(listening.TOTALS)
    before = _cpu(srv.stage_pids())
    t0 = time.monotonic()

    async def go():
        extra = []
        if args.bystander:
            until = seconds - 1.0
            extra.append(
                bystander(
                    srv.url, model, seconds=args.bystander, until_s=until, max_tokens=args.max_tokens, seed=seed + 777
                )
            )
        return await asyncio.gather(
            *extra,
            *(
                one_session(
                    srv.url,
                    model,
                    seconds=seconds,
                    turns=args.turns,
                    max_tokens=args.max_tokens,
                    seed=seed + i,
                    delay_s=args.stagger * i * seconds / sessions,
                )
                for i in range(sessions)
            ),
        )

    results = asyncio.run(go())
    by_rows = results.pop(0) if args.bystander else None
    wall = time.monotonic() - t0
    breakdown = stage_breakdown(args.timeline, t0, t0 + wall) if args.timeline else None
    after = _cpu(srv.stage_pids())
    rows = [t for s in results for t in s]
    fa = [r["first_audio_s"] for r in rows if r["first_audio_s"] is not None]
    ft = [r["first_text_s"] for r in rows if r.get("first_text_s") is not None]
    # Seconds of speech the cell's sessions said (the bystander's, when it is alone).
    speech_s = seconds * args.turns * sessions or args.bystander * len(by_rows or []) or 1.0
    cpu = {k: after[k] - before.get(k, 0.0) for k in after}
    return {
        "seconds": seconds,
        "sessions": sessions,
        "turns": len(rows),
        "first_audio_p50_ms": 1000 * percentile(fa, 50) if fa else None,
        "first_audio_p90_ms": 1000 * percentile(fa, 90) if fa else None,
        "first_text_p50_ms": 1000 * percentile(ft, 50) if ft else None,
        "first_text_p90_ms": 1000 * percentile(ft, 90) if ft else None,
        "cached_share": sum(r["cached_tokens"] for r in rows) / max(1, sum(r["input_tokens"] for r in rows)),
        "stage_cpu_s_per_speech_s": sum(cpu.values()) / speech_s,
        "stage_cpu_s_per_speech_s_by_stage": {k: v / speech_s for k, v in cpu.items()},
        "wall_s": wall,
        "load_average": os.getloadavg(),  # the host is shared: its 1/5/15-min load when the cell ended
        "listening": {k: v - stats0[k] for k, v in asdict(listening.TOTALS).items()},
        "stage_breakdown": breakdown,
        "rows": rows,
        "bystander": by_rows,
    }


def summary_table(result: dict[str, Any]) -> str:
    """Markdown: per turn length x sessions, first audio and first text p50 / p90 (ms) per side,
    every round's turns pooled, and the host's load average (1 min) over the cells."""
    pooled: dict[tuple, dict[str, list]] = {}
    for c in result["cells"]:
        d = pooled.setdefault((c["seconds"], c["sessions"], c["side"]), {"fa": [], "ft": [], "load": [], "hit": []})
        d["fa"] += [r["first_audio_s"] for r in c["rows"] if r["first_audio_s"] is not None]
        d["ft"] += [r["first_text_s"] for r in c["rows"] if r.get("first_text_s") is not None]
        d["load"].append(c["load_average"][0])
        d["hit"].append(c["cached_share"])
    sides = list(dict.fromkeys(c["side"] for c in result["cells"]))

    def ms(xs: list[float]) -> str:
        return f"{1000 * percentile(xs, 50):.0f} / {1000 * percentile(xs, 90):.0f}" if xs else "-"

    head = "| turn | sessions | n |" + "".join(f" first audio {s} |" for s in sides)
    head += "".join(f" first text {s} |" for s in sides) + " thinker cached share " + " / ".join(sides) + " | load |"
    lines = [head, "|" + "---|" * (5 + 2 * len(sides))]
    for seconds, n in dict.fromkeys((k[0], k[1]) for k in pooled):
        cells = [pooled[(seconds, n, s)] for s in sides if (seconds, n, s) in pooled]
        if len(cells) != len(sides):
            continue
        loads = [x for c in cells for x in c["load"]]
        row = f"| {seconds:g} s | {n} | {len(cells[0]['fa'])} |"
        row += "".join(f" {ms(c['fa'])} |" for c in cells) + "".join(f" {ms(c['ft'])} |" for c in cells)
        row += " " + " / ".join(f"{np.mean(c['hit']):.2f}" for c in cells)
        row += f" | {min(loads):.1f}-{max(loads):.1f} |"
        lines.append(row)
    by: dict[tuple, list[float]] = {}
    for c in result["cells"]:
        if c.get("bystander"):
            key = (c["seconds"], c["sessions"], c["side"])
            by.setdefault(key, []).extend(r["first_audio_s"] for r in c["bystander"] if r["first_audio_s"] is not None)
    if by:
        lines += ["", "| speakers | bystander n |" + "".join(f" bystander first audio {s} |" for s in sides)]
        lines.append("|" + "---|" * (2 + len(sides)))
        for seconds, n in dict.fromkeys((k[0], k[1]) for k in by):
            xs = [by.get((seconds, n, s), []) for s in sides]
            lines.append(f"| {n} x {seconds:g} s | {len(xs[0])} |" + "".join(f" {ms(x)} |" for x in xs))
    return "\n".join(lines)


def log_cell(cell: dict[str, Any]) -> None:
    harness.log(
        f"listening {cell['side']} {cell['seconds']:g} s x {cell['sessions']}: "
        f"p50 {cell['first_audio_p50_ms'] or 0:.0f} ms, "
        f"p90 {cell['first_audio_p90_ms'] or 0:.0f} ms "
        f"(first text p50 {cell['first_text_p50_ms'] or 0:.0f} / "
        f"p90 {cell['first_text_p90_ms'] or 0:.0f} ms), cached {cell['cached_share']:.2f}, "
        f"cpu {cell['stage_cpu_s_per_speech_s']:.3f} s/s, load {cell['load_average'][0]:.1f}, "
        f"listening {cell['listening']}"
    )
    if cell.get("bystander"):
        fa = [r["first_audio_s"] for r in cell["bystander"] if r["first_audio_s"] is not None]
        harness.log(
            f"  bystander: {len(fa)} turns, first audio p50 {1000 * percentile(fa, 50):.0f} ms, "
            f"p90 {1000 * percentile(fa, 90):.0f} ms"
        )
    if cell["stage_breakdown"]:
        bd = cell["stage_breakdown"]["ms"]
        harness.log("  p50/p90 ms: " + ", ".join(f"{k} {v[0]:.0f}/{v[1]:.0f}" for k, v in bd.items() if v))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="stage_configs/qwen3_omni.yaml")
    p.add_argument("--seconds", type=float, nargs="+", default=[2.0, 16.0, 30.0])
    p.add_argument("--sessions", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=10)
    p.add_argument("--talker-max-tokens", type=int, default=40)
    p.add_argument("--sides", nargs="+", default=["on", "off"])
    p.add_argument(
        "--stagger",
        type=float,
        default=0.0,
        help="session i starts i x this x turn length / sessions later (0: in lock-step, every turn ends at once)",
    )
    p.add_argument(
        "--bystander",
        type=float,
        default=0.0,
        help="one more session saying turns of this many seconds while the cell's first turn is spoken",
    )
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--json", default=None)
    p.add_argument("--summarize", default=None, help="print the table of a --json result and stop")
    p.add_argument("--timeline", default=None, help="keep request timelines here; per-stage breakdown per cell")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run the grid this many times (sides alternate per cell, flipped every round)",
    )
    args = p.parse_args(argv)
    if args.summarize:
        print(summary_table(json.loads(Path(args.summarize).read_text())))
        return 0
    if args.timeline:
        from omni_cache.timeline import TIMELINE_DIR_ENV

        # Read when the server's orchestrator and its stage processes start (stages inherit it).
        os.environ[TIMELINE_DIR_ENV] = str(Path(args.timeline).resolve())
    result: dict[str, Any] = {"args": vars(args), "cells": []}
    tmp = Path(tempfile.mkdtemp(prefix="listen_bench_"))
    with contextlib.ExitStack() as stack:
        # Every side's server is up at once and the cells alternate sides (the order flipped every
        # round): on a host shared with other work, the sides of one cell run minutes apart at
        # most, under the same load, instead of one side's grid after the other's.
        servers = {}
        for side in args.sides:
            cfg = side_config(args.config, tmp / f"{side}.yaml", side == "on", args.talker_max_tokens)
            srv = stack.enter_context(
                ManagedServer(cfg, prefix_cache=True, tag=f"listen-{side}", checkpoint_dir=args.checkpoint_dir)
            )
            harness.log(f"listening {side}: ready after {srv.startup_s:.0f} s; warm-up")
            model = srv.server.orchestrator.served_model_name
            asyncio.run(one_session(srv.url, model, seconds=9.0, turns=1, max_tokens=args.max_tokens, seed=99_999))
            servers[side] = srv
        for rnd in range(args.rounds):
            for seconds in args.seconds:
                for n in args.sessions:
                    for side in args.sides if rnd % 2 == 0 else args.sides[::-1]:
                        cell = run_cell(servers[side], seconds, n, args, seed=int(seconds * 100) + n + 10_000 * rnd)
                        cell["side"], cell["round"] = side, rnd
                        result["cells"].append(cell)
                        log_cell(cell)
                        if args.json:
                            Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
