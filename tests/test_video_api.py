"""Video through the HTTP API with the official `openai` client, on the shipped Qwen3-Omni pipeline
(stage_configs/qwen3_omni.yaml: tiny checkpoint, thinker -> talker -> code2wav, real stage
processes, ZMQ and HTTP), with small ``server.media`` video limits so that each is reachable,
and the talker capped at TALKER_CODES codes an answer (the tiny checkpoint's random talker never
writes its end of speech: uncapped, every spoken answer was the shipped 1,024 codes, 82 s of
audio, ~8 s of CPU). Where only token counts are asserted, the answer is text alone.

What a client sees: a video (with its sound track, ``use_audio_in_video`` by default, and without)
is answered with text and speech, streamed and not; the same video again is a prefix hit past
the video (``cached_tokens``), its hidden-state rows are served from the cache and the talker hits
too, and the answers equal a cache-off pipeline's; every kind of bad video is a 400 naming the
limit or the problem and its content part, and the server answers the next request.
Parity with transformers' reference is tests/test_qwen3_omni_pipeline.py.
"""

from __future__ import annotations

import base64
import re

import httpx
import pytest
import yaml
from media_samples import clip_b64, png_data_url, video_bytes
from served_config import served, write_pipeline_config

pytestmark = pytest.mark.vllm

NAME = "video"
CONTEXT = "Watch this clip closely; every question about it repeats this sentence. " * 2
LIMITS = {
    "max_video_bytes": 300_000,
    "max_video_seconds": 10.0,
    "max_video_frames": 100,
    "max_video_frame_pixels": 96 * 64 * 4,
    "max_video_audio_seconds": 5.0,
}


#: Codes of one spoken answer (the talker's ``sampling.max_tokens``): 5.12 s of audio, more than
#: the stages' pacing lead (3 s), four decoder windows of 16 codes.
TALKER_CODES = 64

#: Decoded media all requests in flight may hold: a 2 s clip of 96x64 reserves ~0.2 MB.
MEDIA_BOUND = 1_000_000


def pipeline_config(tmp, *, prefix_cache: bool = True) -> dict:
    data = yaml.safe_load(
        write_pipeline_config(tmp, NAME if prefix_cache else NAME + "-off", "qwen3_omni.yaml").read_text()
    )
    data["server"].setdefault("media", {}).update(LIMITS)
    data["server"]["max_media_bytes_in_flight"] = MEDIA_BOUND
    for stage in data["stages"]:
        if stage["name"] == "talker":
            stage["sampling"]["max_tokens"] = TALKER_CODES
        if not prefix_cache and stage["name"] in ("thinker", "talker"):
            stage["prefix_cache"] = False
    return data


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cfg")
    with served(pipeline_config(tmp), tmp) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def video_part(data: bytes) -> dict:
    return {"type": "video_url", "video_url": {"url": "data:video/mp4;base64," + base64.b64encode(data).decode()}}


def clip(seed: int = 0, audio: bool = True) -> dict:
    """16 frames of 96x64 at 8 fps (2 s; 4 frames sampled) and a 2 s sound track."""
    return video_part(video_bytes(audio_s=2.0 if audio else None, seed=seed))


def text(t: str) -> dict:
    return {"type": "text", "text": t}


def speak(client, parts: list[dict], use_audio_in_video: bool | None = None, **kwargs):
    """A spoken answer (text and wav) of 6 tokens."""
    return ask(
        client,
        parts,
        use_audio_in_video,
        modalities=["text", "audio"],
        audio={"voice": "default", "format": "wav"},
        **kwargs,
    )


def ask(client, parts: list[dict], use_audio_in_video: bool | None = None, **kwargs):
    """A text answer of 6 tokens (where only token counts are asserted: the thinker alone, no
    talker and decoder run)."""
    extra = (
        {}
        if use_audio_in_video is None
        else {"extra_body": {"mm_processor_kwargs": {"use_audio_in_video": use_audio_in_video}}}
    )
    return client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": parts}], max_tokens=6, **extra, **kwargs
    )


def metric(server, name: str, stage: str) -> float:
    body = httpx.get(server.url + "/metrics", timeout=30).text
    pattern = rf'^{re.escape(name)}(?:_total)?\{{[^}}]*stage="{stage}"[^}}]*\}} (\S+)$'
    return sum(float(v) for v in re.findall(pattern, body, re.M))


