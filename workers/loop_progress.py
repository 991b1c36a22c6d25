"""Whether a stage's loop is moving: what its heartbeats say besides "the process is alive".

The announcer (workers/announcer.py) beats from a thread of its own, so a beat alone says nothing
about the loop: a loop stuck in a wedged call keeps beating. The loop stamps this object each
time it goes round and each time it takes a message in; the announcer sends with every beat how
long ago the last stamp was (``stalled_s``) and whether the loop was working then (``busy``). A
loop that waits for input while it holds nothing marks itself idle first, so however long it
waits it is never taken for stuck; a long job made of many steps (a big prompt's prefill in
chunks) stamps once per step. The supervisor (omni_cache/runtime/supervision/hang_watch.py) judges.
"""

from __future__ import annotations

import time


class LoopProgress:
    """Written by the stage loop's thread, read by the announcer's: one tuple, replaced whole."""

    def __init__(self) -> None:
        self._state = (time.monotonic(), False)

    def moved(self) -> None:
        """The loop went round, or took a message in: it is working."""
        self._state = (time.monotonic(), True)

    def waiting(self) -> None:
        """The loop is about to wait for input and holds nothing: however long it waits, it is
        not stuck."""
        self._state = (time.monotonic(), False)

    def report(self) -> tuple[bool, float]:
        """(busy, seconds since the last stamp)."""
        at, busy = self._state
        return busy, max(0.0, time.monotonic() - at)
