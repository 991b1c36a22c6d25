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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from omni_cache.cache.latent_rows import HIDDEN, LatentBuffer, LatentChunk, layer_name, merged_name
from omni_cache.models.code_windows import CodeWindow, next_window
from omni_cache.models.qwen3_omni_talker_prompt import DEFAULT_SPEAKER
from omni_cache.wire.messages import CODES_FRAME, StreamStart

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


@dataclass
class Upstream:
    """Everything one input stage has produced so far for one request."""

    stage: str
    token_ids: list[int]  # generated tokens so far
    # Tensor frames so far by name: an autoregressive stage's latent rows ([rows, ...]), or a
    # multi-codebook talker's codes (CODES_FRAME, [num_quantizers, N]).
    latents: dict[str, torch.Tensor]
    num_prompt_tokens: int
    finished: bool
    prompt_token_ids: list[int] = field(default_factory=list)  # when the upstream sends them
    image_grids: list[list[int]] = field(default_factory=list)  # (t, h, w) per image of the prompt
    video_grids: list[list[int]] = field(default_factory=list)  # (t, h, w) per video of the prompt
    video_seconds_per_grid: list[float] = field(default_factory=list)  # per video
    voice: str = ""  # the speaker the request asked for ("" = the checkpoint's default)

    @classmethod
    def opened_by(cls, start: StreamStart) -> Upstream:
        """What a request's upstream has produced once its stream opened: the prompt it saw, no
        output yet (the runner adds the first message's tokens and rows like every later one's)."""
        return cls(
            start.stage,
            [],
            {},
            start.num_prompt_tokens,
            False,
            prompt_token_ids=list(start.prompt_token_ids),
            image_grids=[list(g) for g in start.image_grids],
            video_grids=[list(g) for g in start.video_grids],
            video_seconds_per_grid=list(start.video_seconds_per_grid),
            voice=start.voice,
        )


@dataclass
class HandoffContext:
    """The downstream stage's model directory, plus whatever the hand-off loads from it once."""

    model_path: Path
    resources: dict[str, Any] = field(default_factory=dict)


@dataclass
class RowStream:
    """Rows a request's decode steps consume one per step (Qwen3-Omni's talker: one thinker text
    row per step, `scheduler/streamed_rows.py`), known as far as they have arrived."""

    pad: torch.Tensor  # the row every step after the last one reads
    rows: torch.Tensor  # the rows known now, [n, dim]
    done: bool = False  # no more rows will come


@dataclass
class GenerateJob:
    """Start one request on an autoregressive stage."""

    prompt_token_ids: list[int] | None = None  # fed with tokens
    prompt_embeds: torch.Tensor | None = None  # fed with embeddings
    multi_modal_data: dict[str, list] | None = None  # images / audio for the prompt's placeholders
    multi_modal_uuids: dict[str, list] | None = None  # their content digests, same layout
    mm_processor_kwargs: dict[str, Any] | None = None  # a video's fps and use_audio_in_video
    # M-RoPE positions of prompt_embeds ([3, L]) and the decode positions' offset, when they are
    # not plain text positions (a Qwen3-Omni talker prompt with an image's grid); None: plain.
    positions: tuple[torch.Tensor, int] | None = None
    max_tokens: int = 0  # 0: the stage's sampling.max_tokens
    stop_token_ids: list[int] | None = None  # vLLM stops the request after one of these
    # The only ids vLLM may sample for the request (SamplingParams.allowed_token_ids), None: any.
    allowed_token_ids: list[int] | None = None
    # Extra vLLM SamplingParams.extra_args of the request (e.g. workers/codec_logits.py's rules).
    extra_args: dict[str, Any] | None = None
    stream: RowStream | None = None  # rows its decode steps consume, as they arrive
    last: bool = False


@dataclass
class FeedJob:
    """Rows for the request's streaming GenerateJob (the one with a RowStream)."""

    rows: torch.Tensor
    done: bool = False  # these are the stream's last rows


