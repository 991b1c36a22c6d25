"""/v1/realtime's session logic through the openai SDK's realtime client, on fake stages (no vLLM).

The fake pipeline (tests/fake_stage.py: an echo "thinker" that answers with its prompt's bytes and
a "decoder" that sends 10 ms of a sine per token, real processes over real ZMQ) makes the prompt
each response was given visible in its answer: that is how these tests see what the conversation
holds (an assistant turn cut at barge-in, for one). The real Qwen3-Omni pipeline is
tests/test_realtime_e2e.py.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import time
import uuid

import numpy as np
import pytest
from fake_pipeline import API_KEY, SAMPLES_PER_TOKEN, serve_config, write_config
from websockets.exceptions import ConnectionClosed

from benchmarks.realtime_client import append_audio, connect, next_event, read_answer
from benchmarks.speech_clips import silence, speech


@contextlib.contextmanager
def fake_server(token_delay_s: float, realtime: str = "{}", max_model_len: int = 2048):
    path = write_config(
        f"rt_{uuid.uuid4().hex[:8]}",
        token_delay_s=token_delay_s,
        max_model_len=max_model_len,
        timeout_s=60,
        server_extra=f", realtime: {realtime}",
    )
    with serve_config(path) as srv:
        yield srv


@pytest.fixture(scope="module")
def srv():
    with fake_server(0.02) as s:
        yield s


@pytest.fixture(scope="module")
def slow():
    """Tokens 50 ms apart: responses long enough to interrupt."""
    with fake_server(0.05) as s:
        yield s


@pytest.fixture(scope="module")
def tight():
    with fake_server(
        0.02, "{max_buffer_s: 1.0, max_events_per_s: 5, idle_timeout_s: 1.5, max_sessions: 1, max_session_s: 6.0}"
    ) as s:
        yield s


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 120))


def model(server) -> str:
    return server.orchestrator.served_model_name


async def opened(conn, **session):
    """The session.created event, then (with ``session``) the session.updated one."""
    created = await next_event(conn)
    assert created.type == "session.created"
    if session:
        await conn.session.update(session={"type": "realtime", **session})
        updated = await next_event(conn)
        assert updated.type == "session.updated", updated
    return created


async def say(conn, text: str) -> None:
    await conn.conversation.item.create(
        item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}
    )
    assert (await next_event(conn)).type == "conversation.item.added"
    assert (await next_event(conn)).type == "conversation.item.done"


def echo(prompt: str, max_tokens: int) -> str:
    """What the fake thinker answers: its prompt's bytes, up to max_tokens."""
    return prompt.encode()[:max_tokens].decode(errors="replace")


# ---- turns -------------------------------------------------------------------------------------


def test_a_text_turn_is_answered_with_audio_and_its_transcript(srv):
    async def go():
        async with connect(srv.url, model(srv), API_KEY) as conn:
            created = await opened(conn)
            assert created.session.audio.input.turn_detection.type == "server_vad"
            await say(conn, "hello")
            await conn.response.create()
            return await read_answer(conn)

    answer = run(go())
    assert answer.types[:4] == [
        "response.created",
        "response.output_item.added",
        "conversation.item.added",
        "response.content_part.added",
    ]
    assert answer.types[-6:] == [
        "response.output_audio.done",
        "response.output_audio_transcript.done",
        "response.content_part.done",
        "response.output_item.done",
        "conversation.item.done",
        "response.done",
    ]
    expected = echo("user: hello\n", 16)
    assert answer.transcript == expected
    done = answer.events[-5]
    assert done.type == "response.output_audio_transcript.done" and done.transcript == expected
    tokens = len(expected.encode())
    assert len(answer.audio) == 2 * SAMPLES_PER_TOKEN * tokens  # pcm16 at 24 kHz, every token's audio
    response = answer.done.response
    assert response.status == "completed" and response.usage.output_tokens == tokens
    assert response.output[0].content[0].transcript == expected


