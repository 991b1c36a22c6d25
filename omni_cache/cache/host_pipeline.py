"""The host mirror's copy pipeline (`LatentStore` with `storage="host"` on CUDA).

The mirror lives in host memory, page-locked with `cudaHostRegister` (`page_lock`: exact size, no
rounding by the caching host allocator). A write must not stall the forward pass, so it is a
pipeline:

  1. compute stream: the step's slot mapping and rows are copied (k + 1 contiguous D2D copies)
     into the device staging buffer of a ring entry, laid out [slots | rows of name 0 | ...]
     (`row_kernels.staging_layout`; a snapshot: vLLM reuses its output buffers next step); an event
     marks it. No compaction of the -1 rows (that would need a host sync); they go to the trash row
     in step 3. Steps 1 and 2 are issued as raw CUDA driver calls (`omni_cache.cache.cuda_driver`,
     ~1 us each against ~5 us per torch call): on a decode step `write` is pure serving-loop
     overhead;
  2. copy stream (waits on that event, never the other way round): the used part of the staging
     buffer goes device->host into the entry's pinned host buffer (`cudaMemcpyAsync`; entries over
     1 MiB copy their slots first, with their own event); an event marks the end;
  3. a daemon "drain" thread waits on that event (blocking-sync event: it sleeps, the GIL is
     released) and scatters the rows into the host mirror (`index_copy_` by slot, -1 to the trash
     row; OpenMP team of `drain_threads` threads, 4 by default, so it leaves the cores to the
     serving loop), then frees the ring entry.

Nothing on the compute stream ever waits for the copy stream, and the calling thread only waits
when the ring is full (back-pressure). Entries reach the drain thread through a SimpleQueue (no
lock shared with it on the caller's path). Bound: `staging_depth` entries of `staging_tokens` rows
each, i.e. at most `staging_nbytes` = depth * tokens * (8 + sum of row bytes) of device memory and
the same of pinned host memory are in flight; a step with more tokens is split over several
entries. Defaults: depth 3, tokens = 8192 (vLLM's usual max_num_batched_tokens) capped so that one
entry holds at most 128 MiB (and at least 256 rows), i.e. <= 384 MiB device + 384 MiB pinned
(one bf16 latent of 4096: 3 x 64 MiB). Pass staging_tokens = max_num_batched_tokens so that a
whole step fits one entry: the copy of step t then overlaps steps t+1 and t+2.

`gather` first finds which in-flight writes it needs: it waits for the small slot copies of the
entries still in flight (the copy stream is FIFO, so that also means the rows of every earlier
entry have arrived), records which entry last wrote each slot, and then waits for the drain of
the newest entry that wrote one of the requested slots, and no other. The rows then go back to the
GPU in one batch: by default a Triton kernel reads them straight from the page-locked mirror over
PCIe ("zero_copy": one launch on the compute stream, no CPU copy); `host_gather="staging"` does a
CPU `index_select` per name into one pinned buffer and one non-blocking H2D copy instead.

On CPU the same ring and drain thread run with synchronous "copies" and no-op events (the store's
`_emulate_pipeline`, tests only).
"""

from __future__ import annotations

import collections
import contextlib
import queue
import threading
import warnings
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from omni_cache.cache import cuda_driver
from omni_cache.cache.row_kernels import MODE_GATHER, launch_rows, select_rows, staging_layout

__all__ = ["HostMirror", "HostPipeline", "page_lock"]

_SPLIT_SLOTS_BYTES = 1 << 20  # entries above this copy their slots separately


def page_lock(t: torch.Tensor, registered: list[int]) -> torch.Tensor:
    """Page-lock `t` in place (exact size) so the GPU can DMA/zero-copy read it, appending its
    pointer to `registered` (unregistered when the pipeline stops); falls back to torch's pinned
    allocator if registration is refused."""
    nbytes = t.numel() * t.element_size()
    err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, 0)
    if int(err) == 0:
        registered.append(t.data_ptr())
        return t
    return t.pin_memory()


