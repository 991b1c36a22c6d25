"""Whether a stage replica is stopped, busy in a long step, or hung, judged from its heartbeats.

Every StageReady a stage sends (``server.heartbeat_interval_s``, from a thread of its own:
workers/announcer.py) says, besides that its process is alive, whether its loop was working at
its last progress stamp (``busy``) and how long ago that stamp was (``stalled_s``;
workers/loop_progress.py). Two limits judge a replica that is up:

* **Silence** (``server.heartbeat_timeout_s``): nothing came from it for that long. The whole
  process stopped (SIGSTOP, a paused VM, a host gone) or cannot be reached: it is hung.
* **One long step** (``stages[].step_timeout_s``, much longer): its heartbeats keep coming while
  its loop stays inside one step (a first-use torch.compile, a huge prefill chunk, a contended
  CPU). Past ``heartbeat_timeout_s`` it is *busy in a long step*: reported (/health, metrics:
  each such step counted once), not judged. Past ``step_timeout_s`` it is hung: a loop wedged in
  a call, a deadlock, a send nobody takes.

A loop that waits for input while it holds nothing is never judged, however long it waits; a
long job made of many steps (a big prompt's chunked prefill) stamps once per step. The progress
stamp is taken on the stage's clock and carried as an age, so the stage's and the server's
clocks need not agree.

**Judged on what the server could have read.** The watch runs on the server's event loop, as the
receive loop that reads the beats does. When that loop stalls (a long tokenization, a burst of
outputs), beats wait unread in the inbox, and measuring silence up to *now* would blame the
stage for the server's own stall. So every judgment measures silence and step lengths up to
the *previous* monitoring tick, the horizon: every beat that reached the inbox before it has
been read by now, because the loop ran in between and the receive loop, once woken, drains its
inbox before the next tick's wake-up runs (a wake-up queued earlier runs first). A server stall
of any length therefore never makes a healthy stage look silent, and a loop that lags steadily
(every tick late) still judges on every tick: a stopped stage is found one tick interval after
its silence passed the timeout.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from omni_cache.wire.messages import StageReady

#: ``stages[].step_timeout_s`` when unset: vLLM's first-use torch.compile of a sampler path took
#: ~10 s in one step on a quiet 2-core CPU; 300 s leaves room for several such compiles on a
#: slow, contended CPU, and is the default request deadline (``server.request_timeout_s``), by
#: which the requests of a truly wedged step end anyway.
DEFAULT_STEP_TIMEOUT_S = 300.0


def step_timeout_s(configured: float | None, heartbeat_timeout_s: float) -> float:
    """A stage's step limit: as configured (validated longer than the heartbeat timeout), else
    the default, or the heartbeat timeout when that is longer (no long step is then reported)."""
    if configured is not None:
        return configured
    return max(DEFAULT_STEP_TIMEOUT_S, heartbeat_timeout_s)


@dataclass
class Liveness:
    """What one replica's heartbeats said last, on the server's monotonic clock."""

    #: When anything last came from it.
    last_seen: float = 0.0
    #: Whether its loop was working at its last progress stamp.
    busy: bool = False
    #: When its loop last moved (the stamp's age subtracted from the beat's arrival).
    progress_at: float = 0.0
    #: The last beat's ``stalled_s`` (the stage's clock): a smaller one means the loop moved.
    stalled_s: float = 0.0
    #: The step it is in now was already counted as a long one.
    counted: bool = False

    def beat(self, msg: StageReady, now: float) -> None:
        if not msg.busy or msg.stalled_s < self.stalled_s:
            self.counted = False  # the loop moved since the last beat: a new step
        self.last_seen = now
        self.busy = msg.busy
        self.stalled_s = msg.stalled_s
        self.progress_at = now - max(0.0, msg.stalled_s)

    def moved(self, now: float) -> None:
        """Something its loop sends (an output, an error, its stats) came: the loop is past the
        step it was in, however long it was (its next beat says so again)."""
        self.last_seen = now
        self.progress_at = now

    def step_s(self, until: float) -> float:
        """How long its loop has been inside one step as of ``until`` (0 when not working)."""
        return max(0.0, until - self.progress_at) if self.busy else 0.0

    def long_step_s(self, until: float, heartbeat_timeout_s: float) -> float | None:
        """Seconds in its current step when that is past the heartbeat timeout (a long step,
        busy, not hung), else None."""
        step = self.step_s(until)
        return step if step > heartbeat_timeout_s else None

    def hang(self, until: float, heartbeat_timeout_s: float, step_timeout_s: float) -> str | None:
        """Why the replica hangs, judged on what was read up to ``until`` (words for logs,
        /health and the 503 of its requests), or None while it does not."""
        step = self.step_s(until)
        if step > step_timeout_s:
            return (
                f"hung (its loop made no progress for {step:.1f} s while it held work; "
                f"its stages[].step_timeout_s is {step_timeout_s:g} s)"
            )
        silent = until - self.last_seen
        if silent > heartbeat_timeout_s:
            return (
                f"stopped answering (no heartbeat for {silent:.1f} s, "
                f"server.heartbeat_timeout_s is {heartbeat_timeout_s:g} s)"
            )
        return None


class HangWatch:
    """Judges the replicas on each of the supervisor's monitoring ticks, up to the previous tick
    (the module's note says why); counts each long step once."""

    def __init__(self, heartbeat_timeout_s: float) -> None:
        self.timeout_s = heartbeat_timeout_s
        self._last_tick: float | None = None

    def hung(self, replicas: Iterable[Any], now: float) -> list[tuple[Any, str]]:
        """(replica, why) for each replica that is up and hangs; ``replicas``: what has ``up``,
        ``liveness``, ``step_timeout_s`` and ``long_steps`` (the supervisor's
        SupervisedReplica). A replica found in a long step it was not counted in gets its
        ``long_steps`` raised by one."""
        horizon, self._last_tick = self._last_tick, now
        if horizon is None:
            return []  # the first tick: no horizon yet
        found = []
        for sp in replicas:
            if not sp.up:
                continue
            live = sp.liveness
            why = live.hang(horizon, self.timeout_s, sp.step_timeout_s)
            if why is not None:
                found.append((sp, why))
            elif not live.counted and live.long_step_s(horizon, self.timeout_s) is not None:
                live.counted = True
                sp.long_steps += 1
        return found
