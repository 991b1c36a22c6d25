"""Whether a stage replica hangs, judged from its heartbeats.

Every StageReady a stage sends (``server.heartbeat_interval_s``) says, besides that its process is
alive, whether its loop was working at its last progress stamp (``busy``) and how long ago that
stamp was (``stalled_s``; workers/loop_progress.py). A replica that is up hangs when

* its loop has not moved for more than ``server.heartbeat_timeout_s`` while it was working: its
  heartbeats may go on (they come from a thread of their own) while the loop is stuck in a wedged
  call, a deadlock, a send nobody takes; or
* nothing came from it for that long: the whole process stopped (SIGSTOP, a paused VM, a host
  gone) or cannot be reached.

A loop that waits for input while it holds nothing is never judged, however long it waits; a
long job made of many steps (a big prompt's chunked prefill) stamps once per step. Only a single
step longer than the timeout looks like a hang. The progress stamp is taken on the stage's clock
and carried as an age, so the stage's and the server's clocks need not agree.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from omni_cache.wire.messages import StageReady


@dataclass
class Liveness:
    """What one replica's heartbeats said last, on the server's monotonic clock."""

    #: When anything last came from it.
    last_seen: float = 0.0
    #: Whether its loop was working at its last progress stamp.
    busy: bool = False
    #: When its loop last moved (the stamp's age subtracted from the beat's arrival).
    progress_at: float = 0.0

    def beat(self, msg: StageReady, now: float) -> None:
        self.last_seen = now
        self.busy = msg.busy
        self.progress_at = now - max(0.0, msg.stalled_s)

    def hang(self, now: float, timeout_s: float) -> str | None:
        """Why the replica hangs at ``now`` (words for logs, /health and the 503 of its
        requests), or None while it does not."""
        if self.busy and now - self.progress_at > timeout_s:
            return (f"hung (its loop made no progress for {now - self.progress_at:.1f} s while "
                    f"it held work; server.heartbeat_timeout_s is {timeout_s:g} s)")
        if now - self.last_seen > timeout_s:
            return (f"stopped answering (no heartbeat for {now - self.last_seen:.1f} s, "
                    f"server.heartbeat_timeout_s is {timeout_s:g} s)")
        return None


class HangWatch:
    """Judges the replicas on each of the supervisor's monitoring ticks (every
    ``poll_interval_s``). A tick that comes late means the server's own event loop stalled (a
    long tokenization, a burst of outputs) and has not read the beats waiting in its inbox yet:
    nothing is judged on it."""

    def __init__(self, timeout_s: float, poll_interval_s: float) -> None:
        self.timeout_s = timeout_s
        self.poll_interval_s = poll_interval_s
        self._last_tick = 0.0

    def hung(self, replicas: Iterable[Any], now: float) -> list[tuple[Any, str]]:
        """(replica, why) for each replica that is up and hangs at ``now``; ``replicas``: what
        has ``up`` and ``liveness`` (the supervisor's SupervisedReplica)."""
        late = now - self._last_tick > 5 * self.poll_interval_s
        self._last_tick = now
        if late:
            return []
        found = []
        for sp in replicas:
            why = sp.liveness.hang(now, self.timeout_s) if sp.up else None
            if why is not None:
                found.append((sp, why))
        return found
