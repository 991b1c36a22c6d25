"""A chat-completions request: parsed and validated by vLLM's own ``ChatCompletionRequest`` (its
types, its validators, so its 4xx messages), then checked against what this server does with each
field (:mod:`omni_cache.serving.chat_fields`), with this API's own fields (``modalities``,
``audio``) read from the fields vLLM does not know. The result holds what the handler needs: the
request, its modalities and audio format, its messages as the chat template takes them and its
images and clips (not decoded yet)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

from fastapi.exceptions import RequestValidationError
from starlette.requests import ClientDisconnect

from omni_cache.json_body import BodyError, parse_json
from omni_cache.serving.audio_formats import STREAM_FORMAT, UnsupportedFormat, check_format
from omni_cache.serving.chat_fields import refusal
from omni_cache.serving.errors import APIError

__all__ = ["ChatRequest", "MediaPart", "drain_body", "parse_chat_request", "read_body"]


@dataclass(frozen=True)
class MediaPart:
    """An image or audio clip of the request, not decoded yet; ``param`` names its content part.
    ``part`` is the content part as the client sent it (``image_url: {url}`` or ``input_audio:
    {data, format}``)."""

    kind: str  # "image" | "audio"
    part: dict[str, Any]
    param: str


@dataclass(frozen=True)
class ChatRequest:
    """A request that passed every check: vLLM's request plus what was derived from it."""

    body: Any  # vllm's ChatCompletionRequest
    modalities: tuple[str, ...]
    audio_format: str
    messages: list[dict[str, Any]]
    #: The request's images and clips in the order their placeholders appear in the prompt.
    media: tuple[MediaPart, ...] = ()
    #: The voice of a spoken answer as the client named it ("" = the checkpoint's default).
    voice: str = ""

    @property
    def wants_audio(self) -> bool:
        return "audio" in self.modalities

    def without_content(self) -> ChatRequest:
        """This request without its messages and media (what answering it still reads): once it
        was submitted, its prompt and decoded media are the orchestrator's, and the encoded
        media need not live until it is answered."""
        return replace(self, body=self.body.model_copy(update={"messages": []}), messages=[], media=())


#: The voices a pipeline without named speakers speaks with (omni_cache.models.voices).
VOICES = ("default",)


async def read_body(
    request: Any, limit: int, reserve: Callable[[int], None] | None = None, *, timeout: float | None = None
) -> bytearray:
    """The request body, refused (413) past ``limit`` bytes (``server.max_body_bytes``) before
    more of it is kept, and (408) when it has not all arrived within ``timeout`` seconds
    (``server.body_timeout_s``: a client that declares more than it sends). ``reserve(n)`` is
    told of ``n`` more bytes before they are kept (the declared length at once, else each chunk)
    and may refuse them by raising."""
    try:
        async with asyncio.timeout(timeout):
            return await _read(request, limit, reserve)
    except TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout:g} s (server.body_timeout_s)") from None


async def _read(request: Any, limit: int, reserve: Callable[[int], None] | None) -> bytearray:
    chunks = request.stream()
    try:
        return await _keep(chunks, request.headers.get("content-length", ""), limit, reserve)
    except APIError:
        await _drain(chunks, 2 * limit)  # refused (413, 429): what is still coming is dropped
        raise


async def _keep(
    chunks: AsyncIterator[bytes], declared: str, limit: int, reserve: Callable[[int], None] | None
) -> bytearray:
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    reserved = int(declared) if declared.isdigit() else 0
    if reserve is not None and reserved:
        reserve(reserved)
    body = bytearray()  # one copy of the body, grown in place
    async for chunk in chunks:
        if len(body) + len(chunk) > limit:
            raise _too_large(limit)
        if reserve is not None and len(body) + len(chunk) > reserved:
            reserve(len(body) + len(chunk) - reserved)
            reserved = len(body) + len(chunk)
        body += chunk
    return body


async def drain_body(request: Any, limit: int, timeout: float) -> None:
    """Read and drop the body of a request refused before it was read (up to twice ``limit``
    bytes and ``timeout`` seconds), so that its client reads the answer (see :func:`_drain`)."""
    with contextlib.suppress(TimeoutError, RuntimeError):  # RuntimeError: already read
        async with asyncio.timeout(timeout):
            await _drain(request.stream(), 2 * limit)


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is over {limit} bytes (server.max_body_bytes)")


async def _drain(chunks: AsyncIterator[bytes], limit: int) -> None:
    """Read on and drop up to ``limit`` more bytes of a body that is refused: a client that is
    still sending it then reads the answer, where a connection closed with its bytes unread
    would reach it as a reset (uvicorn closes a ``Connection: close`` request's socket after the
    answer). A body longer still is cut off there (its client may then see a reset)."""
    dropped = 0
    with contextlib.suppress(ClientDisconnect):  # gone: nothing left to drop
        async for chunk in chunks:
            dropped += len(chunk)
            if dropped > limit:
                return


