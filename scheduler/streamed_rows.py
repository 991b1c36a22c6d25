"""Input rows a running request consumes one per decode step, arriving while it runs.

Qwen3-Omni's talker adds one row of the thinker's text (projected into the talker's space) to the
input of every decode step: step s (feeding the talker's s-th sampled code) takes text row s, and
once the text has ended (the thinker finished and the end-of-speech row was consumed) it takes the
pad row. The thinker is still writing that text while the talker runs, so a talker request can be
ahead of it. It must then wait, not guess: the scheduler leaves it out of the step (see
`needs_row` / `is_starved`) until its row arrives, so its codes do not depend on timing.

The rows live on vLLM's `Request` (attribute `streamed_rows`), which the scheduler owns: they go
when vLLM frees the request (finish, abort), and they survive preemption, when the recomputed
positions need every row again.
"""

from __future__ import annotations

from typing import Any

import torch

from omni_cache.cache.latent_rows import LatentBuffer, LatentChunk

ATTRIBUTE = "streamed_rows"
# The request's M-RoPE prompt positions ([3, L] and the decode delta), when the stage gives them
# (a talker prompt that carries an image's grid positions); vLLM's default is plain text positions.
POSITIONS = "prompt_positions"
_NAME = "rows"


class StreamedRows:
    """Rows 0, 1, 2, ... of one request, then `pad` forever once `done`."""

    def __init__(self, pad: torch.Tensor, max_rows: int | None = None) -> None:
        self.pad = pad.reshape(-1)
        self.done = False
        self._rows = LatentBuffer((_NAME,), max_rows=max_rows)

    @property
    def num_rows(self) -> int:
        return self._rows.num_rows

    def add(self, rows: torch.Tensor | None, done: bool = False) -> None:
        """Append rows (views of them are handed out later; they are copied once here)."""
        if self.done and rows is not None and rows.shape[0]:
            raise ValueError("rows added after the stream was marked done")
        if rows is not None and rows.shape[0]:
            if rows.shape[-1] != self.pad.shape[0]:
                raise ValueError(f"streamed rows are {rows.shape[-1]} wide, expected {self.pad.shape[0]}")
            self._rows.add(LatentChunk(self.num_rows, {_NAME: rows.to(self.pad.dtype)}))
        self.done = self.done or done

    def has(self, step: int) -> bool:
        """Whether the row of decode step `step` is known (a row, or the pad after the end)."""
        return step < self.num_rows or self.done

    def rows(self, steps: torch.Tensor) -> torch.Tensor:
        """The rows of these decode steps ([n] ints, each one `has`), pad past the end."""
        filled = self._rows.view().get(_NAME)
        out = self.pad.expand(steps.shape[0], -1).clone()
        if filled is not None:
            inside = steps < filled.shape[0]
            if bool(inside.any()):
                out[inside] = filled[steps[inside]]
        return out


def of(request: Any) -> StreamedRows | None:
    return getattr(request, ATTRIBUTE, None)


def attach(request: Any, rows: StreamedRows) -> None:
    setattr(request, ATTRIBUTE, rows)


def positions_of(request: Any) -> tuple[torch.Tensor, int] | None:
    return getattr(request, POSITIONS, None)


def attach_positions(request: Any, positions: torch.Tensor, delta: int) -> None:
    setattr(request, POSITIONS, (positions, int(delta)))


def needs_row(request: Any) -> int | None:
    """The decode step whose row the request's next forward needs, or None (prefill only).

    Every output token but the last has been fed already (and its row consumed); the next forward
    feeds the last one (a decode step), or all of them again after a preemption. Either way the
    highest step it needs is `num_output_tokens - 1`."""
    n = request.num_output_tokens
    return n - 1 if n > 0 else None


def is_starved(request: Any) -> bool:
    """A request with streamed rows whose next forward needs a row that has not arrived."""
    rows = of(request)
    if rows is None:
        return False
    step = needs_row(request)
    return step is not None and not rows.has(step)
