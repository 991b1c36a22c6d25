"""The Realtime API's events on the wire, with the openai SDK's published types as the schema.

Client events are validated by the SDK's own pydantic models (``openai.types.realtime``: the
union ``RealtimeClientEvent``, one class per ``type``); a bad one becomes an :class:`EventError`
whose ``param`` is the dotted path of the offending field (``session.audio.input.format.rate``,
``item.content.0.text``), as OpenAI's ``error`` events name it. Server events are built as the
same SDK's models (:func:`wire`) so what the SDK parses is what it documents.

A client event's JSON is read by the chat bodies' bounded parser (:mod:`omni_cache.json_body`):
its size, nesting and number of values are checked before it is parsed, so a deep, huge or
many-valued event is an ``error`` naming the problem, never a ``RecursionError`` or a stall. Events
over :data:`OFF_LOOP_BYTES` are scanned, parsed and validated on the server's realtime-event threads
(:func:`parse_client_event_async`, ``server.threads.realtime_events``): every session and HTTP
request shares the event loop, and sessions sending large events wait for each other there, not
for the chat requests' threads.
"""

from __future__ import annotations

import json
import typing
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from pydantic import BaseModel, ValidationError

from omni_cache.json_body import MAX_JSON_DEPTH, BodyError, parse_json
from omni_cache.serving.realtime.ws_protocol import Masked

__all__ = [
    "CLIENT_EVENTS",
    "MAX_EVENT_VALUES",
    "OFF_LOOP_BYTES",
    "EventError",
    "error_event",
    "event_too_large",
    "lone_surrogate",
    "make_event",
    "new_id",
    "parse_client_event",
    "parse_client_event_async",
    "refuse_unsupported",
    "validation_error",
    "wire",
]


class EventError(Exception):
    """A client event that cannot be carried out; answered with an ``error`` event, the session
    stays open. ``param``: the event's field at fault (dotted), ``code``: OpenAI's error code."""

    def __init__(
        self, message: str, *, param: str | None = None, code: str | None = None, type: str = "invalid_request_error"
    ) -> None:
        super().__init__(message)
        self.message, self.param, self.code, self.type = message, param, code, type
        #: The client's event_id of the event at fault, when the parser got that far.
        self.event_id: str | None = None


def _client_event_classes() -> dict[str, type[BaseModel]]:
    from openai.types.realtime.realtime_client_event import RealtimeClientEvent

    union = typing.get_args(RealtimeClientEvent)[0]
    return {typing.get_args(cls.model_fields["type"].annotation)[0]: cls for cls in typing.get_args(union)}


#: event type -> the SDK's model of it (every client event the GA API defines).
CLIENT_EVENTS: dict[str, type[BaseModel]] = _client_event_classes()


def new_id(prefix: str) -> str:
    """An id as OpenAI's look: ``event_...``, ``item_...``, ``resp_...``, ``sess_...``."""
    return f"{prefix}_{uuid.uuid4().hex[:20]}"


#: Values (array and object members) one client event may hold. The largest real ones hold a few
#: thousand (a session.update's tool schemas); parsing a million small values holds the GIL for
#: tens of milliseconds whatever thread runs it.
MAX_EVENT_VALUES = 100_000
#: Events larger than this (bytes) are parsed off the event loop; smaller ones take microseconds.
OFF_LOOP_BYTES = 64 * 1024


async def parse_client_event_async(
    raw: str | bytes | Masked, max_bytes: int, off_loop: Callable[..., Awaitable[Any]]
) -> tuple[BaseModel, str | None]:
    """:func:`parse_client_event`, through ``off_loop(fn, *args)`` (the server's realtime-event
    threads) when ``raw`` is large."""
    if len(raw) <= OFF_LOOP_BYTES:
        return parse_client_event(raw, max_bytes)
    return await off_loop(parse_client_event, raw, max_bytes)


