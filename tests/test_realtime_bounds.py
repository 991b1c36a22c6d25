"""/v1/realtime within the server's bounds, on fake stages (tests/fake_stage.py: real processes,
real ZMQ, no vLLM; the echo thinker answers with its prompt's bytes, so each answer shows where
its prompt starts), driven by the openai SDK's realtime client.

- truncation (the session's ``truncation``) drops the oldest whole turns when a prompt passes
  the context or the clip limit, down to the retention ratio, so a session goes on; ``disabled``
  fails the response instead;
- a session's conversation bytes count against ``server.max_media_bytes_in_flight`` (its share:
  / ``server.realtime.max_sessions``): past it an ``error``, the server serving everyone else;
  everything is given back when sessions end;
- a client that stops reading is closed past ``server.realtime.max_outbox_bytes``;
- an event too deep, too large (``max_event_bytes``), of too many values or not JSON is an
  ``error`` naming the problem and the session goes on; a message past ``max_message_bytes`` is
  not read (close 1009).
The planning itself (cuts, media token estimates, the shared media bound) is unit-tested at the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid

import httpx
import numpy as np
import pytest
from fake_pipeline import API_KEY, metric, serve_config, write_config
from media_samples import flat_png_data_url
from websockets.exceptions import ConnectionClosed

from benchmarks.realtime_client import append_audio, connect, next_event, read_answer
from benchmarks.speech_clips import speech
from omni_cache.runtime.request_path.admission import InFlightBounds, MediaHold
from omni_cache.runtime.request_path.requests import AUDIO, MediaItem
from omni_cache.runtime.request_path.results import RequestError
from omni_cache.serving.realtime.truncation import MediaTokens, cut_points, first_cut

MAX_MODEL_LEN = 600
ANSWER_TOKENS = 16
AUDIO_LIMIT = 4
POOL = 4 * 1024 * 1024
SESSIONS = 4
BUFFER_S = 2.0
OUTBOX = 256 * 1024
EVENT_BYTES, MESSAGE_BYTES = 1024 * 1024, 2 * 1024 * 1024


@contextlib.contextmanager
def fake_server(server_extra: str = "", audio_limit: int | None = None):
    path = write_config(
        f"rtb_{uuid.uuid4().hex[:8]}",
        token_delay_s=0.002,
        max_model_len=MAX_MODEL_LEN,
        timeout_s=60,
        server_extra=server_extra,
    )
    if audio_limit is not None:  # the thinker's clip limit, as stage_configs/qwen3_omni.yaml sets it
        text = path.read_text()
        path.write_text(
            text.replace(
                f"engine_args: {{max_model_len: {MAX_MODEL_LEN}}}",
                f"engine_args: {{max_model_len: {MAX_MODEL_LEN}, extra: "
                f"{{limit_mm_per_prompt: {{audio: {audio_limit}}}}}}}",
            )
        )
    with serve_config(path) as srv:
        yield srv


@pytest.fixture(scope="module")
def limited():
    with fake_server(audio_limit=AUDIO_LIMIT) as s:
        yield s


@pytest.fixture(scope="module")
def small():
    """A media bound of 4 MiB for 4 sessions (1 MiB each, 2 s of input buffer reserved)."""
    with fake_server(
        f", max_media_bytes_in_flight: {POOL}, realtime: {{max_sessions: {SESSIONS}, "
        f"max_buffer_s: {BUFFER_S}, max_outbox_bytes: {OUTBOX}, max_event_bytes: {EVENT_BYTES}, "
        f"max_message_bytes: {MESSAGE_BYTES}}}"
    ) as s:
        yield s


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 180))


def wait_until(condition, timeout: float = 30.0) -> None:
    """Poll for what the server does after a client is gone (it learns of it asynchronously)."""
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, "the server still holds the session"
        time.sleep(0.05)


def model(server) -> str:
    return server.orchestrator.served_model_name


class Session:
    """One SDK connection and the conversation as the client sees it (added, deleted)."""

    def __init__(self, conn) -> None:
        self.conn = conn
        self.items: list[tuple[str, str]] = []  # (id, user | audio | assistant)
        self.deleted: list[str] = []

    async def open(self, **session) -> None:
        assert (await next_event(self.conn)).type == "session.created"
        await self.conn.session.update(
            session={
                "type": "realtime",
                "max_output_tokens": ANSWER_TOKENS,
                "audio": {"input": {"turn_detection": None}},
                **session,
            }
        )
        updated = await next_event(self.conn)
        assert updated.type == "session.updated", updated

    async def until(self, last: str):
        """Events up to one of type ``last`` (an error raises), noting deletions."""
        while True:
            event = await next_event(self.conn)
            if event.type == "error" or event.type == last:
                return event
            if event.type == "conversation.item.deleted":
                self.deleted.append(event.item_id)
                self.items = [i for i in self.items if i[0] != event.item_id]

    async def say(self, text: str):
        await self.conn.conversation.item.create(
            item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}
        )
        event = await self.until("conversation.item.done")
        if event.type == "conversation.item.done":
            self.items.append((event.item.id, "user"))
        return event

    async def commit(self, seconds: float, seed: int):
        await append_audio(self.conn, speech(seconds, seed=seed))
        await self.conn.input_audio_buffer.commit()
        event = await self.until("conversation.item.done")
        if event.type == "conversation.item.done":
            self.items.append((event.item.id, "audio"))
        else:  # refused: the buffer keeps the audio; this client lets it go
            await self.conn.input_audio_buffer.clear()
            assert (await self.until("input_audio_buffer.cleared")).type == "input_audio_buffer.cleared"
        return event

    async def answer(self):
        await self.conn.response.create()
        deleted = len(self.deleted)
        answer = await read_answer(self.conn)
        self.deleted += [e.item_id for e in answer.events if e.type == "conversation.item.deleted"]
        self.items.append((answer.done.response.output[0].id, "assistant"))
        gone = set(self.deleted)
        self.items = [i for i in self.items if i[0] not in gone]
        return answer, len(self.deleted) - deleted


# ---- truncation ----------------------------------------------------------------------------------


def test_retention_ratio_drops_old_turns_and_the_session_goes_on(limited):
    limit = MAX_MODEL_LEN - ANSWER_TOKENS

    async def go():
        async with connect(limited.url, model(limited), API_KEY) as conn:
            s = Session(conn)
            await s.open(truncation={"type": "retention_ratio", "retention_ratio": 0.5})
            turns = []
            for turn in range(40):
                await s.say(f"turn {turn:02d} " + "x" * 20)
                answer, dropped = await s.answer()
                turns.append((answer, dropped, [kind for _, kind in s.items]))
            return turns

    turns = run(go())
    truncated = [i for i, (_, dropped, _) in enumerate(turns) if dropped]
    assert len(truncated) >= 3  # the context was passed again and again
    prompt_tokens = []
    for i, (answer, dropped, kinds) in enumerate(turns):
        response = answer.done.response
        assert response.status in ("completed", "incomplete"), response.status_details
        usage = response.usage
        prompt_tokens.append(usage.input_tokens)
        assert usage.input_tokens <= limit
        # Whole turns go: what is left starts with a user item.
        assert kinds[0] == "user"
        if dropped:
            # Down to half the limit; the echo shows the prompt now starts at a later turn.
            assert usage.input_tokens <= limit * 0.5
            assert answer.transcript.startswith("user: turn ")
            assert 0 < int(answer.transcript[11:13]) < i
        elif i > 0:
            # Between truncations each prompt extends the last one: the cache hits on it.
            assert usage.input_token_details.cached_tokens > 0
    # The ratio leaves room for several turns: truncations are spread out.
    assert min(b - a for a, b in zip(truncated, truncated[1:])) >= 3


def test_the_clip_limit_truncates_audio_turns(limited):
    async def go():
        async with connect(limited.url, model(limited), API_KEY) as conn:
            s = Session(conn)
            await s.open(truncation="auto")
            clips_in_prompt = []
            for turn in range(12):
                await s.commit(0.3, seed=turn)
                clips_in_prompt.append(sum(kind == "audio" for _, kind in s.items))
                answer, dropped = await s.answer()
                assert answer.done.response.status in ("completed", "incomplete")
                clips_in_prompt[-1] = (clips_in_prompt[-1], dropped, sum(kind == "audio" for _, kind in s.items))
            return clips_in_prompt

    counts = run(go())
    # Before each answer the conversation may hold one clip past the limit; the answer's prompt
    # never does: auto (0.75) drops down to 3 of the 4 clips.
    for before, dropped, after in counts:
        assert after <= AUDIO_LIMIT
        if before > AUDIO_LIMIT:
            assert dropped and after == int(0.75 * AUDIO_LIMIT)
    assert sum(1 for _, dropped, _ in counts if dropped) >= 3


def test_truncation_disabled_fails_the_response_and_keeps_the_session(limited):
    async def go():
        async with connect(limited.url, model(limited), API_KEY) as conn:
            s = Session(conn)
            await s.open(truncation="disabled")
            await s.say("y" * MAX_MODEL_LEN)  # past the context: nothing may be dropped
            failed, dropped = await s.answer()
            await conn.conversation.item.delete(item_id=s.items[-2][0])
            await s.until("conversation.item.deleted")
            await s.say("short")
            after, _ = await s.answer()
            return failed, dropped, after

    failed, dropped, after = run(go())
    assert dropped == 0
    response = failed.done.response
    assert response.status == "failed" and "context length" in response.status_details.error.message
    assert after.done.response.status in ("completed", "incomplete")


def test_session_truncation_field_is_validated_and_described(limited):
    async def go():
        async with connect(limited.url, model(limited), API_KEY) as conn:
            created = await next_event(conn)
            await conn.send(
                {
                    "type": "session.update",
                    "session": {"type": "realtime", "truncation": {"type": "retention_ratio", "retention_ratio": 0.0}},
                }
            )
            bad = await next_event(conn)
            await conn.session.update(
                session={
                    "type": "realtime",
                    "truncation": {
                        "type": "retention_ratio",
                        "retention_ratio": 0.6,
                        "token_limits": {"post_instructions": 300},
                    },
                }
            )
            return created, bad, await next_event(conn)

    created, bad, updated = run(go())
    assert created.session.truncation == "auto"  # the default: sessions go on
    assert bad.type == "error" and bad.error.param == "session.truncation.retention_ratio"
    t = updated.session.truncation
    assert t.retention_ratio == 0.6 and t.token_limits.post_instructions == 300


# ---- memory ---------------------------------------------------------------------------------------


def test_sessions_hold_their_bytes_in_the_media_bound_and_give_them_back(small):
    wait_until(lambda: len(small.app.state.realtime_sessions) == 0)
    bounds = small.orchestrator.admission.bounds
    rate = small.orchestrator.audio_input_rate
    room = int(BUFFER_S * rate) * 4
    share = POOL // SESSIONS
    clip_bytes = rate * 4  # 1 s of float32
    fit = (share - room) // clip_bytes  # clips a session's share holds

    async def fill(conn, truncation):
        s = Session(conn)
        await s.open(truncation=truncation)
        errors = []
        for turn in range(fit + 2):
            event = await s.commit(1.0, seed=turn)
            if event.type == "error":
                errors.append(event)
        return s, errors

    async def go():
        conns = [await connect(small.url, model(small), API_KEY).enter() for _ in range(SESSIONS)]
        try:
            full = await asyncio.gather(*(fill(c, "disabled") for c in conns[:-1]))
            truncating = await fill(conns[-1], "auto")
            held = bounds.media_bytes
            # The server goes on serving: a full session still answers a text turn, and HTTP.
            s = full[0][0]
            await s.say("still here")
            answer, _ = await s.answer()
            async with httpx.AsyncClient(timeout=60) as http:
                chat = await http.post(
                    small.url + "/v1/chat/completions",
                    headers={"Authorization": f"Bearer {API_KEY}"},
                    json={"model": model(small), "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
                )
            return full, truncating, held, answer, chat
        finally:
            for c in conns:
                await c.close()

    full, truncating, held, answer, chat = run(go())
    for s, errors in full:
        # Truncation disabled: the commits past the session's share are refused, the rest kept.
        assert len(errors) == 2 and all(e.error.code == "session_memory_limit_reached" for e in errors)
        assert errors[0].error.param == "item"
        assert sum(kind == "audio" for _, kind in s.items) == fit
    s, errors = truncating
    # auto: no error, the oldest turns were dropped to make room (and the client told).
    assert not errors and s.deleted
    assert sum(kind == "audio" for _, kind in s.items) <= fit
    assert (SESSIONS - 1) * (room + 0.99 * fit * clip_bytes) <= held <= POOL
    assert answer.done.response.status in ("completed", "incomplete")
    assert chat.status_code == 200, chat.text
    # Everything is given back when the sessions end.
    wait_until(lambda: len(small.app.state.realtime_sessions) == 0 and bounds.media_bytes == 0)


def test_a_client_that_stops_reading_is_closed_and_freed(small):
    wait_until(lambda: len(small.app.state.realtime_sessions) == 0)
    # Every session.updated carries the instructions back: one event fits the outbox, 200 are
    # 30 MB, more than the socket buffers (~13 MB here) and the outbox hold.
    instructions = "z" * (150 * 1024)
    updates = 200

    async def go():
        conn = await connect(small.url, model(small), API_KEY).enter()
        try:
            await asyncio.to_thread(wait_until, lambda: len(small.app.state.realtime_sessions) == 1)  # (held)
            for _ in range(updates):
                # Closed meanwhile, or the socket full both ways (the server stopped reading a
                # client it is closing; this client reads nothing): the client stops sending, at
                # the latest when its send blocked 30 s, at once when the server freed the session.
                update = asyncio.ensure_future(
                    conn.session.update(session={"type": "realtime", "instructions": instructions})
                )
                blocked_until = time.monotonic() + 30
                while not update.done() and time.monotonic() < blocked_until and small.app.state.realtime_sessions:
                    await asyncio.wait({update}, timeout=0.1)
                if not update.done():
                    update.cancel()
                    break
                if update.exception() is not None:
                    if isinstance(update.exception(), ConnectionClosed):
                        break
                    raise update.exception()
            # The server gives up on the session without this client reading anything.
            await asyncio.to_thread(wait_until, lambda: len(small.app.state.realtime_sessions) == 0)
            # Another session is served as before.
            async with connect(small.url, model(small), API_KEY) as other:
                s = Session(other)
                await s.open()
                await s.say("hello")
                answer, _ = await s.answer()
            received = 0
            with contextlib.suppress(ConnectionClosed, asyncio.TimeoutError):
                while True:
                    await next_event(conn, timeout=10)
                    received += 1
            return received, answer
        finally:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(conn.close(), 30)

    received, answer = run(go())
    # What waited in the server was dropped: the client got far fewer than it asked for.
    assert received < updates
    assert answer.done.response.status in ("completed", "incomplete")
    bounds = small.orchestrator.admission.bounds
    wait_until(lambda: len(small.app.state.realtime_sessions) == 0 and bounds.media_bytes == 0)


# ---- bad events ----------------------------------------------------------------------------------


def test_bad_events_are_errors_naming_the_problem_and_the_session_goes_on(small):
    """Before: 200,000 brackets were an ``internal_error`` (RecursionError) and nothing bounded an
    event below uvicorn's 16 MiB."""
    bad = [
        ("[" * 200_000 + "]" * 200_000, "invalid_json", "nests at least 65536 levels deep; at most 64"),
        ('{"type": "x", "a": [' + ",".join(["0"] * 150_000) + "]}", "invalid_json", "at most 100000 are read"),
        (json.dumps({"type": "input_audio_buffer.append", "audio": "A" * EVENT_BYTES}), "event_too_large", "max_event"),
        ("{nope", "invalid_json", "not valid JSON"),
    ]

    async def go():
        async with connect(small.url, model(small), API_KEY) as conn:
            s = Session(conn)
            await s.open()
            errors = []
            for raw, _, _ in bad:
                await conn.send_raw(raw)
                errors.append(await next_event(conn))
            await s.say("still there?")
            answer, _ = await s.answer()
        conn = await connect(small.url, model(small), API_KEY).enter()
        try:
            assert (await next_event(conn)).type == "session.created"
            with contextlib.suppress(ConnectionClosed, ConnectionResetError):  # closed while sending
                await conn.send_raw("A" * (MESSAGE_BYTES + 1))
            with pytest.raises(ConnectionClosed) as closed:
                await next_event(conn)
        finally:
            with contextlib.suppress(Exception):  # already closed by the server
                await conn.close()
        return errors, answer, closed.value

    errors, answer, closed = run(go())
    for event, (_, code, needle) in zip(errors, bad, strict=True):
        assert event.type == "error" and event.error.type == "invalid_request_error", event
        assert event.error.code == code and needle in event.error.message, event
    assert answer.done.response.status in ("completed", "incomplete")
    assert closed.rcvd is not None and closed.rcvd.code == 1009  # message too big: never read whole
    wait_until(lambda: len(small.app.state.realtime_sessions) == 0)


