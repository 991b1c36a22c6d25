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
from fake_pipeline import API_KEY, SAMPLES_PER_TOKEN, fake_server, sse_events

from omni_cache.pcm import PcmStream, from_int16, resample, to_pcm16
from omni_cache.serving.audio_formats import FORMATS, UnsupportedFormat, check_format, encode_audio
from omni_cache.serving.realtime.audio_codecs import PCM

RATE = 24000
#: libsndfile's name of each container, as the decoder reports it.
CONTAINER = {"wav": "WAV", "flac": "FLAC", "mp3": "MP3", "opus": "OGG"}


def decode(data: bytes, fmt: str) -> tuple[np.ndarray, int]:
    if fmt == "pcm16":
        return from_int16(np.frombuffer(data, dtype="<i2")), RATE
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


def amplitude_db(x: np.ndarray, rate: int, band: tuple[float, float] = (0.0, float("inf"))) -> float:
    """The largest sinusoid amplitude in ``band`` (Hz), in dB of full scale (Hann-windowed FFT:
    the abrupt start and end of a clip do not smear energy over the spectrum)."""
    window = np.hanning(len(x))
    spectrum = 2 * np.abs(np.fft.rfft(x.astype(np.float64) * window)) / window.sum()
    hz = np.fft.rfftfreq(len(x), 1 / rate)
    return float(20 * np.log10(spectrum[(hz >= band[0]) & (hz <= band[1])].max() + 1e-30))


def test_resampling_removes_what_lies_above_the_new_nyquist_and_keeps_the_rest():
    """24 kHz -> 16 kHz: a 10 kHz tone is above the new 8 kHz Nyquist frequency, so nothing of it
    may remain (interpolation folds it to 16 - 10 = 6 kHz at nearly full level); a 1 kHz tone
    keeps its level and frequency."""
    high, low = sine(24000, hz=10000.0), sine(24000, hz=1000.0)
    level = amplitude_db(high, RATE)  # 0.5 -> -6 dB
    assert amplitude_db(resample(high, RATE, 16000), 16000) < level - 60
    t_in, t_out = np.arange(24000) / RATE, np.arange(16000) / 16000
    assert amplitude_db(np.interp(t_out, t_in, high), 16000, (5900, 6100)) > level - 6  # what soxr avoids
    kept = resample(low, RATE, 16000)
    assert len(kept) == 16000
    assert abs(amplitude_db(kept, 16000, (990, 1010)) - amplitude_db(low, RATE)) < 0.01
    assert np.sum(kept.astype(np.float64) ** 2) / 16000 == pytest.approx(
        np.sum(low.astype(np.float64) ** 2) / 24000, rel=1e-3
    )  # the same power


def test_a_stream_resampled_chunk_by_chunk_is_the_whole_clip_resampled():
    """One soxr stream across the chunks: no seams, and flush() hands out what the filter held."""
    x = sine(16000, 16000)
    stream, pieces, start = PcmStream(), [], 0
    for size in (1, 240, 999, 4000, 3, 7000):  # uneven, as a decoder's chunks may be
        pieces.append(stream.chunk(x[start : start + size], 16000))
        start += size
    pieces.append(stream.chunk(x[start:], 16000))
    pieces.append(stream.flush())
    assert b"".join(pieces) == to_pcm16(x, 16000) and len(b"".join(pieces)) == 2 * 24000
    assert stream.flush() == b""
    # At 24 kHz nothing is held back; a change of rate flushes the old rate's stream first.
    assert stream.chunk(x[:100], RATE) == to_pcm16(x[:100])
    held = stream.chunk(x[:8000], 16000)
    assert held + stream.chunk(x[:10], RATE) == to_pcm16(x[:8000], 16000) + to_pcm16(x[:10])


def test_both_apis_and_the_files_quantize_a_waveform_alike():
    """One quantizer: the chat API's pcm16 (whole or streamed), the Realtime API's audio/pcm and the
    16-bit samples inside the chat API's wav and flac files are the same bytes, loud parts too."""
    x = np.concatenate([2.2 * sine(2400), np.random.default_rng(1).uniform(-1, 1, 2400)]).astype(np.float32)
    chat = encode_audio(x, RATE, "pcm16")
    assert chat == PCM.encode(x) == PcmStream().chunk(x, RATE)
    for fmt in ("wav", "flac"):
        samples, _ = soundfile.read(io.BytesIO(encode_audio(x, RATE, fmt)), dtype="int16")
        assert samples.astype("<i2").tobytes() == chat, fmt
    assert np.frombuffer(chat, "<i2").min() == -32768 and np.frombuffer(chat, "<i2").max() == 32767


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
        model=srv.orchestrator.served_model_name,
        messages=[{"role": "user", "content": "sing"}],
        max_tokens=max_tokens,
        modalities=["text", "audio"],
        audio={"voice": "default", "format": fmt},
    )
    msg = r.choices[0].message
    assert msg.audio.transcript == msg.content
    samples, rate = decode(base64.b64decode(msg.audio.data), fmt)
    assert rate == RATE and len(samples) == max_tokens * SAMPLES_PER_TOKEN
    assert np.max(np.abs(samples)) > 0.3  # the fake decoder's sines, not silence


def test_streamed_audio_at_another_rate_is_the_answers_audio_sample_for_sample():
    """A decoder at 16 kHz: the streamed pcm16 chunks, joined, are the non-streamed answer's pcm16
    (the stream resampled as one clip, the filter's tail sent before the finishing chunk)."""
    with (
        fake_server("rate16k", decoder_env='{FAKE_SAMPLE_RATE: "16000"}') as server,
        httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30) as http,
    ):
        body = {
            "model": server.orchestrator.served_model_name,
            "max_tokens": 8,
            "messages": [{"role": "user", "content": "sing"}],
            "modalities": ["text", "audio"],
            "audio": {"voice": "default", "format": "pcm16"},
        }
        whole = base64.b64decode(
            http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["audio"]["data"]
        )
        with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
            chunks = [c for c in sse_events(r.iter_lines())[:-1] if c["choices"]]
    audio = [i for i, c in enumerate(chunks) if "audio" in c["choices"][0]["delta"]]
    streamed = b"".join(base64.b64decode(chunks[i]["choices"][0]["delta"]["audio"]["data"]) for i in audio)
    assert len(whole) == 2 * 8 * SAMPLES_PER_TOKEN * 3 // 2 and streamed == whole
    assert audio[-1] < len(chunks) - 1 and chunks[-1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(
    "fmt, stream, needle",
    [
        ("aac", False, "supported formats: 'wav', 'flac', 'mp3', 'opus', 'pcm16'"),
        ("ogg", False, "supported formats"),
        ("wav", True, "cannot be streamed"),
        ("mp3", True, "cannot be streamed"),
    ],
)
def test_unsupported_format_is_a_400_naming_the_supported_ones(srv, fmt, stream, needle):
    with httpx.Client(base_url=srv.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30) as http:
        payload = {
            "model": srv.orchestrator.served_model_name,
            "stream": stream,
            "max_tokens": 3,
            "messages": [{"role": "user", "content": "x"}],
            "modalities": ["text", "audio"],
            "audio": {"voice": "default", "format": fmt},
        }
        r = http.post("/v1/chat/completions", json=payload)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert needle in err["message"] and err["param"] == "audio.format"
        payload["audio"]["format"] = "pcm16"
        r = http.post("/v1/chat/completions", json=payload)  # still serving
        assert r.status_code == 200