@dataclass
class DecodeJob:
    """One decoder window of the request's codes."""

    window: CodeWindow | None = None  # None: no audio left (an empty output ends the stream)
    last: bool = False


Job = GenerateJob | FeedJob | DecodeJob


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


# transformers' reference samples Qwen3-Omni's talker with this repetition penalty (its
# `talker_repetition_penalty` default); the pipeline applies the same rule (workers/codec_logits.py).
QWEN3_OMNI_TALKER_REPETITION_PENALTY = 1.05
QWEN2_5_OMNI_TALKER_REPETITION_PENALTY = 1.05


def qwen3_omni_thinker_to_talker(ctx: HandoffContext, up: Upstream, state: dict) -> list[GenerateJob | FeedJob]:
    """Qwen3-Omni's talker over the thinker's output, as transformers' reference builds it, streamed.

    One talker request per answer. It starts once the thinker's first output (the prompt's rows)
    and the answer's first token are in (the talker prompt: the user turn, then the assistant part
    with the speaker's codec specials; `omni_cache.models.qwen3_omni_talker_prompt`). Every later
    token of the answer is one row of text for one talker decode step, fed to the running request
    as it arrives; when the thinker finishes, the end-of-speech row follows, then pad rows. A
    talker step that is ahead of the thinker waits for its row (scheduler/streamed_rows.py), so
    the codes do not depend on timing.

    Reads the thinker's layer tap 0 (input embeddings) at the prompt's text positions and its
    `accept_hidden_layer` state at image/audio positions, and its prompt token ids (sent with its
    first output): from one merged latent (`latents.merged`, what stage_configs/qwen3_omni.yaml
    emits) or from the two taps (`latents.layers`). The answer's rows are its tokens' input
    embeddings, read by id from the checkpoint (`TalkerPrompt.embedding_rows`; bitwise the
    thinker's tap 0 there): the thinker hands over only the tokens whose text its client has
    (workers/spoken_tokens.py), and the last token of an answer cut by `max_tokens` has no tap row
    (it was never fed through the thinker), so the talker speaks exactly the client's text.
    """
    prompt = _qwen3_omni_prompt(ctx)
    accept_layer = prompt.accept_hidden_layer
    merged = up.latents.get(merged_name(0, accept_layer))
    if merged is not None:
        # TalkerPrompt reads embeddings only at text positions, accept states only at media ones.
        embeds = accept = merged
    else:
        embeds = up.latents.get(layer_name(0))
        accept = up.latents.get(layer_name(accept_layer))
    if embeds is None or accept is None:
        raise ValueError(
            "the Qwen3-Omni talker needs the thinker's latents.merged {layer: 0, media_layer: "
            f"{accept_layer}}} (or latents.layers [0, {accept_layer}]); it sent "
            f"{sorted(up.latents) or 'none'}"
        )
    if not up.prompt_token_ids:
        raise ValueError("the thinker sent no prompt token ids (needed to find the user turn)")
    known = len(up.prompt_token_ids) + len(up.token_ids)  # positions whose row is known
    if not state.get("started"):
        need = prompt.rows_needed(up.prompt_token_ids)
        if known < need and not up.finished:
            return []
        token_ids = list(up.prompt_token_ids) + list(up.token_ids)
        head = _qwen3_omni_rows(prompt, embeds, up, 0, min(need, known))
        start = prompt.build(token_ids, head, accept, speaker=up.voice or DEFAULT_SPEAKER)
        positions, delta = prompt.positions(token_ids, up.image_grids, up.video_grids, up.video_seconds_per_grid)
        state["started"] = True
        text, done = _qwen3_omni_text(prompt, _qwen3_omni_rows(prompt, embeds, up, need, known), up.finished)
        state["rows_done"] = max(known, need)
        return [
            GenerateJob(
                prompt_embeds=start,
                stream=RowStream(prompt.tts_pad, text, done),
                last=True,
                stop_token_ids=[prompt.codec_eos_id],
                extra_args=_qwen3_omni_logits(prompt),
                positions=(positions, delta) if delta else None,
            )
        ]
    if state.get("rows_finished"):
        return []
    done_rows = state["rows_done"]
    if known <= done_rows and not up.finished:
        return []
    text, done = _qwen3_omni_text(prompt, _qwen3_omni_rows(prompt, embeds, up, done_rows, known), up.finished)
    state["rows_done"] = max(known, done_rows)
    state["rows_finished"] = done
    return [FeedJob(text, done)]


