"""The stage supervisor on its own: what it reports through ``on_stage_down`` / ``on_stage_up``
(real OS processes, real StageReady messages), and the request table's deadlines.

The listener here records what it is told: the supervisor knows nothing of requests, so these are
all its effects besides the state of its :class:`StageProcess` objects.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time
from pathlib import Path

import msgspec
import pytest

from omni_cache.config import load_config
from omni_cache.config.addresses import with_default_addresses
from omni_cache.config.identity import pipeline_hash
from omni_cache.runtime.request_path.requests import Request, RequestTable
from omni_cache.runtime.supervision.supervisor import StageStartError, StageSupervisor
from omni_cache.wire.messages import PROTOCOL_VERSION, StageOutput, StageReady

CONFIG = Path(__file__).resolve().parents[1] / "stage_configs" / "tiny_omni.yaml"


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, ...]] = []

    def on_stage_down(self, stage: str, why: str) -> None:
        self.events.append(("down", stage, why))

    def on_stage_up(self, stage: str) -> None:
        self.events.append(("up", stage))


@pytest.fixture
def thinker(tmp_path):
    # The shipped config leaves its addresses to the server; give them as the server would.
    return with_default_addresses(load_config(CONFIG), str(tmp_path)).stages[0]


def make(events: Recorder) -> StageSupervisor:
    return StageSupervisor(events, heartbeat_timeout_s=10.0, announce_to="tcp://orchestrator:1")


def test_a_spawned_stage_that_exits_is_reported_down_and_fails_the_start(thinker):
    events = Recorder()
    sup = make(events)
    sup.add(thinker, [sys.executable, "-c", "print('bye'); raise SystemExit(3)"], dict(os.environ), False)
    sup.launch([thinker.name])
    sp = sup.stages[thinker.name]
    assert sp.runner.wait(30)
    sup.poll()
    assert events.events == [("down", thinker.name, "died (exit code 3)")]
    assert not sp.up and sp.restart_at is None  # before the start completed: no restart
    with pytest.raises(StageStartError, match=r"exited before it was ready \(exit code 3\)"):
        asyncio.run(sup.wait_ready(5.0))
    sup.kill_all_sync()


def test_a_spawned_stage_is_up_on_its_announcement_once(thinker):
    events = Recorder()
    sup = make(events)
    sup.add(thinker, [sys.executable, "-c", "import time; time.sleep(60)"], dict(os.environ), False)
    sup.launch([thinker.name])
    sp = sup.stages[thinker.name]
    try:
        assert not sp.up and sp.why_down() == "starting"
        sup.on_announcement(StageReady(stage=thinker.name, pid=sp.pid, max_model_len=77))
        sup.on_announcement(StageReady(stage=thinker.name, pid=sp.pid, max_model_len=77))  # heartbeat
        assert events.events == [("up", thinker.name)]
        assert sp.up and sp.max_model_len == 77 and sup.pids() == {thinker.name: sp.pid}
    finally:
        sup.kill_all_sync()
    assert not sp.alive()


def test_an_external_stage_replaced_by_a_new_process_is_down_then_up(thinker):
    events = Recorder()
    sup = make(events)
    sup.add(thinker, None, {}, False)
    sp = sup.stages[thinker.name]
    assert sp.why_down() == "started elsewhere, waiting for it to announce itself"
    sup.on_announcement(StageReady(stage=thinker.name, pid=10, incarnation="a", host="h1"))
    sup.on_announcement(StageReady(stage=thinker.name, pid=10, incarnation="a", host="h1"))
    sup.on_announcement(StageReady(stage=thinker.name, pid=11, incarnation="b", host="h2"))
    assert events.events == [
        ("up", thinker.name),
        ("down", thinker.name, "(started elsewhere, pid 10 on h1) was replaced by a new process (pid 11 on h2)"),
        ("up", thinker.name),
    ]
    assert sp.up and sp.pid == 11 and sp.restarts == 1


def request(rid: str, participants: tuple[str, ...], deadline: float) -> Request:
    return Request(
        request_id=rid,
        prompt_token_ids=[1],
        modalities=("text",),
        participants=participants,
        t0=0.0,
        deadline=deadline,
        timeout_s=deadline,
        return_latents=False,
    )


def test_request_table_knows_deadlines_and_who_serves_what():
    table = RequestTable(recent_ids=2)
    a = request("a", ("thinker", "talker"), deadline=5.0)
    b = request("b", ("thinker",), deadline=9.0)
    table.add(a)
    table.add(b)
    assert table.expired(4.9) == [] and table.expired(5.0) == [a]
    a.finished["thinker"] = StageOutput(request_id="a", stage="thinker", seq=0, finished=True)
    assert table.served_by("thinker") == [b] and table.served_by("talker") == [a]
    assert a.waiting_for() == ["talker"]
    table.answered(a)
    assert table.get("a") is None and len(table) == 1 and table.recently_answered("a")
    table.remember("x")
    table.remember("y")
    assert not table.recently_answered("a")  # only the last ``recent_ids`` are kept


class ElsewhereRunner:
    """A StageRunner whose process runs somewhere the supervisor cannot see (as a Ray actor's
    does): only what it reports. Real enough for the supervisor; Ray's own is tested end to end
    (tests/test_ray_replicas_e2e.py)."""

    def __init__(self) -> None:
        self.argv = ["python", "-m", "workers", "--stage", "thinker"]
        self.pid: int | None = None
        self.code: int | None = None
        self.starts = 0
        self.signals: list[int] = []

    def start(self, on_line) -> None:
        self.starts += 1
        self.pid, self.code = 1000 + self.starts, None
        on_line(f"started {self.starts}")

    def poll(self) -> int | None:
        return self.code

    def describe_exit(self, code: int) -> str:
        return "its Ray actor is gone (node lost)" if code == -1000 else f"exit code {code}"

    def signal(self, sig: int) -> None:
        self.signals.append(sig)

    def wait(self, timeout: float) -> bool:
        return self.code is not None

    def close(self) -> None:
        self.closed = True


def test_a_runner_elsewhere_is_supervised_like_a_local_process(thinker):
    """Down with the runner's own words, restarted through the same runner, its new pid's
    announcement brings it back, the old pid's is stale; stopping signals and closes it."""
    events = Recorder()
    sup = make(events)
    runner = ElsewhereRunner()
    sup.add(thinker, runner, {}, False)
    sup.launch([thinker.name])
    sp = sup.stages[thinker.name]
    assert sp.pid == 1001 and list(sp.tail) == ["started 1"] and sup.pids() == {thinker.name: 1001}
    sup.on_announcement(StageReady(stage=thinker.name, pid=1001))
    asyncio.run(sup.wait_ready(1.0))  # every stage up: from now on, restarts
    runner.code = -1000
    sup.poll()
    assert events.events == [("up", thinker.name), ("down", thinker.name, "died (its Ray actor is gone (node lost))")]
    assert sp.why_down().startswith("down (its Ray actor is gone (node lost)")
    assert signal.SIGKILL in runner.signals  # what the dead process may have left behind
    sup.poll()  # the restart is due at once (it had not crashed before)
    assert runner.starts == 2 and sp.pid == 1002 and not sp.up
    sup.on_announcement(StageReady(stage=thinker.name, pid=1001))  # late, from the old process
    assert not sp.up
    sup.on_announcement(StageReady(stage=thinker.name, pid=1002))
    assert sp.up and events.events[-1] == ("up", thinker.name)
    runner.code = 0  # it exits when told to stop
    sup.stop_processes(0.1)
    assert runner.closed and not sp.up


