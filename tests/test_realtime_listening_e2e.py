"""Listening while the user speaks (issue 51) on the real tiny Qwen3-Omni pipeline
(stage_configs/qwen3_omni.yaml: thinker, talker, code2wav; vLLM engines; real ZMQ), through the
openai SDK's realtime client. The server is tests/conftest.py's shared one (in this process: the
listener's counters, ``listening.TOTALS``, are read directly); each test compares against a fresh
session on it, so what earlier modules left in its caches changes nothing asserted here.

* A 10 s turn: its first 8 s window is prefilled while it is spoken; the response's
  ``cached_tokens`` covers it (every full block up to the window's end).
* Barge-in / clear: audio cleared after a listening request went out leaves nothing in the next
  turn: that turn's prompt (``input_tokens``) is a fresh session's for the same audio, and its
  hit stops where a fresh session's does.

Server VAD with listening (barge-in over an answer, then a long turn listened to) is not here: Silero
splits benchmarks/speech_clips.py's 9.5 s synthetic speech into turns shorter than a window even
with silence_duration_ms 1500 (benchmarks/results/issue51/NOTES.md); the session rules (no listening while the
session's answer is in flight, a speech start forgetting the pieces) are in
tests/test_realtime_listening.py.
"""

from __future__ import annotations

import asyncio

import pytest
from served_config import QWEN3_OMNI_SHARED

from benchmarks.realtime_client import append_audio, connect, next_event, read_answer
from benchmarks.speech_clips import turn_clip
from omni_cache.serving.realtime import listening

pytestmark = pytest.mark.vllm

MODEL = QWEN3_OMNI_SHARED
MAX_TOKENS = 8
BLOCK = 32  # the thinker's block size in qwen3_omni.yaml
WINDOW_TOKENS = 104  # 8 s of audio in the thinker's prompt


@pytest.fixture(scope="module")
def server(qwen3_omni_server):
    return qwen3_omni_server


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 300))


async def opened(conn, **session):
    assert (await next_event(conn)).type == "session.created"
    await conn.session.update(session={"type": "realtime", "max_output_tokens": MAX_TOKENS, **session})
    assert (await next_event(conn)).type == "session.updated"


MANUAL = {"audio": {"input": {"turn_detection": None}}}


async def listened(requests: int, timeout: float = 60.0) -> None:
    """Wait until the server sent ``requests`` listening requests in all."""
    for _ in range(int(timeout / 0.05)):
        if listening.TOTALS.requests >= requests and not listening.IN_FLIGHT:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{listening.TOTALS.requests} listening requests, expected {requests}")


async def answer_turn(conn):
    await conn.input_audio_buffer.commit()
    await conn.response.create()
    answer = await read_answer(conn)
    assert answer.done.response.status in ("completed", "incomplete"), answer.done.response.status_details
    return answer.done.response.usage


def test_a_long_turn_is_prefilled_while_spoken_and_its_response_hits_it(server):
    async def go():
        async with connect(server.url, MODEL) as conn:
            await opened(conn, **MANUAL)
            before = listening.TOTALS.requests
            await append_audio(conn, turn_clip(10.0, seed=5))
            await listened(before + 1)
            return await answer_turn(conn)

    usage = run(go())
    # The turn: the chat template's head, then the first window (listened), then 2 s.
    assert usage.input_token_details.cached_tokens >= WINDOW_TOKENS // BLOCK * BLOCK, usage


def test_cleared_audio_leaves_nothing_in_the_next_turn(server):
    clip = turn_clip(3.0, seed=7)

    async def fresh():
        async with connect(server.url, MODEL) as conn:
            await opened(conn, **MANUAL)
            await append_audio(conn, clip)
            return await answer_turn(conn)

    async def cleared():
        async with connect(server.url, MODEL) as conn:
            await opened(conn, **MANUAL)
            before = (listening.TOTALS.requests, listening.TOTALS.aborted)
            await append_audio(conn, turn_clip(17.0, seed=8))  # two windows: listened to
            await listened(before[0] + 1)
            await conn.input_audio_buffer.clear()
            assert (await next_event(conn)).type == "input_audio_buffer.cleared"
            await append_audio(conn, clip)
            usage = await answer_turn(conn)
            return usage, listening.TOTALS.requests - before[0]

    want = run(fresh())
    got, sent = run(cleared())
    assert sent >= 1
    # The same prompt as a session that never heard the cleared audio, and no more of it cached.
    assert got.input_tokens == want.input_tokens
    assert got.input_token_details.cached_tokens <= want.input_token_details.cached_tokens + BLOCK
