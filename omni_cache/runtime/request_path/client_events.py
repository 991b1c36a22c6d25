"""A request's events waiting for its client, counted in bytes.

The orchestrator puts a request's text and audio in its queue as the stages send them; the client's
handler takes them as it writes them out. A streaming client that stops reading blocks its
handler's write, and the stages go on: without a bound the whole spoken answer would wait here until
``server.request_timeout_s``. Past ``server.max_outbox_bytes`` the request is ended as a slow
client (omni_cache/runtime/request_path/request_ends.py): what waits is dropped at once and :attr:`overflowed`
tells the handler to close the connection."""

from __future__ import annotations

import asyncio
from typing import Any

__all__ = ["ClientEvents", "event_bytes"]


def event_bytes(event: Any) -> int:
    """What an event holds in memory, roughly: an AudioDelta's samples, a TextDelta's text, token
    ids and log-probabilities; nothing for the terminal events. (By their fields: results.py
    imports requests.py, which holds this queue.)"""
    audio = getattr(event, "audio", None)
    if audio is not None and hasattr(audio, "nbytes"):
        return int(audio.nbytes)
    text = getattr(event, "text", None)
    if isinstance(text, str) and hasattr(event, "token_ids"):
        return len(text) + 8 * len(event.token_ids) + 64 * len(getattr(event, "logprobs", None) or ())
    return 0


class ClientEvents:
    """An asyncio queue of one request's events that knows the bytes waiting in it."""

    def __init__(self, max_bytes: int = 2**62) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        #: Set when the events waiting passed ``max_bytes`` and were dropped.
        self.overflowed = asyncio.Event()
        self._queue: asyncio.Queue[Any] = asyncio.Queue()

    @property
    def over(self) -> bool:
        return self.bytes > self.max_bytes

    def put_nowait(self, event: Any) -> None:
        self.bytes += event_bytes(event)
        self._queue.put_nowait(event)

    async def get(self) -> Any:
        event = await self._queue.get()
        self.bytes -= event_bytes(event)
        return event

    def get_nowait(self) -> Any:
        event = self._queue.get_nowait()
        self.bytes -= event_bytes(event)
        return event

    def empty(self) -> bool:
        return self._queue.empty()

    def drop(self) -> None:
        """Drop what waits (freed now, not when the request ends) and say so."""
        while not self._queue.empty():
            self._queue.get_nowait()
        self.bytes = 0
        self.overflowed.set()
