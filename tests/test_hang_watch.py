"""The hang watch's judgment on a clock the test drives (omni_cache/runtime/supervision/hang_watch.py): real
StageReady beats, the server's reads and ticks in the order its event loop runs them. The watch
judges on what the server could have read: a server that lags on every tick still finds a
stopped stage; a server that stalls never blames a healthy stage for the beats it did not read."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from omni_cache.runtime.supervision.hang_watch import HangWatch, Liveness, step_timeout_s
from omni_cache.wire.messages import StageReady

TIMEOUT_S = 3.0  # server.heartbeat_timeout_s
STEP_TIMEOUT_S = 300.0
INTERVAL_S = 0.25  # server.heartbeat_interval_s


@dataclass
class Replica:
    """What the watch reads of the supervisor's SupervisedReplica."""

    up: bool = True
    liveness: Liveness = field(default_factory=Liveness)
    step_timeout_s: float = STEP_TIMEOUT_S
    long_steps: int = 0


def beat(busy: bool = False, stalled_s: float = 0.0) -> StageReady:
    return StageReady(stage="thinker", pid=1, busy=busy, stalled_s=stalled_s)


def test_a_server_that_lags_on_every_tick_still_finds_a_stopped_stage():
    """Every tick 1.1 s after the last (the old watch judged nothing on a late tick, so it never
    judged here); each loop round reads the beats that came, then ticks. The stage beats until
    it is stopped at 5 s: found within the timeout plus two ticks of the stop, not before."""
    watch, sp = HangWatch(TIMEOUT_S), Replica()
    stopped_at, t, sent = 5.0, 0.0, 0.0
    found = None
    while t < 60 and found is None:
        t += 1.1  # the loop lags: a whole round takes 1.1 s
        came = False
        while sent + INTERVAL_S <= min(t, stopped_at):  # the beats that came meanwhile
            sent, came = sent + INTERVAL_S, True
        if came:
            sp.liveness.beat(beat(), t - 0.01)  # read just before the tick (arrival = read time)
        hung = watch.hung([sp], t)
        if hung:
            found = (t, hung[0][1])
    assert found is not None, "a steadily lagging server never found the stopped stage"
    at, why = found
    assert stopped_at + TIMEOUT_S < at <= stopped_at + TIMEOUT_S + 2 * 1.1 + 0.01
    assert why.startswith("stopped answering (no heartbeat for ")


def test_a_server_stall_never_makes_a_healthy_stage_look_silent():
    """The server stalls 30 s; its first tick after the stall runs before the receive loop
    read the beats that waited (the worst order): nothing is judged; once read, all is well."""
    watch, sp = HangWatch(TIMEOUT_S), Replica()
    t = 0.0
    for _ in range(10):  # a punctual loop: read, tick
        t += 0.1
        sp.liveness.beat(beat(), t)
        assert watch.hung([sp], t) == []
    t += 30.0  # the stall: beats queue unread
    assert watch.hung([sp], t) == []  # the tick comes first
    sp.liveness.beat(beat(), t + 0.001)  # the receive loop drains the inbox
    assert watch.hung([sp], t + 0.1) == []
    assert sp.up and sp.long_steps == 0


def test_a_step_that_ended_in_a_server_stall_is_not_counted_past_its_limit():
    """Its last beat read said 298 s in one step (limit 300 s); the server stalls 10 s while the
    stage's step ends: measured to the tick before the stall, not to now, it is not hung."""
    watch, sp = HangWatch(TIMEOUT_S), Replica()
    assert watch.hung([sp], -0.05) == []  # the first tick only sets the horizon
    sp.liveness.beat(beat(busy=True, stalled_s=298.0), 0.0)
    assert watch.hung([sp], 0.05) == []
    assert sp.long_steps == 1  # busy in a long step: counted, not hung
    assert watch.hung([sp], 10.05) == []  # stalled 10 s; the loop moved meanwhile, beats unread
    sp.liveness.beat(beat(busy=True, stalled_s=0.1), 10.06)
    assert watch.hung([sp], 10.15) == [] and sp.long_steps == 1


def test_a_long_step_is_busy_until_its_step_timeout_then_hung():
    watch, sp = HangWatch(TIMEOUT_S), Replica(step_timeout_s=20.0)
    t = 0.0
    assert watch.hung([sp], t) == []
    while t < 19.5:  # the announcer's beats keep coming, the loop stays in one step
        t += INTERVAL_S
        sp.liveness.beat(beat(busy=True, stalled_s=t), t)
        assert watch.hung([sp], t) == []
    assert sp.long_steps == 1
    assert 19 < sp.liveness.long_step_s(t, TIMEOUT_S) <= 19.6
    while True:
        t += INTERVAL_S
        sp.liveness.beat(beat(busy=True, stalled_s=t), t)
        hung = watch.hung([sp], t)
        if hung:
            break
        assert t < 21
    assert hung[0][1].startswith("hung (its loop made no progress for 20.")
    assert hung[0][1].endswith("its stages[].step_timeout_s is 20 s)")


def test_a_replica_that_is_down_is_not_judged():
    watch, sp = HangWatch(TIMEOUT_S), Replica(up=False)
    watch.hung([sp], 0.0)
    assert watch.hung([sp], 100.0) == []


