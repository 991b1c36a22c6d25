"""Audio for the HTTP API: float waveforms -> 16-bit PCM and WAV files (stdlib ``wave``).

OpenAI's audio output is 24 kHz mono 16-bit PCM: a whole WAV file for a non-streamed answer,
raw little-endian PCM chunks for streamed deltas. The decoder stage produces float32 samples in
[-1, 1] at its own sample rate; :func:`to_pcm16` converts (resampling to 24 kHz when the stage's
rate differs) and :func:`encode_wav` wraps the result in a WAV container.
"""

from __future__ import annotations

import io
import wave

import numpy as np

__all__ = ["SAMPLE_RATE", "decode_wav", "encode_wav", "resample", "to_pcm16"]

#: The sample rate of every WAV/PCM the API returns (OpenAI's audio output format).
SAMPLE_RATE = 24000


def resample(samples: np.ndarray, src_rate: int, dst_rate: int = SAMPLE_RATE) -> np.ndarray:
    """Linear-interpolation resampling of a mono float waveform (a no-op when the rates match)."""
    samples = np.asarray(samples, dtype=np.float32).reshape(-1)
    if src_rate <= 0 or src_rate == dst_rate or samples.size == 0:
        return samples
    n_out = int(round(samples.size * dst_rate / src_rate))
    if n_out <= 0:
        return np.zeros(0, dtype=np.float32)
    src_t = np.arange(samples.size, dtype=np.float64) / src_rate
    dst_t = np.arange(n_out, dtype=np.float64) / dst_rate
    return np.interp(dst_t, src_t, samples).astype(np.float32)


def to_pcm16(samples: np.ndarray, sample_rate: int = SAMPLE_RATE) -> bytes:
    """Float samples (clipped to [-1, 1]) -> little-endian 16-bit PCM bytes at 24 kHz."""
    x = resample(samples, sample_rate, SAMPLE_RATE)
    x = np.nan_to_num(x, nan=0.0, posinf=1.0, neginf=-1.0)
    pcm = np.round(np.clip(x, -1.0, 1.0) * 32767.0).astype("<i2")
    return pcm.tobytes()


def encode_wav(samples: np.ndarray, sample_rate: int = SAMPLE_RATE) -> bytes:
    """A complete WAV file (24 kHz, mono, 16-bit PCM) holding ``samples``."""
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(SAMPLE_RATE)
        w.writeframes(to_pcm16(samples, sample_rate))
    return buf.getvalue()


def decode_wav(data: bytes) -> tuple[np.ndarray, int]:
    """``(float32 samples, sample_rate)`` of a mono 16-bit WAV (for tests and clients)."""
    with wave.open(io.BytesIO(data), "rb") as w:
        if w.getsampwidth() != 2 or w.getnchannels() != 1:
            raise ValueError(
                f"expected mono 16-bit PCM, got {w.getnchannels()} channel(s) of "
                f"{8 * w.getsampwidth()} bit"
            )
        frames = w.readframes(w.getnframes())
        rate = w.getframerate()
    return np.frombuffer(frames, dtype="<i2").astype(np.float32) / 32767.0, rate
