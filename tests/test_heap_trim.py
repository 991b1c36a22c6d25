"""The heap trimmer (stages and the server): free pages in the middle of glibc's heap go back to the system."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import pytest

from omni_cache.heap_trim import HEAP_BLOCK_MAX, HeapTrimmer, find_malloc_trim

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


@pytest.mark.skipif(find_malloc_trim() is None, reason="a C library without malloc_trim")
def test_trim_returns_free_pages_below_a_live_block():
    """64 MiB of 64 KiB blocks (under glibc's mmap threshold: they come from the heap), freed
    while a block allocated after them stays live: free() cannot shrink the heap from its top, so
    the pages stay resident until the trimmer runs."""
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    block, n = 64 * 1024, 1024
    blocks = [libc.malloc(block) for _ in range(n)]
    for p in blocks:
        ctypes.memset(p, 1, block)  # resident
    guard = libc.malloc(block)  # above them: the heap's top stays in use
    trimmer = HeapTrimmer(interval_s=60.0)
    try:
        for p in blocks:
            libc.free(p)
        before = rss_bytes()
        assert not trimmer.maybe_trim(trimmer.next_at - 1.0)  # not yet due: nothing happens
        assert trimmer.trims == 0
        assert trimmer.maybe_trim(trimmer.next_at)
        released = before - rss_bytes()
    finally:
        libc.free(guard)
    assert released >= n * block // 2, f"only {released / 2**20:.1f} MiB of 64 MiB went back"
    assert trimmer.trims == 1 and trimmer.counters()["heap_trims"] == 1
    assert trimmer.next_at > 0 and not trimmer.maybe_trim(trimmer.next_at - 1.0)


@pytest.mark.skipif(find_malloc_trim() is None, reason="a C library without malloc_trim")
def test_freed_step_sized_blocks_stay_until_the_trimmer_runs():
    """A 24 MiB block (a step's temporary: over glibc's initial mmap threshold, under
    HEAP_BLOCK_MAX) freed: with the trimmer in charge its pages stay resident for the next
    allocation of its size, which then faults nothing in; the trimmer's run gives them back."""
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    trimmer = HeapTrimmer(interval_s=60.0)
    size = 24 << 20
    assert size < HEAP_BLOCK_MAX
    p = libc.malloc(size)
    ctypes.memset(p, 1, size)
    libc.free(p)
    kept = rss_bytes()
    q = libc.malloc(size)
    ctypes.memset(q, 2, size)
    assert rss_bytes() - kept < size // 4, "the freed block's pages were not reused"
    libc.free(q)
    before = rss_bytes()
    assert trimmer.maybe_trim(trimmer.next_at)
    assert before - rss_bytes() >= size // 2, "the trimmer did not give the freed pages back"


def test_an_orchestrator_leaves_its_callers_allocator_alone(monkeypatch, tmp_path):
    """Before: creating an Orchestrator (the Python API, a notebook's ServerThread) set the
    process's malloc thresholds for good and trimmed its heap; only omni-serve's process is ours."""
    from omni_cache import heap_trim
    from omni_cache.config import load_config
    from omni_cache.runtime.orchestrator import Orchestrator

    tuned = []
    monkeypatch.setattr(heap_trim, "keep_freed_pages", lambda: tuned.append(1) or True)
    config = load_config(Path(__file__).resolve().parents[1] / "stage_configs" / "tiny_omni.yaml")
    caller = Orchestrator(config)
    assert tuned == [] and not caller.heap.due(float("inf"))
    server = Orchestrator(config, manage_heap=True)
    assert tuned == [1] and server.heap.due(float("inf"))
    for orch in (caller, server):
        orch.kill_all_sync()


def test_only_the_servers_own_process_freezes_its_start_up_objects():
    """gc.freeze() after start-up (a full collection then walks only what came after: 134 ms ->
    0.2 ms for a started server's ~275,000 objects); a caller's process is left alone."""
    import gc

    frozen = gc.get_freeze_count()
    assert not HeapTrimmer(trim=lambda pad: 0, manage=False).freeze_startup_objects()
    assert gc.get_freeze_count() == frozen
    try:
        assert HeapTrimmer(trim=lambda pad: 0).freeze_startup_objects()
        assert gc.get_freeze_count() > frozen
    finally:
        gc.unfreeze()