def read_holds(server) -> float:
    return metric(server, "omni_cache_realtime_read_holds_total")


def test_a_connection_is_read_within_its_budget_and_the_session_goes_on(small):
    """``max_read_bytes_per_s`` (1 MiB/s by default) after a burst of ``max_event_bytes``: an
    event of nearly the burst is read at once (no hold); three oversized ones after it are read
    no faster than the budget (each still answered ``event_too_large``), the holds are counted
    in /metrics, and the session answers afterwards."""
    rate = 1024 * 1024
    near = json.dumps({"type": "x", "pad": "A" * (EVENT_BYTES - 100)})
    oversized = json.dumps({"type": "input_audio_buffer.append", "audio": "A" * EVENT_BYTES})

    async def go():
        async with connect(small.url, model(small), API_KEY) as conn:
            s = Session(conn)
            await s.open()
            before = await asyncio.to_thread(read_holds, small)
            await conn.send_raw(near)
            first = await next_event(conn)
            after_burst = await asyncio.to_thread(read_holds, small)
            start = time.monotonic()
            codes = []
            for _ in range(3):
                await conn.send_raw(oversized)
                codes.append((await next_event(conn)).error.code)
            took = time.monotonic() - start
            held = await asyncio.to_thread(read_holds, small)
            await s.say("still there?")
            answer, _ = await s.answer()
        return before, first, after_burst, codes, took, held, answer

    before, first, after_burst, codes, took, held, answer = run(go())
    assert first.type == "error" and first.error.code != "event_too_large", first  # read, parsed
    assert after_burst == before  # the burst went at full speed
    assert codes == ["event_too_large"] * 3
    # 3 oversized events on top of a burst spent: at least (3 x size - what refilled) at the rate.
    assert took >= 0.9 * 3 * len(oversized) / rate - 1.0, took
    assert held > before
    assert answer.done.response.status in ("completed", "incomplete")