def test_a_committed_audio_turn_and_g711_output(srv):
    async def go():
        async with connect(srv.url, model(srv), API_KEY) as conn:
            await opened(conn, audio={"input": {"turn_detection": None}, "output": {"format": {"type": "audio/pcmu"}}})
            await append_audio(conn, speech(0.5, seed=1))
            await conn.input_audio_buffer.commit()
            committed = await next_event(conn)
            await next_event(conn)  # conversation.item.added
            item = (await next_event(conn)).item
            await conn.response.create()
            return committed, item, await read_answer(conn)

    committed, item, answer = run(go())
    assert committed.type == "input_audio_buffer.committed" and committed.item_id == item.id
    assert item.role == "user" and item.content[0].type == "input_audio"
    # The ByteTokenizer renders the audio part's placeholder; the echo shows it reached the prompt.
    expected = echo("user: [{'type': 'audio'}]\n", 16)
    assert answer.transcript == expected
    # mu-law: one byte per 8 kHz sample, a third of the 24 kHz samples.
    assert len(answer.audio) == SAMPLES_PER_TOKEN // 3 * len(expected.encode())


# ---- barge-in ----------------------------------------------------------------------------------


def test_speech_cancels_a_response_and_its_item_keeps_what_was_heard(slow):
    long_text = "alpha bravo charlie delta echo foxtrot golf hotel"

    async def go():
        async with connect(slow.url, model(slow), API_KEY) as conn:
            await opened(
                conn,
                max_output_tokens=60,
                audio={
                    "input": {
                        "turn_detection": {"type": "server_vad", "create_response": False, "silence_duration_ms": 300}
                    }
                },
            )
            await conn.conversation.item.create(
                item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": long_text}]}
            )
            first_user = (await next_event(conn)).item.id
            await next_event(conn)
            await conn.response.create()
            state = {"sent_speech": False}

            async def interrupt(event, answer):
                if (
                    event.type == "response.output_audio.delta"
                    and len(answer.audio) >= 10 * 480
                    and not state["sent_speech"]
                ):
                    state["sent_speech"] = True
                    await append_audio(conn, np.concatenate([speech(1.0, seed=1), silence(0.6)]))

            cancelled = await read_answer(conn, on_event=interrupt)
            # The speech stops and is committed (no response: create_response is off).
            seen = []
            while "conversation.item.done" not in seen:
                seen.append((await next_event(conn)).type)
            await conn.conversation.item.delete(item_id=first_user)
            assert (await next_event(conn)).type == "conversation.item.deleted"
            await conn.response.create()
            return cancelled, seen, await read_answer(conn)

    cancelled, seen, after = run(go())
    types = cancelled.types
    assert "input_audio_buffer.speech_started" in types
    started = types.index("input_audio_buffer.speech_started")
    # Barge-in: not one audio delta after speech started; the response ends cancelled.
    assert "response.output_audio.delta" not in types[started:]
    response = cancelled.done.response
    assert response.status == "cancelled" and response.status_details.reason == "turn_detected"
    full = echo(f"user: {long_text}\n", 60)
    heard = response.output[0].content[0].transcript
    # What was heard: the text of the audio sent (10 ms per token), a strict prefix of the answer.
    sent_tokens = len(cancelled.audio) // (2 * SAMPLES_PER_TOKEN)
    assert full.startswith(heard) and 0 < len(heard.encode()) < len(full.encode())
    # In flight, with no pace measured yet, the text kept is what arrived by the audio sent; the
    # fake decoder sends each token's audio just after its text.
    assert sent_tokens - 1 <= len(heard.encode()) <= sent_tokens + 2
    assert seen[:3] == ["input_audio_buffer.speech_stopped", "input_audio_buffer.committed", "conversation.item.added"]
    # The next prompt holds the assistant turn as heard, then the user's speech.
    assert after.transcript == echo(f"assistant: {heard}\nuser: [{{'type': 'audio'}}]\n", 60)


# ---- bad events --------------------------------------------------------------------------------