# ---- hangs (omni_cache/runtime/supervision/hang_watch.py) ----------------------------------------------------


def beat(sp, *, busy: bool, stalled_s: float, **kw) -> StageReady:
    return StageReady(stage=sp.stage, pid=sp.pid, busy=busy, stalled_s=stalled_s, **kw)


def judge(sup: StageSupervisor) -> None:
    """Two monitoring steps in a row (the first after a pause only sets the monitor's clock)."""
    sup.poll()
    sup.poll()


def started(thinker, timeout_s: float = 10.0):
    events = Recorder()
    sup = StageSupervisor(events, heartbeat_timeout_s=timeout_s, announce_to="tcp://orchestrator:1")
    runner = ElsewhereRunner()
    sup.add(thinker, runner, {}, False)
    sup.launch([thinker.name])
    sp = sup.stages[thinker.name]
    sup.on_announcement(StageReady(stage=thinker.name, pid=sp.pid))
    asyncio.run(sup.wait_ready(1.0))
    return sup, events, runner, sp


def test_a_loop_stuck_while_it_works_is_down_killed_and_restarted(thinker):
    sup, events, runner, sp = started(thinker)
    assert sp.step_timeout_s == 300.0  # the default
    sup.on_announcement(beat(sp, busy=True, stalled_s=300.5))  # alive, in one step for 300.5 s
    judge(sup)
    assert not sp.up and sp.hangs == 1 and runner.signals == [signal.SIGKILL]
    assert events.events[-1][:2] == ("down", thinker.name)
    why = events.events[-1][2]
    assert why.startswith("hung (its loop made no progress for 300.") and "was killed" in why
    assert "its stages[].step_timeout_s is 300 s" in why
    assert sp.why_down().endswith("killed, waiting for its process to exit")
    sup.on_announcement(beat(sp, busy=True, stalled_s=301.0))  # the dying process: ignored
    assert not sp.up
    runner.code = -9  # SIGKILL took it
    sup.poll()
    assert len([e for e in events.events if e[0] == "down"]) == 1  # reported once, when found
    assert sp.last_exit_words.startswith("exit code -9 after it hung (its loop made no progress")
    sup.poll()  # restarted at once: it had not crashed before
    assert runner.starts == 2 and sp.why_down().startswith("restarting (its last process: exit")
    sup.on_announcement(StageReady(stage=thinker.name, pid=sp.pid))
    assert sp.up and events.events[-1] == ("up", thinker.name)


