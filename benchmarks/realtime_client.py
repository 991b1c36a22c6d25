"""A realtime session driven by the openai SDK's own client (``AsyncOpenAI.realtime.connect``),
unmodified: what the realtime tests and ``python -m benchmarks.realtime`` use to talk to
``/v1/realtime``. Every wait has a deadline, so a server that stops answering fails the caller
instead of hanging it."""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from benchmarks.speech_clips import pcm16

__all__ = ["Answer", "append_audio", "client", "connect", "next_event", "read_answer"]

#: 200 ms of 24 kHz audio per append: a clip sent faster than real time in 20 ms chunks would be
#: hundreds of events at once, beyond server.realtime.max_events_per_s.
CHUNK_SAMPLES = 4800


def client(url: str, api_key: str = "unused") -> Any:
    from openai import AsyncOpenAI

    return AsyncOpenAI(
        base_url=url + "/v1", websocket_base_url=url.replace("http", "ws", 1) + "/v1", api_key=api_key, max_retries=0
    )


def connect(url: str, model: str, api_key: str = "unused") -> Any:
    """``async with connect(...) as conn``: the SDK's connection manager."""
    return client(url, api_key).realtime.connect(model=model)


async def next_event(conn: Any, timeout: float = 120.0, skip: tuple[str, ...] = ()) -> Any:
    """The next server event (not of a type in ``skip``)."""
    while True:
        event = await asyncio.wait_for(conn.recv(), timeout)
        if event.type not in skip:
            return event


async def append_audio(conn: Any, samples: np.ndarray, chunk: int = CHUNK_SAMPLES) -> None:
    """``samples`` (24 kHz float) in appends of ``chunk`` samples, sent at once."""
    data = pcm16(samples)
    step = chunk * 2
    for i in range(0, len(data), step):
        await conn.input_audio_buffer.append(audio=base64.b64encode(data[i : i + step]).decode())


@dataclass
class Answer:
    """One response as the client saw it."""

    events: list[Any] = field(default_factory=list)
    audio: bytearray = field(default_factory=bytearray)
    transcript: str = ""
    text: str = ""
    first_audio_s: float | None = None  # from the call's t0 to the first audio delta
    done: Any = None  # the response.done event

    @property
    def types(self) -> list[str]:
        return [e.type for e in self.events]


async def read_answer(
    conn: Any, t0: float | None = None, timeout: float = 300.0, on_event: Callable[[Any, Answer], Any] | None = None
) -> Answer:
    """Events until ``response.done``; ``on_event(event, answer)`` sees each as it comes (it may
    send events; returning ``"stop"`` ends the read early)."""
    t0 = time.monotonic() if t0 is None else t0
    answer = Answer()
    end = time.monotonic() + timeout
    while True:
        event = await next_event(conn, max(0.1, end - time.monotonic()))
        answer.events.append(event)
        if event.type == "error":
            raise RuntimeError(f"the server answered an error: {event.error}")
        if event.type == "response.output_audio.delta":
            if answer.first_audio_s is None:
                answer.first_audio_s = time.monotonic() - t0
            answer.audio += base64.b64decode(event.delta)
        elif event.type == "response.output_audio_transcript.delta":
            answer.transcript += event.delta
        elif event.type == "response.output_text.delta":
            answer.text += event.delta
        if on_event is not None:
            result = on_event(event, answer)
            if asyncio.iscoroutine(result):
                result = await result
            if result == "stop":
                return answer
        if event.type == "response.done":
            answer.done = event
            return answer
