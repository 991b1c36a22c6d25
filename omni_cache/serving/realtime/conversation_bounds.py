"""What one realtime session's conversation may hold, and the room it makes by truncation.

Memory: a session holds its conversation (decoded clips and images, and text) and its input
buffer in the server's media bound, ``server.max_media_bytes_in_flight``, beside the HTTP
requests' media (:class:`~omni_cache.runtime.request_path.admission.MediaHold`): at most
``max_media_bytes_in_flight / server.realtime.max_sessions`` each, so a full house of sessions fits
the bound together. The input buffer's room (``server.realtime.max_buffer_s`` of float32 samples
at the encoder's rate) is reserved when the session opens; each item is held from before its
clips and images are decoded (their size read from their headers and lengths,
:mod:`.client_items`) until it leaves the conversation; the responses' requests do not
reserve the same media a second time. An item that does not fit is refused with an ``error`` (the session
goes on) unless
truncation can drop older turns for it.

Prompts: before each response the conversation is fitted to the thinker's limits
(:mod:`.truncation`): the turns truncation drops leave the conversation.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from omni_cache.runtime.request_path.admission import MediaHold
from omni_cache.runtime.request_path.prompt_ids import PromptIds, prompt_ids
from omni_cache.runtime.request_path.requests import AUDIO, MediaItem
from omni_cache.runtime.request_path.results import RequestError
from omni_cache.runtime.request_path.text_codec import PromptTooLong
from omni_cache.serving.realtime.conversation import Conversation, Item, audio_runs, expand_audio_runs, render
from omni_cache.serving.realtime.protocol import EventError
from omni_cache.serving.realtime.truncation import (
    MediaTokens,
    PromptLimits,
    Truncation,
    cut_points,
    first_cut,
    media_limit,
)

__all__ = ["ConversationBounds", "Prompt"]

#: Bytes of one buffered input sample (float32).
SAMPLE_BYTES = 4


@dataclass
class Prompt:
    """One response's prompt after fitting: what is sent, and the items truncation dropped."""

    token_ids: list[int]
    media: list[MediaItem]
    dropped: list[Item] = field(default_factory=list)