@dataclass(frozen=True)
class HostMirror:
    """The store's mirror as the pipeline sees it: the same tensors, no reference to the store."""

    names: tuple[str, ...]
    specs: dict[str, tuple[int, torch.dtype]]  # name -> (dim, dtype)
    flat: dict[str, torch.Tensor]  # name -> [num_slots + 1, dim] (last row = trash row)
    flat_w: dict[str, torch.Tensor]  # the same memory as words (`row_kernels.word_dtype`)
    row_bytes: tuple[int, ...]  # bytes of one row of each name, in `names` order
    trash: int  # the row that absorbs padding (-1) writes, = num_slots

    def select(self, name: str, slots: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        d, dt = self.specs[name]
        return select_rows(self.flat_w[name], slots, d, dt, out)


class _NullEvent:
    """Stand-in for torch.cuda.Event in the CPU emulation of the pipeline (tests only)."""

    def record(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _Entry:
    __slots__ = (
        "index",
        "dev_buf",
        "host_buf",
        "packed",
        "slots_done",
        "data_done",
        "slots_ev",
        "seq",
        "n",
        "registered",
        "handles",
    )

    def __init__(self, index: int, dev_buf: torch.Tensor, host_buf: torch.Tensor, events: tuple):
        self.index = index
        self.dev_buf = dev_buf
        self.host_buf = host_buf
        self.packed, self.slots_done, self.data_done = events
        self.slots_ev = self.slots_done  # the event after which its slots are on the host
        self.seq = 0  # sequence number of the write chunk it carries (0: free, never used)
        self.n = 0
        self.registered = False  # its slots were recorded in `slot_seq` by a gather
        self.handles: tuple[int, ...] = ()  # driver path: dev ptr, host ptr, the three events


class _DrainState:
    """What the drain thread shares with the pipeline (the thread holds no reference to it).
    Entries reach it through a SimpleQueue (a put costs ~0.1 us and takes no lock the thread may
    hold); `cond` only guards `drained`/`error` for callers that must wait."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.drained = 0  # every write chunk with seq <= drained is in the host mirror
        self.error: BaseException | None = None
        self.queue: queue.SimpleQueue = queue.SimpleQueue()  # entries; None = stop


def _drain_loop(
    state: _DrainState, scatter, num_threads: int | None = None, ready: threading.Event | None = None
) -> None:
    if num_threads:
        torch.set_num_threads(num_threads)  # this thread's OpenMP team only (ICV is per thread)
    if ready is not None:
        ready.set()
    while (entry := state.queue.get()) is not None:  # blocks with the GIL released
        try:
            entry.data_done.synchronize()  # sleeps (blocking-sync event), GIL released
            scatter(entry)
        except BaseException as exc:  # surfaced to the caller at its next call
            with state.cond:
                state.error = exc
                state.cond.notify_all()
            return
        with state.cond:
            state.drained = entry.seq
            state.cond.notify_all()


def _stop_drain(state: _DrainState, thread: threading.Thread, registered: list) -> None:
    state.queue.put(None)
    if thread.is_alive() and thread is not threading.current_thread():
        thread.join(timeout=30)
    for ptr in registered:
        with contextlib.suppress(Exception):
            torch.cuda.cudart().cudaHostUnregister(ptr)
    registered.clear()


def _scatter_fn(mirror: HostMirror):
    """The drain thread's step 3: an entry's rows into the mirror. Closes over the mirror's
    tensors only, so the thread keeps neither the pipeline nor the store alive."""
    flat_w, trash, names, row_bytes = mirror.flat_w, mirror.trash, mirror.names, mirror.row_bytes

    def scatter(entry: _Entry) -> None:
        offsets, _ = staging_layout(entry.n, row_bytes)
        buf = entry.host_buf
        slots = buf[: entry.n * 8].view(torch.int64)
        idx = torch.where(slots < 0, trash, slots)
        for nm, off in zip(names, offsets):
            w = flat_w[nm]
            rows = buf[off : off + entry.n * w.shape[1] * w.element_size()].view(w.dtype)
            w.index_copy_(0, idx, rows.view(entry.n, -1))

    return scatter


class HostPipeline:
    """Writes into and gathers from a host mirror through a ring of staging entries and a drain
    thread (see the module docstring). Owned by one `LatentStore`; `stats` is the store's dict.

    `registered`: the mirror's page-locked pointers (`page_lock`), unregistered once the drain
    thread has stopped (`close()` or garbage collection)."""

    def __init__(
        self,
        mirror: HostMirror,
        device: torch.device,
        *,
        staging_tokens: int | None,
        staging_depth: int,
        host_gather: str,
        drain_threads: int | None,
        use_driver: bool,
        emulated: bool,
        stats: dict[str, int],
        registered: list[int],
    ) -> None:
        self.mirror = mirror
        self.device = device
        self.host_gather = host_gather  # "zero_copy" or "staging" (falls back to staging)
        self.stats = stats
        self._emulated = emulated
        self.closed = False
        row = 8 + sum(mirror.row_bytes)  # slot + the rows of every name
        if staging_tokens is None:  # vLLM's usual max_num_batched_tokens, <= 128 MiB per entry
            staging_tokens = max(256, min(8192, (128 << 20) // row))
        if staging_tokens <= 0 or staging_depth <= 0:
            raise ValueError("staging_tokens and staging_depth must be positive")
        self.staging_tokens, self.staging_depth = int(staging_tokens), int(staging_depth)
        cap = self._layout(self.staging_tokens)[1]
        self.staging_nbytes = cap * self.staging_depth
        self.entries = self._make_entries(cap)
        self._next = 0
        self._seq = 0  # sequence number of the last write chunk issued
        self._inflight: collections.deque[_Entry] = collections.deque()  # main thread's view
        self._slot_seq = torch.zeros(mirror.trash + 1, dtype=torch.int64)  # last writer (registered)
        self._copy_stream = None if emulated else torch.cuda.Stream(device)
        # The caller's share of a write through the CUDA driver (a few us) where it loads, else
        # through torch (~4-6 us per operation); same copies, same streams, same events.
        self._drv = None if (emulated or not use_driver) else cuda_driver.driver()
        if self._drv is not None:
            self._cs_handle = self._copy_stream.cuda_stream
            self._compute_handle = cuda_driver.current_stream_handle(device.index)
            for e in self.entries:
                e.handles = (
                    e.dev_buf.data_ptr(),
                    e.host_buf.data_ptr(),
                    *(cuda_driver.event_handle(ev, self._copy_stream) for ev in (e.packed, e.slots_done, e.data_done)),
                )
        self._state = _DrainState()
        drain_threads = min(drain_threads, torch.get_num_threads()) if drain_threads else None
        self._thread = self._start_drain(drain_threads)
        self._finalizer = weakref.finalize(self, _stop_drain, self._state, self._thread, registered)

    def _make_entries(self, cap: int) -> list[_Entry]:
        dev = self.device if not self._emulated else torch.device("cpu")
        entries = []
        for i in range(self.staging_depth):
            dev_buf = torch.empty(cap, dtype=torch.uint8, device=dev)
            if self._emulated:
                host_buf = torch.empty(cap, dtype=torch.uint8)
                events: tuple = (_NullEvent(), _NullEvent(), _NullEvent())
            else:
                host_buf = torch.empty(cap, dtype=torch.uint8, pin_memory=True)
                events = (torch.cuda.Event(), torch.cuda.Event(blocking=True), torch.cuda.Event(blocking=True))
            entries.append(_Entry(i, dev_buf, host_buf, events))
        return entries

    def _start_drain(self, drain_threads: int | None) -> threading.Thread:
        ready = threading.Event()
        thread = threading.Thread(
            target=_drain_loop,
            args=(self._state, _scatter_fn(self.mirror), drain_threads, ready),
            name="latent-store-drain",
            daemon=True,
        )
        prev_threads = torch.get_num_threads()
        thread.start()
        ready.wait()
        if drain_threads:
            torch.set_num_threads(prev_threads)  # restore the process-wide default for new threads
        return thread

    def _layout(self, n: int) -> tuple[list[int], int]:
        return staging_layout(n, self.mirror.row_bytes)

    # ---- waiting for the drain thread ------------------------------------------------------------
    def _check_error(self) -> None:
        err = self._state.error
        if err is not None:
            raise RuntimeError("latent store: the host-copy thread failed") from err

    def _wait_drained(self, seq: int) -> None:
        st = self._state
        with st.cond:
            while st.drained < seq and st.error is None:
                st.cond.wait()
        self._check_error()
        self._retire()

    def _retire(self) -> None:
        """Forget the in-flight entries the drain thread has finished."""
        drained = self._state.drained
        while self._inflight and self._inflight[0].seq <= drained:
            self._inflight.popleft()

    def synchronize(self) -> None:
        """Wait until every write issued so far is in the mirror."""
        self._wait_drained(self._seq)

    def close(self) -> None:
        """Stop the drain thread (after it finished in-flight writes) and unpin the mirror."""
        if not self.closed:
            with contextlib.suppress(Exception):
                self.synchronize()
            self._finalizer()
        self.closed = True

    # ---- write -----------------------------------------------------------------------------------
    def write(self, slot_mapping: torch.Tensor, srcs: dict[str, torch.Tensor], n: int) -> None:
        self._check_error()
        if self.closed:
            raise RuntimeError("write() on a closed LatentStore")
        self.stats["writes"] += 1
        if slot_mapping.dtype != torch.int64:  # the staging buffer holds int64 slots
            slot_mapping = slot_mapping.long()
        for lo in range(0, n, self.staging_tokens):
            hi = min(n, lo + self.staging_tokens)
            self._write_chunk(slot_mapping[lo:hi], {nm: t[lo:hi] for nm, t in srcs.items()}, hi - lo)

    def _write_chunk(self, slot_mapping: torch.Tensor, srcs: dict[str, torch.Tensor], n: int) -> None:
        entry = self.entries[self._next]
        self._next = (self._next + 1) % self.staging_depth
        if entry.seq > self._state.drained:  # ring full: back-pressure, wait for its drain
            self.stats["ring_waits"] += 1
            self._wait_drained(entry.seq)
        self._retire()
        self._seq += 1
        entry.seq, entry.n, entry.registered = self._seq, n, False
        self.stats["chunks"] += 1
        offsets, total = self._layout(n)
        # Large entries copy their slots first, with their own event: a gather that needs none of
        # these rows then does not wait for them. Small ones go in one copy (lo = 0).
        lo = offsets[0] if total > _SPLIT_SLOTS_BYTES else 0
        if not self._emulated:  # emulated copies are synchronous: the slots are on the host at once
            entry.slots_ev = entry.slots_done if lo else entry.data_done
        if self._drv is not None:
            self._issue_driver(entry, slot_mapping, srcs, n, offsets, total, lo)
        else:
            self._issue_torch(entry, slot_mapping, srcs, n, offsets, total, lo)
        # 3. the drain thread scatters it into the mirror once the copy is done
        self._inflight.append(entry)
        self._state.queue.put(entry)

    def _issue_torch(
        self,
        entry: _Entry,
        slot_mapping: torch.Tensor,
        srcs: dict[str, torch.Tensor],
        n: int,
        offsets: list[int],
        total: int,
        lo: int,
    ) -> None:
        """Steps 1 and 2 of the pipeline through torch (also the CPU emulation's "copies")."""
        buf = entry.dev_buf
        mirror = self.mirror
        # 1. snapshot on the compute stream: k + 1 contiguous device copies (cheaper to launch than
        #    one Triton kernel, and as fast on the GPU)
        buf[: n * 8].view(torch.int64).copy_(slot_mapping)
        for nm, rb, off in zip(mirror.names, mirror.row_bytes, offsets):
            buf[off : off + n * rb].view(mirror.specs[nm][1]).view(n, -1).copy_(srcs[nm])
        if self._emulated:
            entry.host_buf[:total].copy_(buf[:total])
            return
        # 2. device -> host on the copy stream, which waits for the snapshot (never the reverse)
        entry.packed.record(torch.cuda.current_stream(self.device))
        cs = self._copy_stream
        cs.wait_event(entry.packed)
        with torch.cuda.stream(cs):
            if lo:
                entry.host_buf[: n * 8].copy_(buf[: n * 8], non_blocking=True)
                entry.slots_done.record(cs)
            entry.host_buf[lo:total].copy_(buf[lo:total], non_blocking=True)
            entry.data_done.record(cs)

    def _issue_driver(
        self,
        entry: _Entry,
        slot_mapping: torch.Tensor,
        srcs: dict[str, torch.Tensor],
        n: int,
        offsets: list[int],
        total: int,
        lo: int,
    ) -> None:
        """Steps 1 and 2 of the pipeline (see the module docstring) as raw driver calls."""
        drv, compute, cs = self._drv, self._compute_handle(), self._cs_handle
        dev, host, packed, slots_done, data_done = entry.handles
        if not slot_mapping.is_contiguous():
            slot_mapping = slot_mapping.contiguous()
        drv.copy_d2d(dev, slot_mapping.data_ptr(), n * 8, compute)
        for nm, rb, off in zip(self.mirror.names, self.mirror.row_bytes, offsets):
            src = srcs[nm]
            if not src.is_contiguous():  # a temporary on the compute stream: freed in order
                src = src.contiguous()
            drv.copy_d2d(dev + off, src.data_ptr(), n * rb, compute)
        drv.record(packed, compute)
        drv.wait(cs, packed)
        if lo:
            drv.copy_d2h(host, dev, n * 8, cs)
            drv.record(slots_done, cs)
        drv.copy_d2h(host + lo, dev + lo, total - lo, cs)
        drv.record(data_done, cs)

    # ---- gather ----------------------------------------------------------------------------------
    def _needed_seq(self, slots: torch.Tensor) -> int:
        """Sequence number of the newest in-flight write chunk that wrote one of `slots` (0: none)."""
        self._retire()
        if not self._inflight or slots.numel() == 0:
            return 0
        trash = self.mirror.trash
        for entry in list(self._inflight):
            if entry.registered:
                continue
            entry.slots_ev.synchronize()  # small copy; FIFO: every earlier entry's rows are in too
            hs = entry.host_buf[: entry.n * 8].view(torch.int64)
            self._slot_seq.index_fill_(0, torch.where(hs < 0, trash, hs), entry.seq)
            entry.registered = True
        return int(self._slot_seq[slots].max())

    def gather(self, slots: torch.Tensor, out_dev: torch.device) -> dict[str, torch.Tensor]:
        """Rows at `slots` as name -> [M, dim] on `out_dev`, after the writes they need drained."""
        self._check_error()
        slots_cpu = slots.to("cpu")
        if slots_cpu.dtype != torch.int64:
            slots_cpu = slots_cpu.long()
        need = self._needed_seq(slots_cpu)
        if need > self._state.drained:
            self.stats["gather_waits"] += 1
            self._wait_drained(need)
        mirror = self.mirror
        m = slots_cpu.shape[0]
        if out_dev.type == "cpu" or self._emulated:
            out = {nm: mirror.select(nm, slots_cpu) for nm in mirror.names}
            return {nm: t.to(out_dev) for nm, t in out.items()} if out_dev.type != "cpu" else out
        if self.host_gather == "zero_copy":
            idx = slots_cpu.to(out_dev, non_blocking=True)
            out = {nm: torch.empty(m, d, dtype=dt, device=out_dev) for nm, (d, dt) in mirror.specs.items()}
            try:
                launch_rows(MODE_GATHER, idx, m, [(mirror.flat[nm], out[nm]) for nm in mirror.names])
                return out
            except (ValueError, RuntimeError) as exc:  # the driver refused the host pointer
                warnings.warn(f"latent store: zero-copy gather unavailable ({exc}); using staging", stacklevel=2)
                self.host_gather = "staging"
        # staging: CPU index_select per name into one pinned buffer, then one H2D copy
        offsets, total = self._layout(m)
        host = torch.empty(total, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(total, dtype=torch.uint8, device=out_dev)
        views = {}
        for nm, rb, off in zip(mirror.names, mirror.row_bytes, offsets):
            d, dt = mirror.specs[nm]
            sl = slice(off, off + m * rb)
            mirror.select(nm, slots_cpu, out=host[sl].view(dt).view(m, d))
            views[nm] = dev[sl].view(dt).view(m, d)
        dev[offsets[0] :].copy_(host[offsets[0] :], non_blocking=True)
        return views
