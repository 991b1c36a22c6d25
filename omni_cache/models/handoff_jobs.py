"""What a stage hand-off reads and returns: the upstream's output so far (`Upstream`), the stage's
context (`HandoffContext`), and the jobs (`GenerateJob`, `FeedJob`, `DecodeJob`; `Job` is their
union), with the codec logits rules a job may ask vLLM for (`codec_logits_args`).

The generic hand-offs live in `omni_cache.handoff`; a model family's own hand-off lives beside its
model code (`omni_cache.models.qwen3_omni_talker_prompt.thinker_to_talker`,
`omni_cache.models.qwen2_5_omni_talker_input.thinker_to_talker`), which is why these types sit here,
below both. Torch only (no vLLM), and nothing of the wire: `Upstream.opened_by` reads a
`omni_cache.wire.messages.StreamStart` by its fields (the config package, which the wire's types
use, imports this package's checkpoint names).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from omni_cache.models.code_windows import CodeWindow


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
    # A prefill-only request (wire Submit.prefill_only): its prompt ends inside the user's turn
    # (a realtime session listening); the hand-off builds a prompt to prefill, nothing to speak.
    prefill_only: bool = False

    @classmethod
    def opened_by(cls, start: Any) -> Upstream:
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
            prefill_only=start.prefill_only,
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
