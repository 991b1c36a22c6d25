"""Block-boundary states from GatedDeltaNet's chunked kernel (the CUDA path), without cutting.

flash-linear-attention's chunked forward (the kernel vLLM runs for GatedDeltaNet prefill on CUDA)
computes `h`, the recurrent state before every 64-token chunk of every sequence, to produce the
output, then drops it. The state after `o` tokens of a sequence is `h` at that sequence's chunk
`o / 64`, so a block boundary inside a prefill chunk costs one gather from `h` and one copy into
its state block: no second pass, no cut.

Limits: a boundary must fall on a 64-token chunk edge of its sequence (block sizes and chunk starts
that are multiples of 64: 384 and 640 are, Qwen3-Next-80B's 544 is not), and `h` is kept in the
kernel's input dtype (bfloat16), so these states are bfloat16-rounded where the final state is
float32. Measured on an H100/H200 by benchmarks/gdn_kernel_states.py (benchmarks/results/hybrid_block_states.md).
Kept with the benchmarks, not in the product: vLLM cannot be installed on the GPU machines this
project can test on, so the engine keeps block states to its CPU path
(scheduler/mamba_block_states.py) and this design is measured, not served.
"""

from __future__ import annotations

import torch

CHUNK = 64  # flash-linear-attention's GatedDeltaNet chunk size


def chunk_state_rows(seq_lens: list[int], boundaries: list[list[int]], chunk: int = CHUNK) -> list[int]:
    """Rows of the kernel's `h` (chunks of all sequences, in order) holding the state after each
    boundary (tokens into its sequence's query)."""
    rows, first = [], 0
    for length, offsets in zip(seq_lens, boundaries):
        for offset in offsets:
            if not 0 < offset < length or offset % chunk:
                raise ValueError(
                    f"boundary {offset} of a {length}-token sequence is not an inner {chunk}-token chunk edge"
                )
            rows.append(first + offset // chunk)
        first += -(-length // chunk)
    return rows


def store_chunk_states(h: torch.Tensor, rows: torch.Tensor, pool: torch.Tensor, blocks: torch.Tensor) -> None:
    """pool[blocks[i]] = h[:, rows[i]] (h: [1, chunks, heads, K, V]; pool: [blocks, heads, K, V]).

    `rows` and `blocks` are device tensors built once per step with the step's metadata (shared by
    every GatedDeltaNet layer): a host list turned into a device tensor here would be a blocking
    copy per layer, which measured +9-13% on the kernel instead of the copy's own cost. On CUDA one
    Triton launch copies each state once (a gather into a temporary, then a scatter, costs a third
    more traffic and a second launch)."""
    state = h[0, 0].numel()
    if (
        h.is_cuda
        and _triton is not None
        and h.dtype == pool.dtype
        and h.is_contiguous()
        and pool[0].is_contiguous()
        and pool.stride(0) == state
    ):
        grid = (rows.numel(), _triton.cdiv(state, _COPY_TILE))
        _copy_states_kernel[grid](h, pool, rows, blocks, state, TILE=_COPY_TILE)
        return
    pool.index_copy_(0, blocks, h[0].index_select(0, rows).to(pool.dtype))


_COPY_TILE = 4096
try:
    import triton as _triton
    import triton.language as tl

    @_triton.jit
    def _copy_states_kernel(src, dst, rows, blocks, state, TILE: tl.constexpr):
        i = tl.program_id(0)
        offsets = tl.program_id(1) * TILE + tl.arange(0, TILE)
        mask = offsets < state
        row = tl.load(rows + i).to(tl.int64)
        block = tl.load(blocks + i).to(tl.int64)
        values = tl.load(src + row * state + offsets, mask=mask)
        tl.store(dst + block * state + offsets, values, mask=mask)
except ImportError:  # CPU-only installs: the torch path above
    _triton = None
