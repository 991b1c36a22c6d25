"""Stage process supervision: launching stage processes, waiting until they are ready, noticing
when one exits, restarting it with back-off, stopping them all.

:class:`StageSupervision` is the orchestrator's supervision half (the orchestrator keeps request
routing); its methods work on the orchestrator's ``_stages`` (name -> :class:`_StageProcess`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from typing import Any

import zmq
import zmq.utils.monitor
from omni_cache.config import StageConfig
from omni_cache.wire.messages import StageReady

logger = logging.getLogger("omni_cache.runtime.orchestrator")

#: How often stage processes are polled and deadlines checked.
POLL_INTERVAL_S = 0.1
#: How long start() waits for every StageReady (vLLM start-up plus tiny checkpoint generation).
DEFAULT_START_TIMEOUT_S = 600.0
#: Grace after Shutdown before SIGTERM, and after SIGTERM before SIGKILL.
SHUTDOWN_GRACE_S = 5.0
#: Lines of each stage's output kept for error messages.
LOG_TAIL_LINES = 40
#: A stage that ran at least this long before dying is restarted at once; faster crashes back off.
STABLE_UPTIME_S = 60.0
MAX_RESTART_DELAY_S = 30.0


def default_stage_argv() -> list[str]:
    """The command a stage process runs, before its ``--stage-config ...`` arguments."""
    return [sys.executable, "-m", "workers"]


class StageStartError(RuntimeError):
    """A stage process did not come up (exited, or no StageReady in time)."""


def _exit_words(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class _StageProcess:
    """One stage's OS process (or, for an external stage, just its readiness)."""

    def __init__(self, stage: StageConfig, argv: list[str] | None, env: dict[str, str],
                 echo: bool) -> None:
        self.name = stage.name
        self.argv = argv  # None: started elsewhere (external)
        self.env = env
        self.echo = echo
        self.proc: subprocess.Popen[bytes] | None = None
        self.tail: deque[str] = deque(maxlen=LOG_TAIL_LINES)
        self.up = False
        self.ever_ready = False
        self.pid: int | None = None
        self.max_model_len: int | None = None
        self.restarts = 0
        self.crashes_in_a_row = 0
        self.started_at = 0.0
        self.last_exit: int | None = None
        self.restart_at: float | None = None
        self.old_pids: set[int] = set()  # previous incarnations (their late messages are stale)
        self._reader: threading.Thread | None = None
        # Stages started elsewhere: who announced itself last, when, and why it is down.
        self.incarnation = ""
        self.host = ""
        self.last_seen = 0.0
        self.lost_reason: str | None = None

    @property
    def external(self) -> bool:
        return self.argv is None

    def launch(self) -> None:
        assert self.argv is not None
        self.up = False
        self.last_exit = None
        self.restart_at = None
        self.started_at = time.monotonic()
        self.proc = subprocess.Popen(
            self.argv,
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # own process group: signals reach vLLM's helpers too
        )
        self.pid = self.proc.pid
        logger.info("stage %s: started pid %d: %s", self.name, self.proc.pid, " ".join(self.argv))
        self._reader = threading.Thread(
            target=self._read_output, args=(self.proc,), name=f"omni-cache-log-{self.name}",
            daemon=True,
        )
        self._reader.start()

    def _read_output(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        prefix = f"({self.name} pid={proc.pid}) "
        with contextlib.suppress(Exception):
            for raw in proc.stdout:
                line = raw.decode("utf-8", errors="replace").rstrip("\n")
                self.tail.append(line)
                if self.echo:
                    with contextlib.suppress(Exception):
                        sys.stderr.write(prefix + line + "\n")
                        sys.stderr.flush()
        with contextlib.suppress(Exception):
            proc.stdout.close()

    def log_tail(self, n: int = 20) -> str:
        lines = list(self.tail)[-n:]
        return "\n".join("    " + line for line in lines) if lines else "    (no output)"

    def signal_group(self, sig: int) -> None:
        if self.pid is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, sig)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class StageSupervision:
    """The orchestrator's supervision of its stage processes (a mixin of :class:`Orchestrator`).

    Spawned stages are watched through their processes (exit -> fail their requests, restart).
    Stages started elsewhere (``external``) are watched through their announcements: each
    StageReady (sent every ``server.heartbeat_interval_s``) marks the stage up; one more than
    ``server.heartbeat_timeout_s`` late, or one from a new incarnation, means the process we knew
    is gone: its in-flight requests fail at once (503) and it is down until it announces again.
    """

    #: When the supervision loop last judged the external stages' silence.
    _last_tick = 0.0

    def _on_announcement(self, msg: StageReady) -> None:
        sp = self._stages.get(msg.stage)
        if sp is None:
            logger.warning("StageReady from unknown stage %r (pid %d), ignored", msg.stage, msg.pid)
            return
        if sp.external:
            self._on_external_announcement(sp, msg)
            return
        # A spawned stage's heartbeats only confirm what its process handle says.
        if msg.pid in sp.old_pids or sp.proc is None:
            logger.debug("stage %s: StageReady from pid %d that is not its current process, ignored",
                         sp.name, msg.pid)
            return
        sp.last_seen = time.monotonic()
        if msg.max_model_len:
            sp.max_model_len = msg.max_model_len
        if not sp.up:
            sp.up = True
            sp.ever_ready = True
            logger.info("stage %s: ready (pid %d%s)", sp.name, msg.pid,
                        f", max_model_len {msg.max_model_len}" if msg.max_model_len else "")

    def _on_external_announcement(self, sp: _StageProcess, msg: StageReady) -> None:
        now = time.monotonic()
        if sp.incarnation and msg.incarnation != sp.incarnation:
            if sp.up:  # restarted faster than the heartbeat timeout: the old process is gone
                self._stage_lost(sp, f"was replaced by a new process (pid {msg.pid} on {msg.host or '?'})")
            sp.restarts += 1
        elif sp.up:
            sp.last_seen = now
            return
        sp.incarnation = msg.incarnation
        sp.pid = msg.pid
        sp.host = msg.host
        sp.last_seen = now
        sp.lost_reason = None
        if msg.max_model_len:
            sp.max_model_len = msg.max_model_len
        sp.up = True
        sp.ever_ready = True
        logger.info("stage %s: ready (started elsewhere: pid %d on %s%s)", sp.name, msg.pid,
                    msg.host or "?", f", max_model_len {msg.max_model_len}" if msg.max_model_len else "")

    def _heard_from(self, name: str) -> None:
        sp = self._stages.get(name)
        if sp is not None and sp.up:
            sp.last_seen = time.monotonic()

    def _watch_connection(self, name: str, sender: Any) -> None:
        """Watch the connection to an external stage: when its process dies, its host's kernel
        closes the TCP connection at once (ZMQ reports EVENT_DISCONNECTED), much sooner than the
        heartbeat timeout, which stays the net for hosts that vanish without closing anything."""
        mon = sender.socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)

        async def watch() -> None:
            try:
                while True:
                    frames = await mon.recv_multipart()
                    event = zmq.utils.monitor.parse_monitor_message(frames)["event"]
                    sp = self._stages.get(name)
                    if (event == zmq.EVENT_DISCONNECTED and sp is not None and sp.up
                            and self._senders.get(name) is sender and not self._closing):
                        self._stage_lost(sp, "closed its connection (its process is gone)")
            except (asyncio.CancelledError, zmq.ZMQError):
                pass
            finally:
                with contextlib.suppress(Exception):
                    sender.socket.disable_monitor()
                mon.close(linger=0)

        task = asyncio.ensure_future(watch())
        self._connection_watchers[name] = task
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _watch_external(self, now: float) -> None:
        # A stalled event loop (a long tokenization, a burst of outputs) has not read the
        # announcements waiting in its inbox yet: judge silence only on a punctual tick.
        late = now - self._last_tick > 5 * POLL_INTERVAL_S
        self._last_tick = now
        if late:
            return
        timeout = self.config.server.heartbeat_timeout_s
        for sp in self._stages.values():
            if sp.external and sp.up and now - sp.last_seen > timeout:
                self._stage_lost(sp, f"stopped answering (no heartbeat for {now - sp.last_seen:.1f} s, "
                                     f"server.heartbeat_timeout_s is {timeout:g} s)")

    def _stage_lost(self, sp: _StageProcess, why: str) -> None:
        """An external stage's process is gone: fail what it was serving, drop what was queued
        for it, and wait for it to announce itself again."""
        sp.up = False
        sp.lost_reason = why
        where = f"pid {sp.pid} on {sp.host or '?'}"
        logger.error("stage %s (started elsewhere, %s) %s", sp.name, where, why)
        self._reset_sender(sp.name)
        for req in list(self._requests.values()):
            if sp.name in req.participants and sp.name not in req.finished:
                self._fail(req, 503, f"stage {sp.name!r} (started elsewhere, {where}) {why} while "
                                     "serving this request; retry when it is back", stage=sp.name)

    def _stage_command(self, stage: StageConfig) -> list[str]:
        assert self._config_path is not None
        argv = [
            *self._stage_argv,
            "--stage-config", self._config_path,
            "--stage", stage.name,
            # bound to 0.0.0.0 (control_bind_address): spawned stages use the advertised address
            "--orchestrator", self.control_address if self._control_bind else self._inbox.address,
            "--parent-pid", str(os.getpid()),
        ]
        if self._checkpoint_dir:
            argv += ["--checkpoint-dir", self._checkpoint_dir]
        if not self._prefix_cache:
            argv.append("--no-prefix-cache")
        return argv

    async def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            pending = [sp for sp in self._stages.values() if not sp.up]
            if not pending:
                return
            for sp in pending:
                if not sp.ever_ready and not sp.external and sp.last_exit is not None:
                    raise StageStartError(
                        f"stage {sp.name!r} exited before it was ready ({_exit_words(sp.last_exit)}); "
                        f"command: {' '.join(sp.argv or [])}\nlast lines of its output:\n"
                        + sp.log_tail()
                    )
            if time.monotonic() >= deadline:
                parts = []
                for sp in pending:
                    if sp.external:
                        state = f"started elsewhere, never announced itself to {self.control_address}"
                    else:
                        state = f"pid {sp.pid} {_exit_words(sp.proc.poll() if sp.proc else sp.last_exit)}"
                    parts.append(f"stage {sp.name!r} ({state}); last lines of its output:\n"
                                 + sp.log_tail())
                raise StageStartError(
                    f"stage(s) {', '.join(repr(sp.name) for sp in pending)} not ready after "
                    f"{timeout:g} s:\n" + "\n".join(parts)
                )
            await asyncio.sleep(0.05)

    def _stop_processes(self, grace: float) -> None:
        """Blocking: wait ``grace`` for the stages to exit, then SIGTERM, then SIGKILL."""
        procs = [sp for sp in self._stages.values() if sp.proc is not None]
        end = time.monotonic() + grace
        while time.monotonic() < end and any(sp.proc.poll() is None for sp in procs):  # type: ignore[union-attr]
            time.sleep(0.05)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            running = [sp for sp in procs if sp.proc.poll() is None]  # type: ignore[union-attr]
            if not running:
                break
            logger.info("stopping stage(s) %s with %s", ", ".join(sp.name for sp in running), sig.name)
            for sp in running:
                sp.signal_group(sig)
            end = time.monotonic() + grace
            while time.monotonic() < end and any(sp.proc.poll() is None for sp in running):  # type: ignore[union-attr]
                time.sleep(0.05)
        for sp in procs:
            # Leftovers in the stage's process group (helpers of a stage that already exited).
            sp.signal_group(signal.SIGKILL)
            with contextlib.suppress(Exception):
                sp.proc.wait(timeout=1.0)  # type: ignore[union-attr]
            sp.up = False

    def kill_all_sync(self, grace: float = 3.0) -> None:
        """Last resort when the event loop is gone (atexit, a crashed server): SIGTERM every stage
        process group, then SIGKILL after ``grace``."""
        procs = [sp for sp in self._stages.values() if sp.alive()]
        for sp in procs:
            sp.signal_group(signal.SIGTERM)
        end = time.monotonic() + grace
        while time.monotonic() < end and any(sp.alive() for sp in procs):
            time.sleep(0.05)
        for sp in procs:
            sp.signal_group(signal.SIGKILL)
            with contextlib.suppress(Exception):
                sp.proc.wait(timeout=1.0)  # type: ignore[union-attr]

    async def _supervise_loop(self) -> None:
        while True:
            await asyncio.sleep(POLL_INTERVAL_S)
            try:
                self._supervise_once()
            except Exception:  # noqa: BLE001
                logger.exception("orchestrator: supervision step failed")

    def _supervise_once(self) -> None:
        now = time.monotonic()
        if self._started and not self._closing:
            self._watch_external(now)
        for sp in self._stages.values():
            if sp.proc is not None:
                code = sp.proc.poll()
                if code is not None and not self._closing:
                    self._on_stage_exit(sp, code)
            elif (sp.restart_at is not None and now >= sp.restart_at and self._started
                  and not self._closing):
                sp.restarts += 1
                sp.tail.append(f"--- restart {sp.restarts} ---")
                try:
                    sp.launch()
                except OSError as e:
                    logger.error("stage %s: restart failed: %s", sp.name, e)
                    sp.restart_at = now + MAX_RESTART_DELAY_S
        for req in list(self._requests.values()):
            if now >= req.deadline:
                waiting = [p for p in req.participants if p not in req.finished]
                self._fail(
                    req, 504,
                    f"request timed out after {req.timeout_s:g} s (server.request_timeout_s); "
                    f"still waiting for stage(s): {', '.join(waiting)}",
                    stage=waiting[0] if waiting else None,
                )

    def _on_stage_exit(self, sp: _StageProcess, code: int) -> None:
        now = time.monotonic()
        uptime = now - sp.started_at
        if sp.proc is not None:
            sp.old_pids.add(sp.proc.pid)
        sp.proc = None
        sp.up = False
        sp.last_exit = code
        what = _exit_words(code)
        logger.error("stage %s (pid %s) %s after %.1f s; last lines of its output:\n%s",
                     sp.name, sp.pid, what, uptime, sp.log_tail(10))
        sp.signal_group(signal.SIGKILL)  # helpers it may have left behind
        self._reset_sender(sp.name)
        for req in list(self._requests.values()):
            if sp.name in req.participants and sp.name not in req.finished:
                self._fail(
                    req, 503,
                    f"stage {sp.name!r} died ({what}) while serving this request; it is being "
                    "restarted, retry shortly",
                    stage=sp.name,
                )
        if not self._started:
            return  # start() reports it
        if uptime >= STABLE_UPTIME_S and sp.ever_ready:
            sp.crashes_in_a_row = 0
        delay = 0.0 if sp.crashes_in_a_row == 0 else min(MAX_RESTART_DELAY_S, 2.0 ** (sp.crashes_in_a_row - 1))
        sp.crashes_in_a_row += 1
        sp.restart_at = now + delay
        logger.warning("stage %s: restarting%s", sp.name, f" in {delay:g} s" if delay else "")

    def not_ready(self) -> dict[str, str]:
        """stage -> why it is not serving, for every stage that is not up."""
        out: dict[str, str] = {}
        for name in self.stage_names:
            sp = self._stages.get(name)
            if sp is None:
                out[name] = "not started"
            elif sp.up and name == self.entry.name and not self._started:
                # Stages started elsewhere can be up before the server loaded its tokenizer.
                out[name] = "up; the server is still starting (loading the tokenizer)"
            elif sp.up:
                continue
            elif sp.external and sp.lost_reason:
                out[name] = (f"started elsewhere (last pid {sp.pid} on {sp.host or '?'}), "
                             f"{sp.lost_reason}; waiting for it to announce itself again")
            elif sp.external:
                out[name] = "started elsewhere, waiting for it to announce itself"
            elif sp.proc is not None:
                out[name] = "restarting" if sp.restarts else "starting"
            elif sp.last_exit is not None:
                when = ""
                if sp.restart_at is not None:
                    when = f"; restart in {max(0.0, sp.restart_at - time.monotonic()):.1f} s"
                out[name] = f"down ({_exit_words(sp.last_exit)}{when})"
            else:
                out[name] = "down"
        return out

    def stage_pids(self) -> dict[str, int | None]:
        """stage -> pid of its running process (None while it is down)."""
        return {n: (sp.proc.pid if sp.proc is not None else None) for n, sp in self._stages.items()}
