"""A downstream stage that stops reading does not stop its upstream, on the real Qwen3-Omni
pipeline (tiny checkpoint, real vLLM engines, ZMQ, HTTP).

The decoder is SIGSTOPped under spoken answers, with a heartbeat timeout long enough (120 s) that
it is not replaced during the test: the talker's queue to it fills (zmq's high-water mark). A send
to a full queue waits at most a quarter of the heartbeat timeout (workers/outbox.py), then the
request it carried fails with a 503 naming the stage that stopped reading, and every later send to
it fails at once while its queue stays full: spoken requests fail fast instead of hanging, and
text-only requests are answered all along. Once the decoder reads again (SIGCONT), spoken requests
are answered again and nothing of the failed ones stays in any stage.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

import httpx
import pytest
from spoken_streams import WAIT_S, Stream, answers_again, qwen3_omni_server, spoken, wait_until_no_stage_holds_anything
from sse_client import read_events

from workers.outbox import send_timeout_s

pytestmark = pytest.mark.vllm

NAME = "q3press"
# The stopped decoder is not replaced while the test runs. With 60 s (a send then gave up after 15
# s) the talker of a 2-vCPU AMD EPYC Zen 3 (family 25 model 1), where vLLM's CPU steps are 3-4x
# slower than on a Zen 5, had not filled its queue to the decoder 45 s after the stop.
HEARTBEAT_TIMEOUT_S = 120.0
SEND_TIMEOUT_S = send_timeout_s(HEARTBEAT_TIMEOUT_S)  # how long the talker's send waits for room
CONCURRENT = 8  # spoken answers in flight when the decoder stops
LONG_ANSWER = 1024  # thinker tokens: the talker speaks them, one code step each
MAX_STREAMS = 64  # spoken answers sent at most while the talker's queue fills


server = qwen3_omni_server(NAME, HEARTBEAT_TIMEOUT_S)


def stopped_reading(stream: Stream) -> bool:
    error = stream.error
    return error is not None and "stopped reading" in error["message"]


def test_a_downstream_stage_that_stops_reading_does_not_stop_its_upstream(server):
    decoder = server.orchestrator.stage_pids()["decoder"]
    streams = [
        Stream(server, f"Tell me about rivers, slowly and at length ({k}).", LONG_ANSWER) for k in range(CONCURRENT)
    ]
    k = 0
    try:
        for s in streams:
            assert s.audio.wait(WAIT_S)
        os.kill(decoder, signal.SIGSTOP)
        # Keep spoken answers coming until the talker's queue to the decoder is full and a send
        # to it gives up (long before the heartbeat timeout would replace the decoder).
        deadline = time.monotonic() + HEARTBEAT_TIMEOUT_S * 0.75
        while not any(stopped_reading(s) for s in streams):
            assert time.monotonic() < deadline, "no send to the stopped decoder gave up"
            if len(streams) < MAX_STREAMS:
                streams.append(Stream(server, f"Tell me about lakes, at length ({k}).", LONG_ANSWER))
                k += 1
            time.sleep(0.5)
        # The talker gave up on the decoder (and maybe, while the talker waited, the thinker on
        # the talker: the same, one stage up).
        errors = [s.error["message"] for s in streams if stopped_reading(s)]
        assert any(
            e.startswith(f"stage 'talker': SendTimeout: stage 'decoder' took no message for {SEND_TIMEOUT_S:g} s")
            for e in errors
        ), errors
        # The decoder stays stopped. Text-only requests (thinker only) are answered ...
        for n in range(2):
            r = httpx.post(
                server.url + "/v1/chat/completions",
                timeout=120,
                json={
                    "model": NAME,
                    "max_tokens": 8,
                    "messages": [{"role": "user", "content": f"Say something ({n})."}],
                },
            )
            assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"], r.text
        # ... and a spoken one fails (no send waits on a queue that stayed full).
        events: list = []
        read_events(server.url + "/v1/chat/completions", spoken(server, "Speak, please.", 8), {}, events, timeout=120)
        errors = [e["error"]["message"] for e in events if isinstance(e, dict) and "error" in e]
        assert errors and "stopped reading" in errors[0], events[-2:]
        assert server.orchestrator.stage_pids()["decoder"] == decoder  # never replaced
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(decoder, signal.SIGCONT)
    for s in streams:
        s.thread.join(WAIT_S)
        # Ended by the server ([DONE], after its error if it failed): ended_at alone is also set
        # when the read gave up (its timeout is WAIT_S too), so a hung stream would pass.
        assert s.ended_at is not None and s.events[-1:] == ["[DONE]"], s.events[-2:]
    answers_again(server)
    wait_until_no_stage_holds_anything(server)
