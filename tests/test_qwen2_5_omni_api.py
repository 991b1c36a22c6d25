"""Qwen2.5-Omni served (stage_configs/qwen2_5_omni.yaml on the tiny checkpoint) through real HTTP and the
official `openai` SDK: a shared-prefix workload reports `cached_tokens` and the hidden-state rows the
thinker's cache served, the talker's own prefix cache hits on repeats; `audio.voice` picks one of the
checkpoint's speakers; streamed speech arrives as pcm16 chunks; a realtime session answers a spoken
turn in the chosen voice; bad input to the new stages (a clip over the limits, a video without frames,
a voice the checkpoint does not have) is a 400 naming the problem and the next request is answered."""

from __future__ import annotations

import asyncio
import base64
import io
import re
import wave

import httpx
import pytest
import yaml
from media_samples import clip_b64, png_data_url, video_bytes
from served_config import served, system_prompt, write_pipeline_config

pytestmark = pytest.mark.vllm

NAME = "q25api"
LIMITS = {"max_audio_seconds": 4.0, "max_video_seconds": 10.0}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cfg")
    data = yaml.safe_load(write_pipeline_config(tmp, NAME, "qwen2_5_omni.yaml").read_text())
    data["server"].setdefault("media", {}).update(LIMITS)
    for stage in data["stages"]:
        if stage["name"] == "talker":
            stage["sampling"]["max_tokens"] = 48
    with served(data, tmp) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def metric(server, name: str, stage: str) -> float:
    body = httpx.get(server.url + "/metrics", timeout=30).text
    pattern = rf'^{re.escape(name)}(?:_total)?\{{[^}}]*stage="{stage}"[^}}]*\}} (\S+)$'
    return sum(float(v) for v in re.findall(pattern, body, re.M))


def wav_frames(b64: str) -> int:
    with wave.open(io.BytesIO(base64.b64decode(b64))) as w:
        assert w.getframerate() == 24000
        return w.getnframes()


def speak(client, content, voice: str = "default", max_tokens: int = 8):
    return client.chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": content}],
        max_tokens=max_tokens,
        modalities=["text", "audio"],
        audio={"voice": voice, "format": "wav"},
    )


def test_a_shared_prefix_is_served_from_both_caches(client, server):
    system = system_prompt(1200, seed=11)
    rows_before = metric(server, "omni_cache_latent_rows_served", "thinker")
    talker_before = metric(server, "vllm:prefix_cache_hits", "talker")
    cached = []
    for question in ("What is the first thing?", "And the second thing?", "What is the first thing?"):
        r = client.chat.completions.create(
            model=NAME,
            messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
            max_tokens=8,
            modalities=["text", "audio"],
            audio={"voice": "default", "format": "wav"},
        )
        assert wav_frames(r.choices[0].message.audio.data) > 0
        cached.append(r.usage.prompt_tokens_details.cached_tokens)
    assert cached[0] == 0 and min(cached[1:]) >= 1024, cached
    assert metric(server, "omni_cache_latent_rows_served", "thinker") - rows_before >= 2 * 1024
    # The talker's prompt is the thinker's rows: served bitwise from the cache, they repeat exactly,
    # and the talker's own prefix cache hits (the repeated question: through its whole prompt).
    assert metric(server, "vllm:prefix_cache_hits", "talker") - talker_before >= 2 * 1024


def test_voices_choose_the_speaker(client):
    chelsie = speak(client, "Say hello.", "chelsie").choices[0].message.audio.data
    ethan = speak(client, "Say hello.", "Ethan").choices[0].message.audio.data
    default = speak(client, "Say hello.").choices[0].message.audio.data
    assert default == chelsie  # the checkpoint's default speaker
    assert ethan != chelsie


def test_models_lists_the_pipeline_and_a_stream_brings_pcm16(client):
    assert [m.id for m in client.models.list().data] == [NAME]
    chunks, audio = 0, 0
    stream = client.chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": "Tell me about the sea."}],
        max_tokens=8,
        modalities=["text", "audio"],
        audio={"voice": "ethan", "format": "pcm16"},
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        for choice in chunk.choices:
            piece = getattr(choice.delta, "audio", None)
            data = getattr(piece, "data", None) or (piece.get("data") if isinstance(piece, dict) else None)
            if data:
                audio += len(base64.b64decode(data))
                chunks += 1
    assert audio > 0 and audio % 2 == 0 and chunks >= 1


def image_part() -> dict:
    return {"type": "image_url", "image_url": {"url": png_data_url(84, 56, 3)}}


def audio_part(seconds: float) -> dict:
    return {"type": "input_audio", "input_audio": {"data": clip_b64(seconds, 16000), "format": "wav"}}


def video_part(data: bytes) -> dict:
    return {"type": "video_url", "video_url": {"url": "data:video/mp4;base64," + base64.b64encode(data).decode()}}


def test_image_audio_and_video_are_answered_with_speech(client):
    for part in (image_part(), audio_part(1.0), video_part(video_bytes(audio_s=2.0, seed=2))):
        r = speak(client, [part, {"type": "text", "text": "What is this?"}])
        assert r.usage.completion_tokens == 8 and wav_frames(r.choices[0].message.audio.data) > 0


BAD = {
    "clip-over-the-limit": (lambda: [audio_part(6.0)], "server.media.max_audio_seconds", None),
    "video-without-frames": (
        lambda: [video_part(base64.b64decode(clip_b64(1.0, 16000)))],
        "no video stream",
        None,
    ),
    "unknown-voice": (lambda: "hi", "'nova' is not available", "nova"),
}


@pytest.mark.parametrize("kind", sorted(BAD))
def test_bad_input_is_a_400_naming_it_and_the_next_request_is_answered(server, client, kind):
    make, words, voice = BAD[kind]
    r = httpx.post(
        server.url + "/v1/chat/completions",
        timeout=120,
        json={
            "model": NAME,
            "messages": [{"role": "user", "content": make()}],
            "max_tokens": 2,
            "modalities": ["text", "audio"],
            "audio": {"voice": voice or "default", "format": "wav"},
        },
    )
    assert r.status_code == 400, r.text
    assert words in r.json()["error"]["message"], r.json()
    ok = speak(client, "ok?", max_tokens=2)
    assert ok.usage.completion_tokens == 2 and wav_frames(ok.choices[0].message.audio.data) > 0


def test_a_realtime_session_speaks_in_the_chosen_voice(server):
    from benchmarks.realtime_client import connect, next_event, read_answer

    async def go():
        async with connect(server.url, NAME) as conn:
            assert (await next_event(conn)).type == "session.created"
            session = {"type": "realtime", "max_output_tokens": 6, "audio": {"output": {"voice": "Ethan"}}}
            await conn.session.update(
                session={**session, "audio": {**session["audio"], "input": {"turn_detection": None}}}
            )
            updated = await next_event(conn)
            assert updated.type == "session.updated" and updated.session.audio.output.voice == "ethan"
            text = [{"type": "input_text", "text": "Tell me about the weather today."}]
            await conn.conversation.item.create(item={"type": "message", "role": "user", "content": text})
            await next_event(conn), await next_event(conn)
            await conn.response.create()
            answer = await read_answer(conn)
            await conn.session.update(session={"type": "realtime", "audio": {"output": {"voice": "nova"}}})
            refused = await next_event(conn)
            return answer, refused

    answer, refused = asyncio.run(go())
    assert answer.done.response.status in ("completed", "incomplete") and len(answer.audio) > 0
    assert refused.type == "error" and "'nova' is not available" in refused.error.message
