"""Handing the heap's free pages back to the system: glibc's ``malloc_trim(0)``, now and then.

Who runs it: every stage process, from its loop's housekeeping, and the server process (HTTP,
orchestrator), from the orchestrator's deadline loop. Why a stage needs it: glibc raises its mmap threshold (up to 32 MiB) each time a block it had
mmapped is freed, so after warm-up a stage's per-step tensors (hidden rows, prompt embeddings,
logits, all of sizes that vary with the batch) come from the main heap. Freed, they leave free
chunks in the middle of the heap; glibc only gives memory back from the heap's top, so the pages of
those chunks stay resident, and the heap's resident size creeps up as the mix of sizes changes
(benchmarks/results/soak.md: the thinker +27% and the talker +8% from minute 5 to 30 before this,
in ``[heap]``, with nothing kept alive). The server churns the same way through audio frames,
base64 and JSON bodies of varying size, on several threads (each with its own glibc arena; the
trim walks all of them): the soak saw it grow ~0.5 MiB a minute under load while idle it stayed flat. ``malloc_trim(0)`` also releases whole free pages inside
the heap (``MADV_DONTNEED``), so the resident size follows what is live. It costs well under a
millisecond when little was freed since the last call, a few milliseconds after a burst of frees;
pages it released fault in again when reused. Fixing the mmap threshold instead
(``MALLOC_MMAP_THRESHOLD_``) also kept the heap flat, but makes every allocation over the threshold
a fresh mapping (page faults and zeroing on every step).

Other C libraries (musl, macOS) have no ``malloc_trim``: the trimmer then does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

#: Seconds between two trims of a process's heap.
TRIM_INTERVAL_S = 5.0


def find_malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None when the process's C library has none."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


class HeapTrimmer:
    """Calls ``malloc_trim(0)`` at most once every ``interval_s`` (:meth:`maybe_trim`), and counts
    the calls and the time they took (stages report both in their stats, the server in /metrics)."""

    def __init__(self, interval_s: float = TRIM_INTERVAL_S,
                 trim: Callable[[int], int] | None = None) -> None:
        self.interval_s = interval_s
        self._trim = trim if trim is not None else find_malloc_trim()
        if self._trim is None:
            logger.info("no malloc_trim in this C library: freed heap pages stay with the process")
        self.next_at = time.monotonic() + interval_s
        self.trims = 0
        self.seconds = 0.0

    def maybe_trim(self, now: float) -> bool:
        """Trim if ``interval_s`` passed since the last trim (``now``: time.monotonic())."""
        if self._trim is None or now < self.next_at:
            return False
        t0 = time.perf_counter()
        self._trim(0)
        self.seconds += time.perf_counter() - t0
        self.trims += 1
        self.next_at = now + self.interval_s
        return True

    def counters(self) -> dict[str, float]:
        return {"heap_trims": self.trims, "heap_trim_seconds": round(self.seconds, 6)}
