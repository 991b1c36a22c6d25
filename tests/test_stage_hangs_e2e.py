"""A stage that hangs, on the real Qwen3-Omni pipeline (tiny checkpoint, real vLLM engines, ZMQ,
HTTP): SIGSTOP the thinker, then the talker, then the decoder, each under 4 spoken answers
streaming. The stopped process neither exits nor closes a connection; only its heartbeats tell
(omni_cache/runtime/supervision/hang_watch.py). Each time: every stream ends (those the stopped
stage held with a 503 naming it), /health reports the stage not ready while it is down, the
stopped process is replaced while it stays stopped (SIGKILL reaches a stopped process), nothing
of the failed requests stays in the other stages, and the next spoken request is answered.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
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


class HealthLog:
    """Polls /health from a thread of its own and keeps what it said about one stage: the test
    must see the stage reported down while it is, and a quick replacement (the stage back before
    the last stream ended, when a stream the stage had finished goes on with the thinker's long
    answer) would hide that from a check made after the streams."""

    def __init__(self, server, stage: str) -> None:
        self.url, self.stage = server.url + "/health", stage
        self.seen: list[str] = []  # each distinct 503 reason given for the stage, in order
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()

    def _poll(self) -> None:
        with httpx.Client(timeout=30) as client:
            while not self.stop.is_set():
                with contextlib.suppress(httpx.HTTPError):
                    health = client.get(self.url)
                    if health.status_code == 503:
                        why = health.json()["stages"].get(self.stage, "")
                        if why and (not self.seen or self.seen[-1] != why):
                            self.seen.append(why)
                self.stop.wait(0.1)

    def reported_hung(self) -> bool:
        return any("hung (" in why or "stopped answering (" in why for why in self.seen)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(60)


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
    health = HealthLog(server, stage)
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
        # /health says so, while it is down (the streams may have ended sooner, failed by the
        # stage's upstream, or later, when the stage was already back).
        while not health.reported_hung():
            assert time.monotonic() - stopped_at <= WAIT_S, health.seen
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
        health.close()
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)  # a failed test leaves no stopped process behind
