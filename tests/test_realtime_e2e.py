"""/v1/realtime on the real tiny Qwen3-Omni pipeline (stage_configs/qwen3_omni.yaml: thinker,
talker and code2wav in their own processes, vLLM engines, real ZMQ), driven by the openai SDK's
realtime client unmodified. One server for the module (started once for this module and
tests/test_qwen3_omni_streaming.py: tests/conftest.py's qwen3_omni_server).

What a voice client sees: a text turn and a committed audio turn answered with audio and its
transcript; server VAD finding speech in a synthesized clip and answering it; speech cancelling a
response (barge-in) and the assistant item keeping only what was heard; three turns whose
prompts hit the thinker's prefix cache on everything of the earlier turns (to the block) and the
talker's on the earlier user turns; bad events answered with ``error``; nothing left in the server
after a client vanishes mid-answer. Session logic in detail: tests/test_realtime_session.py.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import numpy as np
import pytest
from media_samples import png_data_url
from served_config import QWEN3_OMNI_SHARED

from benchmarks.realtime_client import append_audio, connect, next_event, read_answer
from benchmarks.speech_clips import silence, speech, turn_clip
from omni_cache.runtime.metrics.prometheus import parse_metrics

pytestmark = pytest.mark.vllm

MODEL = QWEN3_OMNI_SHARED
MAX_TOKENS = 10  # thinker tokens per answer: short turns


@pytest.fixture(scope="module")
def server(qwen3_omni_server):
    """The shipped pipeline, shared with tests/test_qwen3_omni_streaming.py (tests/conftest.py)."""
    return qwen3_omni_server


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 300))


def stage_metric(server, name: str, stage: str) -> float:
    samples = parse_metrics(httpx.get(server.url + "/metrics", timeout=30).text)
    return sum(v for n, labels, v in samples if n == name and labels.get("stage") == stage)


async def opened(conn, **session):
    assert (await next_event(conn)).type == "session.created"
    await conn.session.update(session={"type": "realtime", "max_output_tokens": MAX_TOKENS, **session})
    assert (await next_event(conn)).type == "session.updated"


MANUAL = {"audio": {"input": {"turn_detection": None}}}


async def commit_clip(conn, clip):
    await append_audio(conn, clip)
    await conn.input_audio_buffer.commit()
    for expected in ("input_audio_buffer.committed", "conversation.item.added", "conversation.item.done"):
        assert (await next_event(conn)).type == expected


def assert_spoken(answer):
    """Audio deltas (pcm16, 24 kHz) and the transcript, whose done event repeats its deltas."""
    assert answer.done.response.status in ("completed", "incomplete"), answer.done.response
    assert len(answer.audio) > 2 * 2400  # more than 100 ms of speech
    assert len(answer.audio) % 2 == 0
    done = next(e for e in answer.events if e.type == "response.output_audio_transcript.done")
    assert done.transcript == answer.transcript and answer.transcript
    assert answer.done.response.usage.output_tokens > 0


def test_a_text_turn_and_an_audio_turn_are_answered_with_speech(server):
    async def go():
        async with connect(server.url, MODEL) as conn:
            await opened(conn, **MANUAL)
            await conn.conversation.item.create(
                item={
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": "Tell me about the weather today."}],
                }
            )
            await next_event(conn), await next_event(conn)
            await conn.response.create()
            text_turn = await read_answer(conn)
            await commit_clip(conn, turn_clip(2.5, seed=11))
            await conn.response.create()
            return text_turn, await read_answer(conn)

    text_turn, audio_turn = run(go())
    assert_spoken(text_turn)
    assert_spoken(audio_turn)
    # The clip's ~2.5 s became audio tokens in the second prompt (12.5 per second after the
    # encoder), on top of the first turn and its answer.
    grew = audio_turn.done.response.usage.input_tokens - text_turn.done.response.usage.input_tokens
    assert grew >= MAX_TOKENS + 25


def test_server_vad_finds_the_speech_in_a_clip_and_answers_it(server):
    clip = np.concatenate([silence(1.0), speech(2.0, seed=1), silence(1.0)])

    async def go():
        async with connect(server.url, MODEL) as conn:
            await opened(conn, audio={"input": {"turn_detection": {"type": "server_vad", "silence_duration_ms": 500}}})
            await append_audio(conn, clip)
            vad = [await next_event(conn) for _ in range(5)]
            return vad, await read_answer(conn)

    vad, answer = run(go())
    assert [e.type for e in vad] == [
        "input_audio_buffer.speech_started",
        "input_audio_buffer.speech_stopped",
        "input_audio_buffer.committed",
        "conversation.item.added",
        "conversation.item.done",
    ]
    started, stopped = vad[0], vad[1]
    # Speech is at 1.0-3.0 s; the start includes prefix_padding_ms (300), the stop comes
    # silence_duration_ms (500) after the speech ends.
    assert 600 <= started.audio_start_ms <= 1100
    assert 3200 <= stopped.audio_end_ms <= 3900
    assert started.item_id == stopped.item_id == vad[2].item_id
    assert_spoken(answer)  # create_response: the committed speech was answered


def test_speech_during_an_answer_cancels_it_and_truncates_the_item(server):
    async def go():
        async with connect(server.url, MODEL) as conn:
            await opened(
                conn,
                audio={
                    "input": {
                        "turn_detection": {"type": "server_vad", "silence_duration_ms": 300, "create_response": False}
                    }
                },
            )
            await conn.conversation.item.create(
                item={
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": "Please tell me a long story."}],
                }
            )
            await next_event(conn), await next_event(conn)
            await conn.response.create()
            sent = {}

            async def interrupt(event, answer):
                if event.type == "response.output_audio.delta" and not sent:
                    sent["done"] = True
                    await append_audio(conn, np.concatenate([speech(1.0, seed=1), silence(0.6)]))

            answer = await read_answer(conn, on_event=interrupt)
            item_id = answer.done.response.output[0].id
            while (await next_event(conn)).type != "conversation.item.done":
                pass  # speech stopped, committed, added, done
            await conn.conversation.item.retrieve(item_id=item_id)
            return answer, await next_event(conn)

    answer, retrieved = run(go())
    types = answer.types
    started = types.index("input_audio_buffer.speech_started")
    assert "response.output_audio.delta" not in types[started:]
    response = answer.done.response
    assert response.status == "cancelled" and response.status_details.reason == "turn_detected"
    heard = retrieved.item.content[0].transcript or ""
    assert retrieved.type == "conversation.item.retrieved" and retrieved.item.status == "incomplete"
    # The item keeps what was heard: a prefix of the text the answer had streamed.
    assert answer.transcript.startswith(heard)
    assert response.output[0].content[0].transcript == heard


def talker_hits_after(server, before: float, expect_more: bool) -> float:
    """The talker's prefix-cache hit tokens once a turn is answered. A stage that misses a
    scrape keeps its last counters: where hits are expected, look again until they show."""
    end = time.monotonic() + 20
    while True:
        hits = stage_metric(server, "vllm:prefix_cache_hits_total", "talker")
        if hits > before or not expect_more or time.monotonic() > end:
            return hits
        time.sleep(0.2)


def test_later_turns_hit_the_caches_on_the_earlier_turns(server):
    block = server.orchestrator.config.stage("thinker").engine_args.block_size
    talker_block = server.orchestrator.config.stage("talker").engine_args.block_size

    async def go():
        usages, deltas = [], []
        async with connect(server.url, MODEL) as conn:
            await opened(conn, **MANUAL)
            for turn in range(3):
                before = await asyncio.to_thread(stage_metric, server, "vllm:prefix_cache_hits_total", "talker")
                await commit_clip(conn, turn_clip(3.0, seed=21 + turn))
                await conn.response.create()
                answer = await read_answer(conn)
                assert_spoken(answer)
                usages.append(answer.done.response.usage)
                after = await asyncio.to_thread(talker_hits_after, server, before, turn > 0)
                deltas.append(after - before)
        return usages, deltas

    usages, deltas = run(go())
    for prev, cur in zip(usages, usages[1:]):
        # Everything of the earlier turns (prompt and answer) except their last partial block:
        # vLLM caches full blocks only.
        earlier = prev.input_tokens + prev.output_tokens
        assert cur.input_token_details.cached_tokens >= earlier // block * block > 0
    # The talker's prompt holds the user turns: turns 2 and 3 each hit (at least a block) on the
    # earlier ones, counted over the turn itself.
    assert deltas[1] >= talker_block and deltas[2] >= talker_block, deltas


def test_an_image_turn_is_answered_and_the_next_turn_hits_the_caches_on_it(server):
    block = server.orchestrator.config.stage("thinker").engine_args.block_size
    # 128 x 96: 12 image tokens after the processor's 32-pixel patch x merge (no resize)
    image = {"type": "input_image", "image_url": png_data_url(128, 96, seed=5)}
    turns = [
        [image, {"type": "input_text", "text": "What is in this picture? Describe it."}],
        [{"type": "input_text", "text": "And what colours does it have?"}],
    ]

    async def go():
        usages, counters = [], []
        async with connect(server.url, MODEL) as conn:
            await opened(conn, **MANUAL)
            for content in turns:
                before = await asyncio.to_thread(image_counters, server)
                await conn.conversation.item.create(item={"type": "message", "role": "user", "content": content})
                added = await next_event(conn)
                assert added.type == "conversation.item.added", added
                assert (await next_event(conn)).type == "conversation.item.done"
                await conn.response.create()
                answer = await read_answer(conn)
                assert_spoken(answer)
                usages.append(answer.done.response.usage)
                after = await asyncio.to_thread(image_counters, server)
                counters.append([b - a for a, b in zip(before, after)])
        return usages, counters

    (first, second), (_, (encoder_runs, rows_served)) = run(go())
    assert first.input_tokens >= 12
    # The image turn is the next prompt's prefix: a hit on every full block of it, the image's
    # (the first block) included, its latents served from the hidden-state cache, and the image
    # not encoded again. (The answer is in the prompt as its transcript, which a random-weight
    # model's text need not re-tokenize to: the hit is counted up to the turn's prompt.)
    assert second.input_token_details.cached_tokens >= first.input_tokens // block * block >= block
    assert rows_served >= block
    assert encoder_runs == 0


def image_counters(server) -> tuple[float, float]:
    """The thinker's encoder runs and latent rows served from the hidden-state cache."""
    return (
        stage_metric(server, "omni_cache_stage_encoder_runs", "thinker"),
        stage_metric(server, "omni_cache_latent_rows_served_total", "thinker"),
    )


