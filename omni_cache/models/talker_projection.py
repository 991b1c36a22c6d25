"""The talker's input projections (two-layer MLPs from the thinker's space into the talker's), run
block by block, and a memo that reuses the blocks a recent call already projected.

Rows are projected in fixed blocks of :data:`PROJECTION_BLOCK` from row 0: a matrix product's
rounding can change with its shape, and two prompts that share a prefix must get bitwise equal
talker rows there, or the talker's prefix cache (which hashes its prompt embeddings) misses.

A realtime session asks for the same user rows again and again: every listening request and every
answer projects the whole conversation's user turns so far (2,000 rows after five 30 s turns), so
the hand-off's time grew with the conversation. :class:`ProjectionMemo` keeps the last calls'
rows and outputs and projects only from the first block whose rows are not bitwise those of a kept
call; the result is bitwise what projecting every row gives.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: Rows projected per matrix product (see the module's docstring).
PROJECTION_BLOCK = 32
#: Rows a memo keeps over all its entries (Qwen3-Omni-30B: 2,048 + 1,024 bf16 values a row, so
#: about 400 MB at most), and the most entries it keeps (about one per session speaking).
MEMO_ROWS = 65_536
MEMO_ENTRIES = 16

_SAME_SIZE_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass
class Projection:
    """``fc2(silu(fc1(x)))``: Qwen3-Omni's talker `text_projection` and `hidden_projection`."""

    fc1_weight: torch.Tensor
    fc1_bias: torch.Tensor
    fc2_weight: torch.Tensor
    fc2_bias: torch.Tensor

    @property
    def out_dim(self) -> int:
        return self.fc2_weight.shape[0]

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        x = torch.nn.functional.linear(rows.to(self.fc1_weight.dtype), self.fc1_weight, self.fc1_bias)
        return torch.nn.functional.linear(torch.nn.functional.silu(x), self.fc2_weight, self.fc2_bias)

    def blockwise(self, rows: torch.Tensor) -> torch.Tensor:
        """[n, out_dim]: the rows projected in blocks of PROJECTION_BLOCK from row 0 (the last
        block padded with zero rows)."""
        if rows.shape[0] == 0:
            return rows.new_zeros(0, self.out_dim)
        pad = -rows.shape[0] % PROJECTION_BLOCK
        padded = torch.cat([rows, rows.new_zeros(pad, rows.shape[1])]) if pad else rows
        # One batched product over [blocks, PROJECTION_BLOCK, dim]: every block is its own
        # PROJECTION_BLOCK-row product, in a single call.
        blocks = padded.reshape(-1, PROJECTION_BLOCK, rows.shape[1])
        return self(blocks).reshape(-1, self.out_dim)[: rows.shape[0]]


class ProjectionMemo:
    """``projection.blockwise`` of rows, reusing the leading whole blocks of a recent call whose
    rows were bitwise these (compared as integers: -0.0 is not 0.0, a NaN equals itself).

    Only whole blocks of a kept call are reused: its last, partial block was projected beside zero
    padding, which a longer call has real rows in place of. Entries are kept most recently used
    last; a call that extends an entry's rows replaces it, so a session speaking turn after turn
    holds one entry. The memo keeps the rows tensor it is given (no copy: a session's rows are
    megabytes, and copying them cost as much as comparing them): pass rows nobody changes after.
    Not thread-safe: a stage's hand-off runs on its runner's one thread."""

    def __init__(self, projection: Projection, max_rows: int = MEMO_ROWS, max_entries: int = MEMO_ENTRIES) -> None:
        self.projection = projection
        self.max_rows, self.max_entries = max_rows, max_entries
        self._entries: list[tuple[torch.Tensor, torch.Tensor]] = []  # (rows as integers, projected)
        #: Rows taken from kept calls over the memo's life (what the tests read).
        self.rows_reused = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def held_rows(self) -> int:
        return sum(kept.shape[0] for kept, _ in self._entries)

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        bits = _as_integers(rows)
        used, blocks = self._best(bits)
        reused = blocks * PROJECTION_BLOCK
        tail = self.projection.blockwise(rows[reused:])
        out = tail if used is None else torch.cat([self._entries[used][1][:reused], tail])
        self.rows_reused += reused
        if used is not None and reused == self._entries[used][0].shape[0] // PROJECTION_BLOCK * PROJECTION_BLOCK:
            del self._entries[used]  # the new call covers the entry's whole blocks: it takes its place
        self._keep(bits, out)
        return out

    def _best(self, bits: torch.Tensor) -> tuple[int | None, int]:
        """The entry sharing the most leading whole blocks with ``bits``, and how many."""
        best, most = None, 0
        whole = bits.shape[0] // PROJECTION_BLOCK
        for i in range(len(self._entries) - 1, -1, -1):
            kept = self._entries[i][0]
            if kept.shape[1:] != bits.shape[1:] or kept.dtype != bits.dtype:
                continue
            n = _equal_blocks(kept, bits)
            if n > most:
                best, most = i, n
                if most == whole:
                    break
        return best, most

    def _keep(self, bits: torch.Tensor, out: torch.Tensor) -> None:
        if bits.shape[0] < PROJECTION_BLOCK or bits.shape[0] > self.max_rows:
            return  # nothing whole to reuse, or more than the memo holds
        self._entries.append((bits, out))
        while len(self._entries) > self.max_entries or self.held_rows > self.max_rows:
            del self._entries[0]


def _as_integers(rows: torch.Tensor) -> torch.Tensor:
    rows = rows.contiguous()
    if rows.is_floating_point():
        return rows.view(_SAME_SIZE_INT[rows.element_size()])
    return rows


def _equal_blocks(a: torch.Tensor, b: torch.Tensor) -> int:
    """Leading whole blocks of PROJECTION_BLOCK rows that a and b have bitwise equal."""
    whole = min(a.shape[0], b.shape[0]) // PROJECTION_BLOCK
    if whole == 0 or not torch.equal(a[:PROJECTION_BLOCK], b[:PROJECTION_BLOCK]):
        return 0
    n = whole * PROJECTION_BLOCK
    if torch.equal(a[:n], b[:n]):  # the usual case (a session's next request): one pass, no copy
        return whole
    same = (a[:n] == b[:n]).reshape(whole, -1).all(dim=1)
    differ = (~same).nonzero()
    return int(differ[0]) if differ.numel() else whole
