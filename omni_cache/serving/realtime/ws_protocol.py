"""The WebSocket layer under ``/v1/realtime``: uvicorn's own protocol (``websockets-sansio``, the
one uvicorn picks) with two changes that keep a large message off the event loop.

- A message larger than ``server.realtime.max_event_bytes`` is never assembled: its length is read
  from each frame's header, and its payload is dropped as it arrives, one network read at a time
  (nothing is kept, unmasked or decoded; the reads go past websockets' reader buffer, which would
  copy each in and move it out again: 1.8 -> 0.17 ms of the loop per 16 MiB message in 256 KiB
  reads, AMD EPYC Zen 3). When its last byte has arrived the application gets a
  ``websocket.receive`` message with no ``text`` and no ``bytes`` but :data:`SKIPPED_BYTES`, the
  message's size, and answers it with an ``error`` (``event_too_large``); the session goes on.
  Before, uvicorn read the whole message (up to ``max_message_bytes``), joined, unmasked and
  decoded it on the loop, and only then was its size checked: tens of milliseconds of a 15 MiB
  message that every other session and HTTP request waited behind.
- A message larger than ``max_message_bytes`` still ends the connection (close 1009, message too
  big) when its header says so, before its payload is read.
- A text message larger than :data:`OFF_LOOP_TEXT_BYTES` is handed over as its UTF-8 bytes
  (``bytes``, with :data:`TEXT_FRAME` true) instead of a ``str``: it is decoded by the event
  parser on its own threads, not on the loop. Invalid UTF-8 there is an ``error`` event
  (``invalid_json``), not a close 1007. Sent as one frame (as clients send them) and with no
  extension negotiated, it is not even unmasked on the loop: its payload is handed over still
  masked, as the network reads delivered it (:class:`Masked`: those reads' own buffers, never
  joined or copied on the loop, past the reader's buffer), and the parser's thread joins and
  unmasks it (numpy, without the GIL): the loop's share of a 2 MiB message 1.35 -> 0.2 ms
  (AMD EPYC Zen 5), most of what was left copies into fresh buffers, which are gone too (0.58
  -> 0.06 ms on a Zen 3, whose memmove of such buffers is slow).

- Each connection reads at most ``server.realtime.max_read_bytes_per_s`` on average (a
  :class:`ReadBudget`: that rate, with a burst of ``max_event_bytes``): past it the server stops
  reading the socket until the budget has refilled, so a client sending more waits in TCP's flow
  control instead of costing the server its network reads. Under 64 hostile clients, 16 sending
  16 MiB events back to back made the server read ~190 MB/s to drop them: a fifth of a core in
  uvloop's reads alone, on the loop's thread (py-spy).

Frames within the limit are parsed by websockets as before (control frames, fragmentation,
masking and close handling are unchanged)."""

from __future__ import annotations

import struct
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
from websockets.exceptions import InvalidMessage, PayloadTooBig, ProtocolError
from websockets.frames import Frame, Opcode
from websockets.http11 import Request
from websockets.protocol import CONNECTING
from websockets.server import ServerProtocol

__all__ = [
    "OFF_LOOP_TEXT_BYTES",
    "SKIPPED_BYTES",
    "TEXT_FRAME",
    "BoundedServerProtocol",
    "Masked",
    "ReadBudget",
    "bounded_ws_protocol",
]

#: Key of a ``websocket.receive`` message standing for a message that was too large: its size.
SKIPPED_BYTES = "omni_cache.skipped_bytes"
#: Key of a ``websocket.receive`` message whose ``bytes`` are a text message's UTF-8.
TEXT_FRAME = "omni_cache.text_frame"
#: Text messages larger than this are handed over undecoded (the event parser decodes them).
OFF_LOOP_TEXT_BYTES = 64 * 1024

_DATA = (Opcode.CONT, Opcode.TEXT, Opcode.BINARY)


