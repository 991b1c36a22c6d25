"""Realtime sessions holding long conversations: the server's memory against its bounds (a probe,
not a test).

    .venv/bin/python -m benchmarks.realtime_memory [--sessions 64] [--turns 100] [--json OUT.json]

The server (the orchestrator and the HTTP app under uvicorn, as ``omni-serve`` runs them) runs in
this process with its default bounds (``server.max_media_bytes_in_flight`` 1 GiB,
``server.realtime.max_sessions`` 64, ``max_buffer_s`` 60: each session may hold 16 MiB, its input
buffer's room of 3.8 MB included). Its stage is the fake thinker of ``tests/fake_stage.py`` (a real
process over ZMQ, no model: what is measured is the server's own memory); the tokenizer and the
audio encoder's rate (16 kHz) are the tiny Qwen3-Omni checkpoint's.

The clients run in another process: ``--sessions`` openai-SDK realtime sessions at once, each
committing ``--turns`` user turns of ``--clip-s`` seconds of speech-like audio (manual turn
detection, no answers: the conversation only grows), ``truncation: disabled`` so nothing is
dropped. Then one session asks for an answer (the server still answers), and the first session
goes on committing until the server refuses (``session_memory_limit_reached``): the session past
its bound is told so. Recorded: the server process's RSS before, with every session holding its
turns, and after they all closed; the bytes the sessions hold in the media bound
(``InFlightBounds.media_bytes``) at each point.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import multiprocessing
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from benchmarks.in_process_server import InProcessServer

MIB = 1 << 20


def bench_config(directory: Path) -> Path:
    data = {
        "name": f"rtmem-{os.getpid()}",
        "server": {
            "host": "127.0.0.1",
            "port": 0,
            "request_timeout_s": 120,
            "realtime": {"max_events_per_s": 2000.0, "idle_timeout_s": 1800.0},
        },
        "stages": [
            {
                "name": "thinker",
                "kind": "autoregressive",
                "model": "tiny:qwen3-omni",
                "final_output": "text",
                "engine_args": {"max_model_len": 8192},
                "sampling": {"max_tokens": 8},
                "env": {"FAKE_TOKEN_DELAY": "0.001"},
            }
        ],
    }
    path = directory / "rtmem.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


# ---- the clients (another process) ---------------------------------------------------------------


def run_clients(url: str, model: str, args: dict[str, Any], steps: Any, out: Any) -> None:
    """Drive the sessions; put a message on ``out`` at each stage and wait for ``steps`` (the
    server measuring) before going on."""
    asyncio.run(_clients(url, model, args, steps, out))


async def _clients(url: str, model: str, args: dict[str, Any], steps: Any, out: Any) -> None:
    from benchmarks.realtime_client import connect, next_event, read_answer
    from benchmarks.speech_clips import pcm16, speech

    chunks = []  # a few different clips, each as its 200 ms appends
    for seed in range(8):
        data = pcm16(speech(args["clip_s"], seed=seed))
        chunks.append([base64.b64encode(data[i : i + 9600]).decode() for i in range(0, len(data), 9600)])

    async def commit(conn, turn: int) -> Any:
        for chunk in chunks[turn % len(chunks)]:
            await conn.input_audio_buffer.append(audio=chunk)
        await conn.input_audio_buffer.commit()
        first = await next_event(conn, timeout=600)
        if first.type != "error":
            await next_event(conn, timeout=600), await next_event(conn, timeout=600)
        return first

    async def fill(conn) -> int:
        assert (await next_event(conn, timeout=600)).type == "session.created"
        await conn.session.update(
            session={
                "type": "realtime",
                "truncation": "disabled",
                "output_modalities": ["text"],
                "audio": {"input": {"turn_detection": None}},
            }
        )
        assert (await next_event(conn, timeout=600)).type == "session.updated"
        refused = 0
        for turn in range(args["turns"]):
            refused += (await commit(conn, turn)).type == "error"
        return refused

    conns = [await connect(url, model).enter() for _ in range(args["sessions"])]
    t0 = time.monotonic()
    refused = await asyncio.gather(*(fill(c) for c in conns))
    out.put({"filled_s": time.monotonic() - t0, "refused": sum(refused)})
    await asyncio.to_thread(steps.get)
    # The server still answers: one session asks for a (text) answer to its whole conversation.
    await conns[-1].response.create()
    answer = await read_answer(conns[-1])
    # The first session goes on until its share is full.
    extra, err = 0, None
    while err is None and extra < 10_000:
        event = await commit(conns[0], args["turns"] + extra)
        if event.type == "error":
            err = event.error
        else:
            extra += 1
    out.put(
        {
            "answer_status": answer.done.response.status,
            "answer_input_tokens": answer.done.response.usage.input_tokens,
            "more_turns_before_refusal": extra,
            "refusal_code": err.code if err else None,
            "refusal_message": err.message if err else None,
        }
    )
    await asyncio.to_thread(steps.get)
    for conn in conns:
        await conn.close()
    out.put("closed")


# ---- the server (this process) -------------------------------------------------------------------


def rss(field: str = "VmRSS") -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


async def serve(args: argparse.Namespace) -> dict[str, Any]:
    from omni_cache.config import load_config

    config = load_config(bench_config(Path(tempfile.mkdtemp(prefix="rtmem"))))
    srv = InProcessServer(config)
    orch, app = srv.orch, srv.app
    url = await srv.start()
    bounds = orch.admission.bounds
    spawn = multiprocessing.get_context("spawn")
    out: Any = spawn.Queue()
    steps: Any = spawn.Queue()
    clients = spawn.Process(
        target=run_clients,
        args=(
            url,
            orch.served_model_name,
            {"sessions": args.sessions, "turns": args.turns, "clip_s": args.clip_s},
            steps,
            out,
        ),
    )
    result: dict[str, Any] = {
        "bound_bytes": bounds.max_media_bytes,
        "session_share_bytes": bounds.max_media_bytes // config.server.realtime.max_sessions,
    }
    try:
        await asyncio.sleep(1.0)
        result["rss_before_mib"] = rss() / MIB
        clients.start()
        filled = await asyncio.to_thread(out.get)
        result.update(filled)
        result["held_bytes_filled"] = bounds.media_bytes
        result["sessions_open"] = len(app.state.realtime_sessions)
        result["rss_filled_mib"] = rss() / MIB
        steps.put("go")
        result.update(await asyncio.to_thread(out.get))
        result["held_bytes_at_refusal"] = bounds.media_bytes
        result["rss_at_refusal_mib"] = rss() / MIB
        result["rss_peak_mib"] = rss("VmHWM") / MIB
        steps.put("go")
        assert await asyncio.to_thread(out.get) == "closed"
        end = time.monotonic() + 60
        while len(app.state.realtime_sessions) and time.monotonic() < end:
            await asyncio.sleep(0.1)
        # The server trims its heap every few seconds (omni_cache/heap_trim.py): trim now.
        await asyncio.to_thread(orch.heap.maybe_trim, time.monotonic() + 1e6)
        result["held_bytes_closed"] = bounds.media_bytes
        result["rss_closed_mib"] = rss() / MIB
        await asyncio.to_thread(clients.join)
    finally:
        await srv.stop()
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, default=64)
    ap.add_argument("--turns", type=int, default=100, help="user turns each session holds")
    ap.add_argument("--clip-s", type=float, default=1.0, help="seconds of audio per turn")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)

    from benchmarks.harness import machine_info

    result = {
        "args": vars(args) | {"json": str(args.json) if args.json else None},
        "machine": machine_info(),
        **asyncio.run(serve(args)),
    }
    r = result
    audio_mib = args.sessions * args.turns * args.clip_s * 16000 * 4 / MIB
    print(
        f"{args.sessions} sessions x {args.turns} turns of {args.clip_s:g} s ({audio_mib:.0f} MiB of "
        f"16 kHz float32) committed in {r['filled_s']:.0f} s, {r['refused']} refused; held in the "
        f"bound {r['held_bytes_filled'] / MIB:.0f} MiB of {r['bound_bytes'] / MIB:.0f} MiB"
    )
    print(
        f"server RSS {r['rss_before_mib']:.0f} MiB before, {r['rss_filled_mib']:.0f} MiB holding the "
        f"turns (+{r['rss_filled_mib'] - r['rss_before_mib']:.0f}), peak {r['rss_peak_mib']:.0f} MiB, "
        f"{r['rss_closed_mib']:.0f} MiB after all closed (held {r['held_bytes_closed']} bytes)"
    )
    print(
        f"answer while full: {r['answer_status']} ({r['answer_input_tokens']} prompt tokens); the "
        f"first session took {r['more_turns_before_refusal']} more turns, then {r['refusal_code']}: "
        f"{r['refusal_message']} ({result['machine']['cpu_model']}, load {os.getloadavg()[0]:.1f})"
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
