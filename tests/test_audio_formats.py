"""Audio output formats (OpenAI chat ``audio.format``): encoded by libsndfile, read back by a
decoder library at the right rate and length, through the openai SDK against the fake stages."""

from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import openai
import pytest
import soundfile
from test_server_unit import API_KEY, SAMPLES_PER_TOKEN, fake_server

from omni_cache.serving.audio_formats import FORMATS, UnsupportedFormat, check_format, encode_audio

RATE = 24000
#: libsndfile's name of each container, as the decoder reports it.
CONTAINER = {"wav": "WAV", "flac": "FLAC", "mp3": "MP3", "opus": "OGG"}


def decode(data: bytes, fmt: str) -> tuple[np.ndarray, int]:
    if fmt == "pcm16":
        return np.frombuffer(data, dtype="<i2").astype(np.float32) / 32767.0, RATE
    info = soundfile.info(io.BytesIO(data))
    assert info.format == CONTAINER[fmt] and info.channels == 1, info
    samples, rate = soundfile.read(io.BytesIO(data), dtype="float32")
    return samples, rate


def sine(n: int, rate: int = RATE, hz: float = 440.0) -> np.ndarray:
    return (0.5 * np.sin(2 * np.pi * hz * np.arange(n) / rate)).astype(np.float32)


def correlation(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_formats_are_openais_but_aac():
    assert set(FORMATS) == {"wav", "flac", "mp3", "opus", "pcm16"}
    with pytest.raises(UnsupportedFormat, match="'wav', 'flac', 'mp3', 'opus', 'pcm16'"):
        check_format("aac", stream=False)
    with pytest.raises(UnsupportedFormat, match="'pcm16'"):
        check_format("mp3", stream=True)
    assert check_format("pcm16", stream=True) == "pcm16"


@pytest.mark.parametrize("fmt", FORMATS)
def test_encode_roundtrip_at_24khz(fmt):
    x = sine(4800)
    y, rate = decode(encode_audio(x, RATE, fmt), fmt)
    assert rate == RATE and y.shape == x.shape
    if fmt in ("wav", "flac", "pcm16"):  # lossless 16-bit
        assert np.max(np.abs(x - y)) < 1e-4
    else:  # lossy: the same tone
        assert correlation(x, y) > 0.9


@pytest.mark.parametrize("fmt", FORMATS)
def test_other_rates_are_resampled_to_24khz(fmt):
    y, rate = decode(encode_audio(sine(1200, 12000), 12000, fmt), fmt)
    assert rate == RATE and len(y) == 2400


def test_out_of_range_samples_are_clipped_not_wrapped():
    y, _ = decode(encode_audio(np.array([2.0, -3.0, np.nan] * 100, np.float32), RATE, "flac"), "flac")
    assert np.max(y) > 0.99 and np.min(y) < -0.99 and np.all(np.abs(y) <= 1.0)


# ---- through the HTTP API and the openai SDK ----------------------------------------------------


@pytest.fixture(scope="module")
def srv():
    with fake_server("fmt") as server:
        yield server


@pytest.fixture
def oai(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=API_KEY, max_retries=0, timeout=30)


@pytest.mark.parametrize("fmt", FORMATS)
def test_openai_sdk_gets_each_format(srv, oai, fmt):
    max_tokens = 6
    r = oai.chat.completions.create(
        model=srv.orchestrator.served_model_name, messages=[{"role": "user", "content": "sing"}],
        max_tokens=max_tokens, modalities=["text", "audio"], audio={"voice": "default", "format": fmt})
    msg = r.choices[0].message
    assert msg.audio.transcript == msg.content
    samples, rate = decode(base64.b64decode(msg.audio.data), fmt)
    assert rate == RATE and len(samples) == max_tokens * SAMPLES_PER_TOKEN
    assert np.max(np.abs(samples)) > 0.3  # the fake decoder's sines, not silence


@pytest.mark.parametrize("fmt, stream, needle", [
    ("aac", False, "supported formats: 'wav', 'flac', 'mp3', 'opus', 'pcm16'"),
    ("ogg", False, "supported formats"),
    ("wav", True, "cannot be streamed"),
    ("mp3", True, "cannot be streamed"),
])
def test_unsupported_format_is_a_400_naming_the_supported_ones(srv, fmt, stream, needle):
    with httpx.Client(base_url=srv.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30) as http:
        payload = {"model": srv.orchestrator.served_model_name, "stream": stream, "max_tokens": 3,
                   "messages": [{"role": "user", "content": "x"}], "modalities": ["text", "audio"],
                   "audio": {"voice": "default", "format": fmt}}
        r = http.post("/v1/chat/completions", json=payload)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert needle in err["message"] and err["param"] == "audio.format"
        payload["audio"]["format"] = "pcm16"
        r = http.post("/v1/chat/completions", json=payload)  # still serving
        assert r.status_code == 200