def _qwen3_omni_rows(prompt: Any, embeds: torch.Tensor, up: Upstream, start: int, stop: int) -> torch.Tensor:
    """The thinker's input-embedding rows of positions start..stop-1: the prompt's from its tap,
    the answer's by token id from the checkpoint (in the tap's dtype)."""
    n_prompt = len(up.prompt_token_ids)
    if stop <= start:
        return embeds[:0]
    if min(stop, n_prompt) > embeds.shape[0]:
        raise ValueError(f"the thinker sent {embeds.shape[0]} prompt rows of {n_prompt}")
    parts = [embeds[start : min(stop, n_prompt)]]
    if stop > n_prompt:
        ids = up.token_ids[max(start - n_prompt, 0) : stop - n_prompt]
        parts.append(prompt.embedding_rows(ids).to(embeds.dtype))
    return torch.cat(parts)


def _qwen3_omni_text(prompt: Any, rows: torch.Tensor, finished: bool) -> tuple[torch.Tensor, bool]:
    """Talker text rows of these thinker rows, plus the end-of-speech row at the end."""
    text = prompt.text(rows)
    if finished:
        text = torch.cat([text, prompt.tts_eos.reshape(1, -1)])
    return text, finished


def _qwen3_omni_prompt(ctx: HandoffContext) -> Any:
    if "qwen3_omni_prompt" not in ctx.resources:
        from omni_cache.models.qwen3_omni_talker_prompt import TalkerPrompt

        ctx.resources["qwen3_omni_prompt"] = TalkerPrompt.load(ctx.model_path)
    return ctx.resources["qwen3_omni_prompt"]


# SamplingParams.extra_args key of the codec logits rules (workers/codec_logits.py applies them).
CODEC_LOGITS_KEY = "codec_logits"


def codec_logits_args(
    penalty: float, suppress: tuple[int, int], keep: list[int], prompt_ids: list[int] | None = None
) -> dict[str, Any]:
    """extra_args asking for the codec logits rules: a repetition penalty over the request's
    generated codes (and `prompt_ids`, the ids a reference prompt held: Qwen2.5-Omni's talker
    penalises those too), and the ids in [suppress[0], suppress[1]) never sampled except `keep`."""
    rule = {"penalty": float(penalty), "suppress": list(suppress), "keep": list(keep)}
    if prompt_ids:
        rule["prompt_ids"] = sorted(set(prompt_ids))
    return {CODEC_LOGITS_KEY: rule}


def _qwen3_omni_logits(prompt: Any) -> dict[str, Any]:
    # The talker's vocabulary ends with 1,024 control codes transformers never samples but EOS.
    vocab = prompt.talker_vocab_size
    return codec_logits_args(QWEN3_OMNI_TALKER_REPETITION_PENALTY, (vocab - 1024, vocab), keep=[prompt.codec_eos_id])


