"""A session's ``truncation``: the oldest turns of a realtime conversation dropped so the session
keeps going past the thinker's limits (the Realtime API's session field, with the openai SDK's
shapes: ``"auto"``, ``"disabled"`` or ``{"type": "retention_ratio", "retention_ratio": r,
"token_limits": {"post_instructions": n}}``).

What a conversation must stay within:

- at response time, its prompt: the tokens with media placeholders expanded plus the answer's
  ``max_output_tokens`` within the thinker's ``max_model_len`` (and within ``post_instructions``
  tokens after the instructions when the client set it), its audio clips and images within the
  thinker's ``limit_mm_per_prompt``;
- when an item is added: ``server.realtime.max_items`` items, and its media and text within the
  session's share of ``server.max_media_bytes_in_flight`` (:class:`MediaHold`).

When an item or a response would pass one of them, whole turns are dropped from the start (a cut
falls only before a user item; the newest user item is always kept) until every measure is within
``retention_ratio`` x its limit; ``auto`` is a ratio of :data:`AUTO_RETENTION`. The dropped items
leave the conversation (``conversation.item.deleted`` for each) and their audio is freed.
``disabled`` drops nothing: the response fails (``response.done`` status ``failed``) or the item is
refused with an ``error``, as before.

What it costs: a truncation changes the start of the prompt, so that turn's prefix-cache hit ends
where the kept turns begin: at the instructions (their full blocks still hit; without
instructions nothing does). Every later turn extends the new prompt, and its caches hit as before
until the next truncation. Dropping to a ratio below 1 leaves room for several turns, so a session
pays one miss per truncation instead of one per turn (``auto``'s 0.75 with 16 clips per prompt:
one miss every 4 audio turns at worst).

Prompt tokens are counted by the thinker's chat template (exact for text) plus the tokens each
clip or image expands to: measured from the thinker's answers (``usage.input_tokens`` less the
prompt's own tokens, per clip) and, for a clip not yet measured, the session's highest rate so far
(:class:`MediaTokens`; before any answer :data:`DEFAULT_AUDIO_TOKENS_PER_S`, more than the audio
encoders we serve produce).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from omni_cache.runtime.request_path.requests import AUDIO
from omni_cache.serving.realtime.protocol import EventError

__all__ = [
    "AUTO_RETENTION",
    "DEFAULT_AUDIO_TOKENS_PER_S",
    "MediaTokens",
    "PromptLimits",
    "Truncation",
    "cut_points",
    "first_cut",
    "media_limit",
    "parse",
]

#: ``auto``'s retention ratio.
AUTO_RETENTION = 0.75
#: Tokens per second of audio assumed before the session measured any (Qwen3-Omni's encoder
#: gives 13, Whisper-style ones 25); one more token per clip on top.
DEFAULT_AUDIO_TOKENS_PER_S = 26.0
#: Pixels per image token assumed before any was measured (28 x 28 patches, Qwen-VL style).
DEFAULT_PIXELS_PER_IMAGE_TOKEN = 28 * 28


@dataclass(frozen=True)
class Truncation:
    mode: str = "auto"  # auto | disabled | retention_ratio
    retention_ratio: float = AUTO_RETENTION
    #: token_limits.post_instructions: conversation tokens after the instructions (None: the
    #: model's context less the answer).
    post_instructions: int | None = None

    @property
    def enabled(self) -> bool:
        return self.mode != "disabled"

    def sdk(self) -> Any:
        """As ``session.created`` / ``session.updated`` carry it."""
        if self.mode != "retention_ratio":
            return self.mode
        from openai.types.realtime.realtime_truncation_retention_ratio import (
            RealtimeTruncationRetentionRatio,
            TokenLimits,
        )

        limits = None if self.post_instructions is None else TokenLimits(post_instructions=self.post_instructions)
        return RealtimeTruncationRetentionRatio(
            type="retention_ratio", retention_ratio=self.retention_ratio, token_limits=limits
        )


def parse(value: Any) -> Truncation:
    """The SDK's validated ``session.truncation`` as a :class:`Truncation`; EventError naming the
    field when a value is out of range."""
    if value in ("auto", "disabled"):
        return Truncation(mode=value)
    ratio = value.retention_ratio
    if not 0.0 < ratio <= 1.0:
        raise EventError(
            "retention_ratio must be more than 0.0 and at most 1.0",
            param="session.truncation.retention_ratio",
            code="invalid_value",
        )
    post = value.token_limits.post_instructions if value.token_limits is not None else None
    if post is not None and post < 1:
        raise EventError(
            "post_instructions must be a positive number of tokens",
            param="session.truncation.token_limits.post_instructions",
            code="invalid_value",
        )
    return Truncation(mode="retention_ratio", retention_ratio=float(ratio), post_instructions=post)


def media_limit(engine_extra: dict[str, Any], kind: str) -> int | None:
    """The thinker's ``limit_mm_per_prompt`` for ``kind`` (an int or vLLM's ``{count: n}``);
    None: not set (vLLM then takes 999)."""
    limits = engine_extra.get("limit_mm_per_prompt") or {}
    value = limits.get(kind) if isinstance(limits, dict) else None
    if isinstance(value, dict):
        value = value.get("count")
    return int(value) if isinstance(value, int) else None


@dataclass(frozen=True)
class PromptLimits:
    """What one response's prompt must stay within."""

    tokens: int | None  # max_model_len less the answer's max tokens
    post_instructions: int | None
    audio: int | None
    images: int | None


