"""The HTTP protocol under the API: uvicorn's own (the one it picks: httptools, else h11), with each
request's ASGI scope carrying its connection's transport.

ASGI gives a handler no way to see its connection, and a streamed answer needs one: whether its
client takes the bytes sent to it is known only to the kernel (the TCP connection's acknowledged
bytes, :mod:`omni_cache.serving.send_watch`); uvicorn's own flow control sees a client that reads
nothing only once the socket's send buffer is full (megabytes: a minute of a spoken answer).

The transport rides in the scope's ``state`` (uvicorn copies the protocol's ``app_state`` into every
request's scope, h11 and httptools alike), under :data:`TRANSPORT`; :func:`transport_of` reads it
(None under another server).

A response given up on purpose (a streaming client cut past its bounds: the cut is expected and
counted in /metrics) ends without completing, and uvicorn logs "ASGI callable returned without
completing response." at ERROR for it. The handler calls :func:`quiet_unfinished_response` first:
:class:`UnfinishedResponseFilter` (on uvicorn's ``uvicorn.error`` logger, put there by
:class:`HttpProtocol`) then drops that one record. The mark is a context variable: uvicorn logs from
the task that ran the handler, after it returned, in the same context; any other response that
ends unfinished is still logged."""

from __future__ import annotations

import asyncio
import contextvars
import logging
from typing import Any

from uvicorn.protocols.http.auto import AutoHTTPProtocol

__all__ = ["TRANSPORT", "HttpProtocol", "UnfinishedResponseFilter", "quiet_unfinished_response", "transport_of"]

#: Key of the connection's transport in a request scope's ``state``.
TRANSPORT = "omni_cache.transport"


#: uvicorn's message for a response that ended unfinished (uvicorn/protocols/http/*_impl.py).
UNFINISHED = "ASGI callable returned without completing response."
_given_up = contextvars.ContextVar("omni_cache_response_given_up", default=False)


def quiet_unfinished_response() -> None:
    """This request's response ends unfinished on purpose: uvicorn's ERROR line for it is dropped."""
    _given_up.set(True)


class UnfinishedResponseFilter(logging.Filter):
    """Drops uvicorn's "returned without completing response" for responses given up on purpose."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (_given_up.get() and record.msg == UNFINISHED)


_FILTER = UnfinishedResponseFilter()


class HttpProtocol(AutoHTTPProtocol):  # type: ignore[misc,valid-type]
    """uvicorn's HTTP protocol; its requests' scopes carry the connection's transport, and
    uvicorn's logger drops the line for a response given up on purpose."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.logger.addFilter(_FILTER)  # once: a logger keeps one of each filter

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.app_state = {**self.app_state, TRANSPORT: transport}


def transport_of(scope: Any) -> asyncio.Transport | None:
    """The transport of the connection a request ``scope`` came on (None: not served by
    :class:`HttpProtocol`)."""
    return (scope.get("state") or {}).get(TRANSPORT)
