"""The sessions of ``python -m benchmarks.realtime_load``, run in a process of their own: each one's
audio (speech-like clips at its own offsets, silence between), its ``input_audio_buffer.append``
events encoded in advance, one WebSocket per session sending them at their times on an absolute
schedule while it counts the events it gets and times each turn's first audio.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from benchmarks.speech_clips import RATE, pcm16, silence, speech

__all__ = ["CHUNK", "CHUNK_S", "SessionStats", "append_texts", "client_process", "session_audio"]

CHUNK_S = 0.04
CHUNK = int(RATE * CHUNK_S)  # 960 samples: one append


# ---- the audio each session streams -------------------------------------------------------------


def session_audio(index: int, sessions: int, period_s: float, speech_s: float) -> np.ndarray:
    """One period of session ``index``'s audio: speech (its own seed) at an offset that spreads
    the N sessions' clips over the period, silence elsewhere (24 kHz float32)."""
    offset_s = 0.5 + (period_s - speech_s - 1.5) * index / max(1, sessions)
    clip = speech(speech_s, seed=1000 + index)
    out = silence(period_s)
    start = int(offset_s * RATE)
    out[start : start + len(clip)] = clip
    return out


def append_texts(samples: np.ndarray) -> list[str]:
    """The ``input_audio_buffer.append`` events (JSON text) of ``samples`` in 40 ms chunks."""
    data = pcm16(samples)
    step = CHUNK * 2
    return [
        json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(data[i : i + step]).decode()})
        for i in range(0, len(data) - step + 1, step)
    ]


# ---- the clients (a process of their own) -------------------------------------------------------


@dataclass
class SessionStats:
    appends: int = 0
    #: Appends sent per wall-clock second (int(time.time())): what reached the server when.
    sent_per_s: dict[int, int] = field(default_factory=dict)
    late_s: list[float] = field(default_factory=list)  # send time - scheduled time, sampled
    events: dict[str, int] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    #: One per speech_stopped: seconds to the first audio delta (None: no audio came) and how
    #: its response ended.
    turns: list[dict[str, Any]] = field(default_factory=list)


async def _one_session(
    url: str,
    model: str,
    index: int,
    spec: dict[str, Any],
    stats: SessionStats,
    go: asyncio.Event,
    opened: list[int],
    stop: Any,
) -> None:
    import websockets

    texts = append_texts(session_audio(index, spec["sessions"], spec["turn_every_s"], spec["speech_s"]))
    ws_url = url.replace("http", "ws", 1) + f"/v1/realtime?model={model}"
    for _attempt in range(30):  # a session the last phase left may still count (1013: try later)
        ws = await websockets.connect(ws_url, max_size=None)
        first = json.loads(await ws.recv())
        if first["type"] == "session.created":
            break
        await ws.close()
        await asyncio.sleep(0.5)
    else:
        raise RuntimeError(f"session {index} was refused: {first}")
    await ws.send(
        json.dumps(
            {
                "type": "session.update",
                "session": {
                    "type": "realtime",
                    "max_output_tokens": spec["max_tokens"],
                    "audio": {"input": {"turn_detection": {"type": "server_vad", "create_response": spec["respond"]}}},
                },
            }
        )
    )

    async def read() -> None:
        async for raw in ws:
            event = json.loads(raw)
            kind = event["type"]
            stats.events[kind] = stats.events.get(kind, 0) + 1
            turn = stats.turns[-1] if stats.turns else {}
            if kind == "error":
                stats.errors.append(event["error"].get("message", "")[:200])
            elif kind == "input_audio_buffer.speech_stopped":
                stats.turns.append({"stopped_at": time.monotonic(), "first_audio_s": None})
            elif kind == "response.created" and turn and "response_id" not in turn:
                turn["response_id"] = event["response"]["id"]
            elif (
                kind == "response.output_audio.delta"
                and turn.get("response_id") == event["response_id"]
                and turn["first_audio_s"] is None
            ):
                turn["first_audio_s"] = time.monotonic() - turn["stopped_at"]
            elif kind == "response.done" and turn.get("response_id") == event["response"]["id"]:
                turn["status"] = event["response"]["status"]

    reader = asyncio.create_task(read())
    opened.append(index)
    await go.wait()
    t0, k = time.monotonic(), 0
    while not stop.is_set():
        await ws.send(texts[k % len(texts)])
        stats.appends += 1
        second = int(time.time())
        stats.sent_per_s[second] = stats.sent_per_s.get(second, 0) + 1
        k += 1
        late = time.monotonic() - (t0 + (k - 1) * CHUNK_S)
        if k % 25 == 0:
            stats.late_s.append(late)
        await asyncio.sleep(max(0.0, t0 + k * CHUNK_S - time.monotonic()))
    await ws.close()
    reader.cancel()


async def _clients(url: str, model: str, spec: dict[str, Any], out: Any, stop: Any) -> None:
    stats = [SessionStats() for _ in range(spec["sessions"])]
    go, opened = asyncio.Event(), []
    tasks = [
        asyncio.create_task(_one_session(url, model, i, spec, stats[i], go, opened, stop))
        for i in range(spec["sessions"])
    ]
    while len(opened) < len(tasks):
        failed = [t for t in tasks if t.done() and t.exception() is not None]
        if failed:
            raise failed[0].exception()
        await asyncio.sleep(0.05)
    go.set()
    out.put("streaming")
    await asyncio.gather(*tasks)
    out.put([asdict(s) for s in stats])


def client_process(url: str, model: str, spec: dict[str, Any], out: Any, stop: Any) -> None:
    try:
        asyncio.run(_clients(url, model, spec, out, stop))
    except BaseException as e:  # noqa: BLE001 -- told to the benchmark, which stops
        out.put(f"error: {type(e).__name__}: {e}")
        raise