class Masked:
    """The payload of a one-frame text message as it arrived, still masked with ``mask``: the
    network reads' own buffers (``parts``), neither joined nor copied on the loop (a copy of a few
    MiB costs the loop its page faults and a memmove; on some CPUs a slow one)."""

    __slots__ = ("mask", "parts", "size")

    def __init__(self, parts: list[bytes | bytearray | memoryview], mask: bytes) -> None:
        self.parts, self.mask = parts, mask
        self.size = sum(len(p) for p in parts)

    def __len__(self) -> int:
        return self.size

    def unmask(self) -> bytes:
        """The payload (RFC 6455 5.3: every byte XOR the mask's byte at its index mod 4)."""
        joined = self.parts[0] if len(self.parts) == 1 else b"".join(self.parts)
        data = np.frombuffer(joined, np.uint8)
        out = np.empty(len(data), np.uint8)
        whole = len(data) - len(data) % 8
        key = np.frombuffer(self.mask * 2, np.uint64)[0]
        np.bitwise_xor(data[:whole].view(np.uint64), key, out=out[:whole].view(np.uint64))
        out[whole:] = data[whole:] ^ np.frombuffer(self.mask * 2, np.uint8)[: len(data) - whole]
        return out.tobytes()


class Skipped(bytes):
    """The (empty) payload of a frame that ends a message too large to read; ``size``: the
    message's bytes."""

    size: int = 0
    text: bool = False


