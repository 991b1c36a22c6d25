"""The stage supervisor on its own: what it reports through ``on_stage_down`` / ``on_stage_up``
(real OS processes, real StageReady messages), and the request table's deadlines.

The listener here records what it is told: the supervisor knows nothing of requests, so these are
all its effects besides the state of its :class:`StageProcess` objects.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import pytest

from omni_cache.config import load_config
from omni_cache.runtime.requests import Request, RequestTable
from omni_cache.runtime.supervisor import StageStartError, StageSupervisor
from omni_cache.wire.messages import StageOutput, StageReady

CONFIG = Path(__file__).resolve().parents[1] / "stage_configs" / "tiny_omni.yaml"


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, ...]] = []

    def on_stage_down(self, stage: str, why: str) -> None:
        self.events.append(("down", stage, why))

    def on_stage_up(self, stage: str) -> None:
        self.events.append(("up", stage))


@pytest.fixture
def thinker():
    return load_config(CONFIG).stages[0]


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
        ("down", thinker.name,
         "(started elsewhere, pid 10 on h1) was replaced by a new process (pid 11 on h2)"),
        ("up", thinker.name),
    ]
    assert sp.up and sp.pid == 11 and sp.restarts == 1


def request(rid: str, participants: tuple[str, ...], deadline: float) -> Request:
    return Request(request_id=rid, prompt_token_ids=[1], modalities=("text",),
                   participants=participants, t0=0.0, deadline=deadline, timeout_s=deadline,
                   return_latents=False)


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
    assert events.events == [("up", thinker.name),
                             ("down", thinker.name, "died (its Ray actor is gone (node lost))")]
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
