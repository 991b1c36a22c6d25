"""Stage hand-off functions: build a stage's inputs from what its input stages produced so far.

Stage configs name them by dotted path (`handoff: omni_cache.handoff.thinker_to_talker`). The
downstream stage calls its hand-off every time an input stage sends more output for a request, with
everything received so far (`Upstream`), the stage's `HandoffContext` and a per-request `state` dict
the function may keep anything in. It returns the jobs to start now (possibly none), so a stage can
start on partial input instead of waiting for its upstream to finish.

A job is one of three kinds of work, each its own type (`Job` is their union), and the stage's
runner dispatches on the type:
- `GenerateJob`: start a request on an autoregressive stage (workers/ar_runner.py): its prompt
  (token ids, or embeddings with their positions), the media for the prompt's placeholders, what
  vLLM samples it with (max_tokens, stop and allowed ids, extra_args), and, for a request whose
  decode steps consume rows that are still arriving, its `RowStream`.
- `FeedJob`: more rows for the request's running (or queued) `GenerateJob` with a `RowStream`;
  it starts nothing.
- `DecodeJob`: one window of codes for the decoder stage (workers/decoder_runner.py), or none
  (the stream's end, no audio left).
Jobs of one request run in the order returned; the stage marks the request done after the job with
`last=True` (a GenerateJob or DecodeJob) has finished.
"""

from __future__ import annotations

import json

import torch

from omni_cache.cache.latent_rows import LatentBuffer, LatentChunk
from omni_cache.models.code_windows import next_window
from omni_cache.models.handoff_jobs import (
    CODEC_LOGITS_KEY,
    DecodeJob,
    FeedJob,
    GenerateJob,
    HandoffContext,
    Job,
    RowStream,
    Upstream,
    codec_logits_args,
)
from omni_cache.wire.messages import CODES_FRAME

__all__ = [
    "CODEC_LOGITS_KEY",
    "CODES_PER_TOKEN",
    "FIRST_CHUNK_CODES",
    "DecodeJob",
    "FeedJob",
    "GenerateJob",
    "HandoffContext",
    "Job",
    "RowStream",
    "Upstream",
    "codec_logits_args",
    "talker_to_decoder",
    "thinker_to_talker",
]

# Thinker -> talker segmentation: the talker's first segment starts once the thinker has this many
# new rows (a short first segment: time to first audio), then a new segment every SEGMENT_TOKENS
# rows (fewer, larger talker requests), and the rest when the thinker stops.
FIRST_SEGMENT_TOKENS = 3
SEGMENT_TOKENS = 8
# Codec codes the talker writes per thinker token of a segment (12.5 codes/s of audio).
CODES_PER_TOKEN = 2
# Talker -> decoder: the first decode chunk holds this many codes, so the first audio needs
# FIRST_CHUNK_CODES + lookahead codes instead of chunk_size + lookahead (Qwen3-Omni's code2wav is
# causal and needs no lookahead: its audio runs tail_samples behind the codes, code_windows.py; so
# 1 code, and its talker writes one code per thinker token, so each code saved is a thinker step
# earlier). Each later chunk doubles,
# up to the stage's `chunk_size`: a chunk of n codes plays for n code periods (80 ms each at 12.5
# codes/s) while the next, 2n codes, is written; the talker writes codes several times faster
# than real time, so the audio does not stall between small early chunks.
FIRST_CHUNK_CODES = 1


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


def thinker_to_talker(ctx: HandoffContext, up: Upstream, state: dict) -> list[GenerateJob]:
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
    return [
        GenerateJob(
            prompt_embeds=embeds.view().get("embeds", fresh),
            max_tokens=CODES_PER_TOKEN * max(new, 1),
            last=up.finished,
            allowed_token_ids=_talker_codes_and_eos(ctx),
        )
    ]