def test_an_output_from_its_loop_ends_a_long_step_and_a_late_beat_does_not_count_it_twice():
    watch, sp = HangWatch(TIMEOUT_S), Replica()
    watch.hung([sp], 0.0)
    sp.liveness.beat(beat(busy=True, stalled_s=59.9), 0.05)
    assert watch.hung([sp], 0.1) == [] and sp.long_steps == 1
    sp.liveness.moved(0.15)  # its answer came: the loop left that step
    assert sp.liveness.long_step_s(0.2, TIMEOUT_S) is None
    sp.liveness.beat(beat(busy=True, stalled_s=60.1), 0.2)  # sent before the answer, read after
    assert watch.hung([sp], 0.25) == [] and sp.long_steps == 1
    sp.liveness.beat(beat(busy=False), 0.4)
    assert sp.liveness.long_step_s(0.5, TIMEOUT_S) is None


def test_the_default_step_timeout_is_300_s_and_never_below_the_heartbeat_timeout():
    assert step_timeout_s(None, 10.0) == 300.0
    assert step_timeout_s(None, 600.0) == 600.0  # a server that waits that long for any beat
    assert step_timeout_s(20.0, 10.0) == 20.0  # configured (validated longer than 10 s)


# ---- the supervisor's real monitor on a real event loop, beats over real ZMQ ----------------------


def test_a_stalling_then_lagging_server_blames_no_healthy_stage_and_still_finds_a_stopped_one(tmp_path):
    """A stage process beats every 50 ms (a thread here, as its announcer is) over ZMQ to the
    server's inbox, read by a receive task as the orchestrator's is; the supervisor's monitor
    judges. The server's loop stalls three heartbeat timeouts, then lags 0.6 of one on every
    round (every tick late): the stage, beating all along, is never judged. Then its beats stop
    (SIGSTOP) while the lag goes on: found within the timeout and a few late ticks (the old watch,
    judging nothing on a late tick, never found it). Here the receive task drains the inbox
    before the first tick after the stall runs; the driven-clock test above covers the other
    order, where only measuring up to the previous tick saves the stage."""
    import asyncio
    import os
    import sys
    import threading
    import time

    import zmq
    import zmq.asyncio

    from omni_cache.config import load_config
    from omni_cache.config.addresses import with_default_addresses
    from omni_cache.runtime.supervision.supervisor import StageSupervisor
    from omni_cache.wire.messages import MESSAGE_TYPES
    from omni_cache.wire.transport import AsyncReceiver, Codec

    timeout_s = 0.5  # ten beats (a 1 s timeout, the lag and stall scaled with it, showed the same)
    lag_s = 0.6 * timeout_s
    config = load_config(Path(__file__).resolve().parents[1] / "stage_configs" / "tiny_omni.yaml")
    thinker = with_default_addresses(config, str(tmp_path)).stages[0]
    downs: list[str] = []

    class Events:
        def on_stage_down(self, stage: str, why: str) -> None:
            downs.append(why)

        def on_stage_up(self, stage: str) -> None:
            pass

    async def run() -> None:
        sup = StageSupervisor(Events(), heartbeat_timeout_s=timeout_s, announce_to="-")
        sup.add(thinker, [sys.executable, "-c", "import time; time.sleep(120)"], dict(os.environ), False)
        sup.launch([thinker.name])
        sp = sup.stages[thinker.name]
        codec = Codec(MESSAGE_TYPES)
        actx = zmq.asyncio.Context()
        inbox = AsyncReceiver(actx, "tcp://127.0.0.1:*", codec, bind=True)
        beating = threading.Event()
        beating.set()
        done = threading.Event()

        def stage() -> None:  # the stage's announcer thread
            ctx = zmq.Context()
            out = ctx.socket(zmq.PUSH)
            out.connect(inbox.address)
            while not done.is_set():
                if beating.is_set():
                    out.send_multipart(codec.encode(StageReady(stage=thinker.name, pid=sp.pid)))
                time.sleep(0.05)
            out.close(linger=0)
            ctx.term()

        async def receive() -> None:
            while True:
                msg, _ = await inbox.recv()
                sup.on_announcement(msg)

        thread = threading.Thread(target=stage, daemon=True)
        thread.start()
        receiver = asyncio.create_task(receive())
        try:
            await sup.wait_ready(30)
            sup.start_monitor()
            await asyncio.sleep(0.5 * timeout_s)
            time.sleep(3 * timeout_s)  # the server's loop stalls: beats queue unread
            await asyncio.sleep(0.5 * timeout_s)
            lag_until = time.monotonic() + 4 * timeout_s
            while time.monotonic() < lag_until:  # then lags steadily: every tick late
                time.sleep(lag_s)
                await asyncio.sleep(0)
            assert downs == [] and sp.up, downs
            beating.clear()  # the stage stops
            stopped = time.monotonic()
            while sp.up:
                assert time.monotonic() - stopped < timeout_s + 5 * (lag_s + 0.1), "never found stopped"
                time.sleep(lag_s)
                await asyncio.sleep(0)
            assert downs[0].startswith("stopped answering (no heartbeat for ")
        finally:
            done.set()
            receiver.cancel()
            await sup.close()
            sup.kill_all_sync()
            thread.join(5)
            inbox.close()
            actx.destroy(linger=0)

    asyncio.run(run())