def validated_request(raw: bytes) -> Any:
    """vLLM's ``ChatCompletionRequest`` of a JSON body. A body that does not parse or validate
    raises what FastAPI raises for vLLM's route (``RequestValidationError``, answered by vLLM's
    handler); vLLM's validators raise their ``VLLMValidationError`` as under ``vllm serve``."""
    import pydantic
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    try:
        data = parse_json(raw)  # its nesting bounded before it is parsed
    except BodyError as e:
        raise RequestValidationError(
            [
                {
                    "type": "json_invalid",
                    "loc": ("body",),
                    "msg": f"JSON decode error: {e}",
                    "input": {},
                    "ctx": {"error": str(e)},
                }
            ]
        ) from None
    try:
        return ChatCompletionRequest.model_validate(data)
    except pydantic.ValidationError as e:
        raise RequestValidationError(
            [{**err, "loc": ("body", *err["loc"])} for err in e.errors(include_url=False)]
        ) from None


def parse_chat_request(raw: bytes, served_model: str, voices: tuple[str, ...] = VOICES) -> ChatRequest:
    """Validate a chat-completions body for the model this server serves; APIError otherwise.
    ``voices``: the ``audio.voice`` names the pipeline speaks with (matched without case)."""
    req = validated_request(raw)
    if req.model is not None and req.model != served_model:
        raise APIError(404, f"The model `{req.model}` does not exist. Valid aliases: {served_model}.", param="model")
    extras = dict(req.model_extra or {})
    modalities = _modalities(extras.get("modalities"))
    refused = refusal(req, extras, "audio" in modalities)
    if refused is not None:
        field, why = refused
        raise APIError(400, f"{field} is not supported by this server: {why}", param=field)
    audio = extras.get("audio")
    audio = {} if audio is None else audio  # [] or "" is no audio object either
    if not isinstance(audio, dict):
        raise APIError(400, "audio must be an object {voice, format}", param="audio")
    # OpenAI's audio object has these two keys: another (a "speed") would be taken and ignored.
    unknown = next((key for key in audio if key not in ("voice", "format")), None)
    if unknown is not None:
        raise APIError(
            400, f"audio.{unknown} is not supported: the audio object is {{voice, format}}", param=f"audio.{unknown}"
        )
    audio_format = audio.get("format") or (STREAM_FORMAT if req.stream else "wav")
    voice = audio.get("voice")
    if voice is not None and (not isinstance(voice, str) or voice.lower() not in voices):
        raise APIError(
            400,
            f"voice {voice!r} is not available; this pipeline speaks with " + ", ".join(repr(v) for v in voices),
            param="audio.voice",
        )
    if "audio" in modalities:
        try:
            check_format(audio_format, stream=bool(req.stream))
        except UnsupportedFormat as e:
            raise APIError(400, str(e), param="audio.format") from None
    if not req.messages:
        raise APIError(
            400, "Cannot apply chat template to an empty conversation. Provide at least one message.", param="messages"
        )
    media: list[MediaPart] = []
    messages = [_message_dict(i, m, media) for i, m in enumerate(req.messages)]
    spoken_voice = "" if voice is None or voice.lower() == "default" else voice.lower()
    return ChatRequest(req, modalities, audio_format, messages, tuple(media), voice=spoken_voice)


def _modalities(value: Any) -> tuple[str, ...]:
    if value is None:
        return ("text",)
    if not isinstance(value, list) or not all(m in ("text", "audio") for m in value):
        raise APIError(400, 'modalities must be a list of "text" and "audio"', param="modalities")
    return tuple(dict.fromkeys(["text", *value]))


#: Content-part type -> (the field that carries it, the media kind, its keys that are strings).
MEDIA_PARTS = {
    "image_url": ("image_url", "image", ("url", "detail")),
    "input_audio": ("input_audio", "audio", ("data", "format")),
    "video_url": ("video_url", "video", ("url",)),
}
SUPPORTED_PARTS = ("text", *MEDIA_PARTS)


def _message_dict(i: int, m: dict[str, Any], media: list[MediaPart]) -> dict[str, Any]:
    """A chat message as the chat template takes it (as vLLM hands messages to templates: the
    role as sent, a tool message's text parts joined by newlines, an assistant's tool-call
    arguments as objects). Text-only content is one string; content with images or clips is a
    list of parts, ``{"type": "image"}`` / ``{"type": "audio"}`` where the template writes the
    placeholders. The media go to ``media``."""
    content = m.get("content")
    if content is None or isinstance(content, str):
        content = content or ""
    else:
        parts = [_content_part(f"messages.{i}.content.{j}", part, media) for j, part in _read_parts(i, content)]
        if all(p["type"] == "text" for p in parts):
            joiner = "\n" if m["role"] == "tool" else ""
            content = joiner.join(p["text"] for p in parts)
        else:
            content = parts
    d: dict[str, Any] = {"role": m["role"], "content": content}
    for key in ("name", "tool_call_id", "reasoning"):
        if m.get(key) is not None:
            d[key] = m[key]
    if m.get("tool_calls"):
        d["tool_calls"] = [_tool_call(c) for c in m["tool_calls"]]
    return d


