"""Whether a streaming client takes the bytes sent to it, from its TCP connection.

A client that reads nothing of a streamed spoken answer leaves its receive window full; the server
would go on encoding and writing the answer into its own socket's send buffer, which the kernel
grows to megabytes (about a minute of a spoken answer at 50 tokens a second), before uvicorn's
flow control pauses the handler and ``server.max_outbox_bytes`` can count anything. All that time
the server pays for audio nobody hears: 16 such clients were the largest share of the server's CPU
under ``benchmarks/hostile.py``'s attack.

The kernel knows sooner: the connection's acknowledged bytes (``tcpi_bytes_acked``, Linux >= 4.2)
stop moving while bytes wait in its send queue (``SIOCOUTQ``). Every :data:`PAUSE_S` the watch
reads both; an interval in which bytes waited from its start to its end and none was acknowledged
is stalled. After one stalled interval the stream's writes wait (:attr:`SendWatch.taking` is
clear), so the answer waits unencoded in its request's queue, counted against
``server.max_outbox_bytes``, and the request's stages hold its work (scheduler/client_hold.py):
nothing more is generated for a client that takes nothing. Both go on as soon as the client takes
a byte. After
``server.max_send_stall_s`` of stalled intervals in a row :meth:`SendWatch.stalled` returns and the
client is disconnected as a slow client. A socket that is not TCP (a Unix socket) is never stalled:
the byte bound alone holds there."""

from __future__ import annotations

import asyncio
import fcntl
import socket
import struct
import termios
from collections.abc import Callable
from typing import Any

__all__ = ["PAUSE_S", "SendWatch", "acked_and_waiting"]

#: How often the connection is read, and how long a client may take nothing before the writes wait.
PAUSE_S = 0.5
#: ``tcpi_bytes_acked`` (u64) in Linux's ``struct tcp_info``.
_BYTES_ACKED_AT = 120
_TCP_INFO_BYTES = 232


def acked_and_waiting(sock: Any) -> tuple[int, int] | None:
    """(bytes the peer acknowledged, bytes in the send queue it has not) of a TCP socket; None
    when the kernel cannot say (not TCP, not Linux, closed)."""
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_BYTES)
        if len(info) < _BYTES_ACKED_AT + 8:
            return None
        waiting = struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0]
    except (OSError, AttributeError, ValueError):
        return None
    return struct.unpack_from("Q", info, _BYTES_ACKED_AT)[0], waiting


class SendWatch:
    """One streamed response's client, watched through its connection's ``transport``;
    ``on_pause`` is called each time its writes start to wait, ``on_resume`` each time they go on
    (the client took bytes again)."""

    def __init__(
        self,
        transport: asyncio.Transport | None,
        max_stall_s: float,
        on_pause: Callable[[], None] = lambda: None,
        on_resume: Callable[[], None] = lambda: None,
    ) -> None:
        self.transport = transport
        self.max_stall_s = max_stall_s
        self.on_pause, self.on_resume = on_pause, on_resume
        #: Set while the client takes what is sent (or nothing waits); clear while it stalls.
        self.taking = asyncio.Event()
        self.taking.set()

    def _read(self) -> tuple[int, int] | None:
        if self.transport is None or self.transport.is_closing():
            return None
        got = acked_and_waiting(self.transport.get_extra_info("socket"))
        if got is None:
            return None
        acked, waiting = got
        return acked, waiting + self.transport.get_write_buffer_size()

    async def stalled(self) -> None:
        """Return once the client has taken nothing for ``max_stall_s`` while bytes waited for it;
        never when the connection cannot be read (the writes then never wait)."""
        loop = asyncio.get_running_loop()
        last, at = self._read(), loop.time()
        since: float | None = None  # start of the stalled intervals in a row
        while last is not None:
            await asyncio.sleep(PAUSE_S)
            now, t = self._read(), loop.time()
            if now is None:  # closing: the response ends by itself
                break
            if now[0] == last[0] and last[1] > 0 and now[1] > 0:
                since = at if since is None else since
                if self.taking.is_set():
                    self.taking.clear()
                    self.on_pause()
                if t - since >= self.max_stall_s:
                    return  # the writes stay stopped: the client is disconnected next
            else:
                since = None
                self._go_on()
            last, at = now, t
        self._go_on()
        await asyncio.Event().wait()

    def _go_on(self) -> None:
        if not self.taking.is_set():
            self.taking.set()
            self.on_resume()

    def send(self, send: Any) -> Any:
        """``send`` (ASGI) that waits while the client takes nothing."""

        async def send_when_taken(message: Any) -> None:
            await self.taking.wait()
            await send(message)

        return send_when_taken
