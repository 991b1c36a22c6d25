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
  plus one `index_copy_` per name, `gather` one `index_select` per name, both on the rows seen as
  words (`omni_cache.cache.row_kernels`: memcpy speed).
* CUDA, `storage="device"`: the mirror lives in GPU memory. `write` and `gather` are ONE Triton
  launch each for up to four names (`row_kernels.launch_rows`), with no host synchronisation and
  fixed shapes, so `write` can be captured in a CUDA graph. Without Triton: `torch.where` +
  `index_copy_` per name (also graph-safe).
* CUDA, `storage="host"` (the default): the mirror lives in page-locked host memory and is written
  through a ring of staging buffers, a copy stream and a drain thread, so that a write never stalls
  the forward pass; a gather waits only for the in-flight writes it needs
  (`omni_cache.cache.host_pipeline`, which the store owns).

The store owns no eviction logic: vLLM's block pool decides which slots are live.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch

from omni_cache.cache.host_pipeline import HostMirror, HostPipeline, page_lock
from omni_cache.cache.row_kernels import (
    HAS_TRITON,
    MODE_GATHER,
    MODE_WRITE,
    as_words,
    launch_rows,
    select_rows,
    word_dtype,
)

__all__ = ["LatentStore"]


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
        self._use_triton = cuda and HAS_TRITON and use_triton is not False
        if use_triton and not self._use_triton:
            raise RuntimeError("use_triton=True needs a CUDA device and an importable triton")

        row_bytes = {n: d * dt.itemsize for n, (d, dt) in self.specs.items()}
        self._word = {n: word_dtype(rb) for n, rb in row_bytes.items()}
        # The host pipeline runs for host storage on CUDA, or emulated on CPU (tests only).
        self._pipelined = (storage == "host" and cuda) or _emulate_pipeline
        emulated = _emulate_pipeline and not cuda

        mirror_device = self.device if (storage == "device" or not cuda) else torch.device("cpu")
        self._flat: dict[str, torch.Tensor] = {}  # name -> [num_slots + 1, dim] (last = trash row)
        self._flat_w: dict[str, torch.Tensor] = {}  # the same memory as words
        registered: list[int] = []  # page-locked pointers, unregistered by the pipeline
        for n, (d, dt) in self.specs.items():
            t = torch.zeros(self.num_slots + 1, d, dtype=dt, device=mirror_device)
            if self._pipelined and not emulated:
                t = page_lock(t, registered)
            self._flat[n] = t
            self._flat_w[n] = t.view(self._word[n])
        self.nbytes = sum(t.numel() * t.element_size() for t in self._flat.values())
        self.stats = {"writes": 0, "chunks": 0, "ring_waits": 0, "gather_waits": 0}
        self._pipeline: HostPipeline | None = None
        self.staging_tokens, self.staging_depth, self.staging_nbytes = 0, 0, 0
        if self._pipelined:
            mirror = HostMirror(
                self.names, self.specs, self._flat, self._flat_w, tuple(row_bytes[n] for n in self.names), self._trash
            )
            self._pipeline = HostPipeline(
                mirror,
                self.device,
                staging_tokens=staging_tokens,
                staging_depth=staging_depth,
                host_gather=host_gather if self._use_triton else "staging",
                drain_threads=drain_threads,
                use_driver=use_driver,
                emulated=emulated,
                stats=self.stats,
                registered=registered,
            )
            p = self._pipeline
            self.staging_tokens, self.staging_depth, self.staging_nbytes = (
                p.staging_tokens,
                p.staging_depth,
                p.staging_nbytes,
            )

    # ---- public API ----------------------------------------------------------------------------
    @property
    def host_gather(self) -> str:
        """How a gather reads a CUDA host mirror: "zero_copy" or "staging" (also once the driver
        refused a zero-copy read); "staging" for the CPU emulation, "n/a" without a pipeline."""
        return self._pipeline.host_gather if self._pipeline is not None else "n/a"

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
        if self._pipeline is not None:
            self._pipeline.write(slot_mapping, srcs, n)
        elif self._use_triton:
            launch_rows(MODE_WRITE, slot_mapping, n, [(srcs[nm], self._flat[nm]) for nm in self.names])
        else:
            idx = self._safe_index(slot_mapping)
            for nm in self.names:
                self._index_copy(nm, idx, srcs[nm])

    def gather(
        self,
        slots: torch.Tensor,
        *,
        device: torch.device | str | None = None,
        out: Mapping[str, torch.Tensor] | None = None,
    ) -> dict[str, torch.Tensor]:
        """Rows at `slots` (int64 [M], no -1) as name -> [M, dim] on `device` (default: the store's
        compute device; pass "cpu" with host storage to skip the trip to the GPU). Sees every write
        issued before it.

        `out`: name -> a contiguous [M, dim] tensor per latent to fill instead of allocating (a
        caller that assembles a longer sequence gathers straight into its place, saving a copy);
        returned filled."""
        if out is not None:
            return self._gather_into(slots, out)
        out_dev = self.device if device is None else torch.device(device)
        if self._pipeline is not None:
            return self._pipeline.gather(slots, out_dev)
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
                raise ValueError(
                    f"gather out[{nm!r}]: expected contiguous [{m}, {d}] {dt}, got {tuple(t.shape)} {t.dtype}"
                )

    def _direct(self, out: Mapping[str, torch.Tensor]) -> bool:
        """Whether a gather can go straight from the mirror into `out` with torch on the CPU side."""
        return (
            not self._pipelined
            and not self._use_triton
            and all(out[nm].device == self._flat[nm].device for nm in self.names)
        )

    def gather_prefix(
        self, block_ids: Sequence[int], num_tokens: int, out: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
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
    def prefix_slots(
        block_ids: Sequence[int] | torch.Tensor, block_size: int, num_tokens: int, start: int = 0
    ) -> torch.Tensor:
        """Slots of positions start..num_tokens-1 of a request whose block table is `block_ids`
        (int64; on block_ids' device when it is a tensor, else on CPU)."""
        if num_tokens <= start:
            dev = block_ids.device if isinstance(block_ids, torch.Tensor) else "cpu"
            return torch.empty(0, dtype=torch.int64, device=dev)
        first, last = start // block_size, (num_tokens - 1) // block_size
        if len(block_ids) <= last:
            raise ValueError(f"{num_tokens} tokens need {last + 1} blocks, the table has {len(block_ids)}")
        blocks = torch.as_tensor(block_ids[first : last + 1], dtype=torch.int64)
        offsets = torch.arange(block_size, dtype=torch.int64, device=blocks.device)
        slots = (blocks[:, None] * block_size + offsets).flatten()
        lo = start - first * block_size
        return slots[lo : lo + num_tokens - start]

    def synchronize(self) -> None:
        """Wait until every write issued so far is in the mirror (host pipeline: all copies done)."""
        if self._pipeline is not None:
            self._pipeline.synchronize()

    def close(self) -> None:
        """Stop the drain thread (after it finished in-flight writes) and unpin the mirror."""
        if self._pipeline is not None:
            self._pipeline.close()

    def __enter__(self) -> LatentStore:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        spec = ", ".join(f"{n}[{d}, {str(dt).removeprefix('torch.')}]" for n, (d, dt) in self.specs.items())
        return (
            f"LatentStore({spec}; {self.num_blocks}x{self.block_size} slots, storage={self.storage}, "
            f"device={self.device}, {self.nbytes / 2**20:.1f} MiB)"
        )

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
        words = as_words(src, self._word[name])
        if words is not None:
            self._flat_w[name].index_copy_(0, idx, words)
        else:
            self._flat[name].index_copy_(0, idx, src)

    def _index_select(self, name: str, slots: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        d, dt = self.specs[name]
        return select_rows(self._flat_w[name], slots, d, dt, out)
