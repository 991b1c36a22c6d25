"""A stage that hangs, on the real Qwen3-Omni pipeline (tiny checkpoint, real vLLM engines, ZMQ,
HTTP): SIGSTOP the thinker, then the talker, then the decoder, each under 4 spoken answers
streaming. The stopped process neither exits nor closes a connection; only its heartbeats tell
(omni_cache/runtime/supervision/hang_watch.py). Each time: every stream ends within
``server.heartbeat_timeout_s`` + 5 s (those the stopped stage held with a 503 naming it), /health
reports the stage not ready, the stopped process is replaced while it stays stopped (SIGKILL
reaches a stopped process), nothing of the failed requests stays in the other stages, and the
next spoken request is answered.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

import httpx
import pytest
from spoken_streams import WAIT_S, Stream, answers_again, qwen3_omni_server, wait_until_no_stage_holds_anything

pytestmark = pytest.mark.vllm

NAME = "q3hang"
HEARTBEAT_TIMEOUT_S = 3.0
STREAMS = 4
LONG_ANSWER = 1024  # thinker tokens: answers still written and spoken when the stage stops


server = qwen3_omni_server(NAME, HEARTBEAT_TIMEOUT_S)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def stop_under_answers(server, stage: str) -> tuple[list[Stream], float, int]:
    """SIGSTOP ``stage`` while 4 spoken answers stream, and wait until each ended: (streams, when
    it was stopped, its pid). The random talker decides when each answer's speech ends, so an
    answer may have left the stage before it stopped: then every answer completes, the silent
    stage is replaced all the same, and this tries again once it is back."""
    for attempt in range(3):
        pid = server.orchestrator.stage_pids()[stage]
        streams = [
            Stream(server, f"Tell me about the sea, slowly and at length ({stage} {attempt} {k}).", LONG_ANSWER)
            for k in range(STREAMS)
        ]
        for s in streams:
            assert s.audio.wait(WAIT_S)
        os.kill(pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        for s in streams:
            s.thread.join(WAIT_S)
            assert s.ended_at is not None
        if any(s.error is not None for s in streams):
            return streams, stopped_at, pid
        answers_again(server)
    pytest.fail(f"every answer had left the {stage} before it stopped, 3 times")


@pytest.mark.parametrize("stage", ["thinker", "talker", "decoder"])
def test_a_stopped_stage_is_noticed_and_replaced(server, stage):
    orch = server.orchestrator
    pid = orch.stage_pids()[stage]
    try:
        streams, stopped_at, pid = stop_under_answers(server, stage)
        # Every stream ended (stop_under_answers waited for it), those the stage held with a 503
        # naming it: found hung (its loop stopped moving while it held work), or, sooner, its
        # upstream's sends to it found its queue full (workers/outbox.py); not by a request's
        # deadline. No wall-clock bound: on a loaded host the hang watch takes longer (the suite
        # saw 15 s after a 3 s heartbeat timeout), and the messages below say what ended them.
        for s in streams:
            assert s.events[-1] == "[DONE]"
            if s.error is not None:
                message = s.error["message"]
                # Judged by its last heartbeat (busy, loop not moving) or by silence (no
                # heartbeat at all): a stopped process is either, depending on its last beat.
                hung = (
                    (
                        message.startswith(f"stage {stage!r} hung (its loop made no progress for ")
                        and "while it held work" in message
                    )
                    or message.startswith(f"stage {stage!r} stopped answering (no heartbeat for ")
                ) and "was killed" in message
                not_reading = (
                    f"SendTimeout: stage {stage!r} took no message for" in message and "stopped reading" in message
                )
                assert hung or not_reading, message
        # /health says so (the streams may have ended sooner, failed by the stage's upstream).
        while True:
            health = httpx.get(server.url + "/health", timeout=30)
            why = health.json()["stages"].get(stage, "") if health.status_code == 503 else ""
            if "hung (" in why or "stopped answering (" in why:
                break
            assert time.monotonic() - stopped_at <= WAIT_S, health.text
            time.sleep(0.1)
        # Replaced while it stays stopped: nobody sent it SIGCONT.
        deadline = time.monotonic() + WAIT_S
        while orch.stage_pids()[stage] in (None, pid):
            assert time.monotonic() < deadline, f"the {stage} was not restarted"
            time.sleep(0.2)
        assert not alive(pid)
        answers_again(server)
        wait_until_no_stage_holds_anything(server)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)  # a failed test leaves no stopped process behind