def _read_parts(i: int, content: Any) -> Iterator[tuple[int, Any]]:
    """Message ``i``'s content parts with their indices. vLLM's request model types an OpenAI
    message's content as an ``Iterable`` of parts, which pydantic checks only as it is read: a
    part that none of the part types takes raises its ValidationError here, whose text lists
    every type it tried with their class names and no field the client could look for. It is
    a 400 naming the part instead (:func:`_refused_part`)."""
    import pydantic

    parts = iter(content)
    for j in itertools.count():
        try:
            part = next(parts)
        except StopIteration:
            return
        except pydantic.ValidationError as e:
            raise _refused_part(i, e.errors(include_url=False)) from None
        yield j, part


def _refused_part(i: int, errors: list[Any]) -> APIError:
    """The 400 for a content part pydantic refused (``errors``: its error list, each ``loc``
    the part's index, then the part type tried when there were several, then the field): what
    is wrong with it as the part type its ``type`` names, else that its type is not taken."""
    j = errors[0]["loc"][0] if errors and errors[0]["loc"] else 0
    param = f"messages.{i}.content.{j}"
    fields = [_field_of(err["loc"][1:]) for err in errors]
    # Part types the part's "type" did not match: their other errors say nothing about it.
    other_types = {kind for (kind, field) in fields if field == ("type",)}
    for err, (kind, field) in zip(errors, fields, strict=True):
        if kind in other_types:
            continue
        if not field:
            return APIError(400, 'a content part must be an object with a "type"', param=param)
        name = ".".join(str(f) for f in field)
        return APIError(400, f"content part {name}: {err['msg']}", param=f"{param}.{name}")
    kind = next((err["input"] for err in errors if err["type"] == "literal_error"), None)
    return APIError(
        400,
        f"content part type {kind!r} is not supported (supported: {', '.join(SUPPORTED_PARTS)})",
        param=param + ".type",
    )


def _field_of(loc: tuple[Any, ...]) -> tuple[str | None, tuple[Any, ...]]:
    """(the part type tried, the field) of a content part error's location past the index: the
    part types are class names (``ChatCompletionContentPartImageParam``), fields lower case."""
    if loc and isinstance(loc[0], str) and loc[0][:1].isupper():
        return loc[0], tuple(loc[1:])
    return None, tuple(loc)


def _content_part(param: str, part: Any, media: list[MediaPart]) -> dict[str, Any]:
    """One content part as the chat template takes it (its media to ``media``); a 400 naming
    what is wrong with it. A bare string is a text part, as vLLM reads one."""
    if isinstance(part, str):
        return {"type": "text", "text": part}
    if not isinstance(part, dict):
        raise APIError(400, 'a content part must be an object with a "type"', param=param)
    kind = part.get("type")
    if kind == "text":
        text = part.get("text")
        if text is not None and not isinstance(text, str):
            raise APIError(400, "a text content part's text must be a string", param=f"{param}.text")
        return {"type": "text", "text": text or ""}
    if kind not in MEDIA_PARTS:
        raise APIError(
            400,
            f"content part type {kind!r} is not supported (supported: {', '.join(SUPPORTED_PARTS)})",
            param=param + ".type",
        )
    field_name, media_kind, strings = MEDIA_PARTS[kind]
    value = part.get(field_name)
    if not isinstance(value, dict):
        raise APIError(400, f"a {kind} content part needs {field_name!r}", param=f"{param}.{field_name}")
    # The decoders read these as text: another type would fail there, not as the client's error.
    for key in strings:
        if value.get(key) is not None and not isinstance(value[key], str):
            raise APIError(400, f"{field_name}.{key} must be a string", param=f"{param}.{field_name}.{key}")
    media.append(MediaPart(media_kind, part, param))
    return {"type": media_kind}


def _tool_call(call: dict[str, Any]) -> dict[str, Any]:
    """An assistant's earlier tool call with its arguments as an object (chat templates read them
    so; vLLM converts them the same way, an unparsable string becoming ``{}``)."""
    call = dict(call)
    function = dict(call.get("function") or {})
    args = function.get("arguments")
    if isinstance(args, str):
        try:
            args = parse_json(args.encode()) if args else {}  # bounded: the client wrote it
        except BodyError:
            args = {}
    function["arguments"] = args if isinstance(args, dict) else {}
    call["function"] = function
    return call
