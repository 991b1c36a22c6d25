"""A stage's block reports to the router, numbered, with a snapshot after any that was lost.

Each report (``BlockEvents``: what the prefix cache gained and lost since the last one) carries its
number in this process (``seq``, from 1). A report whose send fails (the orchestrator's queue
stayed full past the send timeout) is gone, and the changes it held with it: the next report is
then a snapshot (``cleared`` and every hash held: scheduler/block_events.py ``take(snapshot=True)``)
and the router's index equals what the replica holds again. The router asks for the same
(``BlockSnapshotQuery``) when it sees a gap the stage could not know of (a server restarted)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from omni_cache.wire.messages import BlockEvents, block_report

__all__ = ["BlockReporter"]


class BlockReporter:
    def __init__(self, stage: str, replica: int, take: Callable[[bool], Any]) -> None:
        """``take(snapshot)``: the runner's block changes (None: the stage reports none)."""
        self.stage, self.replica = stage, replica
        self._take = take
        self.seq = 0
        self.snapshot_due = False
        self.snapshots = 0  # sent, for tests and logs

    def request_snapshot(self) -> None:
        """The router saw a gap: the next report holds everything."""
        self.snapshot_due = True

    def report(self, send: Callable[[BlockEvents], None]) -> None:
        """Send what changed (or a snapshot when one is due); a failed send makes one due and
        raises on."""
        snapshot = self.snapshot_due
        changes = self._take(snapshot)
        if not changes:
            return
        self.seq += 1
        self.snapshot_due = False
        try:
            send(self._message(changes))
        except BaseException:
            self.snapshot_due = True  # the router lost this report's changes
            raise
        self.snapshots += snapshot

    def _message(self, changes: Any) -> BlockEvents:
        return BlockEvents(stage=self.stage, replica=self.replica, seq=self.seq, **block_report(changes))