def test_an_idle_or_moving_stage_is_never_taken_for_hung(thinker):
    sup, events, runner, sp = started(thinker)
    sup.on_announcement(beat(sp, busy=False, stalled_s=3600.0))  # waiting for input for an hour
    judge(sup)
    sup.on_announcement(beat(sp, busy=True, stalled_s=9.9))  # a step, not over the heartbeat timeout
    judge(sup)
    assert sp.up and sp.hangs == 0 and runner.signals == [] and events.events == [("up", thinker.name)]
    assert sp.long_steps == 0 and sup.long_steps() == {}


def test_a_long_step_with_heartbeats_is_busy_not_hung(thinker):
    """Past the heartbeat timeout while its beats come (a first-use compile): busy, reported
    and counted once per step; hung only past its step_timeout_s."""
    sup, events, runner, sp = started(thinker)
    sup.on_announcement(beat(sp, busy=True, stalled_s=10.5))
    judge(sup)
    assert sp.up and sp.hangs == 0 and runner.signals == [] and sp.long_steps == 1
    assert 10.5 <= sup.long_steps()[thinker.name] < 20
    sup.on_announcement(beat(sp, busy=True, stalled_s=250.0))  # the same step, still going
    judge(sup)
    assert sp.up and sp.long_steps == 1 and sup.long_steps()[thinker.name] >= 250
    sup.on_announcement(beat(sp, busy=True, stalled_s=0.2))  # it moved: that step ended
    judge(sup)
    assert sup.long_steps() == {}
    sup.on_announcement(beat(sp, busy=True, stalled_s=11.0))  # another long step
    judge(sup)
    assert sp.long_steps == 2 and events.events == [("up", thinker.name)]