def test_bad_events_are_answered_with_errors_and_the_session_goes_on(srv):
    bad = [
        (
            {
                "type": "session.update",
                "session": {
                    "type": "realtime",
                    "audio": {"input": {"turn_detection": {"type": "server_vad", "threshold": "high"}}},
                },
            },
            "session.audio.input.turn_detection.threshold",
        ),
        (
            {"type": "session.update", "session": {"type": "realtime", "tools": [{"type": "function", "name": "f"}]}},
            "session.tools",
        ),
        ({"type": "input_audio_buffer.append", "audio": "%%%"}, "audio"),
        (
            {
                "type": "conversation.item.create",
                "item": {"type": "message", "role": "user", "content": [{"type": "input_text"}]},
            },
            "item.content.0.text",
        ),
        (
            {"type": "conversation.item.truncate", "item_id": "item_nope", "content_index": 0, "audio_end_ms": 10},
            "item_id",
        ),
        ({"type": "input_audio_buffer.commit"}, None),
        ({"type": "response.cancel"}, None),
        (  # 1 ms of the session's 24 kHz pcm16: shorter than the feature extractor takes
            {
                "type": "conversation.item.create",
                "item": {
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_audio", "audio": base64.b64encode(bytes(48)).decode()}],
                },
            },
            "item.content.0.audio",
        ),
        # The beta API's fields: refused, not dropped (before: applied as nothing, no error).
        (
            {"type": "session.update", "session": {"type": "realtime", "input_audio_format": "g711_ulaw"}},
            "session.input_audio_format",
        ),
        ({"type": "response.create", "response": {"modalities": ["text"]}}, "response.modalities"),
        ({"type": "no.such.event"}, "type"),  # last: its event_id is not read
    ]

    async def go():
        async with connect(srv.url, model(srv), API_KEY) as conn:
            await opened(conn)
            errors = []
            for i, (event, _) in enumerate(bad):
                await conn.send({**event, "event_id": f"ev_{i}"})
                errors.append(await next_event(conn))
            await conn.send_raw("{this is not json")
            errors.append(await next_event(conn))
            await conn.send("a string")  # the SDK sends it as a JSON string, not an object
            errors.append(await next_event(conn))
            await say(conn, "still on")
            await conn.response.create()
            return errors, await read_answer(conn)

    errors, answer = run(go())
    for (event, param), err in zip(bad, errors):
        assert err.type == "error", err
        assert err.error.param == param, (event, err.error.message)
    # The client's event_id comes back, except where the event is unknown (no schema to read).
    assert [e.error.event_id for e in errors[: len(bad) - 1]] == [f"ev_{i}" for i in range(len(bad) - 1)]
    assert errors[-2].error.code == "invalid_json" and errors[-1].error.code == "invalid_event"
    assert errors[5].error.code == "input_audio_buffer_commit_empty"
    assert errors[6].error.code == "response_cancel_not_active"
    assert errors[7].error.code == "invalid_value" and "at least 25 ms" in errors[7].error.message
    assert answer.done.response.status == "completed"
    assert answer.transcript == echo("user: still on\n", 16)


def test_a_lone_surrogate_is_refused_and_the_session_still_answers(srv):
    """JSON can escape half a surrogate pair, which is no character: such text is refused with an
    error naming it. Before, the item was added and then its ``conversation.item.added`` failed
    to serialize (an ``internal_error``; every later response failed in the tokenizer), and a
    response whose metadata held one never ended: its ``response.created`` failed the same way,
    and every later ``response.create`` was ``conversation_already_has_active_response``."""

    async def go():
        async with connect(srv.url, model(srv), API_KEY) as conn:
            await opened(conn)
            errors = []
            await conn.send_raw(
                '{"type": "conversation.item.create", "event_id": "ev_1", "item": {"type": "message", '
                '"role": "user", "content": [{"type": "input_text", "text": "hi \\ud800"}]}}'
            )
            errors.append(await next_event(conn, timeout=30))
            await say(conn, "still on")
            await conn.send_raw(
                '{"type": "response.create", "event_id": "ev_2", "response": {"metadata": {"k": "\\udfff"}}}'
            )
            errors.append(await next_event(conn, timeout=30))
            await conn.response.create()
            return errors, await read_answer(conn, timeout=60)

    errors, answer = run(go())
    assert [(e.type, e.error.param, e.error.event_id) for e in errors] == [
        ("error", "item.content.0.text", "ev_1"),
        ("error", "response.metadata.k", "ev_2"),
    ]
    assert all(e.error.code == "invalid_value" for e in errors)
    assert answer.done.response.status == "completed"
    assert answer.transcript == echo("user: still on\n", 16)  # nothing of the refused item


