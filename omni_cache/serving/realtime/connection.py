"""``/v1/realtime``: one WebSocket connection carrying one :class:`RealtimeSession`.

The connection reads client events one at a time and hands them to the session; server events go
out through one writer task in the order they were queued (:class:`EventWriter`). It enforces the
session limits (``server.realtime``): sessions open at once, session length, idle time between
client events, client events per second, and the bytes of server events queued for a client that
does not read them (``max_outbox_bytes``: past it the connection is closed, code 1008
``slow_client``, and what was queued is dropped). An event larger than ``max_event_bytes``, too deep
or not JSON is answered with an ``error`` and the session goes on (a message over
``max_event_bytes`` is never assembled: :mod:`.ws_protocol` drops its bytes as they arrive); the
WebSocket layer closes a connection whose message is larger than ``max_message_bytes`` (1009). A
client that goes away (closed socket, dropped TCP) ends the session: the response in flight is
cancelled, its pipeline request aborted, the session's buffers dropped and it leaves the
:class:`SessionRegistry`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from starlette.websockets import WebSocket, WebSocketState

from omni_cache.config.server_schema import RealtimeConfig
from omni_cache.serving.realtime.client_items import ImageSource
from omni_cache.serving.realtime.protocol import (
    EventError,
    error_event,
    event_too_large,
    parse_client_event_async,
    wire,
)
from omni_cache.serving.realtime.session import RealtimeSession
from omni_cache.serving.realtime.ws_protocol import SKIPPED_BYTES
from omni_cache.thread_pools import ThreadPools

logger = logging.getLogger("omni_cache.serving.realtime")

__all__ = [
    "CLOSE_NORMAL",
    "CLOSE_POLICY",
    "CLOSE_TRY_LATER",
    "EventWriter",
    "RateLimiter",
    "SessionRegistry",
    "handle_event",
    "serve_realtime",
]

#: WebSocket close codes: normal, policy (auth, model), try again later (full, starting).
CLOSE_NORMAL, CLOSE_POLICY, CLOSE_TRY_LATER = 1000, 1008, 1013


class SessionRegistry:
    """The sessions open on this server (``app.state.realtime_sessions``)."""

    def __init__(self) -> None:
        self.sessions: dict[str, RealtimeSession] = {}

    def __len__(self) -> int:
        return len(self.sessions)


class RateLimiter:
    """A token bucket: ``rate`` events per second sustained, bursts of up to ``rate``."""

    def __init__(self, rate: float, clock: Any = time.monotonic) -> None:
        self.rate, self.clock = rate, clock
        self.tokens = rate
        self.last = clock()

    def allow(self) -> bool:
        now = self.clock()
        self.tokens = min(self.rate, self.tokens + (now - self.last) * self.rate)
        self.last = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False


class EventWriter:
    """Server events written in order by one task (two concurrent sends could interleave), at
    most ``max_bytes`` of them waiting: past it the writer gives up (:attr:`overflowed`), drops
    what waits and sends nothing more (a client that does not read would otherwise hold every
    answer's audio in the server)."""

    def __init__(self, websocket: WebSocket, max_bytes: int = 2**62) -> None:
        self.websocket = websocket
        self.max_bytes = max_bytes
        self.closed = False
        #: Set when the events waiting passed max_bytes.
        self.overflowed = asyncio.Event()
        self.queued_bytes = 0  # of the events queued and the one being sent
        self._queue: asyncio.Queue[str | None] = asyncio.Queue()
        self._task = asyncio.create_task(self._write(), name="realtime-outbox")

    def send(self, event: Any) -> None:
        if self.closed:
            return
        text = wire(event)
        self.queued_bytes += len(text)
        if self.queued_bytes > self.max_bytes:
            self._give_up()
            return
        self._queue.put_nowait(text)

    def _give_up(self) -> None:
        self.closed = True
        self.overflowed.set()
        while not self._queue.empty():  # freed now, not when the socket ends
            self._queue.get_nowait()
        self.queued_bytes = 0
        self._task.cancel()  # its send waits for a client that does not read

    async def _write(self) -> None:
        while True:
            text = await self._queue.get()
            if text is None:
                return
            try:
                await self.websocket.send_text(text)
            except Exception:  # noqa: BLE001 -- the client is gone: nothing more to send
                self.closed = True
                return
            self.queued_bytes -= len(text)

    async def close(self) -> None:
        """Send what is queued (for at most 5 s), then stop."""
        if not self._task.done():
            self._queue.put_nowait(None)
            await asyncio.wait({self._task}, timeout=5.0)
            self._task.cancel()  # still sending after 5 s: the client does not read
            await asyncio.wait({self._task})
        self.closed = True


async def serve_realtime(
    websocket: WebSocket,
    orch: Any,
    limits: RealtimeConfig,
    registry: SessionRegistry,
    *,
    served_model: str,
    threads: ThreadPools,
    images: ImageSource | None = None,
    watch: Callable[[Callable[[], None], Callable[[], None]], Any] | None = None,
) -> None:
    """Run one connection's session until the client leaves or a limit ends it. ``threads``: the
    server's worker threads (media items, token counts, large events). ``watch``:
    makes a watch of the client's connection (``watch(on_pause, on_resume)``, a
    :class:`~omni_cache.serving.send_watch.SendWatch`); None: responses are never held."""
    await websocket.accept()
    model = websocket.query_params.get("model")
    refusal = None
    if model is not None and model != served_model:
        refusal = (
            EventError(
                f"the model {model!r} does not exist; this server serves {served_model!r}",
                param="model",
                code="model_not_found",
            ),
            CLOSE_POLICY,
        )
    elif not orch.started:
        refusal = (
            EventError("the pipeline is still starting; retry shortly", code="not_ready", type="server_error"),
            CLOSE_TRY_LATER,
        )
    elif len(registry) >= limits.max_sessions:
        refusal = (
            EventError(
                f"{limits.max_sessions} realtime sessions are open (server.realtime.max_sessions); retry later",
                code="session_limit_reached",
                type="server_error",
            ),
            CLOSE_TRY_LATER,
        )
    outbox = EventWriter(websocket, limits.max_outbox_bytes)
    if refusal is not None:
        outbox.send(error_event(refusal[0], None))
        await _close(websocket, outbox, refusal[1], refusal[0].code or "")
        return
    session = RealtimeSession(
        orch, outbox.send, limits=limits, served_model=served_model, threads=threads, images=images, watch=watch
    )
    registry.sessions[session.id] = session
    try:
        try:
            await session.open()
        except EventError as e:  # no room for one more session in the server's bounds
            outbox.send(error_event(e, None))
            await _close(websocket, outbox, CLOSE_TRY_LATER, e.code or "")
            return
        ending = await _read_events(websocket, session, outbox, limits)
        if ending is not None:
            outbox.send(error_event(ending, None))  # not sent to a client that stopped reading
            await session.close()
            code = CLOSE_POLICY if outbox.overflowed.is_set() else CLOSE_NORMAL
            await _close(websocket, outbox, code, ending.code or "")
    finally:
        await session.close()
        registry.sessions.pop(session.id, None)
        await outbox.close()


async def _read_events(
    websocket: WebSocket, session: RealtimeSession, outbox: EventWriter, limits: RealtimeConfig
) -> EventError | None:
    """Client events until the client leaves (None) or a limit ends the session (its error)."""
    limiter = RateLimiter(limits.max_events_per_s)
    end_at = time.monotonic() + limits.max_session_s
    last_event = time.monotonic()
    # One receive in flight at a time, never cancelled while waiting (a message that arrives as
    # a timed-out receive is cancelled could be lost).
    receiving: asyncio.Task | None = None
    overflow = asyncio.ensure_future(outbox.overflowed.wait())
    try:
        while True:
            now = time.monotonic()
            if session.responding:  # waiting for an answer is not idling
                last_event = now
            if now >= end_at:
                return EventError(
                    f"the session reached its maximum length of "
                    f"{limits.max_session_s:g} s (server.realtime.max_session_s)",
                    code="session_expired",
                )
            if now - last_event >= limits.idle_timeout_s:
                return EventError(
                    f"no client event for {limits.idle_timeout_s:g} s (server.realtime.idle_timeout_s)",
                    code="idle_timeout",
                )
            wait = min(end_at, last_event + limits.idle_timeout_s) - now
            if session.responding:  # look again soon: the response may end meanwhile
                wait = min(wait, 1.0)
            if outbox.overflowed.is_set():
                return EventError(
                    f"more than {limits.max_outbox_bytes} bytes of server events "
                    "waited for the client to read them "
                    "(server.realtime.max_outbox_bytes)",
                    code="slow_client",
                )
            if receiving is None:
                receiving = asyncio.ensure_future(websocket.receive())
            done, _ = await asyncio.wait({receiving, overflow}, timeout=wait, return_when=asyncio.FIRST_COMPLETED)
            if receiving not in done:
                continue
            message, receiving = receiving.result(), None
            if message["type"] == "websocket.disconnect":
                return None
            last_event = time.monotonic()
            raw = message.get("text") if message.get("text") is not None else message.get("bytes")
            skipped = message.get(SKIPPED_BYTES)  # too large: never read (ws_protocol)
            if raw is None and skipped is None:
                continue
            if not limiter.allow():
                outbox.send(
                    error_event(
                        EventError(
                            f"more than {limits.max_events_per_s:g} client events per second "
                            "(server.realtime.max_events_per_s): the event was dropped",
                            code="rate_limit_exceeded",
                        ),
                        None,
                    )
                )
                continue
            if skipped is not None:
                outbox.send(error_event(event_too_large(skipped, limits.max_event_bytes), None))
                continue
            await handle_event(raw, session, outbox, limits.max_event_bytes)
    finally:
        overflow.cancel()
        if receiving is not None and not receiving.done():
            receiving.cancel()


async def handle_event(raw: str | bytes, session: RealtimeSession, outbox: EventWriter, max_bytes: int) -> None:
    """One client event parsed and carried out; every failure an ``error`` event, the session goes on."""
    event_id = None
    try:
        event, event_id = await parse_client_event_async(raw, max_bytes, session.threads.realtime_events)
        await session.handle(event)
    except EventError as e:
        outbox.send(error_event(e, e.event_id or event_id))
    except Exception:  # noqa: BLE001 -- a bug must not end the session
        # The exception's text stays in the log (it can name paths and internals); the client gets
        # the event it concerned and the session id to find it there.
        logger.exception("realtime session %s: internal error handling event %s", session.id, event_id)
        outbox.send(
            error_event(
                EventError(
                    f"internal error handling this event (logged for session {session.id})",
                    type="server_error",
                    code="internal_error",
                ),
                event_id,
            )
        )


async def _close(websocket: WebSocket, outbox: EventWriter, code: int, reason: str) -> None:
    await outbox.close()
    if websocket.application_state == WebSocketState.CONNECTED:
        # A client that does not read may never take the close frame: give up after 5 s.
        closing = asyncio.ensure_future(websocket.close(code=code, reason=reason))
        await asyncio.wait({closing}, timeout=5.0)
        closing.cancel()
        await asyncio.wait({closing})
        if not closing.cancelled():
            closing.exception()  # retrieved: a client gone meanwhile is no error here
