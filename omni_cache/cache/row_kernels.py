"""Moving latent rows: word views, the staging-buffer layout and the Triton row-copy kernel.

Rows as words: a row of any dtype is copied bit-identically as the widest word that divides its
size (complex128 = 16 bytes where it can). Torch's element-wise CPU index kernels (`index_copy_`,
`index_select`) run at memcpy speed on such words, measured 2-3x faster than on bf16 elements, so
the CPU paths of `LatentStore` and the host pipeline's scatter move words, never elements.

The Triton kernel: ONE launch moves the rows of up to four latent names (grid = token tiles x
(name, column-chunk) tiles). In write mode rows whose slot is -1 (padding) are masked inside the
kernel, so a launch needs no host synchronisation and has fixed shapes: a write can be captured in
a CUDA graph. In gather mode the source may be a page-locked host tensor: the kernel then reads it
straight over PCIe ("zero copy").

The staging layout: one contiguous buffer holding a step's slots and then each name's rows
(`[slots | rows of name 0 | ...]`, 16-byte aligned sections), so that the used part of a buffer is
one contiguous range (one copy between device and host).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

try:  # Triton is optional: only the CUDA paths launch its kernel (CPU runs plain torch ops).
    import triton
    import triton.language as tl

    HAS_TRITON = True
except Exception:  # pragma: no cover - depends on the environment
    triton = None
    tl = None
    HAS_TRITON = False

__all__ = [
    "HAS_TRITON",
    "MODE_GATHER",
    "MODE_WRITE",
    "as_words",
    "launch_config",
    "launch_rows",
    "select_rows",
    "staging_layout",
    "word_dtype",
]

_ALIGN = 16  # byte alignment of each section of a staging buffer
_MAX_NAMES_PER_LAUNCH = 4  # the Triton kernel takes up to four (src, dst) pairs per launch
_WORDS = ((16, torch.complex128), (8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))

MODE_WRITE, MODE_GATHER = 0, 1


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def staging_layout(n: int, row_bytes: Sequence[int]) -> tuple[list[int], int]:
    """Byte offsets of each name's rows in a staging buffer holding n rows, and its size.
    Section 0 holds the n slots (int64); sections are 16-byte aligned and each holds its n rows
    contiguously, so the used part of a buffer is one contiguous range."""
    off = _align(n * 8)
    offsets = []
    for rb in row_bytes:
        offsets.append(off)
        off = _align(off + n * rb)
    return offsets, off


def word_dtype(row_bytes: int) -> torch.dtype:
    """Widest dtype whose size divides a row: copies of rows as these words are bit-identical."""
    for size, dtype in _WORDS:
        if row_bytes % size == 0:
            return dtype
    return torch.uint8  # pragma: no cover - size 1 always divides


def as_words(t: torch.Tensor, word: torch.dtype) -> torch.Tensor | None:
    """`t` ([n, dim]) seen as [n, words] without a copy, or None if its strides/offset forbid it."""
    if t.dtype == word:
        return t
    try:
        return t.view(word)
    except RuntimeError:
        return None


def select_rows(
    words: torch.Tensor, slots: torch.Tensor, dim: int, dtype: torch.dtype, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Rows `slots` of a mirror seen as words (`[rows, words]`), as `[len(slots), dim]` of
    `dtype`: into `out` (contiguous) when given, else a new tensor."""
    if out is None:
        return torch.index_select(words, 0, slots).view(dtype).view(-1, dim)
    torch.index_select(words, 0, slots, out=out.view(words.dtype))
    return out


# ------------------------------------------------------------------------------------------------
# Triton kernel: one launch moves rows of up to four latent names.
# ------------------------------------------------------------------------------------------------
if HAS_TRITON:

    @triton.jit
    def _copy_tile(
        src, src_stride, dst, dst_stride, src_rows, dst_rows, row_mask, chunk, D: tl.constexpr, BLOCK_D: tl.constexpr
    ):
        cols = chunk * BLOCK_D + tl.arange(0, BLOCK_D)
        mask = row_mask[:, None] & (cols < D)[None, :]
        vals = tl.load(src + src_rows[:, None] * src_stride + cols[None, :], mask=mask)
        tl.store(dst + dst_rows[:, None] * dst_stride + cols[None, :], vals, mask=mask)

    @triton.jit
    def _latent_rows_kernel(
        idx_ptr,
        n_rows,
        src0,
        ss0,
        dst0,
        ds0,
        src1,
        ss1,
        dst1,
        ds1,
        src2,
        ss2,
        dst2,
        ds2,
        src3,
        ss3,
        dst3,
        ds3,
        D0: tl.constexpr,
        D1: tl.constexpr,
        D2: tl.constexpr,
        D3: tl.constexpr,
        E0: tl.constexpr,
        E1: tl.constexpr,
        E2: tl.constexpr,
        NUM: tl.constexpr,
        MODE: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_D: tl.constexpr,
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


def launch_config(n_rows: int, max_dim: int) -> tuple[int, int, int]:
    """(BLOCK_T, BLOCK_D, num_warps): tiles of ~8K elements (16 KiB of bf16) per program.
    A module-level function looked up at each launch, so a benchmark can sweep other tiles."""
    block_d = min(1024, triton.next_power_of_2(max(max_dim, 16)))
    block_t = max(1, min(128, 8192 // block_d))
    return block_t, block_d, 4


def launch_rows(mode: int, idx: torch.Tensor, n_rows: int, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """One Triton launch per group of four (src, dst) pairs; tensors are [rows, dim], stride(1)=1."""
    if n_rows == 0:
        return
    for g in range(0, len(pairs), _MAX_NAMES_PER_LAUNCH):
        group = list(pairs[g : g + _MAX_NAMES_PER_LAUNCH])
        dims = [src.shape[1] for src, _ in group]
        block_t, block_d, warps = launch_config(n_rows, max(dims))
        chunks = [triton.cdiv(d, block_d) for d in dims]
        ends = [sum(chunks[: i + 1]) for i in range(len(chunks))]
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
            idx,
            n_rows,
            *args,
            D0=dims[0],
            D1=dims[1],
            D2=dims[2],
            D3=dims[3],
            E0=ends[0],
            E1=ends[1],
            E2=ends[2],
            NUM=num,
            MODE=mode,
            BLOCK_T=block_t,
            BLOCK_D=block_d,
            num_warps=warps,
        )
