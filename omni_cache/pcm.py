"""16-bit PCM for both APIs: float waveforms <-> int16 samples, and 24 kHz resampling by libsoxr.

One quantizer, :func:`to_int16`, serves the chat API (``pcm16`` deltas, and the samples its wav /
flac / mp3 / opus files are written from: :mod:`omni_cache.serving.audio_formats`) and the
Realtime API (``audio/pcm`` deltas, and the samples its G.711 bytes are coded from:
:mod:`omni_cache.serving.realtime.audio_codecs`), so the two APIs give the same waveform the same
bytes. :func:`from_int16` is its inverse for audio a client sends.

OpenAI's audio output is 24 kHz mono 16-bit PCM. The decoder stage produces float32 samples in
[-1, 1] at its own sample rate; when that is not 24 kHz the samples are resampled by libsoxr (the
``soxr`` package, which also resamples the audio prompts), whose band-limited filter removes what
lies above the new Nyquist frequency instead of folding it back into the audible band as
interpolation would.

A streamed answer's chunks go through one :class:`PcmStream`: one soxr stream carries the filter's
state across the chunks, so the concatenated chunks are the same samples as the whole answer
resampled at once (no clicks at the seams), and the samples the filter still holds at the end
come out of :meth:`PcmStream.flush`.
"""

from __future__ import annotations

import numpy as np
import soxr

__all__ = ["SAMPLE_RATE", "PcmStream", "from_int16", "pcm16", "resample", "to_int16", "to_pcm16"]

#: The sample rate of every file and PCM stream the API returns (OpenAI's audio output format).
SAMPLE_RATE = 24000

#: Full scale: float 1.0 is 2**15 steps, as libsndfile (and so soundfile) scales both ways.
_FULL_SCALE = 32768.0


def _mono(samples: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(samples, dtype=np.float32).reshape(-1))


def resample(samples: np.ndarray, src_rate: int, dst_rate: int = SAMPLE_RATE) -> np.ndarray:
    """A whole mono float waveform at ``dst_rate`` (the same array when the rates match)."""
    x = _mono(samples)
    if src_rate == dst_rate or x.size == 0:
        return x
    return soxr.resample(x, src_rate, dst_rate)


def to_int16(samples: np.ndarray) -> np.ndarray:
    """Float samples -> int16: x 32768, rounded to nearest, clipped to [-32768, 32767].

    libsndfile's convention (soundfile's float -> PCM_16 with its clipping on, the default): the
    scale is the one its PCM_16 reader divides by, so int16 -> float -> int16 is exact, and 1.0
    clips to 32767 while -1.0 reaches -32768. It rounds to nearest as libsndfile does since its
    commit d8c58ee ("float to int quantization should round to nearest"); the 1.2.2 in soundfile
    0.14's wheels still floors (at most one step lower), which is why the container files are
    written from these int16 samples rather than from floats. NaN is 0 and +-inf is full scale,
    where libsndfile would make NaN a full-scale negative click.
    """
    x = np.nan_to_num(_mono(samples), nan=0.0, posinf=1.0, neginf=-1.0)
    return np.clip(np.rint(x * _FULL_SCALE), -32768, 32767).astype(np.int16)


def from_int16(pcm: np.ndarray) -> np.ndarray:
    """int16 samples -> float32 in [-1, 1): the inverse of :func:`to_int16` (/ 32768, exact)."""
    return np.asarray(pcm, dtype=np.int16).astype(np.float32) / np.float32(_FULL_SCALE)


def pcm16(samples: np.ndarray) -> bytes:
    """Float samples as little-endian 16-bit PCM (:func:`to_int16`)."""
    return to_int16(samples).astype("<i2").tobytes()


def to_pcm16(samples: np.ndarray, sample_rate: int = SAMPLE_RATE) -> bytes:
    """A whole clip (float, mono, at ``sample_rate``) as 24 kHz 16-bit PCM bytes."""
    return pcm16(resample(samples, sample_rate))


class PcmStream:
    """One streamed answer's audio as 24 kHz pcm16 chunks, resampled by one soxr stream.

    The filter delays its output by a few milliseconds: a chunk may come out shorter than its
    input implies, and :meth:`flush` hands out the rest when the answer ends. Should the stage's
    rate change mid-answer, the stream of the old rate is flushed first.
    """

    def __init__(self) -> None:
        self._rate = SAMPLE_RATE
        self._stream: soxr.ResampleStream | None = None

    def chunk(self, samples: np.ndarray, sample_rate: int) -> bytes:
        """The pcm16 bytes of ``samples`` (at ``sample_rate``) that are ready."""
        head = self.flush() if sample_rate != self._rate else b""
        self._rate = sample_rate
        x = _mono(samples)
        if sample_rate == SAMPLE_RATE:
            return head + pcm16(x)
        if self._stream is None:
            self._stream = soxr.ResampleStream(sample_rate, SAMPLE_RATE, 1, dtype="float32")
        return head + pcm16(self._stream.resample_chunk(x))

    def flush(self) -> bytes:
        """What the filter still holds, as pcm16 bytes; the stream starts afresh after it."""
        if self._stream is None:
            return b""
        tail = self._stream.resample_chunk(np.zeros(0, np.float32), last=True)
        self._stream = None
        return pcm16(tail)