def parse_client_event(raw: str | bytes | Masked, max_bytes: int | None = None) -> tuple[BaseModel, str | None]:
    """``(the SDK model of the event, its event_id)``; EventError naming the field otherwise
    (or the problem: larger than ``max_bytes``, too deep, too many values, not JSON)."""
    if max_bytes is not None and len(raw) > max_bytes:  # a str's length never exceeds its UTF-8 size
        raise event_too_large(len(raw), max_bytes)
    if isinstance(raw, Masked):  # a large event as it arrived (ws_protocol): unmasked here, off the loop
        raw = raw.unmask()
    encoded = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else raw
    if max_bytes is not None and len(encoded) > max_bytes:
        raise event_too_large(len(encoded), max_bytes)
    try:
        data = parse_json(encoded, MAX_JSON_DEPTH, max_values=MAX_EVENT_VALUES, what="event")
    except BodyError as e:
        raise EventError(str(e), code="invalid_json") from None
    if not isinstance(data, dict):
        raise EventError("an event must be a JSON object", code="invalid_event")
    # Only an escape or a byte past ASCII (UTF-8, or UTF-16/32 that json detects) can hold one.
    bad = lone_surrogate(data) if b"\\u" in encoded or not encoded.isascii() else None
    event_id = data.get("event_id") if isinstance(data.get("event_id"), str) and bad != "event_id" else None
    if bad is not None:
        err = EventError(
            f"{bad}: the text holds a lone UTF-16 surrogate (a \\ud800-\\udfff escape not in a pair), "
            "which is no Unicode character; send the character itself or its surrogate pair",
            param=bad,
            code="invalid_value",
        )
        err.event_id = event_id
        raise err
    kind = data.get("type")
    cls = CLIENT_EVENTS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise EventError(
            f"{_type_problem(data)} (supported: {', '.join(sorted(CLIENT_EVENTS))})", param="type", code="invalid_value"
        )
    try:
        return cls.model_validate(data), event_id
    except ValidationError as e:
        err = validation_error(e)
        err.event_id = event_id
        raise err from None


def _type_problem(data: dict[str, Any]) -> str:
    """What is wrong with an event's ``type``, in JSON's words (not Python's ``None``), a long
    value cut short."""
    if "type" not in data:
        return "the event has no 'type'"
    kind = data["type"]
    if not isinstance(kind, str):
        return f"'type' must be a string, not {_JSON_TYPES.get(type(kind), 'a number')}"
    shown = json.dumps(kind[:64]) + ("..." if len(kind) > 64 else "")
    return f"unknown event type {shown}"


#: What a JSON value that is not a string is called in messages.
_JSON_TYPES = {type(None): "null", bool: "a boolean", list: "an array", dict: "an object"}


def lone_surrogate(value: Any, path: str = "") -> str | None:
    """The dotted path of the first string (or key) in ``value`` holding a lone surrogate, None
    when there is none.

    JSON lets a string escape half a surrogate pair (``"\\ud800"``) and Python's json reader
    keeps it (and decodes bytes with ``surrogatepass``), but such a string cannot be written as
    UTF-8: echoed in a server event it failed the event's serialization (an ``internal_error``),
    and kept in the conversation it failed every later response's tokenization."""
    if isinstance(value, str):
        return None if value.isascii() or _encodes(value) else path or "event"
    if isinstance(value, dict):
        for key, member in value.items():
            name = key if _encodes(key) else key.encode("utf-8", "backslashreplace").decode("ascii")
            where = f"{path}.{name}" if path else name
            if name is not key:
                return where
            if (found := lone_surrogate(member, where)) is not None:
                return found
    elif isinstance(value, list):
        for i, member in enumerate(value):
            if (found := lone_surrogate(member, f"{path}.{i}" if path else str(i))) is not None:
                return found
    return None


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def event_too_large(size: int, max_bytes: int) -> EventError:
    """The error answering an event of ``size`` bytes, past ``max_bytes``."""
    return EventError(
        f"the event is {size} bytes; at most {max_bytes} are read (server.realtime.max_event_bytes)",
        code="event_too_large",
    )