def test_step_timeout_is_per_stage(thinker):
    thinker.step_timeout_s = 20.0
    sup, events, runner, sp = started(thinker)
    sup.on_announcement(beat(sp, busy=True, stalled_s=20.5))
    judge(sup)
    assert not sp.up and runner.signals == [signal.SIGKILL] and sp.long_steps == 0
    assert "its stages[].step_timeout_s is 20 s" in events.events[-1][2]


def test_a_silent_stage_is_down_and_killed(thinker):
    sup, events, runner, sp = started(thinker, timeout_s=0.3)
    sup.poll()
    deadline = time.monotonic() + 30
    while sp.up:  # no beat comes (a stopped process): the timeout passes
        assert time.monotonic() < deadline
        sup.poll()
        time.sleep(0.05)
    assert events.events[-1][2].startswith("stopped answering (no heartbeat for 0.")
    assert runner.signals == [signal.SIGKILL] and sp.hangs == 1


def test_a_stuck_external_stage_is_down_not_killed_and_back_when_it_moves(thinker):
    events = Recorder()
    sup = make(events)
    sup.add(thinker, None, {}, False)
    sp = sup.stages[thinker.name]
    ready = dict(stage=thinker.name, pid=10, incarnation="a", host="h1")
    sup.on_announcement(StageReady(**ready))
    asyncio.run(sup.wait_ready(1.0))
    sup.on_announcement(StageReady(**ready, busy=True, stalled_s=12.0))  # busy, not hung
    judge(sup)
    assert sp.up and sp.long_steps == 1
    sup.on_announcement(StageReady(**ready, busy=True, stalled_s=312.0))
    judge(sup)
    assert not sp.up and sp.hangs == 1
    assert events.events[-1][:2] == ("down", thinker.name)
    assert events.events[-1][2].startswith("(started elsewhere, pid 10 on h1) hung (its loop made no progress for 312.")
    assert events.events[-1][2].endswith("s while it held work; its stages[].step_timeout_s is 300 s)")
    sup.on_announcement(StageReady(**ready, busy=True, stalled_s=313.0))  # alive, still stuck
    judge(sup)
    assert not sp.up and "hung (its loop made no progress for 313.0 s" in sp.why_down()
    sup.on_announcement(StageReady(**ready, busy=True, stalled_s=0.1))  # it moves again
    assert sp.up and events.events[-1] == ("up", thinker.name) and sp.restarts == 0