def cut_points(roles: Sequence[str]) -> list[int]:
    """Where a conversation with these roles may be cut (the number of oldest items dropped):
    before a user item, so whole turns (a user item and the answers after it) go and the newest
    user item stays. Ascending; 0 (drop nothing) first."""
    return [0] + [i for i, role in enumerate(roles) if role == "user" and i > 0]


def first_cut(cuts: Sequence[int], over: Callable[[int, float], bool], ratio: float) -> int | None:
    """How many of the oldest items to drop: 0 when nothing is over its limit; else the first cut
    that brings every measure within ``ratio`` x its limit, else the first within the limits;
    None when even the last cut does not fit. ``over(cut, scale)``: whether the items from
    ``cut`` on pass some limit x ``scale`` (dropping more never makes it pass)."""
    if not over(0, 1.0):
        return 0
    for scale in (ratio, 1.0):
        lo, hi = 1, len(cuts)  # binary search over cuts[1:] for the first one not over
        while lo < hi:
            mid = (lo + hi) // 2
            if over(cuts[mid], scale):
                lo = mid + 1
            else:
                hi = mid
        if lo < len(cuts):
            return cuts[lo]
    return None


class MediaTokens:
    """How many prompt tokens a session's clips and images expand to (their placeholder
    included), from what the thinker counted: after each answer, the prompt's expanded length
    less its unexpanded one is what its media added; a clip or image measured in no answer yet is
    estimated at the session's highest rate so far."""

    def __init__(self) -> None:
        self.audio_per_s = DEFAULT_AUDIO_TOKENS_PER_S
        self.pixels_per_token = float(DEFAULT_PIXELS_PER_IMAGE_TOKEN)
        self._measured_audio = False
        self._measured_images = False
        #: media digest -> its tokens, measured.
        self.known: dict[str, int] = {}

    def of(self, media: Any) -> int:
        if _key(media) in self.known:
            return self.known[_key(media)]
        if media.kind == AUDIO:
            return math.ceil(len(media.array) / media.sample_rate * self.audio_per_s) + 1
        return math.ceil(_pixels(media) / self.pixels_per_token) + 2

    def learn(self, media: Sequence[Any], expanded: int, unexpanded: int) -> None:
        """An answer's prompt of ``unexpanded`` tokens (one placeholder per item) was ``expanded``
        tokens long at the thinker: what its media took, spread over the items not known yet."""
        unknown = [m for m in dict((_key(m), m) for m in media).values() if _key(m) not in self.known]
        if not unknown:
            return
        added = expanded - unexpanded + len(media) - sum(self.known[_key(m)] for m in media if _key(m) in self.known)
        weights = [self._weight(m) for m in unknown]
        total = sum(weights) or 1.0
        for m, w in zip(unknown, weights):
            self.known[_key(m)] = max(1, round(added * w / total))
        # The highest rate seen is the estimate for what comes next (never under-count).
        audio = [m for m in unknown if m.kind == AUDIO and len(m.array)]
        if audio:
            rate = max(self.known[_key(m)] * m.sample_rate / len(m.array) for m in audio)
            self.audio_per_s = rate if not self._measured_audio else max(self.audio_per_s, rate)
            self._measured_audio = True
        images = [m for m in unknown if m.kind != AUDIO and _pixels(m)]
        if images:
            px = min(_pixels(m) / self.known[_key(m)] for m in images)
            self.pixels_per_token = px if not self._measured_images else min(self.pixels_per_token, px)
            self._measured_images = True

    def _weight(self, media: Any) -> float:
        if media.kind == AUDIO:
            return len(media.array) / media.sample_rate * self.audio_per_s + 1
        return _pixels(media) / self.pixels_per_token + 2


def _key(media: Any) -> str:
    return media.digest or f"object:{id(media)}"


def _pixels(media: Any) -> int:
    shape = getattr(media.array, "shape", ())
    return int(shape[0] * shape[1]) if len(shape) >= 2 else int(getattr(media.array, "size", 0))
