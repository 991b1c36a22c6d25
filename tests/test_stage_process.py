"""The stage loop itself (workers/stage_process.py) over real ZMQ, with a scripted runner in
place of a model: a failure outside any request (a stats query, an Abort, the housekeeping) is
counted and the loop goes on; a step failure fails what the stage holds and only repeated ones
end the process; a bad request fails alone (logged without a traceback when it is the
request's fault, vLLM's ``VLLMClientError`` included); a downstream stage that stops reading
fails the requests whose output it would not take, and the loop goes on serving the others; the
heartbeats say whether the loop moves.

The runner is the real :class:`workers.runner.StageRunner` (its request table, guard, failure and
deadline handling) with a model of a few lines: each step sends one token of every request it
holds, to the orchestrator and, when asked for audio, downstream.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import zmq

from omni_cache.config import load_config
from omni_cache.wire.messages import (
    MESSAGE_TYPES,
    Abort,
    Shutdown,
    StageError,
    StageOutput,
    StageReady,
    StageStats,
    StatsQuery,
    StreamStart,
    Submit,
)
from omni_cache.wire.sampling import EngineSampling
from omni_cache.wire.transport import Codec, Receiver, Sender
from workers.runner import StageRunner, deadline_in
from workers.stage_process import MAX_FAILED_STEPS, StageProcess

ROOT = Path(__file__).resolve().parents[1]
HEARTBEAT_TIMEOUT_S = 2.0  # sends wait at most a quarter of it: 0.5 s
WAIT_S = 30.0  # bound of every wait for a message (never reached when things work)


@dataclass
class Held:
    deadline: float
    audio: bool
    seq: int = 0


class ScriptedRunner(StageRunner):
    """One token per step for each request (``tokens`` of them, the last one finished); what the
    test sets makes a path fail: ``step_failures`` steps raise, ``counters_fail``, ``expire_fail``,
    ``drop_fails`` (request ids), a request id containing "bad" is refused at accept,
    ``block`` (an Event) holds the next step until it is set."""

    max_model_len = 0

    def __init__(self, stage, outbox, tokens: int = 3) -> None:
        super().__init__(stage, outbox, tombstone_ttl_s=60.0)
        self.tokens = tokens
        self.step_failures = 0
        self.counters_fail = False
        self.expire_fail = False
        self.drop_fails: set[str] = set()
        self.block: threading.Event | None = None
        self.blocked = threading.Event()  # a step is held by ``block`` now
        self.burst = 1  # downstream messages per token (to fill a peer's queue)
        self.closed = False

    def accept(self, msg, tensors) -> None:
        if "bad" in msg.request_id:
            raise ValueError(f"request {msg.request_id} is malformed")
        self.requests[msg.request_id] = Held(deadline_in(msg.time_left_s), "audio" in msg.modalities)
        self.total_requests += 1

    def has_work(self) -> bool:
        return bool(self.requests)

    def step(self) -> None:
        if self.block is not None:
            block, self.block = self.block, None
            self.blocked.set()
            block.wait(WAIT_S)
        if self.step_failures:
            self.step_failures -= 1
            raise RuntimeError("the engine broke")
        for rid in list(self.requests):
            self.guarded(rid, lambda rid=rid: self._emit(rid))

    def _emit(self, rid: str) -> None:
        req = self.requests[rid]
        seq = req.seq
        finished = seq + 1 == self.tokens
        if req.audio:
            for k in range(self.burst):
                n = seq * self.burst + k
                kind = StreamStart if n == 0 else StageOutput
                self.outbox.to_downstream(
                    kind(
                        request_id=rid,
                        stage=self.stage.name,
                        seq=n,
                        token_ids=[seq],
                        finished=finished and k == self.burst - 1,
                    )
                )
        self.outbox.to_orchestrator(
            StageOutput(request_id=rid, stage=self.stage.name, seq=seq, token_ids=[seq], finished=finished)
        )
        req.seq += 1
        if finished:
            del self.requests[rid]

    def drop(self, request_id: str) -> None:
        if request_id in self.drop_fails:
            raise RuntimeError(f"the engine cannot drop {request_id}")
        self.requests.pop(request_id, None)

    def expire(self, now: float | None = None) -> None:
        if self.expire_fail:
            raise RuntimeError("the clock is gone")
        super().expire(now)

    def counters(self) -> dict[str, float]:
        if self.counters_fail:
            raise RuntimeError("no counters today")
        return super().counters()

    def close(self) -> None:
        self.closed = True


class Harness:
    """A StageProcess of the thinker serving a ScriptedRunner in a thread; the test is its
    orchestrator (``orch``: the inbox the stage sends to; ``send``: to the stage's inbox). The
    talker's address is bound by nobody unless ``talker`` is: a peer that never reads."""

    def __init__(self, tmp_path: Path, tokens: int = 3) -> None:
        config = load_config(ROOT / "stage_configs" / "tiny_omni.yaml")
        config.server.heartbeat_interval_s = 0.05
        config.server.heartbeat_timeout_s = HEARTBEAT_TIMEOUT_S
        for stage in config.stages:
            stage.address = f"ipc://{tmp_path}/{stage.name}.sock"
        self.ctx = zmq.Context()
        codec = Codec(MESSAGE_TYPES)
        self.orch = Receiver(self.ctx, f"ipc://{tmp_path}/orchestrator.sock", codec)
        self.stage = StageProcess(config, config.stage("thinker"), orchestrator=self.orch.address)
        self.to_stage = Sender(self.ctx, config.stage("thinker").address, codec)
        self.runner = ScriptedRunner(config.stage("thinker"), self.stage.outbox, tokens=tokens)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()
        self.beats: list[StageReady] = []
        self.seen: list = []  # every message from the stage, in order
        self.expect(StageReady)  # the stage announced itself: its loop runs

    def _serve(self) -> None:
        try:
            self.stage.serve(self.runner)
        except BaseException as exc:  # noqa: BLE001 -- the test reads it
            self.error = exc

    def send(self, msg) -> None:
        self.to_stage.send(msg)

    def submit(self, rid: str, audio: bool = False) -> None:
        self.send(
            Submit(
                request_id=rid,
                prompt_token_ids=[1, 2],
                sampling=EngineSampling(),
                modalities=["text", "audio"] if audio else ["text"],
            )
        )

    def expect(self, kind, match=lambda m: True):
        """The next message of ``kind`` (a type or a tuple of them) that ``match`` accepts; the
        heartbeats seen on the way are kept in ``beats``."""
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            got = self.orch.recv(timeout_ms=200)
            if got is None:
                assert self.thread.is_alive(), f"the stage loop ended: {self.error!r}"
                continue
            msg, _ = got
            self.seen.append(msg)
            if isinstance(msg, StageReady):
                self.beats.append(msg)
            if isinstance(msg, kind) and match(msg):
                return msg
        raise AssertionError(f"no {kind} within {WAIT_S} s")

    def answer(self, rid: str) -> list[int]:
        """The request's tokens until its finished output (a StageError for it fails the test)."""
        tokens = []
        while True:
            msg = self.expect((StageOutput, StageError), lambda m: m.request_id == rid)
            assert isinstance(msg, StageOutput), f"request {rid} failed: {msg}"
            tokens += msg.token_ids
            if msg.finished:
                return tokens

    def error_for(self, rid: str) -> StageError:
        return self.expect(StageError, lambda m: m.request_id == rid)

    def stats(self) -> dict[str, float]:
        self.send(StatsQuery())
        return self.expect(StageStats).counters

    def close(self) -> None:
        if self.thread.is_alive():
            self.send(Shutdown())
            self.thread.join(WAIT_S)
        assert not self.thread.is_alive()
        self.to_stage.close()
        self.orch.close()
        self.ctx.term()


@pytest.fixture
def stage(tmp_path):
    h = Harness(tmp_path)
    yield h
    h.close()


def test_a_request_is_served_and_the_stage_stops_when_told(stage):
    stage.submit("a")
    assert stage.answer("a") == [0, 1, 2]
    stage.send(Shutdown())
    stage.thread.join(WAIT_S)
    assert not stage.thread.is_alive() and stage.error is None and stage.runner.closed


def test_a_bad_request_fails_alone(stage):
    stage.submit("bad-1")
    stage.submit("good")
    err = stage.error_for("bad-1")
    assert err.status == 400 and "malformed" in err.message and err.stage == "thinker"
    assert stage.answer("good") == [0, 1, 2]


def test_a_step_failure_fails_what_the_stage_holds_and_the_loop_goes_on(stage):
    stage.runner.step_failures = 1
    stage.submit("a")
    err = stage.error_for("a")
    assert err.status == 500 and "the engine broke" in err.message
    stage.submit("b")
    assert stage.answer("b") == [0, 1, 2]
    assert stage.stats()["loop_errors"] == 1


def test_repeated_step_failures_end_the_process(stage):
    stage.runner.step_failures = MAX_FAILED_STEPS
    for k in range(MAX_FAILED_STEPS):
        stage.submit(f"r{k}")
        if k < MAX_FAILED_STEPS - 1:  # the last one's error may die with the process
            assert "the engine broke" in stage.error_for(f"r{k}").message
    stage.thread.join(WAIT_S)
    assert not stage.thread.is_alive()
    assert isinstance(stage.error, RuntimeError) and "the engine broke" in str(stage.error)
    assert stage.runner.closed  # it exits through its clean-up (the supervisor restarts it)


def test_a_failing_stats_query_is_counted_and_the_loop_goes_on(stage):
    stage.runner.counters_fail = True
    stage.send(StatsQuery())
    stage.submit("a")
    assert stage.answer("a") == [0, 1, 2]  # no StageStats came for the failed query
    stage.runner.counters_fail = False
    assert stage.stats()["loop_errors"] == 1


def test_an_abort_that_fails_in_the_model_still_ends_the_request(tmp_path):
    stage = Harness(tmp_path, tokens=1000)  # "a" is far from done when the Abort arrives
    try:
        block = stage.runner.block = threading.Event()
        stage.runner.drop_fails = {"a"}
        stage.submit("a")
        assert stage.runner.blocked.wait(WAIT_S)  # "a" is being stepped
        stage.send(Abort(request_id="a"))
        stage.submit("b")
        block.set()
        assert stage.answer("b") == list(range(1000))
        counters = stage.stats()
        assert counters["loop_errors"] == 1 and counters["queue_depth"] == 0
        a = [m for m in stage.seen if isinstance(m, StageOutput) and m.request_id == "a"]
        assert a and not any(m.finished for m in a)  # it ended at the Abort, unfinished
    finally:
        stage.close()


def test_failing_housekeeping_is_counted_and_the_loop_goes_on(stage):
    stage.runner.expire_fail = True
    stage.submit("a")
    assert stage.answer("a") == [0, 1, 2]
    deadline = time.monotonic() + WAIT_S
    while stage.stats()["loop_errors"] < 2:  # housekeeping runs every 100 ms
        assert time.monotonic() < deadline
    stage.runner.expire_fail = False
    stage.submit("b")
    assert stage.answer("b") == [0, 1, 2]


def test_a_downstream_stage_that_stops_reading_fails_what_it_carried(tmp_path):
    """Nobody reads the talker's address: its queue fills (zmq's high-water mark, 1000
    messages), a send waits at most a quarter of the heartbeat timeout, the request it carried
    fails with 503 naming the talker, and the loop goes on: text-only requests are answered."""
    stage = Harness(tmp_path, tokens=5)
    try:
        stage.runner.burst = 600  # two tokens of it fill the queue
        stage.submit("spoken", audio=True)
        err = stage.error_for("spoken")
        assert err.status == 503 and "stage 'talker'" in err.message and "stopped reading" in err.message
        stage.submit("spoken-2", audio=True)  # the queue is still full: fails at once
        assert stage.error_for("spoken-2").status == 503
        stage.submit("text")
        assert stage.answer("text") == [0, 1, 2, 3, 4]
        counters = stage.stats()
        assert counters["send_timeouts"] == 2 and counters["errors"] == 2
        assert counters["queue_depth"] == 0
    finally:
        stage.close()


def test_the_heartbeats_say_whether_the_loop_moves(stage):
    stage.beats.clear()
    stage.expect(StageReady)
    stage.expect(StageReady)
    # Waiting for input with nothing held: idle, however long it waits.
    assert all(not b.busy for b in stage.beats[-2:])
    block = stage.runner.block = threading.Event()
    stage.submit("a")
    # The loop is stuck in the step: busy, and the time since it moved grows beat after beat.
    stuck = stage.expect(StageReady, lambda b: b.busy and b.stalled_s > 0.5)
    later = stage.expect(StageReady, lambda b: b.stalled_s > stuck.stalled_s)
    assert later.busy
    block.set()
    assert stage.answer("a") == [0, 1, 2]
    moving = stage.expect(StageReady, lambda b: b.stalled_s < 0.5)
    assert moving.stalled_s < later.stalled_s


class _Outbox:
    """What a runner sends, kept (the runner's outbox without ZMQ)."""

    def __init__(self) -> None:
        self.sent: list = []

    def to_orchestrator(self, msg) -> None:
        self.sent.append(msg)

    def forget(self, request_id: str) -> None:
        pass


def test_a_request_vllm_refuses_as_the_clients_fault_is_logged_without_a_traceback(caplog):
    """vLLM files a request's own faults as VLLMClientError, which is no ValueError: each such
    request (a response_format schema that does not compile) logged three chained tracebacks."""
    from vllm.exceptions import VLLMValidationError

    config = load_config(ROOT / "stage_configs" / "tiny_omni.yaml")
    outbox = _Outbox()
    runner = ScriptedRunner(config.stage("thinker"), outbox)
    causes = {
        "client": VLLMValidationError("Grammar error: Invalid type: nosuchtype"),
        "bad": ValueError("request bad is malformed"),
        "server": RuntimeError("the engine broke"),
    }
    with caplog.at_level("WARNING", logger="workers.runner"):
        for rid, exc in causes.items():
            runner.guarded(rid, lambda exc=exc: (_ for _ in ()).throw(exc))
    traced = {r.getMessage().split()[3]: bool(r.exc_info) for r in caplog.records}
    assert traced == {"client": False, "bad": False, "server": True}
    assert [(m.request_id, m.status) for m in outbox.sent] == [("client", 400), ("bad", 400), ("server", 500)]


def test_a_stage_error_names_the_field_vllms_check_named():
    from vllm.exceptions import VLLMValidationError

    from workers.runner import error_message

    refused = VLLMValidationError("allowed_token_ids contains out-of-vocab token id!", parameter="allowed_token_ids")
    err = error_message("thinker", "r", refused)
    assert (err.status, err.param) == (400, "allowed_token_ids")
    assert error_message("thinker", "r", ValueError("bad")).param is None
    too_long = VLLMValidationError("x", parameter="p" * 1000)  # past the wire's bound: not sent
    assert error_message("thinker", "r", too_long).param is None
