"""A session's conversation: its items in order, and the prompt each response is given.

Every response's prompt is the whole conversation so far, rendered by the thinker's chat
template as a chat request's messages are (system instructions, then each item as a message):
user audio goes in as the audio clip it was (the same decoded samples and digest every turn, so
vLLM's multimodal prefix hashes, the hidden-state cache and the talker's prompt-embedding hashes
all match the earlier turns), and an assistant turn as the text the user heard (its transcript,
cut where its audio was truncated). Each turn's prompt then extends the previous turn's prompt
and answer, and the prefix caches hit on everything before the new turn.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from omni_cache.models.preprocessor import MIN_AUDIO_SAMPLES
from omni_cache.runtime.request_path.requests import AUDIO, MediaItem
from omni_cache.serving.realtime.protocol import EventError, new_id

__all__ = [
    "ItemPart",
    "Conversation",
    "Item",
    "SpokenText",
    "audio_item",
    "audio_parts",
    "audio_runs",
    "expand_audio_runs",
    "render",
]


@dataclass
class SpokenText:
    """An answer's text beside its audio, to cut the text where the audio was cut.

    The talker speaks the thinker's text at a steady pace (Qwen3-Omni's: one codec frame per text
    token), so the text a listener heard after ``ms`` of audio is the first ``ms / ms_per_token``
    tokens. The pace is measured: from this answer once it finished (all its audio over all its
    tokens), else from the session's earlier answers, else from this answer so far (audio sent
    over tokens received: text runs ahead of audio, so in a session's first answer this keeps the
    text that had arrived, which may be a little more than was spoken)."""

    pieces: list[tuple[int, str]] = field(default_factory=list)  # (tokens so far, text so far)
    tokens: int = 0
    text: str = ""
    audio_ms: float = 0.0
    finished: bool = False

    def add_text(self, text: str, n_tokens: int) -> None:
        self.tokens += n_tokens
        self.text += text
        self.pieces.append((self.tokens, self.text))

    def ms_per_token(self, session_pace: float | None) -> float | None:
        if self.finished and self.tokens:
            return self.audio_ms / self.tokens
        if session_pace:
            return session_pace
        return self.audio_ms / self.tokens if self.tokens else None

    def heard(self, ms: float, session_pace: float | None) -> str:
        """The text spoken in the first ``ms`` of audio."""
        if ms >= self.audio_ms and self.finished:
            return self.text
        pace = self.ms_per_token(session_pace)
        if not pace:
            return ""
        n = int(ms / pace)
        heard = ""
        for tokens, text in self.pieces:
            if tokens > n:
                break
            heard = text
        return heard


@dataclass
class ItemPart:
    #: input_text | input_audio | input_image | output_text | output_audio
    type: str
    text: str = ""  # the text, or an audio part's transcript
    media: MediaItem | None = None  # input_audio / input_image
    #: input_audio: this clip goes on the previous part's audio (one clip cut at the encoder's
    #: windows, :func:`audio_parts`): no placeholder span of its own, its item right after the
    #: previous one's inside the same ``audio_start ... audio_end``.
    joined: bool = False


@dataclass
class Item:
    role: str  # system | user | assistant
    content: list[ItemPart]
    id: str = field(default_factory=lambda: new_id("item"))
    status: str = "completed"
    #: Assistant audio: what was sent, the text beside it, and where it was truncated.
    spoken: SpokenText | None = None
    audio_end_ms: float | None = None
    #: (the message it was counted as, its prompt tokens): conversation_bounds counts each
    #: item once, again only when its text changed.
    counted: tuple[Any, int] | None = field(default=None, repr=False)

    @property
    def nbytes(self) -> int:
        """What the item holds: its decoded media and its text (a character taken as a byte)."""
        return sum((p.media.array.nbytes if p.media is not None else 0) + len(p.text) for p in self.content)

    @property
    def media(self) -> list[MediaItem]:
        return [p.media for p in self.content if p.media is not None]

    @property
    def sent_audio_ms(self) -> float:
        return self.spoken.audio_ms if self.spoken is not None else 0.0

    def message(self) -> tuple[dict[str, Any], list[MediaItem]] | None:
        """The chat message this item is in the prompt (None: nothing to say) and its media."""
        parts: list[dict[str, Any]] = []
        media: list[MediaItem] = []
        for part in self.content:
            if part.media is not None:
                media.append(part.media)
                if not part.joined:
                    parts.append({"type": "audio" if part.media.kind == AUDIO else "image"})
            elif part.text:
                parts.append({"type": "text", "text": part.text})
        if not parts:
            return None
        if all(p["type"] == "text" for p in parts):
            return {"role": self.role, "content": "".join(p["text"] for p in parts)}, media
        return {"role": self.role, "content": parts}, media

    def sdk(self) -> Any:
        """The item as the SDK's ConversationItem (audio bytes are not echoed back)."""
        from openai.types.realtime import (
            RealtimeConversationItemAssistantMessage,
            RealtimeConversationItemSystemMessage,
            RealtimeConversationItemUserMessage,
        )

        cls = {
            "user": RealtimeConversationItemUserMessage,
            "system": RealtimeConversationItemSystemMessage,
            "assistant": RealtimeConversationItemAssistantMessage,
        }[self.role]
        content = []
        for part in self.content:
            if part.joined:  # the rest of the clip before it
                continue
            if part.type in ("input_audio", "output_audio"):
                content.append({"type": part.type, "transcript": part.text or None})
            elif part.type == "input_image":
                content.append({"type": part.type})
            else:
                content.append({"type": part.type, "text": part.text})
        return cls(
            id=self.id, object="realtime.item", type="message", role=self.role, status=self.status, content=content
        )


