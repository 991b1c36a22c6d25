"""The WebSocket layer under /v1/realtime (omni_cache/serving/realtime/ws_protocol.py), fed bytes
as a socket would deliver them: a message over ``max_event_bytes`` is dropped as it arrives (the
reader's buffer never holds more than one network read of it) and stands as one frame whose
payload says its size; one over ``max_message_bytes`` is refused from its header (1009); frames
within the limit, control frames between fragments and the message after a skipped one are read
as websockets reads them."""

from __future__ import annotations

import random

import pytest
from websockets.client import ClientProtocol
from websockets.frames import Frame, Opcode
from websockets.protocol import OPEN
from websockets.uri import parse_uri

from omni_cache.serving.realtime import ws_protocol
from omni_cache.serving.realtime.ws_protocol import BoundedServerProtocol, Masked, ReadBudget, Skipped

EVENT, MESSAGE = 1000, 5000
CHUNK = 300  # bytes per network read


def wire(*frames: Frame) -> bytes:
    """What a client sends for ``frames`` (masked)."""
    client = ClientProtocol(parse_uri("ws://localhost/"), state=OPEN)
    for frame in frames:
        client.send_frame(frame)
    return b"".join(client.data_to_send())


def feed(data: bytes) -> tuple[BoundedServerProtocol, list[Frame], int]:
    """The server's frames from ``data`` read CHUNK bytes at a time, and the most its reader held."""
    server = BoundedServerProtocol(max_size=MESSAGE, max_event_bytes=EVENT, state=OPEN)
    frames, held = [], 0
    for i in range(0, len(data), CHUNK):
        server.receive_data(data[i : i + CHUNK])
        held = max(held, len(server.reader.buffer))
        frames += [e for e in server.events_received() if isinstance(e, Frame)]
    return server, frames, held


def test_frames_within_the_limit_are_read_as_sent():
    _, frames, _ = feed(wire(Frame(Opcode.TEXT, b"a" * EVENT), Frame(Opcode.BINARY, b"b" * 10)))
    assert [(f.opcode, bytes(f.data)) for f in frames] == [(Opcode.TEXT, b"a" * EVENT), (Opcode.BINARY, b"b" * 10)]


def test_a_large_one_frame_text_message_is_handed_over_still_masked(monkeypatch):
    """A one-frame text message over OFF_LOOP_TEXT_BYTES is not unmasked on the loop: its
    payload is Masked, which the event parser's thread unmasks to what was sent (any length, so
    any tail past the 8-byte words); fragmented, binary and small messages are read as before."""
    monkeypatch.setattr(ws_protocol, "OFF_LOOP_TEXT_BYTES", 100)
    rng = random.Random(3)
    texts = [bytes(rng.randrange(256) for _ in range(n)) for n in (101, 107, 999)]
    _, frames, _ = feed(
        wire(
            *(Frame(Opcode.TEXT, t) for t in texts),
            Frame(Opcode.TEXT, b"small"),
            Frame(Opcode.BINARY, b"b" * 500),
            Frame(Opcode.TEXT, b"c" * 300, fin=False),
            Frame(Opcode.CONT, b"d" * 300),
        )
    )
    assert all(isinstance(f.data, Masked) for f in frames[:3])
    assert [f.data.unmask() for f in frames[:3]] == texts and [len(f.data) for f in frames[:3]] == [101, 107, 999]
    assert [bytes(f.data) for f in frames[3:]] == [b"small", b"b" * 500, b"c" * 300, b"d" * 300]


