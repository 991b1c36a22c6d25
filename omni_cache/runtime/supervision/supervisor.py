"""Stage process supervision: launching stage processes, waiting until they are ready, noticing
when one exits, hangs (it went silent, or its loop stayed in one step past its
``step_timeout_s``; a shorter long step is only reported busy:
:mod:`omni_cache.runtime.supervision.hang_watch`) or (started elsewhere) closes its connection, restarting
it with back-off (a hung process is killed first), stopping them all.

:class:`StageSupervisor` owns one :class:`SupervisedReplica` per stage replica (a stage with
``replicas: N`` has N, each supervised and restarted on its own, named as
:mod:`omni_cache.config.replicas` says: ``thinker`` for a one-replica stage, ``thinker#0`` ..
otherwise) and knows nothing of requests:
it tells its owner (the orchestrator) what happened through :class:`StageEvents`
(``on_stage_down``, ``on_stage_up``), the way vLLM v1's engine core client owns its engine
processes and has a monitor report a dead one.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

import zmq

from omni_cache.config import StageConfig
from omni_cache.config.replicas import Replica, stage_replicas
from omni_cache.runtime.supervision.connection_watch import ConnectionWatch
from omni_cache.runtime.supervision.hang_watch import HangWatch, step_timeout_s
from omni_cache.runtime.supervision.process_runner import LocalRunner, ProcessRunner, StageStartError
from omni_cache.runtime.supervision.stage_identity import StageIdentity
from omni_cache.runtime.supervision.stage_stopping import kill_replicas, stop_replicas
from omni_cache.runtime.supervision.supervised_replica import SupervisedReplica
from omni_cache.tasks import wait_ended
from omni_cache.wire.messages import StageReady

logger = logging.getLogger(__name__)

#: How often stage processes are polled and deadlines checked.
POLL_INTERVAL_S = 0.1
#: How long start() waits for every StageReady (vLLM start-up plus tiny checkpoint generation).
DEFAULT_START_TIMEOUT_S = 600.0
#: Grace after Shutdown before SIGTERM, and after SIGTERM before SIGKILL.
SHUTDOWN_GRACE_S = 5.0
#: A stage that ran at least this long before dying is restarted at once; faster crashes back off.
STABLE_UPTIME_S = 60.0
MAX_RESTART_DELAY_S = 30.0


class StageEvents(Protocol):
    """What the supervisor tells its owner. Both are called on the event loop's thread, after the
    stage's :class:`SupervisedReplica` already shows the new state."""

    def on_stage_down(self, stage: str, why: str) -> None:
        """Replica ``stage`` (its stage's name when the stage has one replica, else
        ``name#index``; ``supervisor.stages[stage]`` has both) stopped serving: its process exited
        (``why``: "died (exit code 1)"), hung ("hung (its loop made no progress for 300.2 s
        while it held work; ...) and was killed") or, started elsewhere, it hung, went silent, closed
        its connection or was replaced (``why``: "(started elsewhere, pid 12 on host) closed its
        connection (its process is gone)")."""

    def on_stage_up(self, stage: str) -> None:
        """Replica ``stage`` announced itself ready (first start, after a restart, or back after
        a loss)."""