def test_bad_events_get_errors_and_the_session_goes_on(server):
    async def go():
        async with connect(server.url, MODEL) as conn:
            await opened(conn, **MANUAL)
            await conn.send(
                {
                    "type": "session.update",
                    "session": {"type": "realtime", "audio": {"output": {"voice": "alloy"}}},
                    "event_id": "ev_1",
                }
            )
            voice = await next_event(conn)
            await conn.input_audio_buffer.commit()
            empty = await next_event(conn)
            await conn.send({"type": "response.create", "response": {"output_modalities": ["video"]}})
            modality = await next_event(conn)
            await conn.conversation.item.create(
                item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hello?"}]}
            )
            await next_event(conn), await next_event(conn)
            await conn.response.create(response={"output_modalities": ["text"]})
            return voice, empty, modality, await read_answer(conn)

    voice, empty, modality, answer = run(go())
    assert voice.type == "error" and voice.error.param == "session.audio.output.voice"
    assert voice.error.event_id == "ev_1"
    assert empty.type == "error" and empty.error.code == "input_audio_buffer_commit_empty"
    assert modality.type == "error" and modality.error.param == "response.output_modalities.0"
    # A text response: text deltas, no audio.
    assert answer.text and not answer.audio
    assert "response.output_text.done" in answer.types


