"""The stage loop's heap trimming: when it runs, and that it hands freed memory back."""

import ctypes.util
import sys

import pytest

from workers.heap_trim import HeapTrimmer


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_trims_soon_when_idle_and_at_most_every_max_interval_when_busy():
    clock = Clock()
    heap = HeapTrimmer(max_interval_s=30.0, idle_interval_s=5.0, clock=clock)
    if heap.trim is None:
        pytest.skip("this C library has no malloc_trim")
    calls = []
    heap.trim = calls.append
    clock.now = 4.0
    assert not heap.maybe_trim(busy=False)
    clock.now = 5.0
    assert heap.maybe_trim(busy=False) and calls == [0]
    clock.now = 20.0
    assert not heap.maybe_trim(busy=True)  # busy: waits for the longer interval
    clock.now = 35.0
    assert heap.maybe_trim(busy=True) and heap.trims == 2


@pytest.mark.skipif(not sys.platform.startswith("linux") or "musl" in (ctypes.util.find_library("c") or ""),
                    reason="glibc only")
def test_freed_fragmented_heap_memory_goes_back_to_the_os():
    import psutil

    heap = HeapTrimmer(idle_interval_s=0.0)
    assert heap.trim is not None
    proc = psutil.Process()
    # Many mid-sized blocks (below glibc's mmap threshold, so they live in the heap), every other one
    # freed: the heap cannot shrink from the top, only a trim inside it gives the pages back.
    blocks = [bytearray(100_000) for _ in range(2000)]
    for b in blocks:
        b[::4096] = b"\1" * len(b[::4096])  # touch every page
    keep = blocks[1::2]
    del blocks
    before = proc.memory_info().rss
    assert heap.maybe_trim(busy=False)
    after = proc.memory_info().rss
    assert before - after > 50_000_000, (before, after)  # ~100 MB were freed inside the heap
    del keep