@pytest.mark.parametrize("with_sound", [True, False], ids=["sound-track", "frames-only"])
def test_a_video_is_answered_with_text_and_speech(client, with_sound):
    with_video = speak(client, [clip(1, audio=with_sound), text("What happens?")])
    choice = with_video.choices[0]
    assert with_video.usage.completion_tokens == 6
    assert choice.message.audio is not None and len(base64.b64decode(choice.message.audio.data)) > 44
    without = ask(client, [text("What happens?")])
    # The placeholder grew into the video's tokens: 4 frames of at least 131,072 pixels each
    # (the processor's per-frame minimum) in temporal pairs, 2 x 280 tokens, plus the track's.
    assert with_video.usage.prompt_tokens >= without.usage.prompt_tokens + 280


def test_a_streamed_video_answer_is_the_same_answer_as_a_whole_one(client):
    """Greedy: the streamed answer's text, tokens and audio (pcm16, its chunks joined) are those of
    the same request answered whole, and there is speech at all (a 6-token answer)."""
    request = {
        "model": NAME,
        "messages": [{"role": "user", "content": [clip(2), text("Describe it.")]}],
        "max_tokens": 6,
        "temperature": 0.0,
        "modalities": ["text", "audio"],
        "audio": {"voice": "default", "format": "pcm16"},
        "extra_body": {"return_token_ids": True},
    }
    stream = client.chat.completions.create(**request, stream=True, stream_options={"include_usage": True})
    streamed_text, token_ids, pcm, usage, finish = "", [], b"", None, None
    for chunk in stream:
        usage = chunk.usage or usage
        if chunk.choices:
            choice = chunk.choices[0]
            delta = choice.delta
            streamed_text += delta.content or ""
            token_ids += (choice.model_extra or {}).get("token_ids") or []
            finish = choice.finish_reason or finish
            audio = getattr(delta, "audio", None) or (delta.model_extra or {}).get("audio")
            if audio:
                pcm += base64.b64decode(audio["data"] if isinstance(audio, dict) else audio.data)
    whole = client.chat.completions.create(**request)
    choice = whole.choices[0]
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens == 6
    assert usage.prompt_tokens == whole.usage.prompt_tokens
    assert len(token_ids) == 6 and token_ids == choice.model_extra["token_ids"]
    assert streamed_text == choice.message.content and finish == choice.finish_reason == "length"
    whole_pcm = base64.b64decode(choice.message.audio.data)
    assert len(pcm) > 0 and len(pcm) % 2 == 0
    assert len(pcm) == len(whole_pcm), "streamed and whole audio differ in length"
    first_diff = next((i for i, (a, b) in enumerate(zip(pcm, whole_pcm)) if a != b), None)
    assert first_diff is None, f"streamed audio differs from the whole answer's from byte {first_diff}"


def test_the_same_video_again_hits_every_cache_and_equals_the_cache_off_answer(client, server, tmp_path_factory):
    parts = [clip(3), text(CONTEXT + "What moves first?")]
    first = speak(client, parts)
    rows, talker_hits = (
        metric(server, "omni_cache_latent_rows_served", "thinker"),
        metric(server, "vllm:prefix_cache_hits_total", "talker"),
    )
    second = speak(client, parts)
    without = ask(client, [text(CONTEXT + "What moves first?")])
    # "<|im_start|>user\n" is 6 tokens; then the video's expansion (its tokens, its track's).
    video_end = 6 + second.usage.prompt_tokens - without.usage.prompt_tokens
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens >= video_end
    assert metric(server, "omni_cache_latent_rows_served", "thinker") - rows >= video_end
    assert metric(server, "vllm:prefix_cache_hits_total", "talker") > talker_hits
    assert second.choices[0].message.content == first.choices[0].message.content
    assert second.choices[0].message.audio.data == first.choices[0].message.audio.data
    tmp = tmp_path_factory.mktemp("cfg-off")
    from openai import OpenAI

    with served(pipeline_config(tmp, prefix_cache=False), tmp) as off:
        answer = OpenAI(base_url=off.url + "/v1", api_key="unused", max_retries=0, timeout=300).chat.completions.create(
            model=NAME + "-off",
            messages=[{"role": "user", "content": parts}],
            max_tokens=6,
            modalities=["text", "audio"],
            audio={"voice": "default", "format": "wav"},
        )
    assert answer.usage.prompt_tokens_details is None or not answer.usage.prompt_tokens_details.cached_tokens
    assert answer.choices[0].message.content == second.choices[0].message.content
    assert answer.choices[0].message.audio.data == second.choices[0].message.audio.data