def test_replacing_a_watched_connection_again_and_again_keeps_it_watched(thinker):
    # The server replaces a down stage's socket at once: the new socket often gets the closed
    # one's file descriptor, after which a monitor endpoint named after it (pyzmq's default)
    # can still be bound. Each replacement must be watched, and its events must reach the
    # supervisor: sixty times the stage dies (its socket closes: the old connection's end is
    # seen), comes back and announces itself while nothing listens yet (the replacement's
    # refused connects are seen: not up), then listens again, and only the replacement's
    # connect event can bring it up.
    import zmq
    import zmq.asyncio

    async def until(what: str, cond) -> None:
        deadline = time.monotonic() + 10
        while not cond():
            assert time.monotonic() < deadline, what
            await asyncio.sleep(0.005)

    async def run() -> None:
        events = Recorder()
        sup = make(events)
        sup.add(thinker, None, {}, False)  # started elsewhere: its connection is watched
        sp = sup.stages[thinker.name]
        ctx = zmq.asyncio.Context()
        stage = ctx.socket(zmq.PULL)
        port = stage.bind_to_random_port("tcp://127.0.0.1")

        def connected() -> zmq.Socket:
            sock = ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.RECONNECT_IVL, 10)  # refused connects retried (and reported) fast
            sock.connect(f"tcp://127.0.0.1:{port}")
            return sock

        old = connected()
        sup.watch_connection(thinker.name, old)
        # The first connection is made before the stage first goes away (a message goes through
        # it): on a loaded host the I/O thread may not have connected yet when the listener
        # closes, and a connect that never succeeded closes nothing: it is refused, which keeps
        # a stage from coming up but does not take an announced one down (the heartbeat does).
        await old.send(b"first")
        assert await stage.recv() == b"first"
        sup.on_announcement(StageReady(stage=thinker.name, pid=1, incarnation="0"))
        try:
            for i in range(1, 61):
                assert sp.up
                stage.close(linger=0)  # the stage's process dies
                await until(f"replacement {i}: the disconnect was not seen", lambda: not sp.up)
                sock = connected()
                sup.unwatch_connection(thinker.name)
                old.close(linger=0)
                sup.watch_connection(thinker.name, sock)  # takes the connection as up for now
                old = sock
                await until(f"replacement {i}: no refused connect was seen", lambda: sp.connection_down)
                sup.on_announcement(StageReady(stage=thinker.name, pid=1 + i, incarnation=str(i)))
                assert not sp.up  # announced, but its connection is down
                stage = ctx.socket(zmq.PULL)
                while True:  # the closed listener may hold the port for a moment
                    try:
                        stage.bind(f"tcp://127.0.0.1:{port}")
                        break
                    except zmq.ZMQError:
                        await asyncio.sleep(0.005)
                await until(f"replacement {i}: the connect was not seen", lambda: sp.up)
                assert not sp.connection_down
            ups = [e for e in events.events if e[0] == "up"]
            downs = [e for e in events.events if e[0] == "down"]
            assert len(ups) == 61 and len(downs) == 60 and sp.restarts == 60
            assert all(e[2].endswith("closed its connection (its process is gone)") for e in downs)
        finally:
            await sup.close()  # cancels the watches and waits until they closed their monitors
            stage.close(linger=0)
            ctx.destroy(linger=0)

    asyncio.run(run())


def test_a_stage_of_another_protocol_or_pipeline_is_refused_naming_both(thinker, caplog):
    """Before: StageReady carried neither, and msgspec filled what an older stage did not send:
    a stage started elsewhere from other code or another config was taken silently."""
    events = Recorder()
    ours = pipeline_hash(load_config(CONFIG))
    sup = StageSupervisor(events, heartbeat_timeout_s=10.0, announce_to="tcp://orchestrator:1", config_hash=ours)
    sup.add(thinker, None, {}, False)
    sp = sup.stages[thinker.name]
    with caplog.at_level(logging.ERROR, logger="omni_cache.runtime.supervision.supervisor"):
        sup.on_announcement(StageReady(stage=thinker.name, pid=10, incarnation="a", config_hash=ours))
        sup.on_announcement(StageReady(stage=thinker.name, pid=10, incarnation="a", config_hash=ours))  # once
        sup.on_announcement(
            StageReady(stage=thinker.name, pid=11, incarnation="b", protocol=PROTOCOL_VERSION, config_hash="0123abcd")
        )
    assert not sp.up and events.events == []
    assert f"refused: it runs pipeline config 0123abcd, this server {ours}" in sp.why_down()  # /health says
    refusals = [r.getMessage() for r in caplog.records]
    assert len(refusals) == 2, refusals
    assert (
        f"speaks stage protocol none (code from before protocol versions), this server {PROTOCOL_VERSION}"
        in (refusals[0])
    )
    assert f"runs pipeline config 0123abcd, this server {ours}" in refusals[1]
    sup.on_announcement(
        StageReady(stage=thinker.name, pid=12, incarnation="c", protocol=PROTOCOL_VERSION, config_hash=ours)
    )
    assert sp.up and events.events == [("up", thinker.name)]


def test_the_pipeline_hash_is_its_shape_not_its_addresses(tmp_path):
    config = load_config(CONFIG)
    placed = with_default_addresses(config, str(tmp_path))
    assert pipeline_hash(placed) == pipeline_hash(config)
    other = msgspec.structs.replace(config, stages=[msgspec.structs.replace(config.stages[0], model="tiny:other")])
    assert pipeline_hash(other) != pipeline_hash(config)
