"""Per-request latent rows, assembled in token-position order.

A stage emits latents as chunks: `LatentChunk(start, tensors)` holds rows for token positions
`start .. start + n - 1`, one tensor per latent name. Row `i` is the latent of the token at position
`i` (the model's output when that token was its input), so a request of P prompt tokens that
generated G tokens has P + G - 1 rows once it finishes: its last sampled token was never fed back.

Chunks can overlap (a request resumed after preemption is re-admitted with a prefix hit and gets its
prefix gathered again) or arrive past the end (async scheduling runs one step for a request that has
just finished). `LatentRows` keeps the first copy of every position and drops the rest, and a gap
is a bug upstream, so it raises.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

#: Latent names, as stages emit them and hand-offs read them.
HIDDEN = "hidden"  # the final hidden state


def layer_name(index: int) -> str:
    """Layer tap `index`: the residual stream entering decoder layer `index` (0: input embeddings)."""
    return f"layer_{index}"


def merged_name(layer: int, media_layer: int) -> str:
    """Tap `layer`'s rows, with tap `media_layer`'s at the prompt's media placeholder positions
    (the stage config's `latents.merged`)."""
    return f"layer_{layer}_media_{media_layer}"


@dataclass
class LatentChunk:
    start: int
    tensors: dict[str, torch.Tensor]

    @property
    def num_rows(self) -> int:
        return next(iter(self.tensors.values())).shape[0] if self.tensors else 0


def rows_to_skip(num_rows: int, chunk: LatentChunk) -> int | None:
    """How many leading rows of ``chunk`` a holder of positions ``0 .. num_rows - 1`` already has,
    or None when the chunk brings nothing new. A chunk starting past ``num_rows`` leaves a gap: a
    bug upstream, so it raises."""
    if chunk.start > num_rows:
        raise RuntimeError(f"latent rows {num_rows}..{chunk.start - 1} are missing (chunk starts at {chunk.start})")
    if chunk.start + chunk.num_rows <= num_rows:
        return None
    return num_rows - chunk.start


@dataclass
class LatentRows:
    """Rows of one request, appended chunk by chunk; `take_new()` hands out what is new since the
    last call (for streaming downstream), `all()` the whole sequence (concatenated once)."""

    names: tuple[str, ...]
    chunks: list[dict[str, torch.Tensor]] = field(default_factory=list)
    num_rows: int = 0
    _taken: int = 0  # rows already handed out by take_new()

    def add(self, chunk: LatentChunk) -> None:
        skip = rows_to_skip(self.num_rows, chunk)
        if skip is None:
            return
        self.chunks.append({n: chunk.tensors[n][skip:] for n in self.names})
        self.num_rows = chunk.start + chunk.num_rows

    def all(self) -> dict[str, torch.Tensor]:
        if len(self.chunks) != 1:
            self.chunks = [self._concat(self.chunks)]
        return dict(self.chunks[0])

    def take_new(self, upto: int | None = None) -> tuple[int, dict[str, torch.Tensor]]:
        """(start, rows) for positions [last taken, upto) (default: everything held).

        Only the chunks that overlap the range are touched: a decode step hands out one row, and
        re-concatenating a long prompt's rows every step would copy megabytes per token."""
        upto = self.num_rows if upto is None else min(upto, self.num_rows)
        start = self._taken
        if upto <= start:
            return start, {}
        pieces: list[dict[str, torch.Tensor]] = []
        chunk_end = self.num_rows
        for chunk in reversed(self.chunks):  # new rows sit in the last chunks
            rows = next(iter(chunk.values())).shape[0]
            chunk_start = chunk_end - rows
            lo, hi = max(start, chunk_start), min(upto, chunk_end)
            if lo < hi:
                pieces.append({n: t[lo - chunk_start : hi - chunk_start] for n, t in chunk.items()})
            if chunk_start <= start:
                break
            chunk_end = chunk_start
        self._taken = upto
        return start, self._concat(pieces[::-1])

    def _concat(self, chunks: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        if not chunks:
            return {}
        return {n: torch.cat([c[n] for c in chunks]) if len(chunks) > 1 else chunks[0][n] for n in self.names}


class LatentBuffer:
    """Rows of one request on the receiving side, in one growing tensor per latent name.

    A downstream stage gets an upstream request's rows as many small chunks (one per decode step)
    and its hand-off reads them as one sequence. Concatenating every chunk for every message
    copied all rows received so far each time (quadratic: ~268 MB per thinker token at Qwen3-Omni
    sizes). Here each row is copied once into a buffer whose capacity doubles when full (amortized
    O(new rows) per chunk), and `view()` hands out views of the filled part without copying. Rows
    already filled are never written again, so earlier views stay valid.

    Same position semantics as `LatentRows`: the first copy of a position wins, a gap raises. A
    chunk whose names, dtypes or row shapes differ from the first one's is refused (ValueError):
    it comes from a broken or hostile peer.
    """

    def __init__(self, names: tuple[str, ...], max_rows: int | None = None) -> None:
        self.names = names
        self.max_rows = max_rows
        self.num_rows = 0
        self._buffers: dict[str, torch.Tensor] = {}

    def add(self, chunk: LatentChunk) -> None:
        self._check(chunk)
        skip = rows_to_skip(self.num_rows, chunk)
        if skip is None:
            return
        end = chunk.start + chunk.num_rows
        if self.max_rows is not None and end > self.max_rows:
            raise ValueError(f"latent rows up to position {end} exceed the limit of {self.max_rows}")
        for name in self.names:
            new = chunk.tensors[name][skip:]
            buf = self._buffers.get(name)
            if buf is None or buf.shape[0] < end:
                buf = self._grow(name, new, end)
            buf[self.num_rows : end].copy_(new)
        self.num_rows = end

    def view(self) -> dict[str, torch.Tensor]:
        """Rows 0 .. num_rows - 1 of each name: views, no copy."""
        return {n: b[: self.num_rows] for n, b in self._buffers.items()} if self.num_rows else {}

    def _grow(self, name: str, like: torch.Tensor, need: int) -> torch.Tensor:
        old = self._buffers.get(name)
        capacity = max(need, 2 * (old.shape[0] if old is not None else 0), 16)
        if self.max_rows is not None:
            capacity = min(capacity, max(self.max_rows, need))
        buf = torch.empty((capacity, *like.shape[1:]), dtype=like.dtype)
        if old is not None:
            buf[: self.num_rows].copy_(old[: self.num_rows])
        self._buffers[name] = buf
        return buf

    def _check(self, chunk: LatentChunk) -> None:
        if set(chunk.tensors) != set(self.names):
            raise ValueError(f"latent chunk has {sorted(chunk.tensors)}, expected {sorted(self.names)}")
        if chunk.start < 0:
            raise ValueError(f"latent chunk starts at a negative position {chunk.start}")
        rows = {t.shape[0] if t.dim() else -1 for t in chunk.tensors.values()}
        if len(rows) != 1 or -1 in rows:
            raise ValueError("latent chunk tensors disagree on their number of rows")
        for name, t in chunk.tensors.items():
            buf = self._buffers.get(name)
            if buf is not None and (t.dtype != buf.dtype or t.shape[1:] != buf.shape[1:]):
                raise ValueError(
                    f"latent {name!r}: rows of {t.dtype} {tuple(t.shape[1:])}, earlier rows were "
                    f"{buf.dtype} {tuple(buf.shape[1:])}"
                )
