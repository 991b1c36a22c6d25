"""Handing the heap's free pages back to the system: glibc's ``malloc_trim(0)``, now and then.

Who runs it: every stage process, from its loop's housekeeping, and the server process (HTTP,
orchestrator), from the orchestrator's deadline loop. Why a stage needs it: glibc raises its mmap threshold
(up to 32 MiB) each time a block it had
mmapped is freed, so after warm-up a stage's per-step tensors (hidden rows, prompt embeddings,
logits, all of sizes that vary with the batch) come from the main heap. Freed, they leave free
chunks in the middle of the heap; glibc only gives memory back from the heap's top, so the pages of
those chunks stay resident, and the heap's resident size creeps up as the mix of sizes changes
(benchmarks/results/soak.md: the thinker +27% and the talker +8% from minute 5 to 30 before this,
in ``[heap]``, with nothing kept alive). The server churns the same way through audio frames,
base64 and JSON bodies of varying size, on several threads (each with its own glibc arena; the
trim walks all of them): the soak saw it grow ~0.5 MiB a minute under load while idle it stayed flat.
``malloc_trim(0)`` also releases whole free pages inside
the heap (``MADV_DONTNEED``), so the resident size follows what is live. It costs well under a
millisecond when little was freed since the last call, a few milliseconds after a burst of frees;
pages it released fault in again when reused. Fixing the mmap threshold instead
(``MALLOC_MMAP_THRESHOLD_``) also kept the heap flat, but makes every allocation over the threshold
a fresh mapping (page faults and zeroing on every step).

The trimmer also takes trimming over from ``free()`` (:func:`keep_freed_pages`): glibc returns the
top of its heap to the system whenever more than its trim threshold is free there (twice the
dynamic mmap threshold: at most 64 MiB), and blocks over the mmap threshold are mapped and unmapped
one by one. A model step's temporaries (a prefill's activations, a decoder window's) are such
blocks, or sit at the heap's top: every step gave their pages back and faulted them in again
(2,000-25,000 page faults a step in a matrix-product stand-in of a prefill, 15-25% of its time
on these VMs, where a page fault is expensive: benchmarks/results/e2e_no_reuse.md). With both
thresholds set, blocks up to 32 MiB come from the heap and freed pages stay for the next step,
until the next ``malloc_trim(0)``, which gives back whatever is free then, at most
``TRIM_INTERVAL_S`` later.

Other C libraries (musl, macOS) have no ``malloc_trim``: the trimmer then does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

#: Seconds between two trims of a process's heap.
TRIM_INTERVAL_S = 5.0
#: mallopt(3) parameters (glibc's malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
#: glibc's largest mmap threshold on 64-bit systems: blocks up to it come from the heap.
HEAP_BLOCK_MAX = 32 << 20
#: Free bytes at the heap's top above which free() gives them back: in practice never (the
#: trimmer does it, every TRIM_INTERVAL_S).
TOP_TRIM_THRESHOLD = 1 << 30


def keep_freed_pages() -> bool:
    """Have glibc keep freed heap pages for reuse until the next ``malloc_trim`` (blocks up to
    HEAP_BLOCK_MAX from the heap, no trimming of its top on free); False where the C library has
    no ``mallopt``. Setting a threshold turns glibc's dynamic thresholds off: both are set."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, HEAP_BLOCK_MAX)) and bool(mallopt(M_TRIM_THRESHOLD, TOP_TRIM_THRESHOLD))


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
    the calls and the time they took (stages report both in their stats, the server in /metrics).
    With the C library's own ``malloc_trim`` (``trim`` not given) it also takes trimming over from
    ``free()`` (:func:`keep_freed_pages`)."""

    def __init__(
        self, interval_s: float = TRIM_INTERVAL_S, trim: Callable[[int], int] | None = None, *, manage: bool = True
    ) -> None:
        """``manage`` False: a process that is not ours to tune (the Python API's caller): no
        trims, the allocator's thresholds left as they are."""
        self.interval_s = interval_s
        #: Whether this process is the server's own (its allocator and collector tuned here).
        self.manage = manage
        self._trim: Callable[[int], int] | None = None
        if manage:
            self._trim = trim if trim is not None else find_malloc_trim()
            if self._trim is None:
                logger.info("no malloc_trim in this C library: freed heap pages stay with the process")
            elif trim is None:
                keep_freed_pages()
        self.next_at = time.monotonic() + interval_s
        self.trims = 0
        self.seconds = 0.0

    def freeze_startup_objects(self) -> bool:
        """In the server's own process (``manage``): collect, then ``gc.freeze()`` what start-up
        built (modules, torch, the SDK's models, the app), so that the collector's full passes walk
        only what came after. A full pass over the ~275,000 objects of a started server took 134 ms
        (0.2 ms frozen) on a loaded 2-core host, holding the GIL: every request waited that long,
        more often the more clients allocate (benchmarks/hostile.py). Idempotent."""
        if not self.manage:
            return False
        gc.collect()
        gc.freeze()
        return True

    def due(self, now: float) -> bool:
        """Whether :meth:`maybe_trim` would trim at ``now``."""
        return self._trim is not None and now >= self.next_at

    def maybe_trim(self, now: float) -> bool:
        """Trim if ``interval_s`` passed since the last trim (``now``: time.monotonic())."""
        if not self.due(now):
            return False
        t0 = time.perf_counter()
        self._trim(0)
        self.seconds += time.perf_counter() - t0
        self.trims += 1
        self.next_at = now + self.interval_s
        return True

    def counters(self) -> dict[str, float]:
        return {"heap_trims": self.trims, "heap_trim_seconds": round(self.seconds, 6)}