def test_a_large_text_message_goes_past_the_readers_buffer_in_reads_of_any_size(monkeypatch):
    """A Masked payload is the network reads' own bytes: the reader's buffer holds at most the
    read a frame starts in (not the payload as it grows), for reads of any size, down to one
    byte, and frames that begin inside a read are parsed from where the payload ended."""
    monkeypatch.setattr(ws_protocol, "OFF_LOOP_TEXT_BYTES", 100)
    rng = random.Random(5)
    texts = [bytes(rng.randrange(256) for _ in range(n)) for n in (101, 2000, 333, 4999)]
    data = wire(*(Frame(Opcode.TEXT, t) for t in texts), Frame(Opcode.TEXT, b"small"))
    for sizes in ([CHUNK], [1], [7, 1, 450, 2, 1999], [len(data)]):
        server = BoundedServerProtocol(max_size=MESSAGE, max_event_bytes=MESSAGE, state=OPEN)
        frames, held, i, k = [], 0, 0, 0
        while i < len(data):
            n = sizes[k % len(sizes)]
            server.receive_data(data[i : i + n])
            held, i, k = max(held, len(server.reader.buffer)), i + n, k + 1
            frames += [e for e in server.events_received() if isinstance(e, Frame)]
        assert [f.data.unmask() for f in frames[:4]] == texts, sizes
        assert bytes(frames[4].data) == b"small" and server.parser_exc is None
        assert held <= max(sizes) + 14, (sizes, held)  # a read, and a frame header and mask


def test_a_message_over_the_event_limit_is_dropped_as_it_arrives_and_the_next_is_read():
    server, frames, held = feed(wire(Frame(Opcode.TEXT, b"x" * (EVENT + 1)), Frame(Opcode.TEXT, b"next")))
    assert held <= CHUNK  # never assembled
    assert isinstance(frames[0].data, Skipped) and frames[0].data.size == EVENT + 1 and frames[0].data.text
    assert frames[0].opcode is Opcode.TEXT and frames[0].fin
    assert bytes(frames[1].data) == b"next"
    assert server.parser_exc is None and server.close_sent is None


def test_a_fragmented_message_is_counted_whole_with_pings_between_its_fragments():
    data = wire(
        Frame(Opcode.BINARY, b"1" * 600, fin=False),
        Frame(Opcode.PING, b"p"),
        Frame(Opcode.CONT, b"2" * 600, fin=False),  # 1200: past the limit from here on
        Frame(Opcode.CONT, b"3" * 10, fin=True),
        Frame(Opcode.TEXT, b"after"),
    )
    server, frames, held = feed(data)
    assert held <= 600 + 14  # the fragment within the limit, read whole; none of the rest
    kinds = [(f.opcode, type(f.data) is Skipped) for f in frames]
    # The first fragment was read (uvicorn keeps it and drops it when the skipped end arrives).
    assert kinds == [(Opcode.BINARY, False), (Opcode.PING, False), (Opcode.CONT, True), (Opcode.TEXT, False)]
    assert frames[2].data.size == 1210 and not frames[2].data.text
    assert server.data_to_send()  # the pong
    assert bytes(frames[3].data) == b"after"


def test_a_message_over_the_message_limit_closes_with_1009_from_its_header():
    server, frames, held = feed(wire(Frame(Opcode.TEXT, b"x" * (MESSAGE + 1))))
    assert frames == [] and held <= CHUNK + 14
    assert server.close_sent is not None and server.close_sent.code == 1009


@pytest.mark.parametrize(
    "frames",
    [
        [Frame(Opcode.CONT, b"x" * (EVENT + 1))],  # a continuation with no message started
        [Frame(Opcode.TEXT, b"a" * 10, fin=False), Frame(Opcode.TEXT, b"x" * (EVENT + 1))],
    ],
)
def test_a_protocol_error_in_a_skipped_frame_closes_with_1002(frames):
    server, _, _ = feed(wire(*frames))
    assert server.close_sent is not None and server.close_sent.code == 1002


def test_the_read_budget_lets_a_burst_through_then_the_rate():
    now = [0.0]
    budget = ReadBudget(rate=100.0, burst=1000.0, clock=lambda: now[0])
    assert budget.spend(1000) == 0.0  # the whole burst at once
    assert budget.spend(50) == pytest.approx(0.5)  # 50 bytes over: half a second at 100 B/s
    now[0] = 0.5
    assert budget.spend(0) == 0.0  # refilled to zero
    now[0] = 100.0
    assert budget.spend(1000) == 0.0  # refills to the burst, no further
    assert budget.spend(1) == pytest.approx(0.01)
