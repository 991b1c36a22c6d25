"""One stage replica as the supervisor sees it: its process (or, started elsewhere, only its
announcements), whether it is up, its restarts and the tail of its output. Written by the
supervisor (:mod:`omni_cache.runtime.supervision.supervisor`) only; read-only for everyone else."""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections import deque

from omni_cache.config import StageConfig
from omni_cache.config.replicas import Replica, stage_replicas
from omni_cache.runtime.supervision.hang_watch import DEFAULT_STEP_TIMEOUT_S, Liveness
from omni_cache.runtime.supervision.process_runner import ProcessRunner, exit_words

logger = logging.getLogger(__name__)

#: Lines of each stage's output kept for error messages.
LOG_TAIL_LINES = 40


class SupervisedReplica:
    """One stage replica's OS process (or, for an external stage, just its readiness), as the
    supervisor sees it; read-only for everyone else. ``runner`` runs the process (None: started
    elsewhere, by hand)."""

    def __init__(
        self, stage: StageConfig, runner: ProcessRunner | None, echo: bool, replica: Replica | None = None
    ) -> None:
        replica = replica or stage_replicas(stage)[0]
        self.name = replica.name  # the stage's name when it has one replica
        self.stage = stage.name
        self.index = replica.index
        self.address = replica.address
        self.runner = runner
        self.argv = runner.argv if runner is not None else None
        self.echo = echo
        #: Launched and its exit not handled yet.
        self.running = False
        self.tail: deque[str] = deque(maxlen=LOG_TAIL_LINES)
        self.up = False
        self.ever_ready = False
        self._pid: int | None = None  # a stage started elsewhere: the pid it announced
        self.max_model_len: int | None = None
        self.restarts = 0
        self.crashes_in_a_row = 0
        self.started_at = 0.0
        self.last_exit: int | None = None
        self.last_exit_words = ""
        self.restart_at: float | None = None
        self.old_pids: set[int] = set()  # previous incarnations (their late messages are stale)
        #: What its heartbeats said last: when, and whether its loop moves (hang_watch.py).
        self.liveness = Liveness()
        #: Times it was found hung (its loop stuck while working, or silent) and marked down.
        self.hangs = 0
        #: How long one step of its loop may last before it is hung (``stages[].step_timeout_s``;
        #: the supervisor fills in the default, which depends on the heartbeat timeout).
        self.step_timeout_s = stage.step_timeout_s or DEFAULT_STEP_TIMEOUT_S
        #: Steps it was seen in past the heartbeat timeout (busy, heartbeats coming), each once.
        self.long_steps = 0
        #: Why its current process was killed as hung (until that process's exit is handled).
        self.hung: str | None = None
        # Stages started elsewhere: who announced itself last, and why it is down.
        self.incarnation = ""
        self.host = ""
        self.lost_reason: str | None = None
        self.announced = False  # announced itself since it was last lost
        # Our connection to it failed or closed (and has not connected since): an announcement
        # alone does not make it up, or a death before we connect would go unnoticed.
        self.connection_down = False

    @property
    def external(self) -> bool:
        return self.runner is None

    @property
    def pid(self) -> int | None:
        """The pid of its (current or last) process, on the host it runs on."""
        return self.runner.pid if self.runner is not None else self._pid

    @pid.setter
    def pid(self, value: int | None) -> None:
        assert self.runner is None, "a spawned replica's pid is its runner's"
        self._pid = value

    def launch(self) -> None:
        assert self.runner is not None
        self.up = False
        self.last_exit = None
        self.restart_at = None
        self.started_at = time.monotonic()
        self.runner.start(self._on_line)
        self.running = True
        logger.info(
            "stage %s: started%s: %s",
            self.name,
            f" pid {self.pid}" if self.pid is not None else "",
            " ".join(self.runner.argv),
        )

    def _on_line(self, line: str) -> None:
        self.tail.append(line)
        if self.echo:
            with contextlib.suppress(Exception):
                sys.stderr.write(f"({self.name} pid={self.runner.pid if self.runner else '?'}) " + line + "\n")
                sys.stderr.flush()

    def poll(self) -> int | None:
        """The exit code of the launched process once it is gone (None: running, or not launched)."""
        if not self.running or self.runner is None:
            return None
        return self.runner.poll()

    def log_tail(self, n: int = 20) -> str:
        lines = list(self.tail)[-n:]
        return "\n".join("    " + line for line in lines) if lines else "    (no output)"

    def signal_group(self, sig: int) -> None:
        if self.runner is not None:
            self.runner.signal(sig)

    def alive(self) -> bool:
        return self.running and self.runner is not None and self.runner.poll() is None

    def why_down(self) -> str:
        """Why this stage is not serving (for /health and 503 messages); call it when not up."""
        if self.external and self.lost_reason:
            return (
                f"started elsewhere (last pid {self.pid} on {self.host or '?'}), "
                f"{self.lost_reason}; waiting for it to announce itself again"
            )
        if self.external and self.announced:
            return (
                f"started elsewhere (pid {self.pid} on {self.host or '?'}), announced itself; "
                f"waiting for the connection to {self.address}"
            )
        if self.external:
            return "started elsewhere, waiting for it to announce itself"
        if self.hung:
            return f"{self.hung}; killed, waiting for its process to exit"
        if self.running and self.restarts and self.last_exit_words:
            return f"restarting (its last process: {self.last_exit_words})"
        if self.running:
            return "restarting" if self.restarts else "starting"
        if self.last_exit is not None:
            when = ""
            if self.restart_at is not None:
                when = f"; restart in {max(0.0, self.restart_at - time.monotonic()):.1f} s"
            return f"down ({self.last_exit_words or exit_words(self.last_exit)}{when})"
        return "down"
