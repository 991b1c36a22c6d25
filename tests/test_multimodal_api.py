"""Images and audio through the HTTP API, with the official `openai` client, on the Qwen3-Omni thinker
pipeline (stage_configs/qwen3_omni_thinker.yaml: the tiny Qwen3-Omni checkpoint, a real stage process,
real ZMQ and HTTP).

What a client sees: chats with an image, an audio clip at 44.1 kHz and both are answered; the same
image again is a prefix hit that covers the image's tokens (``cached_tokens``) and does not run the
encoder again (``omni_cache_stage_encoder_runs``); every kind of bad media is a 400 naming the
content part, and the server keeps serving. Row-level correctness of the cached multimodal latents is
tests/test_multimodal_cache.py.
"""

from __future__ import annotations

import re

import httpx
import pytest
from media_samples import clip_b64, png_data_url
from served_config import write_pipeline_config
from shared_forkers import shared_forkers

from omni_cache.config import load_config
from omni_cache.runtime.orchestrator import Orchestrator
from omni_cache.serving.server import ServerThread

pytestmark = pytest.mark.vllm

CONTEXT = "Please look at this carefully; every question about it repeats this sentence. " * 2


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = write_pipeline_config(tmp_path_factory.mktemp("cfg"), "mm", "qwen3_omni_thinker.yaml")
    orch = Orchestrator(load_config(path), echo_stage_logs=False, stage_forkers=shared_forkers())
    srv = ServerThread(orch).start()
    srv.wait_ready(600)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def image(seed: int = 0) -> dict:
    # 128 x 96 is a multiple of the processor's 32-pixel patch x merge: 12 image tokens, no resize
    return {"type": "image_url", "image_url": {"url": png_data_url(128, 96, seed)}}


def audio(seed: int = 0, fmt: str = "wav") -> dict:
    data = clip_b64(1.0, 44100, freq=300 + 50 * seed, fmt=fmt.upper())
    return {"type": "input_audio", "input_audio": {"data": data, "format": fmt}}


def text(t: str) -> dict:
    return {"type": "text", "text": t}


def ask(client, parts: list[dict], max_tokens: int = 4):
    return client.chat.completions.create(
        model="mm", messages=[{"role": "user", "content": parts}], max_tokens=max_tokens
    )


def encoder_runs(server) -> float:
    body = httpx.get(server.url + "/metrics", timeout=30).text
    m = re.search(r'^omni_cache_stage_encoder_runs\{[^}]*stage="thinker"[^}]*\} (\S+)$', body, re.M)
    assert m, "no encoder_runs sample for the thinker in /metrics"
    return float(m.group(1))


@pytest.mark.parametrize(
    "parts",
    [
        [image(1), text("What is in the image?")],
        [audio(1), text("What do you hear?")],
        [image(2), audio(2), text("Describe both.")],
        [audio(3, "mp3"), text("And this one?")],
    ],
    ids=["image", "audio-44k", "both", "audio-mp3"],
)
def test_media_chats_are_answered(client, parts):
    r = ask(client, parts)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 4
    only_text = ask(client, [p for p in parts if p["type"] == "text"])
    # The placeholders were expanded to the media's tokens (>= 1 each beyond the 3 marker tokens).
    media = len(parts) - 1
    assert r.usage.prompt_tokens >= only_text.usage.prompt_tokens + 4 * media


def test_the_same_image_again_is_a_prefix_hit_without_the_encoder(client, server):
    img = image(7)
    first = ask(client, [img, text(CONTEXT + "First question?")])
    runs = encoder_runs(server)
    second = ask(client, [img, text(CONTEXT + "Another, different question?")])
    assert encoder_runs(server) == runs, "the encoder ran again for a cached image"
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    # The image's tokens end 6 + (prompt with the image - prompt without it) tokens in:
    # "<|im_start|>user\n" is 6 tokens, then the markers and the expanded image.
    without = ask(client, [text(CONTEXT + "Another, different question?")])
    image_end = 6 + second.usage.prompt_tokens - without.usage.prompt_tokens
    assert second.usage.prompt_tokens_details.cached_tokens >= image_end
    assert encoder_runs(server) == runs


@pytest.mark.parametrize(
    "part, status, param, words",
    [
        (
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,bm90IGFuIGltYWdl"}},
            400,
            "messages.0.content.0.image_url.url",
            "could not be decoded",
        ),
        (
            {"type": "image_url", "image_url": {"url": "file:///etc/passwd"}},
            400,
            "messages.0.content.0.image_url.url",
            "scheme file:",
        ),
        (
            {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},
            400,
            "messages.0.content.0.image_url.url",
            "allowed_url_hosts",
        ),
        ({"type": "image_url"}, 400, "messages.0.content.0.image_url", "needs 'image_url'"),
        (
            {"type": "input_audio", "input_audio": {"data": clip_b64(), "format": "flac"}},
            400,
            "messages.0.content.0.input_audio.format",
            "not supported",
        ),
        (
            {"type": "input_audio", "input_audio": {"data": "%%%", "format": "wav"}},
            400,
            "messages.0.content.0.input_audio.data",
            "base64",
        ),
        (
            {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}},
            400,
            "messages.0.content.0.video_url.url",
            "video could not be read",
        ),
        (  # 5 ms: the stage's processor failed on it, its 400 a dump of the array
            {"type": "input_audio", "input_audio": {"data": clip_b64(0.005, 16000), "format": "wav"}},
            400,
            "messages.0.content.0.input_audio",
            "is 5.0 ms long; at least 25 ms",
        ),
        (  # the stage's processor refused it with no param and the image's repr
            {"type": "image_url", "image_url": {"url": png_data_url(1, 300)}},
            400,
            "messages.0.content.0.image_url.url",
            "one side 300 times the other; at most 200",
        ),
    ],
    ids=["corrupt-image", "file-url", "remote-url", "no-url", "flac", "bad-base64", "video", "short-audio", "thin"],
)
def test_bad_media_is_a_400_and_the_server_keeps_serving(server, client, part, status, param, words):
    r = httpx.post(
        server.url + "/v1/chat/completions",
        timeout=60,
        json={"model": "mm", "messages": [{"role": "user", "content": [part, text("hi")]}], "max_tokens": 2},
    )
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err
    assert ask(client, [image(0), text("still serving?")], max_tokens=2).choices[0].message.content is not None


def test_too_many_items_is_a_400(server):
    parts = [image(i) for i in range(9)] + [text("so many")]
    r = httpx.post(
        server.url + "/v1/chat/completions",
        timeout=60,
        json={"model": "mm", "messages": [{"role": "user", "content": parts}], "max_tokens": 2},
    )
    assert r.status_code == 400 and "server.media.max_items" in r.json()["error"]["message"], r.text


def test_more_images_than_the_engine_takes_is_a_400_from_the_stage(server, client):
    # limit_mm_per_prompt allows 4 images: vLLM refuses the fifth in the stage, for this request alone
    parts = [image(i) for i in range(5)] + [text("five")]
    r = httpx.post(
        server.url + "/v1/chat/completions",
        timeout=60,
        json={"model": "mm", "messages": [{"role": "user", "content": parts}], "max_tokens": 2},
    )
    assert r.status_code == 400, r.text
    assert "thinker" in r.json()["error"]["message"]
    assert ask(client, [text("and a plain question")], max_tokens=2).usage.completion_tokens == 2