def test_a_wrong_key_or_model_is_refused(srv):
    async def wrong_key():
        async with connect(srv.url, model(srv), "wrong"):
            pass

    with pytest.raises(Exception, match="403"):
        run(wrong_key())

    async def wrong_model():
        async with connect(srv.url, "gpt-realtime", API_KEY) as conn:
            first = await next_event(conn)
            with pytest.raises(ConnectionClosed):  # closed, not merely quiet
                await next_event(conn, timeout=10)
            return first

    err = run(wrong_model())
    assert err.type == "error" and err.error.code == "model_not_found" and err.error.param == "model"


# ---- limits and cleanup ------------------------------------------------------------------------


def test_buffer_and_event_rate_limits_answer_errors(tight, monkeypatch):
    wait_until(lambda: len(tight.app.state.realtime_sessions) == 0)
    from omni_cache.serving.realtime import connection

    # The session's limiter on a clock that stands still: no token comes back while the clears
    # arrive, however long the machine takes to send them.
    limiter = connection.RateLimiter
    monkeypatch.setattr(connection, "RateLimiter", lambda rate: limiter(rate, clock=lambda: 0.0))

    async def go():
        async with connect(tight.url, model(tight), API_KEY) as conn:
            await opened(conn)
            audio = base64.b64encode(np.zeros(36000, "<i2").tobytes()).decode()  # 1.5 s
            await conn.input_audio_buffer.append(audio=audio)
            full = await next_event(conn)
            for _ in range(8):
                await conn.input_audio_buffer.clear()
            return full, [await next_event(conn) for _ in range(8)]

    full, answers = run(go())
    assert full.type == "error" and full.error.code == "input_audio_buffer_full"
    assert full.error.param == "audio"
    # max_events_per_s 5 (bursts of 5): the append took one, so 4 clears pass; the rest are
    # dropped with an error.
    cleared = [e for e in answers if e.type == "input_audio_buffer.cleared"]
    refused = [e for e in answers if e.type == "error"]
    assert len(cleared) == 4 and len(refused) == 4, [e.type for e in answers]
    assert all(e.error.code == "rate_limit_exceeded" for e in refused)


def test_an_idle_session_is_closed_and_sessions_are_counted(tight):
    wait_until(lambda: len(tight.app.state.realtime_sessions) == 0)

    async def go():
        async with connect(tight.url, model(tight), API_KEY) as conn:
            await opened(conn)
            async with connect(tight.url, model(tight), API_KEY) as second:
                refused = await next_event(second)
            closing = await next_event(conn, timeout=30)
            with pytest.raises(ConnectionClosed):  # closed, not merely quiet
                await next_event(conn, timeout=10)
            return refused, closing

    refused, closing = run(go())
    assert refused.type == "error" and refused.error.code == "session_limit_reached"
    assert closing.type == "error" and closing.error.code == "idle_timeout"
    wait_until(lambda: len(tight.app.state.realtime_sessions) == 0)


def test_a_session_ends_at_its_maximum_length(tight):
    wait_until(lambda: len(tight.app.state.realtime_sessions) == 0)

    async def go():
        async with connect(tight.url, model(tight), API_KEY) as conn:
            created_at = time.monotonic()
            await opened(conn)
            while True:  # busy, never idle: only max_session_s can end it
                with contextlib.suppress(ConnectionClosed):  # closed meanwhile: its error is queued
                    await conn.input_audio_buffer.clear()
                event = await next_event(conn, timeout=10)
                if event.type == "error":
                    return event, time.monotonic() - created_at
                await asyncio.sleep(0.5)

    event, lived = run(go())
    assert event.error.code == "session_expired"
    assert lived >= 5.5


def wait_until(condition, timeout: float = 30.0) -> None:
    """Poll for what the server does after the client is gone (it learns of it asynchronously)."""
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, "the server still holds the session"
        time.sleep(0.05)


def test_a_client_that_vanishes_mid_answer_frees_everything(slow):
    orch = slow.orchestrator

    async def go():
        conn = await connect(slow.url, model(slow), API_KEY).enter()
        await opened(conn, max_output_tokens=200)
        await say(conn, "x" * 150)
        await conn.response.create()
        while (await next_event(conn)).type != "response.output_audio.delta":
            pass
        assert orch.in_flight == 1
        await conn.close()

    run(go())
    wait_until(lambda: len(slow.app.state.realtime_sessions) == 0 and orch.in_flight == 0)


