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
    event_id = data.get("event_id") if isinstance(data.get("event_id"), str) else None
    kind = data.get("type")
    cls = CLIENT_EVENTS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise EventError(
            f"unknown event type {kind!r} (supported: {', '.join(sorted(CLIENT_EVENTS))})",
            param="type",
            code="invalid_value",
        )
    try:
        return cls.model_validate(data), event_id
    except ValidationError as e:
        err = validation_error(e)
        err.event_id = event_id
        raise err from None


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
        members = tuple(str(p) for p in err["loc"] if _is_member(p))
        by_member.setdefault(members, []).append(err)
    meant = [errs for errs in by_member.values() if not any(_discriminator_mismatch(x) for x in errs)]
    err = meant[0][0] if meant else errors[0]
    loc = [p for p in err["loc"] if not _is_member(p)]
    param = ".".join(str(p) for p in loc) or None
    if meant or len(by_member) <= 1:
        message = f"{param or 'event'}: {err['msg']}"
    else:  # no member's discriminator matched: say which values there are
        wanted = sorted({str(x["ctx"]["expected"]) for x in errors if _discriminator_mismatch(x) and "ctx" in x})
        message = f"{param}: expected one of {', '.join(wanted)}" if wanted else f"{param}: {err['msg']}"
    return EventError(message, param=param, code="invalid_value")


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