# ---- images ---------------------------------------------------------------------------------------

IMAGE_SIDE = 300  # one colour: a few KiB sent, 270,000 bytes decoded (three fit a session's share)


def image_part(seed: int, side: int = IMAGE_SIDE) -> dict:
    return {"type": "input_image", "image_url": flat_png_data_url(side, side, (seed, 30, 90))}


async def show(s: Session, *parts: dict):
    """A user item of ``parts`` (an image and its question); its item.done or the error."""
    await s.conn.conversation.item.create(item={"type": "message", "role": "user", "content": list(parts)})
    event = await s.until("conversation.item.done")
    if event.type == "conversation.item.done":
        s.items.append((event.item.id, "user"))
    return event


def test_images_are_held_before_they_are_decoded_and_truncated_like_clips(small):
    wait_until(lambda: len(small.app.state.realtime_sessions) == 0)
    bounds = small.orchestrator.admission.bounds
    cache = small.app.state.media_cache
    room = int(BUFFER_S * small.orchestrator.audio_input_rate) * 4
    share = POOL // SESSIONS
    image_bytes = IMAGE_SIDE * IMAGE_SIDE * 3
    fit = (share - room) // image_bytes
    question = {"type": "input_text", "text": "What is in this picture?"}

    async def go():
        async with connect(small.url, model(small), API_KEY) as conn:
            s = Session(conn)
            await s.open(truncation="disabled")
            added = [await show(s, image_part(i), question) for i in range(fit)]
            held, cached = bounds.media_bytes, len(cache)
            refused = await show(s, image_part(fit))  # one more than the share holds
            after_refusal = bounds.media_bytes, len(cache)
            answer, _ = await s.answer()
            await conn.session.update(session={"type": "realtime", "truncation": "auto"})
            assert (await s.until("session.updated")).type == "session.updated"
            truncated = await show(s, image_part(fit + 1), question)
            return added, held, cached, refused, after_refusal, answer, truncated, s.deleted

    added, held, cached, refused, after_refusal, answer, truncated, deleted = run(go())
    assert fit == 3
    for event in added:
        assert event.type == "conversation.item.done", event
        assert [c.type for c in event.item.content] == ["input_image", "input_text"]
    assert room + fit * image_bytes <= held <= share
    # The image past the share is refused from its header: nothing of it was decoded (the
    # decoded-item cache did not see it) and its room was given back.
    assert refused.type == "error" and refused.error.code == "session_memory_limit_reached"
    assert after_refusal == (held, cached)
    assert answer.done.response.status in ("completed", "incomplete")
    # auto: the oldest image turns leave (the client is told) to make room for the new one.
    assert truncated.type == "conversation.item.done" and len(deleted) >= 2
    wait_until(lambda: len(small.app.state.realtime_sessions) == 0 and bounds.media_bytes == 0)