class BoundedServerProtocol(ServerProtocol):
    """websockets' server protocol dropping the payload of messages over ``max_event_bytes``
    (``max_size``, ``max_message_bytes``, still ends the connection past it)."""

    def __init__(self, *args: Any, max_event_bytes: int, **kwargs: Any) -> None:
        self.max_event_bytes = max_event_bytes
        self._skipping: int | None = None  # bytes of the message being skipped so far
        self._skipping_text = self._after_read = False
        # Payload bytes of the frame being read that bypass the reader's buffer (receive_data),
        # and where they go (None: dropped).
        self._payload_left = 0
        self._payload_parts: list[bytes | bytearray | memoryview] | None = None
        super().__init__(*args, **kwargs)

    def receive_data(self, data: bytes | bytearray) -> None:
        """As websockets' own, except that the payload of a frame taken whole (a skipped frame's,
        a masked text frame's: :meth:`_payload`) goes past the reader's buffer as it arrives: the
        buffer would copy it in, and out again. ``data`` is kept, not copied: asyncio's and
        uvloop's transports hand each read over as a new ``bytes``."""
        if self._payload_left and data and not self.reader.buffer:
            take = min(self._payload_left, len(data))
            if self._payload_parts is not None:
                self._payload_parts.append(data if take == len(data) else memoryview(data)[:take])
            self._payload_left -= take
            data = memoryview(data)[take:] if take < len(data) else b""
        super().receive_data(data)  # type: ignore[arg-type]  # feed_data appends any bytes-like

    def parse(self) -> Generator[None]:
        if self.state is CONNECTING:  # the opening handshake, as ServerProtocol.parse reads it
            try:
                request = yield from Request.parse(self.reader.read_line)
            except Exception as exc:  # noqa: BLE001
                self.handshake_exc = InvalidMessage("did not receive a valid HTTP request")
                self.handshake_exc.__cause__ = exc
                self.send_eof()
                self.parser = self.discard()
                next(self.parser)
                yield
            self.events.append(request)
        yield from self._frames()

    def _frames(self) -> Generator[None]:
        try:
            while True:
                if (yield from self.reader.at_eof()):
                    raise EOFError("unexpected end of stream")
                head = yield from self._peek(2)
                opcode = Opcode(head[0] & 0x0F) if head[0] & 0x0F in _OPCODES else None
                n = head[1] & 0x7F
                header = 2 + (2 if n == 126 else 8 if n == 127 else 0)
                if n >= 126:
                    head = yield from self._peek(header)
                    (length,) = struct.unpack("!H" if n == 126 else "!Q", head[2:header])
                else:
                    length = n
                if opcode in _DATA and (
                    self._skipping is not None or (self.cur_size or 0) + length > self.max_event_bytes
                ):
                    yield from self._skip(opcode, bool(head[0] & 0x80), bool(head[1] & 0x80), header, length)
                    continue
                if (
                    opcode is Opcode.TEXT
                    and head[0] & 0xF0 == 0x80  # FIN, no RSV bit
                    and head[1] & 0x80  # masked, as a client's frames must be
                    and length > OFF_LOOP_TEXT_BYTES
                    and not self.extensions
                    and self.cur_size is None
                ):
                    yield from self._masked_text(header, length)
                    continue
                max_size = None if self.max_size is None else self.max_size - (self.cur_size or 0)
                frame = yield from Frame.parse(
                    self.reader.read_exact, mask=True, max_size=max_size, extensions=self.extensions
                )
                self.recv_frame(frame)
        except ProtocolError as exc:
            self.fail(1002, str(exc))
            self.parser_exc = exc
        except EOFError as exc:
            self.fail(1006, str(exc))
            self.parser_exc = exc
        except UnicodeDecodeError as exc:
            self.fail(1007, f"{exc.reason} at position {exc.start}")
            self.parser_exc = exc
        except PayloadTooBig as exc:
            self.fail(1009, str(exc))
            self.parser_exc = exc
        except Exception as exc:  # noqa: BLE001 -- as websockets' own parser: a close, no details
            self.logger.error("parser failed", exc_info=True)
            self.fail(1011)
            self.parser_exc = exc
        yield
        raise AssertionError("parse() shouldn't step after error")

    def _masked_text(self, header: int, length: int) -> Generator[None]:
        """Read a one-frame text message without unmasking it: its payload is :class:`Masked`."""
        prefix = yield from self.reader.read_exact(header + 4)
        parts: list[bytes | bytearray | memoryview] = []
        yield from self._payload(length, parts)
        self.recv_frame(Frame(Opcode.TEXT, Masked(parts, bytes(prefix[header:])), fin=True))  # type: ignore[arg-type]

    def _payload(self, length: int, parts: list[bytes | bytearray | memoryview] | None) -> Generator[None]:
        """Take the next ``length`` bytes, the current frame's payload, into ``parts`` (None:
        drop them): what the reader holds now, then the rest as the network delivers it
        (:meth:`receive_data` hands it over past the buffer)."""
        buffer = self.reader.buffer
        have = min(length, len(buffer))
        if have == len(buffer) and have and parts is not None:
            parts.append(buffer)  # all of it is payload: handed over whole, the reader gets a new one
            self.reader.buffer = bytearray()
        elif have:
            if parts is not None:
                parts.append(buffer[:have])
            del buffer[:have]
        self._payload_left, self._payload_parts = length - have, parts
        while self._payload_left:
            if self.reader.eof:
                raise EOFError("unexpected end of stream")
            yield
        self._payload_parts = None

    def _peek(self, n: int) -> Generator[None, None, bytes]:
        """The next ``n`` bytes, left in the buffer."""
        while len(self.reader.buffer) < n:
            if self.reader.eof:
                raise EOFError(f"stream ends after {len(self.reader.buffer)} bytes, expected {n} bytes")
            yield
        return bytes(self.reader.buffer[:n])

    def _skip(self, opcode: Opcode, fin: bool, masked: bool, header: int, length: int) -> Generator[None]:
        """Drop one frame of a message too large to read; at the message's end, a frame whose
        payload is :class:`Skipped` stands for it."""
        if not masked:
            raise ProtocolError("incorrect masking")
        starting = self._skipping is None
        if opcode is Opcode.CONT:
            if starting and self.cur_size is None:
                raise ProtocolError("unexpected continuation frame")
        elif not starting or self.cur_size is not None:
            raise ProtocolError("expected a continuation frame")
        if starting:  # frames of it already read (cur_size) are dropped by the application side
            self._skipping = self.cur_size or 0
            self._skipping_text = opcode is Opcode.TEXT
            self._after_read = self.cur_size is not None
        total = self._skipping + length
        if self.max_size is not None and total > self.max_size:
            raise PayloadTooBig(length, self.max_size, total - length)
        self._skipping = total
        yield from self.reader.read_exact(header + 4)  # the header and the mask
        yield from self._payload(length, None)
        if fin:
            payload = Skipped()
            payload.size, payload.text = total, self._skipping_text
            self._skipping, self.cur_size = None, None
            # CONT after frames of it were read (uvicorn appends it to them), else TEXT / BINARY.
            kind = Opcode.CONT if self._after_read else Opcode.TEXT if self._skipping_text else Opcode.BINARY
            self.events.append(Frame(kind, payload, fin=True))