def validation_error(e: ValidationError) -> EventError:
    """The first real problem of a pydantic error as an EventError naming its field.

    The SDK's unions (session, item, turn_detection, audio format) are tried member by member, so
    pydantic reports each member's complaint; a member whose ``type``/``role`` literal did not
    match is not the one the client meant and is dropped. Member names (class names, ``int``,
    ``literal[...]``) are not fields and are dropped from the path."""
    errors = e.errors()
    by_member: dict[tuple[str, ...], list[dict[str, Any]]] = {}
    for err in errors:
        by_member.setdefault(_members(err), []).append(err)
    meant = [errs for errs in by_member.values() if not any(_discriminator_mismatch(x) for x in errs)]
    if meant or len(by_member) <= 1:
        err = meant[0][0] if meant else errors[0]
        param = _field_path(err) or None
        return EventError(f"{param or 'event'}: {err['msg']}", param=param, code="invalid_value")
    # No member's discriminator matched: name the one that is wrong and the values it takes.
    closest = _closest_mismatches([x for x in errors if _discriminator_mismatch(x)])
    param = _field_path(closest[0])
    wanted = sorted({str(x["ctx"]["expected"]) for x in closest if "ctx" in x})
    message = f"{param}: expected one of {', '.join(wanted)}" if wanted else f"{param}: {closest[0]['msg']}"
    return EventError(message, param=param, code="invalid_value")


def _field_path(err: dict[str, Any]) -> str:
    return ".".join(str(p) for p in err["loc"] if not _is_member(p))


def _closest_mismatches(mismatches: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The discriminator mismatches that say what the client got wrong, all at one field.

    The members that got furthest into the event are the ones meant (an audio format's
    ``type`` inside a realtime session, not the transcription session's ``session.type``);
    among those, a member whose ``type`` matched says the ``role`` is wrong (``role:
    "developer"`` in a message: the message roles), else the ``type`` is (``type: "foo"``:
    every item type, not the roles of the message members)."""
    depth = max(len(_field_path(x).split(".")) for x in mismatches)
    deepest = [x for x in mismatches if len(_field_path(x).split(".")) == depth]
    fields: dict[tuple[str, ...], set[str]] = {}
    for x in deepest:
        fields.setdefault(_members(x), set()).add(x["loc"][-1])
    typed = {m for m, names in fields.items() if "type" not in names}
    if typed:
        return [x for x in deepest if _members(x) in typed]
    return [x for x in deepest if x["loc"][-1] == "type"]


def _members(err: dict[str, Any]) -> tuple[str, ...]:
    return tuple(str(p) for p in err["loc"] if _is_member(p))


#: How pydantic names the members of a union that are not models (``int``, ``literal['inf']``).
_SCALAR_MEMBERS = {"int", "str", "float", "bool", "none", "list", "dict"}


def _is_member(part: Any) -> bool:
    """Whether a path element names a union member (a class, a scalar type) rather than a field."""
    return isinstance(part, str) and (part[:1].isupper() or "[" in part or part in _SCALAR_MEMBERS)


def _discriminator_mismatch(err: dict[str, Any]) -> bool:
    loc = err["loc"]
    return err["type"] == "literal_error" and len(loc) >= 2 and loc[-1] in ("type", "role") and _is_member(loc[-2])


def make_event(cls: type[BaseModel], **fields: Any) -> BaseModel:
    """A server event of the SDK's class ``cls`` with a new ``event_id`` and its ``type``."""
    kind = typing.get_args(cls.model_fields["type"].annotation)[0]
    return cls(type=kind, event_id=new_id("event"), **fields)


def wire(event: BaseModel) -> str:
    """A server event as the JSON text sent (the fields that were set, nulls included: a
    ``turn_detection: null`` says manual commits)."""
    return event.model_dump_json(exclude_unset=True)


def error_event(err: EventError, event_id: str | None) -> BaseModel:
    from openai.types.realtime import RealtimeError, RealtimeErrorEvent

    return make_event(
        RealtimeErrorEvent,
        error=RealtimeError(type=err.type, code=err.code, message=err.message, param=err.param, event_id=event_id),
    )


def refuse_unsupported(fields: Sequence[tuple[str, bool]], what: str) -> None:
    """EventError for the first ``(param, present)`` that is present: a feature not served."""
    for param, present in fields:
        if present:
            raise EventError(f"{param} is not supported by this server ({what})", param=param, code="unsupported")
