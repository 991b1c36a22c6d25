"""Giving freed heap memory back to the OS, so a long-running stage's RSS stays flat.

A stage allocates and frees tensors of many sizes for every request (prompts, latent rows, code
frames, audio). glibc serves the ones under its mmap threshold from its heaps and keeps freed
pages there for reuse; with sizes that vary per request the heaps fragment and RSS creeps up for
tens of minutes before it levels off (a 30-minute soak: thinker +27%, talker +8%). `malloc_trim(0)`
hands every free page of every arena back (glibc >= 2.8 also trims inside the heap, not only its
top). It walks the free lists, so it runs from the stage loop's housekeeping: when the stage is idle,
and at the latest every `max_interval_s` while it is busy. On a C library without it (musl, macOS)
this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import time

logger = logging.getLogger("omni_cache.stage")

#: Seconds between trims while the stage has work all the time.
MAX_INTERVAL_S = 30.0
#: Seconds between trims while it is idle (a trim of an idle heap costs little).
IDLE_INTERVAL_S = 5.0


def _malloc_trim():  # -> the C function, or None
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        return libc.malloc_trim
    except (OSError, AttributeError, TypeError):
        return None


class HeapTrimmer:
    def __init__(self, max_interval_s: float = MAX_INTERVAL_S, idle_interval_s: float = IDLE_INTERVAL_S,
                 clock=time.monotonic) -> None:
        self.trim = _malloc_trim()
        self.max_interval_s, self.idle_interval_s = max_interval_s, idle_interval_s
        self.clock = clock
        self.last = clock()
        self.trims = 0

    def maybe_trim(self, busy: bool) -> bool:
        """Trim if due (`busy`: the stage has work queued); True when it trimmed."""
        if self.trim is None:
            return False
        now = self.clock()
        if now - self.last < (self.max_interval_s if busy else self.idle_interval_s):
            return False
        self.last = now
        self.trim(0)
        self.trims += 1
        took = self.clock() - now
        if took > 0.05:
            logger.info("malloc_trim took %.0f ms", took * 1e3)
        return True