def test_a_turn_past_the_context_in_characters_fails_its_response_and_is_truncated_away(server):
    """A 1 MB text turn is refused from its length before it is tokenized (the response fails
    naming it); the next turn's truncation drops it like any turn over the context."""

    async def go():
        async with connect(server.url, MODEL) as conn:
            await opened(conn, **MANUAL)
            answers = []
            for text in ("word " * 200_000, "Hello?"):
                await conn.conversation.item.create(
                    item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}
                )
                await next_event(conn), await next_event(conn)
                await conn.response.create(response={"output_modalities": ["text"]})
                answers.append(await read_answer(conn))
            return answers

    too_long, after = run(go())
    response = too_long.done.response
    assert response.status == "failed", response
    assert "1000" in response.status_details.error.message and "characters" in response.status_details.error.message
    assert after.done.response.status in ("completed", "incomplete") and after.text


def test_a_client_gone_mid_answer_leaves_nothing_in_the_server(server):
    orch = server.orchestrator

    async def go():
        conn = await connect(server.url, MODEL).enter()
        await opened(conn, **MANUAL)
        await commit_clip(conn, turn_clip(2.0, seed=31))
        await conn.response.create()
        while (await next_event(conn)).type != "response.output_audio.delta":
            pass
        await conn.close()

    run(go())
    end = time.monotonic() + 60
    while True:
        running = sum(stage_metric(server, "vllm:num_requests_running", s) for s in ("thinker", "talker"))
        queued = sum(stage_metric(server, "omni_cache_stage_queue_depth", s) for s in ("thinker", "talker", "decoder"))
        if len(server.app.state.realtime_sessions) == 0 and orch.in_flight == 0 and running == 0 and queued == 0:
            break
        assert time.monotonic() < end, (len(server.app.state.realtime_sessions), orch.in_flight, running, queued)
        time.sleep(0.2)


INSTRUCTIONS = (
    "You are a voice assistant in a long conversation. Answer in a few words, and keep to the subject the user chose."
)
# Turns of the first part (clip path) and in all: each part reaches its truncation path at least
# three times (the first at turn 33, then every tenth turn; the second every few turns).
CLIP_TURNS = 64
LONG_TURNS = CLIP_TURNS + 32