def qwen2_5_omni_thinker_to_talker(ctx: HandoffContext, up: Upstream, state: dict) -> list[GenerateJob | FeedJob]:
    """Qwen2.5-Omni's talker over the thinker's output, as transformers' reference builds it, streamed
    (`omni_cache.models.qwen2_5_omni_talker_input` says what each row is).

    One talker request per answer, started once the thinker has sent the row of the answer's first
    token (the thinker's second output): the prompt rows, the speaker row, that row. Every later row
    is one step's text, fed to the running request as it arrives; when the thinker finishes, the
    text-eos row follows, then the text-pad row for ever. A step ahead of the thinker waits for its
    row (scheduler/streamed_rows.py), so the codes do not depend on timing. Reads the thinker's
    final hidden states (`latents: {hidden: true}`) and its prompt ids (sent with its first
    output); each row adds the token's embedding, read by id from the checkpoint.
    """
    talker = _qwen2_5_omni_input(ctx)
    hidden = up.latents.get(HIDDEN)
    if hidden is None:
        raise ValueError(
            f"the Qwen2.5-Omni talker needs the thinker's latents.hidden; it sent {sorted(up.latents) or 'none'}"
        )
    n_prompt = len(up.prompt_token_ids)
    if not n_prompt:
        raise ValueError("the thinker sent no prompt token ids (needed for the talker's rows and positions)")
    ids = [*up.prompt_token_ids, *up.token_ids]
    known = min(hidden.shape[0], len(ids))  # positions whose row is known
    if not state.get("started"):
        if known <= n_prompt and not up.finished:
            return []
        speaker = talker.speaker(up.voice)
        head = min(known, n_prompt + 1)
        rows = talker.rows(hidden[:head], ids[:head])
        if known <= n_prompt:
            # The answer ended before its first token was fed (a one-token answer): its first row
            # is the end of the text, as if the answer were empty.
            rows = torch.cat([rows[:n_prompt], talker.text_eos.to(rows.dtype)[None]])
        first = up.token_ids[0] if up.token_ids else up.prompt_token_ids[-1]
        rope_ids = talker.prompt_ids(list(up.prompt_token_ids), first, speaker)
        positions, delta = talker.positions(rope_ids, up.image_grids, up.video_grids, up.video_seconds_per_grid)
        state.update(started=True, rows_done=max(known, n_prompt + 1))
        text = _qwen2_5_omni_text(talker, hidden, ids, n_prompt + 1, known, up.finished)
        state["rows_finished"] = up.finished
        return [
            GenerateJob(
                prompt_embeds=talker.prompt(rows, speaker),
                stream=RowStream(talker.text_pad.to(rows.dtype), text, up.finished),
                last=True,
                stop_token_ids=talker.stop_ids(),
                extra_args=qwen2_5_omni_talker_logits(talker),
                positions=(positions, delta) if delta else None,
            )
        ]
    if state.get("rows_finished") or (known <= state["rows_done"] and not up.finished):
        return []
    text = _qwen2_5_omni_text(talker, hidden, ids, state["rows_done"], known, up.finished)
    state.update(rows_done=max(known, state["rows_done"]), rows_finished=up.finished)
    return [FeedJob(text, up.finished)]


def _qwen2_5_omni_text(
    talker: Any, hidden: torch.Tensor, ids: list[int], start: int, stop: int, finished: bool
) -> torch.Tensor:
    """Text rows start..stop-1 (hidden state plus embedding), then text-eos once finished."""
    rows = talker.rows(hidden[start:stop], ids[start:stop]) if stop > start else hidden[:0]
    return torch.cat([rows, talker.text_eos.to(rows.dtype)[None]]) if finished else rows


def _qwen2_5_omni_input(ctx: HandoffContext) -> Any:
    if "qwen2_5_omni_input" not in ctx.resources:
        from omni_cache.models.qwen2_5_omni_talker_input import Qwen25TalkerInput

        ctx.resources["qwen2_5_omni_input"] = Qwen25TalkerInput.load(ctx.model_path)
    return ctx.resources["qwen2_5_omni_input"]


def qwen2_5_omni_talker_logits(talker: Any) -> dict[str, Any]:
    """The reference's talker `generate` rule for `talker` (a `Qwen25TalkerInput`): HF's repetition
    penalty 1.05 over its input ids (a prompt of embeddings has none, so the reference's codec mask,
    pad and bos are given) and the generated codes; codec bos suppressed (workers/codec_logits.py)."""
    bos = talker.codec_bos_id
    return codec_logits_args(
        QWEN2_5_OMNI_TALKER_REPETITION_PENALTY, (bos, bos + 1), keep=[], prompt_ids=talker.penalized_prompt_ids()
    )


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