_OPCODES = {op.value for op in Opcode}


@dataclass
class ReadBudget:
    """A connection's reads: ``rate`` bytes per second on average, up to ``burst`` at once (a
    token bucket, full at the start)."""

    rate: float
    burst: float
    clock: Callable[[], float] = time.monotonic
    tokens: float = field(init=False)
    last: float = field(init=False)

    def __post_init__(self) -> None:
        self.tokens, self.last = self.burst, self.clock()

    def spend(self, n: int) -> float:
        """Count ``n`` bytes read; the seconds to wait before reading more (0: none)."""
        now = self.clock()
        self.tokens = min(self.burst, self.tokens + (now - self.last) * self.rate) - n
        self.last = now
        return 0.0 if self.tokens >= 0 else -self.tokens / self.rate


def bounded_ws_protocol(
    max_event_bytes: int, max_read_bytes_per_s: int, on_read_held: Callable[[], None] | None = None
) -> type[WebSocketsSansIOProtocol]:
    """uvicorn's ``ws`` protocol class for a server whose events are at most ``max_event_bytes``
    (``uvicorn.Config(ws=..., ws_max_size=max_message_bytes)``) and whose connections read at
    most ``max_read_bytes_per_s`` on average (:class:`ReadBudget`); ``on_read_held`` is called
    each time a connection's reading is held for its budget (a metric)."""

    class BoundedWebSocketProtocol(WebSocketsSansIOProtocol):
        def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
            super().__init__(config, *args, **kwargs)
            self.conn = BoundedServerProtocol(
                extensions=self.conn.available_extensions,
                max_size=config.ws_max_size,
                max_event_bytes=max_event_bytes,
                logger=self.conn.logger,
            )
            self.budget = ReadBudget(max_read_bytes_per_s, max_event_bytes)
            self.held: Any = None  # the timer that resumes reading held for the budget

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            wait = self.budget.spend(len(data))
            if wait and self.held is None and not self.transport.is_closing():
                self.transport.pause_reading()
                self.held = self.loop.call_later(wait, self.release)
                if on_read_held is not None:
                    on_read_held()

        def release(self) -> None:
            """The budget has refilled: read again, unless uvicorn holds reading itself (a
            message the application has not taken yet; its ``receive`` resumes then)."""
            self.held = None
            if not self.read_paused and not self.transport.is_closing():
                self.transport.resume_reading()

        async def receive(self) -> Any:
            message = await super().receive()
            if self.held is not None and not self.transport.is_closing():
                self.transport.pause_reading()  # uvicorn resumed for the next message: not yet
            return message

        def connection_lost(self, exc: Exception | None) -> None:
            if self.held is not None:
                self.held.cancel()
                self.held = None
            super().connection_lost(exc)

        def send_receive_event_to_app(self) -> None:
            frames, self.frames = self.frames, []
            skipped = next((f for f in frames if isinstance(f, Skipped)), None)
            if self.close_sent:
                return
            if skipped is not None:
                message: dict[str, Any] = {"type": "websocket.receive", "text": None, "bytes": None}
                message[SKIPPED_BYTES] = skipped.size
            elif self.curr_msg_data_type == "text" and sum(len(f) for f in frames) > OFF_LOOP_TEXT_BYTES:
                data = frames[0] if len(frames) == 1 else b"".join(frames)  # one Masked frame stays so
                message = {"type": "websocket.receive", "text": None, "bytes": data, TEXT_FRAME: True}
            else:
                self.frames = frames
                super().send_receive_event_to_app()
                return
            self.queue.put_nowait(message)
            if not self.read_paused:
                self.read_paused = True
                self.transport.pause_reading()

    return BoundedWebSocketProtocol
