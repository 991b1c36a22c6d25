"""A chat-completions request: its schema (pydantic, OpenAI's fields) and the checks that turn a
body into what the handler needs (model, n, modalities, audio format, plain chat messages), each
failure an :class:`~omni_cache.serving.errors.APIError` naming the field."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from omni_cache.serving.audio_formats import STREAM_FORMAT, UnsupportedFormat, check_format
from omni_cache.serving.errors import APIError, invalid_request

__all__ = ["ChatCompletionRequest", "ChatRequest", "MediaPart", "parse_chat_request"]

_INT64 = 2**63 - 1


class _Model(BaseModel):
    # strict: "5" is not an int, 1 is not a bool (OpenAI rejects both); unknown fields are ignored.
    model_config = ConfigDict(extra="ignore", strict=True)


class ImageURL(_Model):
    url: str
    detail: str | None = None  # accepted and not used: the processor decides the resolution


class InputAudio(_Model):
    data: str
    format: str


class ContentPart(_Model):
    type: str
    text: str | None = None
    image_url: ImageURL | None = None
    input_audio: InputAudio | None = None


class ChatMessage(_Model):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None


class AudioOptions(_Model):
    voice: str | None = None
    # Default: "wav", or "pcm16" when streaming (the only format a stream can carry).
    format: str | None = None


class StreamOptions(_Model):
    include_usage: bool = False


class ChatCompletionRequest(_Model):
    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1, le=2**31)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=2**31)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    seed: int | None = Field(default=None, ge=-_INT64 - 1, le=_INT64)
    stream: bool = False
    stream_options: StreamOptions | None = None
    modalities: list[Literal["text", "audio"]] | None = None
    audio: AudioOptions | None = None
    n: int | None = Field(default=None, ge=1)


@dataclass(frozen=True)
class MediaPart:
    """An image or audio clip of the request, not decoded yet; ``param`` names its content part."""

    kind: str  # "image" | "audio"
    part: ContentPart
    param: str


@dataclass(frozen=True)
class ChatRequest:
    """A request that passed every check: the body plus what was derived from it."""

    body: ChatCompletionRequest
    modalities: tuple[str, ...]
    audio_format: str
    messages: list[dict[str, Any]]
    #: The request's images and clips in the order their placeholders appear in the prompt.
    media: tuple[MediaPart, ...] = ()

    @property
    def wants_audio(self) -> bool:
        return "audio" in self.modalities

    @property
    def include_usage(self) -> bool:
        return bool(self.body.stream_options and self.body.stream_options.include_usage)

    def without_content(self) -> ChatRequest:
        """This request without its messages and media (what answering it still reads): once it
        was submitted, its prompt and decoded media are the orchestrator's, and the encoded
        media need not live until it is answered."""
        return replace(self, body=self.body.model_copy(update={"messages": []}), messages=[],
                       media=())


#: The voices the pipeline speaks with (its talker has one).
VOICES = ("default",)


async def read_body(request: Any, limit: int,
                    reserve: Callable[[int], None] | None = None) -> bytearray:
    """The request body, refused (413) past ``limit`` bytes (``server.max_body_bytes``) before
    more of it is read. ``reserve(n)`` is told of ``n`` more bytes before they are kept (the
    declared length at once, else each chunk) and may refuse them by raising."""
    too_large = APIError(413, f"the request body is over {limit} bytes (server.max_body_bytes)")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    reserved = int(declared) if declared.isdigit() else 0
    if reserve is not None and reserved:
        reserve(reserved)
    body = bytearray()  # one copy of the body, grown in place
    async for chunk in request.stream():
        if len(body) + len(chunk) > limit:
            raise too_large
        if reserve is not None and len(body) + len(chunk) > reserved:
            reserve(len(body) + len(chunk) - reserved)
            reserved = len(body) + len(chunk)
        body += chunk
    return body


def parse_chat_request(raw: bytes, served_model: str) -> ChatRequest:
    """Validate a chat-completions body for the model this server serves; APIError otherwise."""
    try:
        req = ChatCompletionRequest.model_validate_json(raw)
    except ValidationError as e:
        raise invalid_request(e) from None
    if req.model != served_model:
        raise APIError(404, f"the model {req.model!r} does not exist; this server serves {served_model!r}",
                       param="model", code="model_not_found")
    if req.n not in (None, 1):
        raise APIError(400, "only n=1 is supported", param="n")
    modalities = tuple(dict.fromkeys(req.modalities or ["text"]))
    audio_format = (req.audio.format if req.audio else None) or (STREAM_FORMAT if req.stream else "wav")
    voice = req.audio.voice if req.audio else None
    if voice is not None and voice not in VOICES:
        raise APIError(400, f"voice {voice!r} is not available; this pipeline speaks with "
                       + ", ".join(repr(v) for v in VOICES), param="audio.voice")
    if "audio" in modalities:
        try:
            check_format(audio_format, stream=req.stream)
        except UnsupportedFormat as e:
            raise APIError(400, str(e), param="audio.format") from None
    media: list[MediaPart] = []
    messages = [_message_dict(i, m, media) for i, m in enumerate(req.messages)]
    return ChatRequest(req, modalities, audio_format, messages, tuple(media))


#: Content-part type -> (the field that carries it, the media kind, the chat template's part type).
MEDIA_PARTS = {"image_url": ("image_url", "image"), "input_audio": ("input_audio", "audio")}
SUPPORTED_PARTS = ("text", *MEDIA_PARTS)


def _message_dict(i: int, m: ChatMessage, media: list[MediaPart]) -> dict[str, Any]:
    """A chat message as the chat template takes it (developer -> system). Text-only content stays
    one string; content with images or clips is a list of parts, ``{"type": "image"}`` /
    ``{"type": "audio"}`` where the template writes the placeholders. The media go to ``media``."""
    if m.content is None or isinstance(m.content, str):
        content: Any = m.content or ""
    else:
        parts: list[dict[str, Any]] = []
        for j, part in enumerate(m.content):
            param = f"messages.{i}.content.{j}"
            if part.type == "text":
                if part.text is None:
                    raise APIError(400, "a text content part needs 'text'", param=param + ".text")
                parts.append({"type": "text", "text": part.text})
            elif part.type in MEDIA_PARTS:
                field_name, kind = MEDIA_PARTS[part.type]
                if getattr(part, field_name) is None:
                    raise APIError(400, f"a {part.type} content part needs {field_name!r}",
                                   param=f"{param}.{field_name}")
                media.append(MediaPart(kind, part, param))
                parts.append({"type": kind})
            else:
                raise APIError(400, f"content part type {part.type!r} is not supported (supported: "
                               f"{', '.join(SUPPORTED_PARTS)})", param=param + ".type")
        if all(p["type"] == "text" for p in parts):
            content = "".join(p["text"] for p in parts)
        else:
            content = parts
    d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": content}
    if m.name:
        d["name"] = m.name
    return d
