"""Stage hand-off functions: build a stage's inputs from what its input stages produced so far.

Stage configs name them by dotted path (`handoff: omni_cache.handoff.thinker_to_talker`). The
downstream stage calls its hand-off every time an input stage sends more output for a request, with
everything received so far (`Upstream`), the stage's `HandoffContext` and a per-request `state` dict
the function may keep anything in. It returns the jobs to start now (possibly none), so a stage can
start on partial input instead of waiting for its upstream to finish.

Jobs of one request run in the order returned; the stage marks the request done after the job with
`last=True` has finished.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from omni_cache.cache.latent_rows import LatentBuffer, LatentChunk

# Thinker -> talker segmentation: the talker's first segment starts once the thinker has this many
# new rows (a short first segment: time to first audio), then a new segment every SEGMENT_TOKENS
# rows (fewer, larger talker requests), and the rest when the thinker stops.
FIRST_SEGMENT_TOKENS = 3
SEGMENT_TOKENS = 8
# Codec codes the talker writes per thinker token of a segment (12.5 codes/s of audio).
CODES_PER_TOKEN = 2
# Talker -> decoder: the first decode chunk holds this many codes (the stage's `chunk_size` after
# it), so the first audio needs FIRST_CHUNK_CODES + context codes instead of chunk_size + context.
FIRST_CHUNK_CODES = 4


@dataclass
class Upstream:
    """Everything one input stage has produced so far for one request."""

    stage: str
    token_ids: list[int]
    latents: dict[str, torch.Tensor]
    num_prompt_tokens: int
    finished: bool


@dataclass
class HandoffContext:
    """The downstream stage's model directory, plus whatever the hand-off loads from it once."""

    model_path: Path
    resources: dict[str, Any] = field(default_factory=dict)


@dataclass
class Job:
    """One unit of work for the downstream stage."""

    prompt_embeds: torch.Tensor | None = None  # autoregressive stage fed with embeddings
    prompt_token_ids: list[int] | None = None  # autoregressive stage fed with tokens
    multi_modal_data: dict[str, list] | None = None  # images / audio for the prompt's placeholders
    max_tokens: int = 0
    codes: list[int] | None = None  # decoder: codes window to decode
    keep: tuple[int, int] = (0, 0)  # decoder: frames [start, end) of the window to keep
    last: bool = False


def _talker_projection(ctx: HandoffContext) -> tuple[torch.Tensor, torch.Tensor, dict]:
    if "projection" not in ctx.resources:
        from safetensors.torch import load_file

        weights = load_file(str(ctx.model_path / "thinker_projection.safetensors"))
        meta = json.loads((ctx.model_path / "talker_config.json").read_text())
        # float64 so a row's projection does not depend on how many rows are projected together:
        # identical thinker rows (served from the cache) must give bitwise identical talker
        # embeddings, or the talker's own prefix cache (which hashes embeddings) would miss.
        ctx.resources["projection"] = (weights["weight"].double(), weights["bias"].double(), meta)
    return ctx.resources["projection"]


def thinker_to_talker(ctx: HandoffContext, up: Upstream, state: dict) -> list[Job]:
    """Talker segments over the thinker's hidden states.

    Segment k is a talker request whose prompt embeddings are the projected thinker rows of every
    token up to the segment's end; it writes CODES_PER_TOKEN codes per thinker token new in that
    segment. Each segment's prompt extends the previous one, so the talker's prefix cache skips
    the part it has already seen. The first segment is short (FIRST_SEGMENT_TOKENS rows), the
    others SEGMENT_TOKENS rows.
    """
    hidden = up.latents.get("hidden")
    if hidden is None:
        raise ValueError("thinker_to_talker needs the thinker's 'hidden' latents (latents.hidden: true)")
    rows = hidden.shape[0]
    done = state.setdefault("rows_done", up.num_prompt_tokens)
    if state.get("finished"):
        return []
    new = rows - done
    need = FIRST_SEGMENT_TOKENS if done == up.num_prompt_tokens else SEGMENT_TOKENS
    if not up.finished and new < need:
        return []
    if up.finished:
        state["finished"] = True
    weight, bias, _ = _talker_projection(ctx)
    # Project only the rows no earlier segment projected: re-projecting a 4,000-row prompt for
    # every segment cost ~0.1 s of float64 matmul each. Row-by-row float64 makes the pieces
    # bitwise equal to projecting all rows at once.
    # The embeddings grow in place (LatentBuffer) and each job gets a view: concatenating the
    # previous segment's embeddings with the new ones copied the whole prompt every segment.
    embeds = state.setdefault("embeds", LatentBuffer(("embeds",)))
    start = embeds.num_rows
    fresh = (hidden[start:rows].double() @ weight.T + bias).to(torch.bfloat16)
    embeds.add(LatentChunk(start, {"embeds": fresh}))
    state["rows_done"] = rows
    return [Job(prompt_embeds=embeds.view().get("embeds", fresh),
                max_tokens=CODES_PER_TOKEN * max(new, 1), last=up.finished)]


def talker_to_decoder(ctx: HandoffContext, up: Upstream, state: dict) -> list[Job]:
    """Decoder chunks over the talker's codes: FIRST_CHUNK_CODES codes first (early audio), then
    `chunk_size` codes at a time, each with the decoder's receptive field of context on both sides
    so chunked audio equals whole-sequence audio bitwise. Special tokens (ids >= codebook size)
    are not audio and are dropped."""
    codebook, chunk, context = ctx.resources["codebook_size"], ctx.resources["chunk_size"], \
        ctx.resources["context"]
    codes = [c for c in up.token_ids if c < codebook]
    start = state.setdefault("next", 0)
    jobs = []
    while True:
        size = min(FIRST_CHUNK_CODES, chunk) if start == 0 else chunk
        end = min(start + size, len(codes))
        ready = len(codes) >= start + size + context or up.finished
        if not ready or (end <= start and not up.finished):
            break
        lo, hi = max(0, start - context), min(len(codes), end + context)
        last = up.finished and end == len(codes)
        jobs.append(Job(codes=codes[lo:hi], keep=(start - lo, end - lo), last=last))
        start = end
        if last:
            break
    state["next"] = start
    return jobs