def _wav_b64() -> str:
    return clip_b64(1.0, 16000)


BAD = {
    "too-many-bytes": (lambda: video_part(video_bytes() + bytes(400_000)), "server.media.max_video_bytes"),
    "frame-too-large": (lambda: video_part(video_bytes(frames=4, w=256, h=128)), "server.media.max_video_frame_pixels"),
    "too-many-frames": (
        lambda: video_part(video_bytes(frames=120, w=32, h=32, fps=60)),
        "server.media.max_video_frames",
    ),
    "too-long": (lambda: video_part(video_bytes(frames=12, w=32, h=32, fps=1)), "server.media.max_video_seconds"),
    "sound-track-too-long": (lambda: video_part(video_bytes(audio_s=8.0)), "server.media.max_video_audio_seconds"),
    "corrupt-stream": (lambda: video_part(video_bytes(faststart=True)[:1200]), "corrupt"),
    "zero-length": (lambda: {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,"}}, "empty"),
    "not-a-video": (lambda: video_part(b"this is a text file, not a video at all\n" * 20), "could not be read"),
    "audio-only-file": (lambda: video_part(base64.b64decode(_wav_b64())), "no video stream"),
    "an-image": (
        lambda: {
            "type": "video_url",
            "video_url": {"url": png_data_url(64, 48).replace("data:image/png", "data:video/mp4")},
        },
        "video",
    ),
    "bad-base64": (lambda: {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,%%%"}}, "base64"),
    "remote-url": (
        lambda: {"type": "video_url", "video_url": {"url": "https://example.com/a.mp4"}},
        "allowed_url_hosts",
    ),
}


@pytest.mark.parametrize("kind", sorted(BAD))
def test_a_bad_video_is_a_400_and_the_server_keeps_serving(server, client, kind):
    make, words = BAD[kind]
    r = httpx.post(
        server.url + "/v1/chat/completions",
        timeout=120,
        json={"model": NAME, "messages": [{"role": "user", "content": [make(), text("hi")]}], "max_tokens": 2},
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "messages.0.content.0.video_url.url" and words in err["message"], err
    ok = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": [clip(0), text("ok?")]}], max_tokens=2
    )
    assert ok.usage.completion_tokens == 2


def test_a_video_decoding_past_the_media_bound_is_refused_before_it_is_decoded(server, client):
    """10 s of 192x128 (20 sampled frames, 1.5 MB decoded) with a 4.5 s track, each within its
    server.media limit, reserve more than the server's media bound from the header: 413, nothing
    decoded, and the next request is served."""
    big = video_part(video_bytes(frames=80, w=192, h=128, fps=8, audio_s=4.5, noise=False))
    r = httpx.post(
        server.url + "/v1/chat/completions",
        timeout=120,
        json={"model": NAME, "messages": [{"role": "user", "content": [big, text("hi")]}], "max_tokens": 2},
    )
    assert r.status_code == 413, r.text
    assert "server.max_media_bytes_in_flight" in r.json()["error"]["message"]
    assert ask(client, [clip(6), text("and this one?")]).usage.completion_tokens == 6


def test_use_audio_in_video_that_cannot_be_honoured_is_a_400(server, client):
    r = httpx.post(
        server.url + "/v1/chat/completions",
        timeout=120,
        json={
            "model": NAME,
            "messages": [{"role": "user", "content": [clip(4, audio=False), text("hi")]}],
            "max_tokens": 2,
            "mm_processor_kwargs": {"use_audio_in_video": True},
        },
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "mm_processor_kwargs.use_audio_in_video" and "no sound track" in err["message"]
    # By default the same video's frames go alone; with the track switched off, a video that has
    # one is answered from its frames only (fewer prompt tokens).
    assert ask(client, [clip(4, audio=False), text("hi")]).usage.completion_tokens == 6
    with_track = ask(client, [clip(5), text("hi")])
    frames_only = ask(client, [clip(5), text("hi")], use_audio_in_video=False)
    assert frames_only.usage.prompt_tokens < with_track.usage.prompt_tokens
