"""Realtime sessions streaming audio in real time: what they cost the server and its other users.

A fresh ``omni-serve`` (the default pipeline, a process of its own) serves N ``/v1/realtime``
sessions (``--sessions``, 16 and 64), each appending 40 ms of pcm16 24 kHz audio every 40 ms
with server VAD on. Every session's audio is a speech-like clip (benchmarks/speech_clips.py,
its own seed) once every ``--turn-every`` seconds (10) and silence between, the sessions'
clips spread over that period. The clients run in a process of their own
(benchmarks/realtime_load_clients.py: raw WebSocket JSON, appends encoded in advance, each sent
at its time on an absolute schedule); the probes run in this process:

* ``/health`` every 100 ms: latency p50/p99;
* a text chat request (stream, 4 tokens) one after the other, 250 ms apart: time to the first
  token (TTFT) p50/p99;
* the server process's CPU seconds (psutil, the omni-serve process alone, not its stages) per
  second of audio the sessions sent in that time (counted by the clients: on a busy machine they
  may fall behind real time, the table's last column), less what the idle server spends.

Phases: idle (probes only), then per N with ``create_response: false`` (no stage works: the
cost of listening), then the turns: one session alone, then N sessions, each answering every
speech clip (``create_response: true``): first audio = the ``speech_stopped`` event -> the
first ``response.output_audio.delta``, p50/p90 (client clock), against the one session's.

    .venv/bin/python -m benchmarks.realtime_load --sessions 16 64 --log benchmarks/results/realtime_load.md
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import queue
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import harness
from benchmarks.realtime_load_clients import CHUNK_S, client_process
from benchmarks.report import percentile

__all__ = ["appends_between", "cpu_per_session_second", "format_table", "main", "percentiles", "summarize_turns"]

TARGETS = {"health_p99_ms": 20.0, "ttft_p99_over_idle": 1.5, "cpu_ms_per_session_s": 5.0}


# ---- the probes (this process) ------------------------------------------------------------------


async def _probe_health(http: Any, url: str, end: float, out: list[float]) -> None:
    while time.monotonic() < end:
        t0 = time.perf_counter()
        r = await http.get(url + "/health")
        if r.status_code == 200:
            out.append(time.perf_counter() - t0)
        await asyncio.sleep(max(0.0, 0.1 - (time.perf_counter() - t0)))


async def _probe_chat(http: Any, url: str, model: str, end: float, out: list[float], errors: list[str]) -> None:
    from benchmarks.client import Sample, stream_chat

    while time.monotonic() < end:
        sample = Sample(id="probe", session=0, kind="text", turn=0)
        await stream_chat(
            http,
            url,
            model,
            [{"role": "user", "content": "Say something short."}],
            4,
            sample,
            {},
            time.perf_counter(),
            audio=False,
        )
        if sample.ttft_s is not None:
            out.append(sample.ttft_s)
        elif sample.error:
            errors.append(sample.error)
        await asyncio.sleep(0.25)


async def run_probes(url: str, model: str, seconds: float) -> dict[str, Any]:
    import httpx

    health: list[float] = []
    ttft: list[float] = []
    errors: list[str] = []
    end = time.monotonic() + seconds
    async with httpx.AsyncClient(timeout=60) as http:
        await asyncio.gather(_probe_health(http, url, end, health), _probe_chat(http, url, model, end, ttft, errors))
    return {"health_s": health, "ttft_s": ttft, "chat_errors": errors[:5]}


# ---- summaries (pure) ---------------------------------------------------------------------------


def percentiles(values: list[float]) -> dict[str, float | int | None]:
    """n, p50, p90, p99 (benchmarks.report.percentile: numpy's linear method) and max of
    ``values``; None without any."""
    if not values:
        return {"n": 0, "p50": None, "p90": None, "p99": None, "max": None}
    return {"n": len(values), **{f"p{q}": percentile(values, q) for q in (50, 90, 99)}, "max": max(values)}


def appends_between(sent_per_s: list[dict[int, int]], t0: float, t1: float) -> float:
    """Appends the sessions sent between wall-clock times ``t0`` and ``t1`` (from their
    per-second counts; a second cut by an end counts in proportion)."""
    total = 0.0
    for counts in sent_per_s:
        for second, n in counts.items():
            second = int(second)
            overlap = min(t1, second + 1) - max(t0, second)
            if overlap > 0:
                total += n * overlap
    return total


def cpu_per_session_second(cpu_s: float, seconds: float, audio_s: float, idle_cores: float) -> dict[str, float]:
    """The server's CPU per second of audio it received (``audio_s``, all sessions together):
    raw, and less the idle server's use (``idle_cores``: its CPU seconds per second with the
    probes alone) over the same ``seconds``."""
    audio_s = max(audio_s, 1e-9)
    return {
        "cores": cpu_s / seconds,
        "audio_s": audio_s,
        "ms_raw": 1000 * cpu_s / audio_s,
        "ms_above_idle": 1000 * max(0.0, cpu_s - idle_cores * seconds) / audio_s,
    }


def summarize_turns(sessions: list[dict[str, Any]]) -> dict[str, Any]:
    """First audio of every turn with audio (p50/p90), and how many turns had none."""
    turns = [t for s in sessions for t in s["turns"]]
    first = [t["first_audio_s"] for t in turns if t.get("first_audio_s") is not None]
    return {
        "turns": len(turns),
        "answered": len(first),
        "without_audio": len(turns) - len(first),
        "first_audio_s": percentiles(first),
    }


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{1000 * v:.0f}"


def format_table(result: dict[str, Any]) -> str:
    """The results as one markdown table: a row per phase."""
    idle = result["phases"][0]
    rows = [
        "| phase | sessions | /health p50 / p99 ms | chat TTFT p50 / p99 ms (p99 / idle) | "
        "server cores | CPU ms per session-s (above idle) | first audio p50 / p90 ms | appends late p90 ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for ph in result["phases"]:
        h, t = ph["health"], ph["ttft"]
        ratio = (t["p99"] / idle["ttft"]["p99"]) if t["p99"] and idle["ttft"]["p99"] else None
        cpu = ph.get("cpu") or {}
        fa = (ph.get("turns") or {}).get("first_audio_s") or {}
        per = "-" if not ph["sessions"] else f"{cpu['ms_raw']:.1f} ({cpu['ms_above_idle']:.1f})"
        rows.append(
            f"| {ph['name']} | {ph['sessions']} | {_ms(h['p50'])} / {_ms(h['p99'])} | "
            f"{_ms(t['p50'])} / {_ms(t['p99'])} ({'-' if ratio is None else f'{ratio:.2f}x'}) | "
            f"{cpu.get('cores', 0):.2f} | {per} | {_ms(fa.get('p50'))} / {_ms(fa.get('p90'))} | "
            f"{_ms((ph.get('client_late_s') or {}).get('p90'))} |"
        )
    return "\n".join(rows)


# ---- phases -------------------------------------------------------------------------------------


def _server_cpu_s(pid: int) -> float:
    import psutil

    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def run_phase(
    srv: harness.ServerProcess,
    model: str,
    name: str,
    sessions: int,
    respond: bool,
    args: argparse.Namespace,
    idle_cores: float = 0.0,
) -> dict[str, Any]:
    """``sessions`` streaming sessions (none: the idle server) while the probes run."""
    spawn = multiprocessing.get_context("spawn")
    out, stop = spawn.Queue(), spawn.Event()
    proc = None
    seconds = args.turn_seconds if respond else args.seconds if sessions else args.idle_seconds
    if sessions:
        spec = {
            "sessions": sessions,
            "respond": respond,
            "turn_every_s": args.turn_every,
            "speech_s": args.speech_seconds,
            "max_tokens": args.max_tokens,
        }
        proc = spawn.Process(target=client_process, args=(srv.url, model, spec, out, stop), daemon=True)
        proc.start()
        msg = out.get(timeout=300)
        if msg != "streaming":
            raise RuntimeError(f"{name}: the clients failed: {msg}")
        time.sleep(args.settle)
    harness.log(f"{name}: {sessions} sessions, measuring {seconds:g} s")
    load0, cpu0, t0, wall0 = os.getloadavg()[0], _server_cpu_s(srv.pid), time.monotonic(), time.time()
    probes = asyncio.run(run_probes(srv.url, model, seconds))
    cpu_s, elapsed, wall1 = _server_cpu_s(srv.pid) - cpu0, time.monotonic() - t0, time.time()
    phase: dict[str, Any] = {
        "name": name,
        "sessions": sessions,
        "respond": respond,
        "seconds": elapsed,
        "loadavg": [load0, os.getloadavg()[0]],
        "health": percentiles(probes["health_s"]),
        "ttft": percentiles(probes["ttft_s"]),
        "chat_errors": probes["chat_errors"],
        "cpu": {"cores": cpu_s / elapsed},
    }
    if proc is not None:
        stop.set()
        stats = None
        deadline = time.monotonic() + 120
        while stats is None and time.monotonic() < deadline:
            try:
                got = out.get(timeout=5)
            except queue.Empty:
                continue
            if isinstance(got, list):
                stats = got
            elif isinstance(got, str) and got.startswith("error"):
                raise RuntimeError(f"{name}: the clients failed: {got}")
        proc.join(30)
        stats = stats or []
        late = [x for s in stats for x in s["late_s"]]
        audio_s = CHUNK_S * appends_between([s["sent_per_s"] for s in stats], wall0, wall1)
        phase["cpu"] = cpu_per_session_second(cpu_s, elapsed, audio_s, idle_cores)
        phase.update(
            appends=sum(s["appends"] for s in stats),
            client_late_s=percentiles(late),
            errors=sorted({e for s in stats for e in s["errors"]})[:5],
            events={
                k: sum(s["events"].get(k, 0) for s in stats)
                for k in (
                    "input_audio_buffer.speech_started",
                    "input_audio_buffer.speech_stopped",
                    "response.done",
                    "error",
                )
            },
        )
        if respond:
            phase["turns"] = summarize_turns(stats)
    return phase


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.realtime_load", description=__doc__.split("\n\n")[0])
    p.add_argument("--stage-config", default="stage_configs/qwen3_omni.yaml")
    p.add_argument("--checkpoint-dir", help="where tiny checkpoints live (default: the config's)")
    p.add_argument("--sessions", type=int, nargs="+", default=[16, 64])
    p.add_argument("--seconds", type=float, default=30.0, help="measured seconds per listening phase")
    p.add_argument("--idle-seconds", type=float, default=20.0)
    p.add_argument("--turn-seconds", type=float, default=30.0, help="measured seconds per turn phase")
    p.add_argument("--turn-every", type=float, default=10.0, help="a speech clip every this many seconds")
    p.add_argument("--speech-seconds", type=float, default=1.5)
    p.add_argument(
        "--turn-sessions",
        type=int,
        nargs="*",
        default=None,
        help="session counts of the turn phase (default: --sessions); none: no turn phase",
    )
    p.add_argument("--settle", type=float, default=3.0, help="seconds of streaming before measuring")
    p.add_argument("--max-tokens", type=int, default=8, help="thinker tokens per answer")
    p.add_argument("--talker-max-tokens", type=int, default=32, help="codec steps per answer")
    p.add_argument("--json", help="write every number here")
    p.add_argument("--log", help="append the run (command, machine, table) to this markdown file")
    p.add_argument("--note", default="")
    args = p.parse_args(argv)
    if args.turn_sessions is None:
        args.turn_sessions = args.sessions
    return args


def run(args: argparse.Namespace) -> dict[str, Any]:
    from benchmarks.realtime import bench_config

    machine = harness.machine_info()
    tmp = Path(tempfile.mkdtemp(prefix="omni_cache_rtload_"))
    phases: list[dict[str, Any]] = []
    try:
        # Room for every clip of a turn phase in one prompt, and short answers.
        config = bench_config(
            args.stage_config,
            tmp / "base.yaml",
            turns=int(args.turn_seconds // args.turn_every) + 4,
            talker_max_tokens=args.talker_max_tokens,
        )
        config = harness.private_config(config, tmp, "rtload")
        with harness.ServerProcess(config, checkpoint_dir=args.checkpoint_dir) as srv:
            model = asyncio.run(_served_model(srv.url))
            harness.log(f"omni-serve ready after {srv.startup_s:.0f} s at {srv.url}; warm-up")
            asyncio.run(run_probes(srv.url, model, 3.0))  # first requests (compiles) not measured
            idle = run_phase(srv, model, "idle", 0, False, args)
            phases.append(idle)
            cores = idle["cpu"]["cores"]
            for n in args.sessions:
                phases.append(run_phase(srv, model, f"listening x{n}", n, False, args, cores))
            if args.turn_sessions:
                phases.append(run_phase(srv, model, "turns x1", 1, True, args, cores))
                for n in args.turn_sessions:
                    phases.append(run_phase(srv, model, f"turns x{n}", n, True, args, cores))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {
        "benchmark": "realtime_load",
        "command": harness.command_line("benchmarks.realtime_load"),
        "machine": machine,
        "note": args.note,
        "targets": TARGETS,
        "config": {
            k: getattr(args, k)
            for k in (
                "sessions",
                "seconds",
                "idle_seconds",
                "turn_seconds",
                "turn_every",
                "speech_seconds",
                "turn_sessions",
                "max_tokens",
                "talker_max_tokens",
            )
        },
        "phases": phases,
    }


async def _served_model(url: str) -> str:
    from benchmarks.client import served_model

    return await served_model(url)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    table = format_table(result)
    print(table)
    for ph in result["phases"]:
        if ph.get("errors") or ph.get("chat_errors"):
            print(f"{ph['name']}: errors {ph.get('errors')} chat {ph.get('chat_errors')}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1), encoding="utf-8")
    if args.log:
        m = result["machine"]
        with open(args.log, "a", encoding="utf-8") as f:
            f.write(
                f"\n## {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n\n`{result['command']}`\n\n"
                f"{m['cpu_model']}, {m['nproc']} CPUs, load average at start {m['loadavg_start'][0]:.1f}"
                f"{'; ' + args.note if args.note else ''}\n\n{table}\n\n"
            )
            for ph in result["phases"]:
                extra = {
                    k: ph.get(k)
                    for k in ("loadavg", "appends", "client_late_s", "events", "errors", "chat_errors", "turns")
                    if ph.get(k)
                }
                f.write(f"- {ph['name']}: {json.dumps(extra, default=str)}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
