"""Storage of the hidden-state prefix cache: a mirror of vLLM's KV-cache slots.

For every latent name the store holds one tensor `[num_blocks, block_size, dim]`; the latent of the
token that vLLM put at KV slot `slot = block_id * block_size + offset` lives at row `slot` of the
flattened `[num_blocks * block_size, dim]` view. `write` stores a step's latents by its slot mapping
(padding slots are -1 and skipped), `gather` reads rows back by slot (a request's prefix, see
`prefix_slots`). Callers issue all writes of a step before any gather of that step; every path below
keeps that order (a gather sees every write issued before it).

Three paths, chosen at construction:

* CPU (`device="cpu"`; `storage` "host" and "device" are the same thing). Plain tensors. `write` is
  one `torch.where` (maps -1 to a spare "trash" row past the last slot, so no masking, no nonzero)
  plus one `index_copy_` per name, `gather` one `index_select` per name. Both run on a bit-identical
  view of the rows as the widest word that divides a row (complex128 = 16 bytes where it can), which
  makes torch's element-wise CPU index kernels run at memcpy speed (measured 2-3x faster than on
  bf16 elements).
* CUDA, `storage="device"`: the mirror lives in GPU memory. `write` and `gather` are ONE Triton
  launch each for up to four names (grid = token tiles x (name, column-chunk) tiles; -1 rows are
  masked inside the kernel), with no host synchronisation and fixed shapes, so `write` can be
  captured in a CUDA graph. Without Triton: `torch.where` + `index_copy_` per name (also graph-safe).
* CUDA, `storage="host"` (the default): the mirror lives in host memory, page-locked with
  `cudaHostRegister` (exact size, no rounding by the caching host allocator). A write must not stall
  the forward pass, so it is a pipeline:

    1. compute stream: the step's slot mapping and rows are copied (k + 1 contiguous D2D copies)
       into the device staging buffer of a ring entry, laid out [slots | rows of name 0 | ...]
       (a snapshot: vLLM reuses its output buffers next step); an event marks it. No compaction
       of the -1 rows (that would need a host sync); they go to the trash row in step 3.
       Steps 1 and 2 are issued as raw CUDA driver calls (`omni_cache.cache.cuda_driver`, ~1 us each
       against ~5 us per torch call): on a decode step `write` is pure serving-loop overhead;
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

The store owns no eviction logic: vLLM's block pool decides which slots are live.
"""

from __future__ import annotations

import collections
import contextlib
import queue
import threading
import warnings
import weakref
from typing import Any, Literal, Mapping, Sequence

import torch

from omni_cache.cache import cuda_driver

try:  # Triton is optional: only the CUDA paths launch its kernel (CPU runs plain torch ops).
    import triton
    import triton.language as tl

    _HAS_TRITON = True
except Exception:  # pragma: no cover - depends on the environment
    triton = None
    tl = None
    _HAS_TRITON = False

__all__ = ["LatentStore"]

_ALIGN = 16  # byte alignment of each section of a staging buffer
_MAX_NAMES_PER_LAUNCH = 4  # the Triton kernel takes up to four (src, dst) pairs per launch
_SPLIT_SLOTS_BYTES = 1 << 20  # host pipeline: entries above this copy their slots separately
_WORDS = ((16, torch.complex128), (8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))

MODE_WRITE, MODE_GATHER = 0, 1


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _staging_layout(n: int, row_bytes: Sequence[int]) -> tuple[list[int], int]:
    """Byte offsets of each name's rows in a staging buffer holding n rows, and its size.
    Section 0 holds the n slots (int64); sections are 16-byte aligned and each holds its n rows
    contiguously, so the used part of a buffer is one contiguous range."""
    off = _align(n * 8)
    offsets = []
    for rb in row_bytes:
        offsets.append(off)
        off = _align(off + n * rb)
    return offsets, off


def _word_dtype(row_bytes: int) -> torch.dtype:
    """Widest dtype whose size divides a row: copies of rows as these words are bit-identical."""
    for size, dtype in _WORDS:
        if row_bytes % size == 0:
            return dtype
    return torch.uint8  # pragma: no cover - size 1 always divides