def audio_item(samples: np.ndarray, rate: int) -> MediaItem:
    """A clip of the conversation as the thinker takes it; its digest (vLLM's multimodal UUID and
    prefix-hash key) is the sha256 of its samples, the same in every later turn's prompt."""
    samples = np.ascontiguousarray(samples, dtype=np.float32)
    samples.setflags(write=False)
    h = hashlib.sha256(f"realtime-audio:{rate}:".encode())
    h.update(samples.tobytes())
    return MediaItem(AUDIO, samples, rate, h.hexdigest())


def audio_parts(samples: np.ndarray, rate: int, window: int | None) -> list[ItemPart]:
    """A user turn's audio as the prompt holds it: one clip, or (``window``: the thinker's audio
    encoder window in samples) the clip cut every ``window`` samples, each piece its own item
    (its own digest) and the pieces after the first joined to it. The thinker sees the same
    token ids either way and encodes each window as the whole clip's (issue 51): the pieces of a
    turn prefilled while it was spoken (:mod:`.listening`) are the turn's first items.

    A last piece shorter than ``MIN_AUDIO_SAMPLES`` stays with the one before: the feature
    extractor fails on a clip of ``n_fft // 2`` samples or fewer, and a turn of 8 s and up to
    12.5 ms (at 16 kHz) failed its response on its last piece. That window, if it was listened
    to as a piece of its own, is encoded again at the turn's end (about one long turn in 300)."""
    samples = np.ascontiguousarray(samples, dtype=np.float32)
    if not window or len(samples) < window + MIN_AUDIO_SAMPLES:
        return [ItemPart("input_audio", media=audio_item(samples, rate))]
    cuts = list(range(0, len(samples), window))
    if len(samples) - cuts[-1] < MIN_AUDIO_SAMPLES:
        cuts.pop()
    ends = cuts[1:] + [len(samples)]
    return [
        ItemPart("input_audio", media=audio_item(samples[at:end], rate), joined=at > 0)
        for at, end in zip(cuts, ends, strict=True)
    ]


def audio_runs(items: list[Item]) -> list[int]:
    """How many audio items each audio placeholder of a prompt of ``items`` stands for, in order."""
    runs: list[int] = []
    for item in items:
        if item.message() is None:
            continue
        for part in item.content:
            if part.media is None or part.media.kind != AUDIO:
                continue
            if part.joined and runs:
                runs[-1] += 1
            else:
                runs.append(1)
    return runs


def expand_audio_runs(token_ids: list[int], runs: list[int], placeholder: int | None) -> list[int]:
    """``token_ids`` with the audio placeholder of a run of ``n`` items repeated ``n`` times (vLLM
    expands each to its own item's tokens: the items sit side by side in one span)."""
    if placeholder is None or all(n == 1 for n in runs):
        return token_ids
    out: list[int] = []
    k = 0
    for t in token_ids:
        if t == placeholder and k < len(runs):
            out.extend([t] * runs[k])
            k += 1
        else:
            out.append(t)
    if k != len(runs):
        raise ValueError(f"the prompt has {k} audio placeholders for {len(runs)} clips")
    return out


class Conversation:
    def __init__(self, max_items: int) -> None:
        self.max_items = max_items
        self.items: list[Item] = []

    def add(self, item: Item, previous_item_id: str | None = None) -> str | None:
        """Insert ``item`` after ``previous_item_id`` (None: at the end); the id it follows."""
        if len(self.items) >= self.max_items:
            raise EventError(
                f"the conversation holds {self.max_items} items "
                "(server.realtime.max_items): delete some or start a new session",
                param="item",
                code="conversation_full",
            )
        if any(i.id == item.id for i in self.items):
            raise EventError(f"an item with id {item.id!r} exists", param="item.id", code="duplicate_item_id")
        if previous_item_id is None:
            at = len(self.items)
        elif previous_item_id == "root":
            at = 0
        else:
            at = self.index(previous_item_id, "previous_item_id") + 1
        self.items.insert(at, item)
        return self.items[at - 1].id if at > 0 else None

    def index(self, item_id: str, param: str) -> int:
        for i, item in enumerate(self.items):
            if item.id == item_id:
                return i
        raise EventError(f"no item with id {item_id!r} in the conversation", param=param, code="item_not_found")

    def get(self, item_id: str, param: str = "item_id") -> Item:
        return self.items[self.index(item_id, param)]

    def delete(self, item_id: str) -> None:
        del self.items[self.index(item_id, "item_id")]

    @property
    def nbytes(self) -> int:
        return sum(item.nbytes for item in self.items)

    def drop(self, items: list[Item]) -> list[Item]:
        """Remove these items (those still here; truncation); the ones removed."""
        gone = {id(i) for i in items}
        removed = [i for i in self.items if id(i) in gone]
        self.items = [i for i in self.items if id(i) not in gone]
        return removed

    def prompt(self, instructions: str) -> tuple[list[dict[str, Any]], list[MediaItem]]:
        """The chat messages and media (in placeholder order) of a response to the conversation."""
        return render(self.items, instructions)


def render(items: list[Item], instructions: str) -> tuple[list[dict[str, Any]], list[MediaItem]]:
    """The chat messages and media (in placeholder order) of a prompt of these items."""
    messages: list[dict[str, Any]] = []
    media: list[MediaItem] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    for item in items:
        rendered = item.message()
        if rendered is not None:
            messages.append(rendered[0])
            media.extend(rendered[1])
    return messages, media