@pytest.fixture(scope="module")
def quick():
    """Tokens 2 ms apart: a long spoken answer fills a silent client's socket within a second."""
    with fake_server(0.002, max_model_len=8192) as s:
        yield s


class PausedClient:
    """A realtime client on one thread over a socket with a 4 KiB receive window: between its
    reads nothing takes the server's bytes (a threaded client would go on reading into its
    queue), and when it reads it takes whatever the window holds at once and answers the server's
    keepalive pings as soon as it reads them. (websockets' threaded client, paused by its
    ``max_queue``, hands each message between two threads; on a CPU shared with other work that
    took so long that the server's keepalive ping, queued behind the held response, timed out.)"""

    def __init__(self, url: str) -> None:
        import socket

        from websockets.client import ClientProtocol
        from websockets.uri import parse_uri

        uri = parse_uri(url)
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: the window stays small
        self.sock.connect((uri.host, uri.port))
        self.protocol = ClientProtocol(uri, max_size=None)
        request = self.protocol.connect()
        request.headers["Authorization"] = f"Bearer {API_KEY}"
        self.protocol.send_request(request)
        self._flush()
        self.pending: list[dict] = []

    def _flush(self) -> None:
        self.sock.sendall(b"".join(self.protocol.data_to_send()))

    def send(self, event: dict) -> None:
        import json

        self.protocol.send_text(json.dumps(event).encode())
        self._flush()

    def recv(self, timeout: float) -> dict:
        """The next event the server sent; reads the socket only when none is waiting."""
        import json

        from websockets.frames import Frame, Opcode

        end = time.monotonic() + timeout
        while not self.pending:
            for event in self.protocol.events_received():
                if isinstance(event, Frame) and event.opcode is Opcode.TEXT:
                    assert event.fin, "the server fragments no event"
                    self.pending.append(json.loads(event.data))
            self._flush()  # pongs to the pings just read
            if self.pending:
                break
            assert self.protocol.handshake_exc is None, self.protocol.handshake_exc
            assert self.protocol.close_rcvd is None, f"the server closed: {self.protocol.close_rcvd}"
            self.sock.settimeout(max(end - time.monotonic(), 0.001))
            data = self.sock.recv(1 << 16)
            if data:
                self.protocol.receive_data(data)
            else:
                self.protocol.receive_eof()
        return self.pending.pop(0)

    def close(self) -> None:
        self.sock.close()


def test_a_client_that_stops_reading_has_its_response_held_and_gets_all_of_it(quick):
    """A realtime client that takes none of a streaming response (its socket's window is full)
    has the response held at its stages, as a chat stream's is (scheduler/client_hold.py): the
    thinker writes no token for it; reading again, the client gets every event to response.done."""
    from fake_pipeline import HOLDS, SENT, metric, wait_until_held

    tokens = 3000
    before = metric(quick, HOLDS, stage="thinker")
    ws = PausedClient(f"{quick.url.replace('http', 'ws', 1)}/v1/realtime?model={model(quick)}")
    try:
        assert ws.recv(timeout=30)["type"] == "session.created"
        # (The GA place: the beta API's top-level "turn_detection" was ignored here, now refused.)
        ws.send(
            {"type": "session.update", "session": {"type": "realtime", "audio": {"input": {"turn_detection": None}}}}
        )
        text = "x" * tokens
        ws.send(
            {
                "type": "conversation.item.create",
                "item": {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]},
            }
        )
        ws.send({"type": "response.create", "response": {"max_output_tokens": tokens}})
        first = wait_until_held(quick, before)
        time.sleep(0.5)  # 250 tokens' time
        assert metric(quick, SENT, stage="thinker") == first, "the thinker wrote tokens for a held response"
        transcript, done = "", None
        while done is None:
            event = ws.recv(timeout=60)
            assert event["type"] != "error", event
            if event["type"] == "response.output_audio_transcript.delta":
                transcript += event["delta"]
            elif event["type"] == "response.done":
                done = event
    finally:
        ws.close()
    # Every token of the answer (the echo is longer: it ends at max_output_tokens).
    assert done["response"]["status"] == "incomplete", done
    assert done["response"]["status_details"]["reason"] == "max_output_tokens"
    assert transcript == echo(f"user: {text}\n", tokens)