class StageSupervisor:
    """Owns the pipeline's stage processes: launches them, waits until they are ready, polls them
    (a monitor task, every :data:`POLL_INTERVAL_S`), restarts a dead one with back-off, stops them.

    Spawned stages (here or placed by Ray) are watched through their processes (exit -> down,
    restart) and their heartbeats: one that hangs (:mod:`omni_cache.runtime.supervision.hang_watch`) is
    marked down at once and its process group killed (SIGKILL reaches a stopped process too); its
    exit then restarts it. Stages started elsewhere (``external``) are watched through their
    announcements: each StageReady (sent every ``server.heartbeat_interval_s``) marks the stage
    up (as soon as our connection to it is not known to be down); one that hangs, one from a new
    incarnation, or their connection closing (:meth:`watch_connection`) means the process we knew
    is gone or stuck: it is down until it announces itself again with its loop moving. It never
    kills, restarts or stops those.
    """

    def __init__(
        self, events: StageEvents, *, heartbeat_timeout_s: float, announce_to: str, config_hash: str | None = None
    ) -> None:
        self._events = events
        #: This pipeline's hash (omni_cache.config.identity): announcements of another are refused.
        #: None: not checked (a supervisor without a pipeline, in tests).
        self._identity = StageIdentity(config_hash) if config_hash is not None else None
        self._heartbeat_timeout_s = heartbeat_timeout_s
        self._announce_to = announce_to  # the address external stages announce themselves to
        self._stages: dict[str, SupervisedReplica] = {}  # replica name -> its process
        self._by_replica: dict[tuple[str, int], str] = {}  # (stage, index) -> replica name
        self._started = False  # every stage was ready once: restarts from now on
        self._stopping = False  # shutting down: exits are expected, nothing is restarted
        self._hangs = HangWatch(heartbeat_timeout_s)
        self._monitor: asyncio.Task | None = None
        self._connections = ConnectionWatch(self._on_connection_event)  # external stages' sockets

    # ---- the stages ------------------------------------------------------------------------------

    def add(
        self,
        stage: StageConfig,
        argv: list[str] | ProcessRunner | None,
        env: dict[str, str],
        echo: bool,
        replica: Replica | None = None,
    ) -> None:
        """Supervise a replica of ``stage`` (default: replica 0): ``argv`` is its command (spawned
        here with ``env``), a :class:`ProcessRunner` that runs it elsewhere (Ray), or None when it
        is started by hand."""
        replica = replica or stage_replicas(stage)[0]
        runner: ProcessRunner | None
        if isinstance(argv, list):
            runner = LocalRunner(argv, env, replica.name)
        else:
            runner = argv
        sp = SupervisedReplica(stage, runner, echo, replica)
        sp.step_timeout_s = step_timeout_s(stage.step_timeout_s, self._heartbeat_timeout_s)
        self._stages[sp.name] = sp
        self._by_replica[(sp.stage, sp.index)] = sp.name

    @property
    def stages(self) -> Mapping[str, SupervisedReplica]:
        """Replica name -> its process, in the order they were added."""
        return self._stages

    def replicas_of(self, stage: str) -> list[SupervisedReplica]:
        """The replicas of ``stage``, by index."""
        return sorted((sp for sp in self._stages.values() if sp.stage == stage), key=lambda sp: sp.index)

    def replica(self, stage: str, index: int) -> SupervisedReplica | None:
        name = self._by_replica.get((stage, index))
        return self._stages.get(name) if name is not None else None

    def up_replicas(self, stage: str) -> list[int]:
        """The indices of the replicas of ``stage`` that are up."""
        return [sp.index for sp in self.replicas_of(stage) if sp.up]

    def is_up(self, stage: str) -> bool:
        """Whether any replica of ``stage`` is up (it can take requests)."""
        return any(sp.up for sp in self._stages.values() if sp.stage == stage)

    def launch(self, names: Iterable[str]) -> None:
        """Start the processes of these replicas (those started elsewhere are skipped)."""
        for name in names:
            sp = self._stages[name]
            if not sp.external:
                sp.launch()

    def alive(self) -> list[str]:
        """The replicas whose process is running."""
        return [sp.name for sp in self._stages.values() if sp.alive()]

    def not_ready(self, stage_names: Iterable[str], *, entry: str, starting: bool) -> dict[str, str]:
        """stage -> why it is not serving: the stages none of whose replicas is up; while
        ``starting`` (the server takes requests once every replica was ready), also those with a
        replica not up yet, and the entry stage while the server itself is still starting. A stage
        with several replicas: each one's reason that is down, ``thinker#1: starting; ...``."""
        out: dict[str, str] = {}
        for name in stage_names:
            replicas = self.replicas_of(name)
            down = [sp for sp in replicas if not sp.up]
            if not replicas:
                out[name] = "not started"
            elif len(down) == len(replicas) or (down and starting):
                out[name] = (
                    down[0].why_down()
                    if len(replicas) == 1
                    else "; ".join(f"{sp.name}: {sp.why_down()}" for sp in down)
                )
            elif name == entry and starting:
                # Stages started elsewhere can be up before the server loaded its tokenizer.
                out[name] = "up; the server is still starting (loading the tokenizer)"
        return out

    def long_steps(self) -> dict[str, float]:
        """replica name -> seconds its loop has been inside one step, for each replica that is up
        and busy in a step past the heartbeat timeout (its heartbeats come: not hung until
        ``stages[].step_timeout_s``)."""
        now = time.monotonic()
        out = {}
        for sp in self._stages.values():
            step = sp.liveness.long_step_s(now, self._heartbeat_timeout_s) if sp.up else None
            if step is not None:
                out[sp.name] = step
        return out

    def replicas_not_ready(self) -> dict[str, str]:
        """replica name -> why it is not serving, for every replica that is not up, also where
        another replica of its stage serves."""
        return {sp.name: sp.why_down() for sp in self._stages.values() if not sp.up}

    def pids(self) -> dict[str, int | None]:
        """replica name -> pid of its running process (None while it is down); a Ray-placed
        replica's pid is on its own node."""
        return {n: (sp.pid if sp.running else None) for n, sp in self._stages.items()}

    # ---- readiness -------------------------------------------------------------------------------

    async def wait_ready(self, timeout: float) -> None:
        """Wait until every stage announced itself; then restarts begin. Raises
        :class:`StageStartError` naming the stage that exited first or is not ready in time."""
        deadline = time.monotonic() + timeout
        while True:
            pending = [sp for sp in self._stages.values() if not sp.up]
            if not pending:
                self._started = True
                return
            for sp in pending:
                if not sp.ever_ready and not sp.external and sp.last_exit is not None:
                    raise StageStartError(
                        f"stage {sp.name!r} exited before it was ready ({sp.last_exit_words}); "
                        f"command: {' '.join(sp.argv or [])}\nlast lines of its output:\n" + sp.log_tail()
                    )
            if time.monotonic() >= deadline:
                parts = []
                for sp in pending:
                    if sp.external and sp.announced:
                        state = (
                            f"started elsewhere, pid {sp.pid} on {sp.host or '?'}: announced "
                            f"itself, but the connection to {sp.address} never came up"
                        )
                    elif sp.external:
                        state = f"started elsewhere, never announced itself to {self._announce_to}"
                    else:
                        code = sp.poll() if sp.running else sp.last_exit
                        state = f"pid {sp.pid} " + (
                            sp.runner.describe_exit(code)
                            if sp.runner is not None and code is not None
                            else "still running"
                        )
                    parts.append(f"stage {sp.name!r} ({state}); last lines of its output:\n" + sp.log_tail())
                raise StageStartError(
                    f"stage(s) {', '.join(repr(sp.name) for sp in pending)} not ready after "
                    f"{timeout:g} s:\n" + "\n".join(parts)
                )
            await asyncio.sleep(0.05)

    def on_announcement(self, msg: StageReady) -> None:
        """A StageReady (first announcement or heartbeat)."""
        sp = self.replica(msg.stage, msg.replica)
        if sp is None:
            logger.warning(
                "StageReady from unknown stage %r replica %d (pid %d), ignored", msg.stage, msg.replica, msg.pid
            )
            return
        refusal = self._identity.refusal(sp.name, msg) if self._identity is not None else None
        if refusal is not None:  # another protocol or pipeline: never up (logged; /health says why)
            if sp.external and not sp.up:
                sp.pid, sp.host, sp.lost_reason = msg.pid, msg.host, f"refused: it {refusal}"
            return
        if sp.external:
            self._on_external_announcement(sp, msg)
            return
        # A spawned stage's heartbeats confirm what its process handle says, and whether its
        # loop moves.
        if msg.pid in sp.old_pids or not sp.running or sp.hung:
            logger.debug("stage %s: StageReady from pid %d that is not its current process, ignored", sp.name, msg.pid)
            return
        sp.liveness.beat(msg, time.monotonic())
        if msg.max_model_len:
            sp.max_model_len = msg.max_model_len
        if not sp.up:
            sp.up = True
            sp.ever_ready = True
            logger.info(
                "stage %s: ready (pid %d%s)",
                sp.name,
                msg.pid,
                f", max_model_len {msg.max_model_len}" if msg.max_model_len else "",
            )
            self._events.on_stage_up(sp.name)

    def _on_external_announcement(self, sp: SupervisedReplica, msg: StageReady) -> None:
        now = time.monotonic()
        if sp.incarnation and msg.incarnation != sp.incarnation:
            if sp.up:  # restarted faster than the heartbeat timeout: the old process is gone
                self._stage_lost(sp, f"was replaced by a new process (pid {msg.pid} on {msg.host or '?'})")
            sp.restarts += 1
        elif sp.up:
            sp.liveness.beat(msg, now)
            return
        sp.incarnation = msg.incarnation
        sp.pid = msg.pid
        sp.host = msg.host
        sp.liveness.beat(msg, now)
        stuck = sp.liveness.hang(now, self._heartbeat_timeout_s, sp.step_timeout_s)
        if stuck is not None:
            # Alive, but its loop is still stuck: down until it moves again.
            sp.lost_reason = stuck
            return
        sp.lost_reason = None
        if msg.max_model_len:
            sp.max_model_len = msg.max_model_len
        sp.announced = True
        if sp.connection_down:
            logger.debug("stage %s: announced itself; up once the connection to %s is", sp.name, sp.address)
            return
        self._external_up(sp)

    def _external_up(self, sp: SupervisedReplica) -> None:
        sp.up = True
        sp.ever_ready = True
        logger.info(
            "stage %s: ready (started elsewhere: pid %d on %s%s)",
            sp.name,
            sp.pid,
            sp.host or "?",
            f", max_model_len {sp.max_model_len}" if sp.max_model_len else "",
        )
        self._events.on_stage_up(sp.name)

    def heard_from(self, name: str) -> None:
        """Any message from a stage says it is alive, not only its heartbeats, and (its loop sends
        all but those) that its loop moved. ``name``: a stage's name; only a one-replica stage is
        found by it."""
        sp = self._stages.get(name)
        if sp is not None and sp.up:
            sp.liveness.moved(time.monotonic())

    # ---- watching --------------------------------------------------------------------------------

    def start_monitor(self) -> None:
        """Start the monitor task (on the running loop): exits, restarts, silent external stages."""
        self._monitor = asyncio.create_task(self._monitor_loop(), name="omni-cache-supervise")

    def watch_connection(self, name: str, socket: Any) -> None:
        """Watch ``socket``, the connection to external stage ``name`` (it replaces the one watched
        before): when the stage's process dies, its host's kernel closes the TCP connection at once
        (ZMQ reports EVENT_DISCONNECTED), much sooner than the heartbeat timeout, which stays the
        net for hosts that vanish without closing anything.

        A stage is up only while this connection is not known to be down: a stage that announced
        itself before our (re)connect to it succeeded, then died, would otherwise never close a
        connection and stay "up" until the heartbeat timeout. The state starts unknown (taken as
        up): events from before the monitor existed are lost, and a failed connect is retried
        (and reported) every 100 ms."""
        sp = self._stages.get(name)
        if sp is not None:
            sp.connection_down = False
        self._connections.watch(name, socket)

    def _on_connection_event(self, name: str, event: int) -> None:
        sp = self._stages.get(name)
        if sp is None or self._stopping:
            return
        if event == zmq.EVENT_CONNECTED:
            sp.connection_down = False
            fresh = time.monotonic() - sp.liveness.last_seen <= self._heartbeat_timeout_s
            if sp.announced and not sp.up and fresh:
                self._external_up(sp)
            return
        sp.connection_down = True  # EVENT_CONNECT_RETRIED (refused) or EVENT_DISCONNECTED
        if event == zmq.EVENT_DISCONNECTED and sp.up:
            self._stage_lost(sp, "closed its connection (its process is gone)")

    def unwatch_connection(self, name: str) -> None:
        self._connections.unwatch(name)

    async def _monitor_loop(self) -> None:
        while True:
            await asyncio.sleep(POLL_INTERVAL_S)
            try:
                self.poll()
            except Exception:  # noqa: BLE001
                logger.exception("supervisor: monitoring step failed")

    def poll(self) -> None:
        """One monitoring step: hung stages, exited processes, due restarts."""
        now = time.monotonic()
        if self._started and not self._stopping:
            self._watch_heartbeats(now)
        for sp in self._stages.values():
            if sp.running:
                code = sp.poll()
                if code is not None and not self._stopping:
                    self._on_stage_exit(sp, code)
            elif sp.restart_at is not None and now >= sp.restart_at and self._started and not self._stopping:
                sp.restarts += 1
                sp.tail.append(f"--- restart {sp.restarts} ---")
                try:
                    sp.launch()
                except OSError as e:
                    logger.error("stage %s: restart failed: %s", sp.name, e)
                    sp.restart_at = now + MAX_RESTART_DELAY_S

    def _watch_heartbeats(self, now: float) -> None:
        for sp, why in self._hangs.hung(self._stages.values(), now):
            sp.hangs += 1
            if sp.external:
                self._stage_lost(sp, why)
            else:
                self._kill_hung(sp, why)

    def _kill_hung(self, sp: SupervisedReplica, why: str) -> None:
        """A spawned replica hangs: down now (its requests end or move at once), then its process
        group is killed; its exit (:meth:`_on_stage_exit`) restarts it."""
        sp.up = False
        sp.hung = why
        logger.error(
            "stage %s (pid %s) %s: killing its process group; last lines of its output:\n%s",
            sp.name,
            sp.pid,
            why,
            sp.log_tail(10),
        )
        self._events.on_stage_down(sp.name, f"{why} and was killed")
        sp.signal_group(signal.SIGKILL)

    def _stage_lost(self, sp: SupervisedReplica, why: str) -> None:
        """An external stage's process is gone or stuck: it is down until it announces itself
        again (with its loop moving)."""
        sp.up = False
        sp.announced = False
        sp.lost_reason = why
        where = f"pid {sp.pid} on {sp.host or '?'}"
        logger.error("stage %s (started elsewhere, %s) %s", sp.name, where, why)
        self._events.on_stage_down(sp.name, f"(started elsewhere, {where}) {why}")

    def _on_stage_exit(self, sp: SupervisedReplica, code: int) -> None:
        now = time.monotonic()
        uptime = now - sp.started_at
        if sp.pid is not None:
            sp.old_pids.add(sp.pid)
        sp.running = False
        sp.up = False
        sp.last_exit = code
        assert sp.runner is not None
        what = sp.last_exit_words = sp.runner.describe_exit(code)
        hung, sp.hung = sp.hung, None
        if hung is not None:
            what = sp.last_exit_words = f"{what} after it {hung}"
        logger.error(
            "stage %s (pid %s) %s after %.1f s; last lines of its output:\n%s",
            sp.name,
            sp.pid,
            what,
            uptime,
            sp.log_tail(10),
        )
        sp.signal_group(signal.SIGKILL)  # helpers it may have left behind
        if hung is None:  # a hung one was reported down when it was found
            self._events.on_stage_down(sp.name, f"died ({what})")
        if not self._started:
            return  # wait_ready() reports it
        if uptime >= STABLE_UPTIME_S and sp.ever_ready:
            sp.crashes_in_a_row = 0
        delay = 0.0 if sp.crashes_in_a_row == 0 else min(MAX_RESTART_DELAY_S, 2.0 ** (sp.crashes_in_a_row - 1))
        sp.crashes_in_a_row += 1
        sp.restart_at = now + delay
        logger.warning("stage %s: restarting%s", sp.name, f" in {delay:g} s" if delay else "")

    # ---- stopping --------------------------------------------------------------------------------

    def begin_stop(self) -> None:
        """From now on exits are expected: nothing is reported down or restarted."""
        self._stopping = True

    def stop_processes(self, grace: float) -> None:
        """Blocking: wait ``grace`` for the stages to exit, then SIGTERM, then SIGKILL
        (:mod:`omni_cache.runtime.supervision.stage_stopping`)."""
        self._stopping = True
        stop_replicas(self._stages.values(), grace)

    async def close(self) -> None:
        """Cancel the monitor and the connection watchers (after :meth:`stop_processes`)."""
        self._stopping = True
        tasks = self._connections.stop()
        if self._monitor is not None:
            self._monitor.cancel()
            tasks.append(self._monitor)
        self._monitor = None
        await wait_ended(tasks)  # their own cancellation expected; the caller's is raised

    def kill_all_sync(self, grace: float = 3.0) -> None:
        """Last resort when the event loop is gone (atexit, a crashed server): SIGTERM every stage
        process group, then SIGKILL after ``grace``."""
        kill_replicas(self._stages.values(), grace)
