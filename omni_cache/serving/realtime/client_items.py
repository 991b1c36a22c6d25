"""A client's ``conversation.item.create`` message made into a conversation :class:`Item`, in two
steps so its media are held in the server's bounds before they are decoded.

:func:`read` checks the SDK-validated item and what each part carries without decoding any
media: an ``input_image`` (``{"type": "input_image", "image_url": "data:image/png;base64,..."}``)
is read and checked from its header by the server's media decoder (an :class:`ImageSource` the
server builds around :class:`omni_cache.serving.media.MediaDecoder`) with the chat API's limits
(``server.media``: the encoded size, the pixel count, the formats,
allowed hosts for an http(s) URL) and gets the chat API's digest (so the same image is the same
vLLM multimodal UUID and prefix-cache key in a chat request and in every turn of a session); an
``input_audio`` clip's decoded size is bounded from its base64 length. The
:class:`PendingItem`'s :attr:`~PendingItem.nbytes` is what decoding will hold: the session makes
room for that much (:mod:`.conversation_bounds`) and only then :func:`decode` runs. Both steps run
off the event loop (base64 and pixels take milliseconds). A part that cannot be used is an
:class:`EventError` naming it (``item.content.<i>...``): the session answers ``error`` and goes on.

``detail`` (``auto`` | ``low`` | ``high``) is not a resolution switch here: the thinker's own
processor sizes every image to its pixel budget, as in the chat API.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from omni_cache.models.preprocessor import too_short
from omni_cache.runtime.request_path.requests import MediaItem
from omni_cache.serving.realtime.audio_codecs import AudioFormat, StreamResampler
from omni_cache.serving.realtime.conversation import Item, ItemPart, SpokenText, audio_item
from omni_cache.serving.realtime.protocol import EventError, new_id

__all__ = ["ImageSource", "PendingItem", "PendingPart", "clip_bound", "decode", "decode_clip", "read"]

#: Bytes of one decoded audio sample (float32).
SAMPLE_BYTES = 4


@dataclass(frozen=True)
class ImageSource:
    """How the server reads ``input_image`` parts (its MediaDecoder: ``server.media``'s limits and
    its decoded-item cache; omni_cache/serving/routes.py builds it). Both calls raise EventError
    naming the part."""

    #: (URL, param) -> the image read and checked from its header, nothing decoded: an object
    #: with ``decoded_bytes`` and ``param`` (the decoder's EncodedItem).
    read: Callable[[str, str], Any]
    #: What ``read`` returned -> the decoded image.
    decode: Callable[[Any], MediaItem]
    #: Clips and images one item may carry (``server.media.max_items``, as one chat request).
    max_items: int
    #: [(URL, param)] -> the http(s) ones downloaded, on the event loop, for ``read`` to find.
    fetch: Callable[[list[tuple[str, str]]], Awaitable[None]]
    #: Drops what ``fetch`` downloaded, once ``read`` took it.
    forget: Callable[[], None]


@dataclass
class PendingPart:
    type: str
    text: str = ""
    audio: str | None = None  # an input_audio part's base64, decoded by decode()
    image: Any = None  # an input_image part as ImageSource.read returned it (not decoded)

    @property
    def nbytes(self) -> int:
        return len(self.text) + (self.image.decoded_bytes if self.image is not None else 0)


@dataclass
class PendingItem:
    """A client's item, checked, its media not decoded yet."""

    role: str
    id: str
    parts: list[PendingPart]
    #: The most bytes its decoded clips will hold (at the encoder's rate, float32).
    audio_bytes: int = 0

    @property
    def nbytes(self) -> int:
        """What the item will hold once decoded (an upper bound: Item.nbytes is the exact size)."""
        return sum(p.nbytes for p in self.parts) + self.audio_bytes