@pytest.mark.parametrize(
    "part, param, message",
    [
        (
            {"type": "input_image", "image_url": "data:image/png;base64,bm90IGFuIGltYWdl"},
            "item.content.0.image_url",
            "could not be decoded",
        ),
        (
            {"type": "input_image", "image_url": "data:image/png;base64,@@@@"},
            "item.content.0.image_url",
            "not valid base64",
        ),
        ({"type": "input_image", "image_url": "file:///etc/passwd"}, "item.content.0.image_url", "scheme file:"),
        ({"type": "input_image"}, "item.content.0.image_url", "needs 'image_url'"),
        (image_part(1, side=4100), "item.content.0.image_url", "server.media.max_image_pixels"),
        ([image_part(i, side=8) for i in range(9)], "item.content", "server.media.max_items"),
    ],
    ids=["not-an-image", "bad-base64", "file-url", "no-url", "too-many-pixels", "too-many-images"],
)
def test_a_bad_image_is_an_error_naming_it_and_the_session_goes_on(small, part, param, message):
    async def go():
        async with connect(small.url, model(small), API_KEY) as conn:
            s = Session(conn)
            await s.open()
            bad = await show(s, *(part if isinstance(part, list) else [part]))
            good = await show(s, image_part(2, side=16), {"type": "input_text", "text": "and this?"})
            answer, _ = await s.answer()
            return bad, good, answer

    bad, good, answer = run(go())
    assert bad.type == "error" and bad.error.param == param and message in bad.error.message, bad
    # Nothing of the server's own objects: PIL's error named its buffer ("<_io.BytesIO object at 0x...>").
    assert "object at 0x" not in bad.error.message, bad.error.message
    assert good.type == "conversation.item.done"
    assert answer.done.response.status in ("completed", "incomplete")