def _as_words(t: torch.Tensor, word: torch.dtype) -> torch.Tensor | None:
    """`t` ([n, dim]) seen as [n, words] without a copy, or None if its strides/offset forbid it."""
    if t.dtype == word:
        return t
    try:
        return t.view(word)
    except RuntimeError:
        return None


# ------------------------------------------------------------------------------------------------
# Triton kernel: one launch moves rows of up to four latent names.
# ------------------------------------------------------------------------------------------------
if _HAS_TRITON:

    @triton.jit
    def _copy_tile(src, src_stride, dst, dst_stride, src_rows, dst_rows, row_mask, chunk,
                   D: tl.constexpr, BLOCK_D: tl.constexpr):
        cols = chunk * BLOCK_D + tl.arange(0, BLOCK_D)
        mask = row_mask[:, None] & (cols < D)[None, :]
        vals = tl.load(src + src_rows[:, None] * src_stride + cols[None, :], mask=mask)
        tl.store(dst + dst_rows[:, None] * dst_stride + cols[None, :], vals, mask=mask)

    @triton.jit
    def _latent_rows_kernel(
        idx_ptr, n_rows,
        src0, ss0, dst0, ds0,
        src1, ss1, dst1, ds1,
        src2, ss2, dst2, ds2,
        src3, ss3, dst3, ds3,
        D0: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, D3: tl.constexpr,
        E0: tl.constexpr, E1: tl.constexpr, E2: tl.constexpr,
        NUM: tl.constexpr, MODE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        """Rows of token tile `program_id(0)`, column chunk `program_id(1)` of one name.

        Axis 1 enumerates (name, chunk) pairs: name i owns chunks [E_{i-1}, E_i).
        MODE_WRITE:  dst[idx[t]] = src[t], rows with idx < 0 skipped (padding).
        MODE_GATHER: dst[t] = src[idx[t]].
        """
        pid_t = tl.program_id(0)
        pid_c = tl.program_id(1)
        toks = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
        tmask = toks < n_rows
        idx = tl.load(idx_ptr + toks, mask=tmask, other=-1).to(tl.int64)
        toks64 = toks.to(tl.int64)
        if MODE == 0:
            src_rows = toks64
            dst_rows = idx
            rmask = tmask & (idx >= 0)
        else:
            src_rows = idx
            dst_rows = toks64
            rmask = tmask
        if pid_c < E0:
            _copy_tile(src0, ss0, dst0, ds0, src_rows, dst_rows, rmask, pid_c, D0, BLOCK_D)
        if NUM > 1:
            if (pid_c >= E0) & (pid_c < E1):
                _copy_tile(src1, ss1, dst1, ds1, src_rows, dst_rows, rmask, pid_c - E0, D1, BLOCK_D)
        if NUM > 2:
            if (pid_c >= E1) & (pid_c < E2):
                _copy_tile(src2, ss2, dst2, ds2, src_rows, dst_rows, rmask, pid_c - E1, D2, BLOCK_D)
        if NUM > 3:
            if pid_c >= E2:
                _copy_tile(src3, ss3, dst3, ds3, src_rows, dst_rows, rmask, pid_c - E2, D3, BLOCK_D)


def _launch_config(n_rows: int, max_dim: int) -> tuple[int, int, int]:
    """(BLOCK_T, BLOCK_D, num_warps): tiles of ~8K elements (16 KiB of bf16) per program."""
    block_d = min(1024, triton.next_power_of_2(max(max_dim, 16)))
    block_t = max(1, min(128, 8192 // block_d))
    return block_t, block_d, 4


def launch_rows(mode: int, idx: torch.Tensor, n_rows: int,
                pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """One Triton launch per group of four (src, dst) pairs; tensors are [rows, dim], stride(1)=1."""
    if n_rows == 0:
        return
    for g in range(0, len(pairs), _MAX_NAMES_PER_LAUNCH):
        group = list(pairs[g:g + _MAX_NAMES_PER_LAUNCH])
        dims = [src.shape[1] for src, _ in group]
        block_t, block_d, warps = _launch_config(n_rows, max(dims))
        chunks = [triton.cdiv(d, block_d) for d in dims]
        ends = [sum(chunks[:i + 1]) for i in range(len(chunks))]
        num = len(group)
        while len(group) < _MAX_NAMES_PER_LAUNCH:  # unused slots: never touched (NUM guards them)
            group.append(group[0])
            dims.append(dims[0])
            ends.append(ends[-1])
        args: list[Any] = []
        for src, dst in group:
            args += [src, src.stride(0), dst, dst.stride(0)]
        grid = (triton.cdiv(n_rows, block_t), ends[num - 1])
        _latent_rows_kernel[grid](
            idx, n_rows, *args,
            D0=dims[0], D1=dims[1], D2=dims[2], D3=dims[3],
            E0=ends[0], E1=ends[1], E2=ends[2],
            NUM=num, MODE=mode, BLOCK_T=block_t, BLOCK_D=block_d, num_warps=warps,
        )


# ------------------------------------------------------------------------------------------------
# Host pipeline (storage="host" on CUDA)
# ------------------------------------------------------------------------------------------------
class _NullEvent:
    """Stand-in for torch.cuda.Event in the CPU emulation of the pipeline (tests only)."""

    def record(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _Entry:
    __slots__ = ("index", "dev_buf", "host_buf", "packed", "slots_done", "data_done", "slots_ev",
                 "seq", "n", "registered", "handles")

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
    """What the drain thread shares with the store (the thread holds no reference to the store).
    Entries reach it through a SimpleQueue (a put costs ~0.1 us and takes no lock the thread may
    hold); `cond` only guards `drained`/`error` for callers that must wait."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.drained = 0  # every write chunk with seq <= drained is in the host mirror
        self.error: BaseException | None = None
        self.queue: queue.SimpleQueue = queue.SimpleQueue()  # entries; None = stop


def _drain_loop(state: _DrainState, scatter, num_threads: int | None = None,
                ready: threading.Event | None = None) -> None:
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


class LatentStore:
    """Hidden-state mirror of one KV-cache group: `[num_blocks, block_size, dim]` per latent name.

    Args:
        specs: name -> (dim, dtype).
        num_blocks, block_size: of the mirrored KV-cache group.
        storage: "host" (mirror in host memory, page-locked when `device` is CUDA) or "device"
            (mirror on `device`). The same thing on CPU.
        device: where the model's latents live; `write` takes and `gather` returns tensors there.
        staging_tokens, staging_depth: host pipeline ring (CUDA + host only): rows per entry and
            number of entries; in flight at most `staging_nbytes` device + the same pinned host bytes.
        host_gather: CUDA + host only: "zero_copy" (a Triton kernel reads the page-locked mirror
            over PCIe) or "staging" (CPU index_select into a pinned buffer, one H2D copy).
        use_triton: None = use Triton on CUDA when importable; False forces the torch fallback.
        drain_threads: CUDA + host only: intra-op threads of the drain thread's host scatter
            (None: torch's default, all cores).
        use_driver: CUDA + host only: issue a write's copies and events through the CUDA driver
            (ctypes, ~1 us a call) rather than torch (~5 us a call); False forces torch.

    `write` on a device mirror can be captured in a CUDA graph; on a host mirror it cannot (it
    records events and switches streams): call it eagerly after the graph replay. `stats` counts
    writes, ring entries used, writes that waited for a free ring entry and gathers that waited
    for an in-flight copy. `close()` (or garbage collection) stops the drain thread.
    """

    def __init__(
        self,
        specs: Mapping[str, tuple[int, torch.dtype]],
        num_blocks: int,
        block_size: int,
        *,
        storage: Literal["host", "device"] = "host",
        device: torch.device | str = "cpu",
        staging_tokens: int | None = None,
        staging_depth: int = 3,
        host_gather: Literal["zero_copy", "staging"] = "zero_copy",
        use_triton: bool | None = None,
        drain_threads: int | None = 4,
        use_driver: bool = True,
        _emulate_pipeline: bool = False,
    ) -> None:
        if not specs:
            raise ValueError("LatentStore needs at least one latent name")
        if storage not in ("host", "device"):
            raise ValueError(f"storage must be 'host' or 'device', not {storage!r}")
        if host_gather not in ("zero_copy", "staging"):
            raise ValueError(f"host_gather must be 'zero_copy' or 'staging', not {host_gather!r}")
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.names: tuple[str, ...] = tuple(specs)
        self.specs: dict[str, tuple[int, torch.dtype]] = {n: (int(d), dt) for n, (d, dt) in specs.items()}
        self.num_blocks = int(num_blocks)
        self.block_size = int(block_size)
        self.num_slots = self.num_blocks * self.block_size
        self.storage = storage
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._trash = self.num_slots  # row that absorbs padding (-1) writes; never gathered
        cuda = self.device.type == "cuda"
        self._use_triton = cuda and _HAS_TRITON and use_triton is not False
        if use_triton and not self._use_triton:
            raise RuntimeError("use_triton=True needs a CUDA device and an importable triton")

        self._row_bytes = {n: d * dt.itemsize for n, (d, dt) in self.specs.items()}
        self._row_bytes_seq = tuple(self._row_bytes[n] for n in self.names)
        self._word = {n: _word_dtype(rb) for n, rb in self._row_bytes.items()}
        # The host pipeline runs for host storage on CUDA, or emulated on CPU (tests only).
        self._pipelined = (storage == "host" and cuda) or _emulate_pipeline
        self._emulated = _emulate_pipeline and not cuda
        self.host_gather = host_gather if (self._pipelined and self._use_triton) else "staging"
        if not self._pipelined:
            self.host_gather = "n/a"

        mirror_device = self.device if (storage == "device" or not cuda) else torch.device("cpu")
        self._flat: dict[str, torch.Tensor] = {}  # name -> [num_slots + 1, dim] (last = trash row)
        self._flat_w: dict[str, torch.Tensor] = {}  # the same memory as words
        self._registered: list[int] = []
        for n, (d, dt) in self.specs.items():
            t = torch.zeros(self.num_slots + 1, d, dtype=dt, device=mirror_device)
            if self._pipelined and not self._emulated:
                t = self._page_lock(t)
            self._flat[n] = t
            self._flat_w[n] = t.view(self._word[n])
        self.nbytes = sum(t.numel() * t.element_size() for t in self._flat.values())
        self.staging_nbytes = 0
        self.stats = {"writes": 0, "chunks": 0, "ring_waits": 0, "gather_waits": 0}
        self._closed = False
        self._drain_threads = min(drain_threads, torch.get_num_threads()) if drain_threads else None
        if self._pipelined:
            self._init_pipeline(staging_tokens, staging_depth, use_driver)
        else:
            self.staging_tokens, self.staging_depth = 0, 0

    # ---- public API ----------------------------------------------------------------------------
    def tensor(self, name: str) -> torch.Tensor:
        """The mirror of `name` as `[num_blocks, block_size, dim]` (a view; for inspection)."""
        return self._flat[name][: self.num_slots].view(self.num_blocks, self.block_size, -1)

    def write(self, slot_mapping: torch.Tensor, latents: Mapping[str, torch.Tensor]) -> None:
        """Store the latents of a step's tokens at their slots (-1 = padding, skipped).

        slot_mapping: int64/int32 [N] on `device`; latents[name]: [>= N, dim] on `device` (rows past
        N are ignored). Within one call, non-negative slots are expected to be distinct (as in a
        vLLM step); across calls the later write wins.
        """
        n = slot_mapping.shape[0]
        srcs = self._sources(latents, n)
        if n == 0:
            return
        if self._pipelined:
            self._pipeline_write(slot_mapping, srcs, n)
        elif self._use_triton:
            launch_rows(MODE_WRITE, slot_mapping, n, [(srcs[nm], self._flat[nm]) for nm in self.names])
        else:
            idx = self._safe_index(slot_mapping)
            for nm in self.names:
                self._index_copy(nm, idx, srcs[nm])

    def gather(self, slots: torch.Tensor, *, device: torch.device | str | None = None,
               out: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """Rows at `slots` (int64 [M], no -1) as name -> [M, dim] on `device` (default: the store's
        compute device; pass "cpu" with host storage to skip the trip to the GPU). Sees every write
        issued before it.

        `out`: name -> a contiguous [M, dim] tensor per latent to fill instead of allocating (a
        caller that assembles a longer sequence gathers straight into its place, saving a copy);
        returned filled."""
        if out is not None:
            return self._gather_into(slots, out)
        out_dev = self.device if device is None else torch.device(device)
        if self._pipelined:
            return self._pipeline_gather(slots, out_dev)
        if self._use_triton:
            slots = slots.to(self.device, non_blocking=True)
            m = slots.shape[0]
            out = {nm: torch.empty(m, d, dtype=dt, device=self.device) for nm, (d, dt) in self.specs.items()}
            launch_rows(MODE_GATHER, slots, m, [(self._flat[nm], out[nm]) for nm in self.names])
        else:
            slots = slots.to(self._flat[self.names[0]].device)
            out = {nm: self._index_select(nm, slots) for nm in self.names}
        if out_dev != self.device:
            out = {nm: t.to(out_dev) for nm, t in out.items()}
        return out

    def _gather_into(self, slots: torch.Tensor, out: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        self._check_out(out, slots.shape[0])
        if not self._direct(out):  # device and pipelined paths gather into their own buffers first
            rows = self.gather(slots, device=out[self.names[0]].device)
            for nm in self.names:
                out[nm].copy_(rows[nm])
            return dict(out)
        slots = slots.to(self._flat[self.names[0]].device)
        for nm in self.names:
            self._index_select(nm, slots, out=out[nm])
        return dict(out)

    def _check_out(self, out: Mapping[str, torch.Tensor], m: int) -> None:
        for nm in self.names:
            d, dt = self.specs[nm]
            t = out[nm]
            if t.shape != (m, d) or t.dtype != dt or not t.is_contiguous():
                raise ValueError(f"gather out[{nm!r}]: expected contiguous [{m}, {d}] {dt}, "
                                 f"got {tuple(t.shape)} {t.dtype}")

    def _direct(self, out: Mapping[str, torch.Tensor]) -> bool:
        """Whether a gather can go straight from the mirror into `out` with torch on the CPU side."""
        return not self._pipelined and not self._use_triton and all(
            out[nm].device == self._flat[nm].device for nm in self.names)

    def gather_prefix(self, block_ids: Sequence[int], num_tokens: int,
                      out: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Rows of positions 0..num_tokens-1 of a request whose block table is `block_ids`, into
        `out` (as `gather(..., out=out)`). A prefix hit is whole blocks but for at most one: on the
        CPU path those are copied a block at a time (one index per `block_size` rows of a block-major
        view), which runs at memcpy speed where a row-by-row `index_select` of 1 KiB rows took up to
        twice as long; the tail of a partial last block goes row by row."""
        full = num_tokens // self.block_size
        if full == 0 or not self._direct(out):
            return self.gather(self.prefix_slots(block_ids, self.block_size, num_tokens), out=out)
        self._check_out(out, num_tokens)
        blocks = torch.as_tensor(block_ids[:full], dtype=torch.int64)
        rows = full * self.block_size
        for nm in self.names:
            by_block = self._flat_w[nm][: self.num_slots].view(self.num_blocks, -1)
            dst = out[nm][:rows].view(self._word[nm]).view(full, -1)
            torch.index_select(by_block, 0, blocks, out=dst)
        if rows < num_tokens:
            tail = self.prefix_slots(block_ids, self.block_size, num_tokens, start=rows)
            for nm in self.names:
                self._index_select(nm, tail, out=out[nm][rows:])
        return dict(out)

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy every row of block src to block dst, for each (src, dst): the mirror's side of
        vLLM's copy-on-write of a shared KV block. Ordered after earlier writes, before later ones."""
        if not pairs:
            return
        blocks = torch.tensor(pairs, dtype=torch.int64)
        offsets = torch.arange(self.block_size, dtype=torch.int64)
        src, dst = ((blocks[:, i, None] * self.block_size + offsets).flatten() for i in (0, 1))
        self.write(dst.to(self.device), self.gather(src))

    @staticmethod
    def prefix_slots(block_ids: Sequence[int] | torch.Tensor, block_size: int, num_tokens: int,
                     start: int = 0) -> torch.Tensor:
        """Slots of positions start..num_tokens-1 of a request whose block table is `block_ids`
        (int64; on block_ids' device when it is a tensor, else on CPU)."""
        if num_tokens <= start:
            dev = block_ids.device if isinstance(block_ids, torch.Tensor) else "cpu"
            return torch.empty(0, dtype=torch.int64, device=dev)
        first, last = start // block_size, (num_tokens - 1) // block_size
        if len(block_ids) <= last:
            raise ValueError(f"{num_tokens} tokens need {last + 1} blocks, the table has {len(block_ids)}")
        blocks = torch.as_tensor(block_ids[first:last + 1], dtype=torch.int64)
        offsets = torch.arange(block_size, dtype=torch.int64, device=blocks.device)
        slots = (blocks[:, None] * block_size + offsets).flatten()
        lo = start - first * block_size
        return slots[lo: lo + num_tokens - start]

    def synchronize(self) -> None:
        """Wait until every write issued so far is in the mirror (host pipeline: all copies done)."""
        if self._pipelined:
            self._wait_drained(self._seq)

    def close(self) -> None:
        """Stop the drain thread (after it finished in-flight writes) and unpin the mirror."""
        if self._pipelined and not self._closed:
            with contextlib.suppress(Exception):
                self.synchronize()
            self._finalizer()
        self._closed = True

    def __enter__(self) -> "LatentStore":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        spec = ", ".join(f"{n}[{d}, {str(dt).removeprefix('torch.')}]" for n, (d, dt) in self.specs.items())
        return (f"LatentStore({spec}; {self.num_blocks}x{self.block_size} slots, storage={self.storage}, "
                f"device={self.device}, {self.nbytes / 2**20:.1f} MiB)")

    # ---- torch paths (CPU, and the CUDA fallback) -----------------------------------------------
    def _sources(self, latents: Mapping[str, torch.Tensor], n: int) -> dict[str, torch.Tensor]:
        srcs = {}
        for nm in self.names:
            try:
                t = latents[nm]
            except KeyError:
                raise KeyError(f"write() is missing latent {nm!r} (store holds {self.names})") from None
            d, dt = self.specs[nm]
            if t.dim() != 2 or t.shape[1] != d or t.shape[0] < n:
                raise ValueError(f"latent {nm!r}: expected [>={n}, {d}], got {list(t.shape)}")
            t = t[:n]
            if t.dtype != dt:
                t = t.to(dt)
            if t.stride(1) != 1:
                t = t.contiguous()
            srcs[nm] = t
        return srcs

    def _safe_index(self, slot_mapping: torch.Tensor) -> torch.Tensor:
        """slot_mapping with -1 mapped to the trash row, int64 (no sync, fixed shape)."""
        if slot_mapping.dtype != torch.int64:
            slot_mapping = slot_mapping.long()
        return torch.where(slot_mapping < 0, self._trash, slot_mapping)

    def _index_copy(self, name: str, idx: torch.Tensor, src: torch.Tensor) -> None:
        words = _as_words(src, self._word[name])
        if words is not None:
            self._flat_w[name].index_copy_(0, idx, words)
        else:
            self._flat[name].index_copy_(0, idx, src)

    def _index_select(self, name: str, slots: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        d, dt = self.specs[name]
        if out is None:
            return torch.index_select(self._flat_w[name], 0, slots).view(dt).view(-1, d)
        torch.index_select(self._flat_w[name], 0, slots, out=out.view(self._word[name]))
        return out

    # ---- host pipeline ---------------------------------------------------------------------------
    def _page_lock(self, t: torch.Tensor) -> torch.Tensor:
        """Page-lock `t` in place (exact size) so the GPU can DMA/zero-copy read it; falls back to
        torch's pinned allocator if registration is refused."""
        nbytes = t.numel() * t.element_size()
        err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, 0)
        if int(err) == 0:
            self._registered.append(t.data_ptr())
            return t
        return t.pin_memory()

    def _init_pipeline(self, staging_tokens: int | None, staging_depth: int, use_driver: bool) -> None:
        row = 8 + sum(self._row_bytes.values())  # slot + the rows of every name
        if staging_tokens is None:  # vLLM's usual max_num_batched_tokens, <= 128 MiB per entry
            staging_tokens = max(256, min(8192, (128 << 20) // row))
        if staging_tokens <= 0 or staging_depth <= 0:
            raise ValueError("staging_tokens and staging_depth must be positive")
        self.staging_tokens, self.staging_depth = int(staging_tokens), int(staging_depth)
        cap = self._layout(self.staging_tokens)[1]
        self.staging_nbytes = cap * self.staging_depth
        dev = self.device if not self._emulated else torch.device("cpu")
        self._entries: list[_Entry] = []
        for i in range(self.staging_depth):
            dev_buf = torch.empty(cap, dtype=torch.uint8, device=dev)
            if self._emulated:
                host_buf = torch.empty(cap, dtype=torch.uint8)
                events: tuple = (_NullEvent(), _NullEvent(), _NullEvent())
            else:
                host_buf = torch.empty(cap, dtype=torch.uint8, pin_memory=True)
                events = (torch.cuda.Event(), torch.cuda.Event(blocking=True),
                          torch.cuda.Event(blocking=True))
            self._entries.append(_Entry(i, dev_buf, host_buf, events))
        self._next = 0
        self._seq = 0  # sequence number of the last write chunk issued
        self._inflight: collections.deque[_Entry] = collections.deque()  # main thread's view
        self._slot_seq = torch.zeros(self.num_slots + 1, dtype=torch.int64)  # last writer (registered)
        self._copy_stream = None if self._emulated else torch.cuda.Stream(self.device)
        # The caller's share of a write through the CUDA driver (a few us) where it loads, else
        # through torch (~4-6 us per operation); same copies, same streams, same events.
        self._drv = None if (self._emulated or not use_driver) else cuda_driver.driver()
        if self._drv is not None:
            self._cs_handle = self._copy_stream.cuda_stream
            self._compute_handle = cuda_driver.current_stream_handle(self.device.index)
            for e in self._entries:
                e.handles = (e.dev_buf.data_ptr(), e.host_buf.data_ptr(),
                             *(cuda_driver.event_handle(ev, self._copy_stream)
                               for ev in (e.packed, e.slots_done, e.data_done)))
        self._state = _DrainState()
        flat_w, word, trash = self._flat_w, self._word, self._trash
        names, row_bytes = self.names, self._row_bytes_seq

        def scatter(entry: _Entry) -> None:  # runs on the drain thread; holds no ref to the store
            offsets, _ = _staging_layout(entry.n, row_bytes)
            buf = entry.host_buf
            slots = buf[: entry.n * 8].view(torch.int64)
            idx = torch.where(slots < 0, trash, slots)
            for nm, off in zip(names, offsets):
                w = flat_w[nm]
                rows = buf[off: off + entry.n * w.shape[1] * w.element_size()].view(word[nm])
                w.index_copy_(0, idx, rows.view(entry.n, -1))

        ready = threading.Event()
        self._thread = threading.Thread(
            target=_drain_loop, args=(self._state, scatter, self._drain_threads, ready),
            name="latent-store-drain", daemon=True)
        prev_threads = torch.get_num_threads()
        self._thread.start()
        ready.wait()
        if self._drain_threads:
            torch.set_num_threads(prev_threads)  # restore the process-wide default for new threads
        self._finalizer = weakref.finalize(self, _stop_drain, self._state, self._thread, self._registered)

    def _layout(self, n: int) -> tuple[list[int], int]:
        return _staging_layout(n, self._row_bytes_seq)

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

    def _pipeline_write(self, slot_mapping: torch.Tensor, srcs: dict[str, torch.Tensor], n: int) -> None:
        self._check_error()
        if self._closed:
            raise RuntimeError("write() on a closed LatentStore")
        self.stats["writes"] += 1
        if slot_mapping.dtype != torch.int64:  # the staging buffer holds int64 slots
            slot_mapping = slot_mapping.long()
        for lo in range(0, n, self.staging_tokens):
            hi = min(n, lo + self.staging_tokens)
            self._write_chunk(slot_mapping[lo:hi], {nm: t[lo:hi] for nm, t in srcs.items()}, hi - lo)

    def _write_chunk(self, slot_mapping: torch.Tensor, srcs: dict[str, torch.Tensor], n: int) -> None:
        entry = self._entries[self._next]
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

    def _issue_torch(self, entry: _Entry, slot_mapping: torch.Tensor, srcs: dict[str, torch.Tensor],
                     n: int, offsets: list[int], total: int, lo: int) -> None:
        """Steps 1 and 2 of the pipeline through torch (also the CPU emulation's "copies")."""
        buf = entry.dev_buf
        # 1. snapshot on the compute stream: k + 1 contiguous device copies (cheaper to launch than
        #    one Triton kernel, and as fast on the GPU)
        buf[: n * 8].view(torch.int64).copy_(slot_mapping)
        for nm, off in zip(self.names, offsets):
            buf[off: off + n * self._row_bytes[nm]].view(self.specs[nm][1]).view(n, -1).copy_(srcs[nm])
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

    def _issue_driver(self, entry: _Entry, slot_mapping: torch.Tensor, srcs: dict[str, torch.Tensor],
                      n: int, offsets: list[int], total: int, lo: int) -> None:
        """Steps 1 and 2 of the pipeline (see the module docstring) as raw driver calls."""
        drv, compute, cs = self._drv, self._compute_handle(), self._cs_handle
        dev, host, packed, slots_done, data_done = entry.handles
        if not slot_mapping.is_contiguous():
            slot_mapping = slot_mapping.contiguous()
        drv.copy_d2d(dev, slot_mapping.data_ptr(), n * 8, compute)
        for nm, off in zip(self.names, offsets):
            src = srcs[nm]
            if not src.is_contiguous():  # a temporary on the compute stream: freed in order
                src = src.contiguous()
            drv.copy_d2d(dev + off, src.data_ptr(), n * self._row_bytes[nm], compute)
        drv.record(packed, compute)
        drv.wait(cs, packed)
        if lo:
            drv.copy_d2h(host, dev, n * 8, cs)
            drv.record(slots_done, cs)
        drv.copy_d2h(host + lo, dev + lo, total - lo, cs)
        drv.record(data_done, cs)

    def _needed_seq(self, slots: torch.Tensor) -> int:
        """Sequence number of the newest in-flight write chunk that wrote one of `slots` (0: none)."""
        self._retire()
        if not self._inflight or slots.numel() == 0:
            return 0
        for entry in list(self._inflight):
            if entry.registered:
                continue
            entry.slots_ev.synchronize()  # small copy; FIFO: every earlier entry's rows are in too
            hs = entry.host_buf[: entry.n * 8].view(torch.int64)
            self._slot_seq.index_fill_(0, torch.where(hs < 0, self._trash, hs), entry.seq)
            entry.registered = True
        return int(self._slot_seq[slots].max())

    def _pipeline_gather(self, slots: torch.Tensor, out_dev: torch.device) -> dict[str, torch.Tensor]:
        self._check_error()
        slots_cpu = slots.to("cpu")
        if slots_cpu.dtype != torch.int64:
            slots_cpu = slots_cpu.long()
        need = self._needed_seq(slots_cpu)
        if need > self._state.drained:
            self.stats["gather_waits"] += 1
            self._wait_drained(need)
        m = slots_cpu.shape[0]
        if out_dev.type == "cpu" or self._emulated:
            out = {nm: self._index_select(nm, slots_cpu) for nm in self.names}
            return {nm: t.to(out_dev) for nm, t in out.items()} if out_dev.type != "cpu" else out
        if self.host_gather == "zero_copy":
            idx = slots_cpu.to(out_dev, non_blocking=True)
            out = {nm: torch.empty(m, d, dtype=dt, device=out_dev) for nm, (d, dt) in self.specs.items()}
            try:
                launch_rows(MODE_GATHER, idx, m, [(self._flat[nm], out[nm]) for nm in self.names])
                return out
            except (ValueError, RuntimeError) as exc:  # the driver refused the host pointer
                warnings.warn(f"latent store: zero-copy gather unavailable ({exc}); using staging")
                self.host_gather = "staging"
        # staging: CPU index_select per name into one pinned buffer, then one H2D copy
        offsets, total = self._layout(m)
        host = torch.empty(total, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(total, dtype=torch.uint8, device=out_dev)
        views = {}
        for nm, off in zip(self.names, offsets):
            d, dt = self.specs[nm]
            sl = slice(off, off + m * self._row_bytes[nm])
            self._index_select(nm, slots_cpu, out=host[sl].view(dt).view(m, d))
            views[nm] = dev[sl].view(dt).view(m, d)
        dev[offsets[0]:].copy_(host[offsets[0]:], non_blocking=True)
        return views