def _talker_codes_and_eos(ctx: HandoffContext) -> list[int]:
    """The ids the talker may write: its codec codes and end of speech. Its vocabulary also holds
    specials (bos, pad) and unused ids; the decoder drops those as not audio, so a talker that
    samples them writes silence: greedy on random weights, one of them can repeat for a whole
    answer, which then ends with no audio at all (Qwen3-Omni's talker suppresses its control
    codes the same way: `_qwen3_omni_logits`)."""
    if "codes_and_eos" not in ctx.resources:
        meta = _talker_projection(ctx)[2]
        ctx.resources["codes_and_eos"] = [*range(meta["codebook_size"]), meta["codec_eos_id"]]
    return ctx.resources["codes_and_eos"]


def talker_to_decoder(ctx: HandoffContext, up: Upstream, state: dict) -> list[DecodeJob]:
    """Decoder windows over the talker's codes: FIRST_CHUNK_CODES codes first (early audio), then
    twice as many each time up to `chunk_size` codes, each window carrying the decoder's receptive field of left
    context and its lookahead (`omni_cache.models.code_windows.next_window`), so chunked audio
    equals whole-sequence audio (bitwise for the tiny codec, within `CHUNKED_ATOL` for code2wav).

    The codes are `up.latents[CODES_FRAME]` ([num_quantizers, N]) when the talker sends code
    frames; otherwise its token ids are the codes of a one-codebook decoder, and ids >= the
    codebook size (special tokens) are not audio and are dropped. `ctx.resources` holds the
    decoder's `receptive_field`, `num_quantizers`, `codebook_size` and the stage's `chunk_size`."""
    rf, chunk = ctx.resources["receptive_field"], ctx.resources["chunk_size"]
    if state.get("done"):
        return []
    codes = _decoder_codes(ctx, up, state)
    emitted = state.get("emitted", 0)
    jobs = []
    while True:
        # A decoder that works in blocks of codes (token2wav's DiT: 12) starts at one block.
        size = min(max(FIRST_CHUNK_CODES, rf.block_codes) << state.get("windows", 0), chunk)
        if not up.finished and codes.shape[-1] - rf.right_codes < emitted + size:
            break  # wait for a whole chunk and its lookahead
        window = next_window(
            rf,
            codes,
            emitted,
            up.finished,
            max_codes=size,
            left_context=rf.context_codes(ctx.resources["samples_per_code"]),
        )
        if window is None:
            break
        emitted += window.stop - window.start
        # A causal decoder's windows always reach the last code received: only the stream's end
        # makes one the last.
        last = up.finished and emitted == codes.shape[-1]
        jobs.append(DecodeJob(window, last))
        state["windows"] = state.get("windows", 0) + 1
        if last:
            break
    if up.finished and not (jobs and jobs[-1].last):
        # Every code already decoded (or none came): an empty window ends the stream.
        jobs.append(DecodeJob(last=True))
    state["emitted"], state["done"] = emitted, up.finished
    return jobs


def _decoder_codes(ctx: HandoffContext, up: Upstream, state: dict) -> torch.Tensor:
    """The request's codes so far, [num_quantizers, N]: its code frames, or its token ids less the
    special tokens (collected once each, in a buffer that grows in place)."""
    frames = up.latents.get(CODES_FRAME)
    tokens: LatentBuffer | None = state.get("token_codes")
    if frames is not None:
        if tokens is not None and tokens.num_rows:
            raise ValueError(f"the talker sent codes as token ids, then as {CODES_FRAME!r} frames")
        return frames
    q, codebook = ctx.resources["num_quantizers"], ctx.resources["codebook_size"]
    if q != 1:
        if up.token_ids:
            raise ValueError(
                f"the decoder reads {q} codebooks: the talker must send its codes as a "
                f"{CODES_FRAME!r} tensor frame [{q}, k], not as token ids"
            )
        return torch.zeros(q, 0, dtype=torch.long)
    if tokens is None:
        tokens = state["token_codes"] = LatentBuffer(("codes",))
    seen = state.get("token_ids_seen", 0)
    new = [c for c in up.token_ids[seen:] if c < codebook]
    state["token_ids_seen"] = len(up.token_ids)
    if new:
        tokens.add(LatentChunk(tokens.num_rows, {"codes": torch.tensor(new, dtype=torch.long)[:, None]}))
    rows = tokens.view().get("codes")
    return torch.zeros(1, 0, dtype=torch.long) if rows is None else rows.T