# ---- the planning, unit by unit ------------------------------------------------------------------


def test_cuts_fall_before_turns_and_keep_the_newest():
    roles = ["user", "assistant", "user", "user", "assistant", "system", "user", "assistant"]
    assert cut_points(roles) == [0, 2, 3, 6]
    sizes = [10] * len(roles)

    def over(cut, scale):
        return sum(sizes[cut:]) > scale * 60

    assert first_cut(cut_points(roles), over, 0.5) == 6  # 20 <= 30
    assert first_cut(cut_points(roles), over, 1.0) == 2  # 60 <= 60
    assert first_cut(cut_points(roles), lambda cut, scale: sum(sizes[cut:]) > scale * 40, 1.0) == 6
    assert first_cut(cut_points(roles), lambda cut, scale: True, 0.5) is None
    assert first_cut(cut_points(roles), lambda cut, scale: False, 0.5) == 0


def test_media_tokens_are_learned_from_answers():
    tokens = MediaTokens()
    clip = MediaItem(AUDIO, np.zeros(16000, np.float32), 16000, "a")
    short = MediaItem(AUDIO, np.zeros(3200, np.float32), 16000, "b")
    assert tokens.of(clip) == 27  # 26 per second before any answer, and one more
    # A prompt of 40 tokens with one placeholder was 52 at the thinker: the clip took 13.
    tokens.learn([clip], expanded=52, unexpanded=40)
    assert tokens.of(clip) == 13
    assert tokens.of(short) == 4  # 13 per second, estimated, plus one
    # Two placeholders in 55 tokens were 70: the clip's 13 known, the short one took 4.
    tokens.learn([clip, short], expanded=70, unexpanded=55)
    assert tokens.of(short) == 4
    # The highest rate seen (20 per second) estimates the next clip: never under-counted.
    assert tokens.of(MediaItem(AUDIO, np.zeros(16000, np.float32), 16000, "c")) == 21


def test_a_session_hold_shares_the_pool_with_requests():
    bounds = InFlightBounds(max_requests=4, max_media_bytes=1000)
    hold = MediaHold(bounds, share=400)
    hold.resize(300)
    ticket = bounds.enter()
    ticket.hold_media(700)
    with pytest.raises(RequestError) as e:
        hold.resize(350)  # within its share, not within the pool
    assert e.value.status == 429 and hold.nbytes == 300
    with pytest.raises(RequestError) as e:
        hold.resize(500)
    assert e.value.status == 413
    ticket.release()
    hold.resize(400)
    assert bounds.media_bytes == 400
    hold.release()
    assert bounds.media_bytes == 0