class ConversationBounds:
    """One session's share of the server's bounds and the thinker's limits on its prompts."""

    def __init__(
        self,
        pipeline: Any,
        max_items: int,
        max_sessions: int,
        rate: int,
        max_buffer_s: float,
        off_loop: Callable[..., Awaitable[Any]] = asyncio.to_thread,
    ) -> None:
        self.pipeline = pipeline
        #: Runs the prompt's tokenizing off the event loop (the server's request threads).
        self.off_loop = off_loop
        self.max_items = max_items
        admission = pipeline.admission
        self.hold = MediaHold(admission.bounds, admission.bounds.max_media_bytes // max_sessions)
        #: The input buffer's room, reserved while the session is open.
        self.buffer_room = int(max_buffer_s * rate) * SAMPLE_BYTES
        #: Room made for an item not in the conversation yet (its media being decoded): held
        #: until it joins or is given up (:meth:`done`), whatever settles meanwhile.
        self.pending = 0
        self.media_tokens = MediaTokens()
        extra = (
            dict(pipeline.topology.entry.engine_args.extra) if pipeline.topology.entry.engine_args is not None else {}
        )
        self.audio_limit = media_limit(extra, "audio")
        #: The thinker's audio placeholder token: a clip cut at the encoder's windows is one
        #: placeholder per piece, side by side (conversation.audio_parts).
        self.audio_placeholder: int | None = getattr(pipeline, "audio_placeholder_id", None)
        self.image_limit = media_limit(extra, "image")

    # ---- memory ----------------------------------------------------------------------------------

    def open(self) -> None:
        """Reserve the input buffer's room; EventError when the server has none for a session."""
        if self.buffer_room > self.hold.share:
            raise EventError(
                f"a session's input buffer needs {self.buffer_room} bytes, more than a "
                f"session's share of {self.hold.share} (server.max_media_bytes_in_flight "
                "/ server.realtime.max_sessions; lower server.realtime.max_buffer_s)",
                type="server_error",
                code="server_memory_limit_reached",
            )
        self._hold(self.buffer_room)

    def close(self) -> None:
        self.hold.release()

    @property
    def conversation_share(self) -> int:
        return self.hold.share - self.buffer_room

    def make_room(
        self, conversation: Conversation, nbytes: int, truncation: Truncation, keep: Item | None = None
    ) -> list[Item]:
        """Room for one more item of ``nbytes``: the oldest turns to drop for it (none when it
        fits), its bytes held; EventError when it cannot have room. Nothing is dropped here: the
        caller removes the items returned, adds the item and calls :meth:`done`. ``keep``: an
        item that must not be dropped."""
        items = conversation.items
        protect = items.index(keep) if keep is not None and keep in items else len(items)
        sizes = [i.nbytes for i in items]
        share = self.conversation_share

        def over(cut: int, scale: float) -> bool:
            return len(items) - cut + 1 > scale * self.max_items or sum(sizes[cut:]) + nbytes > scale * share

        cut = 0
        if over(0, 1.0):
            cuts = [c for c in cut_points([i.role for i in items]) if c <= protect]
            found = first_cut(cuts, over, truncation.retention_ratio) if truncation.enabled else None
            if found is None:
                raise self._no_room(len(items), sum(sizes) + nbytes, truncation)
            cut = found
        self._hold(self.buffer_room + sum(sizes[cut:]) + nbytes)
        self.pending = nbytes
        return items[:cut]

    def settle(self, conversation: Conversation) -> None:
        """Hold what the conversation holds now (an item left, an answer's text grew)."""
        self.hold.settle(self.buffer_room + conversation.nbytes + self.pending)

    def done(self, conversation: Conversation) -> None:
        """The item :meth:`make_room` made room for joined the conversation or was given up."""
        self.pending = 0
        self.settle(conversation)

    def _hold(self, nbytes: int) -> None:
        try:
            self.hold.resize(nbytes)
        except RequestError as e:
            if e.status == 413:  # this session's share
                raise EventError(
                    f"no room for it: {e.message}; delete items or start a new session",
                    param="item",
                    code="session_memory_limit_reached",
                ) from None
            raise EventError(
                f"no room for it now: {e.message}; retry shortly",
                param="item",
                code="server_memory_limit_reached",
                type="server_error",
            ) from None

    def _no_room(self, n_items: int, nbytes: int, truncation: Truncation) -> EventError:
        how = (
            "truncation is disabled: delete items or start a new session"
            if not truncation.enabled
            else "the newest turn alone does not fit"
        )
        if n_items + 1 > self.max_items:
            return EventError(
                f"the conversation holds {self.max_items} items (server.realtime.max_items); {how}",
                param="item",
                code="conversation_full",
            )
        return EventError(
            f"the conversation would hold {nbytes} bytes of media and text, more than "
            f"this session's {self.conversation_share} (server.max_media_bytes_in_flight "
            f"/ server.realtime.max_sessions, less the input buffer); {how}",
            param="item",
            code="session_memory_limit_reached",
        )

    # ---- prompts ---------------------------------------------------------------------------------

    def limits(self, max_tokens: int | None, truncation: Truncation) -> PromptLimits:
        admission = self.pipeline.admission
        context = admission.max_model_len
        answer = max_tokens if max_tokens is not None else admission.default_sampling().max_tokens
        return PromptLimits(
            tokens=context - answer if context else None,
            post_instructions=truncation.post_instructions,
            audio=self.audio_limit,
            images=self.image_limit,
        )

    async def fit(self, items: list[Item], instructions: str, max_tokens: int | None, truncation: Truncation) -> Prompt:
        """The prompt of a response to ``items`` (the conversation when it was asked for):
        with truncation on, its oldest turns dropped until it is within the thinker's limits
        (:mod:`.truncation`). The prompt is tokenized off the event loop (:attr:`off_loop`)."""
        tokenize = self.pipeline.tokenize_messages
        counts, base = await self.off_loop(_count, items, instructions, tokenize)
        limits = self.limits(max_tokens, truncation)
        extra = [sum(self.media_tokens.of(m) - 1 for m in i.media) for i in items]
        audio = [sum(m.kind == AUDIO for m in i.media) for i in items]
        images = [len(i.media) - a for i, a in zip(items, audio)]

        def over(cut: int, scale: float) -> bool:
            conv = sum(counts[cut:]) + sum(extra[cut:])
            return (
                _past(base + conv, limits.tokens, scale)
                or _past(conv, limits.post_instructions, scale)
                or _past(sum(audio[cut:]), limits.audio, scale)
                or _past(sum(images[cut:]), limits.images, scale)
            )

        cuts = cut_points([i.role for i in items])
        cut = (first_cut(cuts, over, truncation.retention_ratio) or 0) if truncation.enabled else 0
        while True:
            messages, media = render(items[cut:], instructions)
            ids = await self.off_loop(_tokenized, tokenize, messages, audio_runs(items[cut:]), self.audio_placeholder)
            estimate = len(ids) - len(media) + sum(self.media_tokens.of(m) for m in media)
            later = [c for c in cuts if c > cut]
            # The per-item counts assumed the template adds each message's tokens: the whole
            # prompt is what counts.
            if not (truncation.enabled and later and _past(estimate, limits.tokens, 1.0)):
                return Prompt(ids, media, items[:cut])
            cut = later[0]

    def learn(self, media: list[MediaItem], expanded: int, unexpanded: int) -> None:
        """An answered prompt's length at the thinker: what its media expanded to."""
        if media:
            self.media_tokens.learn(media, expanded, unexpanded)


def _past(value: int, limit: int | None, scale: float) -> bool:
    return limit is not None and value > scale * limit


def _tokenized(
    tokenize: Callable[[Any], list[int]], messages: Any, runs: list[int], placeholder: int | None
) -> PromptIds:
    """The prompt's ids with its audio runs expanded, checked (on a worker thread: both walk every
    id, milliseconds for a long conversation)."""
    return prompt_ids(expand_audio_runs(tokenize(messages), runs, placeholder))


def _count(
    items: list[Item], instructions: str, tokenize: Callable[[list[dict[str, Any]]], list[int]]
) -> tuple[list[int], int]:
    """Each item's prompt tokens (counted once per text: :attr:`Item.counted`) and the tokens of
    the rest of the prompt (instructions and the generation prompt)."""
    probe = {"role": "user", "content": "."}
    one = len(tokenize([probe]))
    generation = 2 * one - len(tokenize([probe, probe]))  # the template's tail, once per prompt
    base = len(tokenize([{"role": "system", "content": instructions}])) if instructions else generation
    counts = []
    for item in items:
        rendered = item.message()
        message = rendered[0] if rendered is not None else None
        if item.counted is None or item.counted[0] != message:
            item.counted = (message, 0 if message is None else _tokens(tokenize, message, generation))
        counts.append(item.counted[1])
    return counts, base


def _tokens(tokenize: Callable[[list[dict[str, Any]]], list[int]], message: dict[str, Any], generation: int) -> int:
    """One message's prompt tokens (less the template's ``generation`` tail); one too long to
    tokenize counts as more than the context holds, so truncation drops it like any other turn
    over the limit."""
    try:
        return len(tokenize([message])) - generation
    except PromptTooLong as e:
        return e.tokens_at_least