def test_a_long_session_goes_on_past_the_clip_limit_and_the_context(server):
    """Text and 0.2 s audio turns, 96 of them: in the first 64 short text and audio turns
    alternate under ``truncation: auto`` (the thinker's 16 clips per prompt are passed at turn
    33, then every 10 turns: 0.75 of 16 clips kept); in the last 32 longer text turns with a clip
    every sixth under a retention ratio of 0.5 and a token limit (``post_instructions``, 600: the
    token path, passed every few turns; with the real 8192-token context this part took ~10
    minutes on a loaded 2-vCPU machine, and the fake pipeline's tests truncate at max_model_len).
    Every turn is answered; each turn after the first hits the prefix cache: on the whole
    previous prompt between truncations, on the instructions' blocks on a turn that truncated."""
    block = server.orchestrator.config.stage("thinker").engine_args.block_size
    half = CLIP_TURNS
    post_instructions = 600
    filler = " ".join(f"word{i}" for i in range(15))  # ~100 bytes

    def audio_turn(turn: int) -> bool:
        return turn % 2 == 1 if turn < half else turn % 6 == 5

    async def go():
        turns = []
        clips = []  # ids of the audio items the conversation holds, as the client sees it
        async with connect(server.url, MODEL) as conn:
            await opened(conn, instructions=INSTRUCTIONS, max_output_tokens=4, output_modalities=["text"], **MANUAL)
            for turn in range(LONG_TURNS):
                if turn == half:
                    await conn.session.update(
                        session={
                            "type": "realtime",
                            "truncation": {
                                "type": "retention_ratio",
                                "retention_ratio": 0.5,
                                "token_limits": {"post_instructions": post_instructions},
                            },
                        }
                    )
                    assert (await next_event(conn)).type == "session.updated"
                if audio_turn(turn):
                    await append_audio(conn, speech(0.2, seed=1000 + turn))
                    await conn.input_audio_buffer.commit()
                    committed = await next_event(conn, skip=("conversation.item.deleted",))
                    clips.append(committed.item_id)
                    await next_event(conn), await next_event(conn)  # item added, done
                else:
                    await conn.conversation.item.create(
                        item={
                            "type": "message",
                            "role": "user",
                            "content": [
                                {
                                    "type": "input_text",
                                    "text": f"Turn {turn}: what comes next?" + (" " + filler if turn >= half else ""),
                                }
                            ],
                        }
                    )
                    await next_event(conn, skip=("conversation.item.deleted",))
                    await next_event(conn)
                # Every fourth answer spoken, the rest text: both kinds of answer, turns kept short.
                await conn.response.create(response={"output_modalities": ["audio" if turn % 4 == 3 else "text"]})
                answer = await read_answer(conn)
                deleted = {e.item_id for e in answer.events if e.type == "conversation.item.deleted"}
                clips = [c for c in clips if c not in deleted]
                turns.append((answer.done.response, bool(deleted), len(clips)))
        return turns

    start = time.monotonic()
    turns = run_long(go())
    elapsed = time.monotonic() - start
    print(f"{LONG_TURNS} turns in {elapsed:.0f} s")
    tokenize = server.orchestrator.tokenize_messages
    user = {"role": "user", "content": "x"}
    system = len(tokenize([{"role": "system", "content": INSTRUCTIONS}, user])) - len(tokenize([user]))
    tail = 2 * len(tokenize([user])) - len(tokenize([user, user]))  # the generation prompt
    instructions_blocks = system // block * block
    truncated = 0
    for i, (response, dropped, n_clips) in enumerate(turns):
        assert response.status in ("completed", "incomplete"), (i, response.status_details)
        assert n_clips <= 16
        if i == 0:
            continue
        cached = response.usage.input_token_details.cached_tokens
        prev = turns[i - 1][0].usage.input_tokens
        if dropped:
            truncated += 1
            assert cached >= instructions_blocks > 0, (i, cached)
            assert response.usage.input_tokens < prev
        else:
            # The previous prompt is this one's start (but its generation prompt, when its answer
            # had no text): all its full blocks hit.
            assert cached >= (prev - tail) // block * block > 0, (i, cached, prev)
    first = [t for i, t in enumerate(turns) if i < half]
    second = [t for i, t in enumerate(turns) if i >= half]
    cut = [sum(dropped for _, dropped, _ in part) for part in (first, second)]
    longest = max(r.usage.input_tokens for r, _, _ in second)
    print(
        f"{truncated} truncations ({cut[0]} in the first half, {cut[1]} in the second); longest "
        f"prompt of the second half {longest} tokens"
    )
    # The first half reached the clip limit, the second the token limit, again and again; each
    # truncation left room for several turns.
    assert max(n for _, _, n in first) == 16 and cut[0] >= 3
    assert 0.5 * post_instructions < longest <= post_instructions + system + tail and cut[1] >= 3
    assert truncated <= LONG_TURNS // 6, truncated


def run_long(coro):
    return asyncio.run(asyncio.wait_for(coro, 900))