def clip_bound(fmt: AudioFormat, data: str, rate: int) -> int:
    """The most bytes the base64 clip ``data`` in ``fmt`` decodes to at ``rate`` (float32)."""
    samples = len(data) * 3 // 4 // fmt.bytes_per_sample
    return (-(-samples * rate // fmt.rate) + 1) * SAMPLE_BYTES


def read(sdk_item: Any, fmt: AudioFormat, rate: int, images: ImageSource | None) -> PendingItem:
    """The client's message item checked part by part, its images read from their headers
    (nothing decoded); EventError naming the first part that cannot be used."""
    role = getattr(sdk_item, "role", None)
    if getattr(sdk_item, "type", None) != "message" or role not in ("user", "system", "assistant"):
        raise EventError(
            f"item type {sdk_item.type!r} is not supported (messages only: this server serves no tools)",
            param="item.type",
            code="unsupported",
        )
    if not sdk_item.content:
        raise EventError("a message needs content", param="item.content", code="invalid_value")
    _check_media_count(sdk_item.content, images)
    item = PendingItem(role, sdk_item.id or new_id("item"), [])
    for i, c in enumerate(sdk_item.content):
        param = f"item.content.{i}"
        kind = c.type or ("input_text" if role != "assistant" else "output_text")
        if kind in ("input_text", "output_text"):
            if c.text is None:
                raise EventError(f"a {kind} part needs 'text'", param=param + ".text", code="invalid_value")
            item.parts.append(PendingPart(kind, c.text))
        elif kind == "input_audio":
            if c.audio is None:
                raise EventError(
                    "an input_audio part needs 'audio' (base64, in the session's input format)",
                    param=param + ".audio",
                    code="invalid_value",
                )
            item.parts.append(PendingPart(kind, c.transcript or "", audio=c.audio))
            item.audio_bytes += clip_bound(fmt, c.audio, rate)
        elif kind == "input_image":
            item.parts.append(PendingPart(kind, image=_read_image(images, c.image_url, param + ".image_url")))
        elif kind == "output_audio":
            # An assistant turn the client supplies: its transcript is what the user heard.
            item.parts.append(PendingPart(kind, c.transcript or ""))
        else:
            raise EventError(f"content type {kind!r} is not supported", param=param + ".type", code="unsupported")
    return item


def decode(pending: PendingItem, fmt: AudioFormat, rate: int, images: ImageSource | None) -> Item:
    """The item with its clips and images decoded (the server's decoded-item cache is used for
    images, as for chat requests); EventError naming a part that does not decode."""
    parts: list[ItemPart] = []
    for i, p in enumerate(pending.parts):
        if p.audio is not None:
            samples = decode_clip(fmt, p.audio, f"item.content.{i}.audio", rate)
            parts.append(ItemPart(p.type, p.text, media=audio_item(samples, rate)))
        elif p.image is not None:
            parts.append(ItemPart(p.type, media=images.decode(p.image)))
        else:
            parts.append(ItemPart(p.type, p.text))
    item = Item(pending.role, parts, id=pending.id)
    if pending.role == "assistant":
        item.spoken = SpokenText(finished=True)
    return item


def decode_clip(fmt: AudioFormat, data: str, param: str, rate: int) -> np.ndarray:
    """A whole clip (base64 in ``fmt``) as float32 samples at ``rate``."""
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise EventError("audio is not valid base64", param=param, code="invalid_value") from None
    try:
        samples = fmt.decode(raw)
    except ValueError as e:
        raise EventError(str(e), param=param, code="invalid_value") from None
    clip = StreamResampler(fmt.rate, rate)(samples, last=True)
    if short := too_short("audio", len(clip), rate):
        raise EventError(short, param=param, code="invalid_value")
    return clip


def _check_media_count(content: list[Any], images: ImageSource | None) -> None:
    """One item carries at most ``server.media.max_items`` clips and images, as one chat request."""
    n = sum(c.type in ("input_audio", "input_image") for c in content)
    limit = images.max_items if images is not None else None
    if limit is not None and n > limit:
        raise EventError(
            f"the item has {n} audio clips and images; at most {limit} are accepted "
            "in one item (server.media.max_items)",
            param="item.content",
            code="invalid_value",
        )


def image_urls(sdk_item: Any) -> list[tuple[str, str]]:
    """The ``(image_url, param)`` of a message item's ``input_image`` parts."""
    content = getattr(sdk_item, "content", None) or []
    return [
        (c.image_url, f"item.content.{i}.image_url")
        for i, c in enumerate(content)
        if getattr(c, "type", None) == "input_image" and c.image_url
    ]


def _read_image(images: ImageSource | None, url: str | None, param: str) -> Any:
    if images is None:
        raise EventError("images are not taken by this server", param=param, code="unsupported")
    if not url:
        raise EventError("an input_image part needs 'image_url' (a data: URL)", param=param, code="invalid_value")
    return images.read(url, param)
