"""The Realtime API's audio formats: bytes on the WebSocket <-> float32 samples, and streaming
resampling between the client's rate and the rates the pipeline needs.

Three formats, as the API names them (``session.audio.input.format`` / ``.output.format``):

* ``audio/pcm``: 16-bit little-endian mono PCM at 24 kHz (the default);
* ``audio/pcmu`` / ``audio/pcma``: G.711 mu-law / A-law, one byte per sample at 8 kHz.

Floats become 16-bit samples by the quantizer the chat API uses too
(:func:`omni_cache.pcm.to_int16`), so both APIs give a waveform the same PCM. G.711 is
libsndfile's (soundfile's headerless RAW ``ULAW`` / ``ALAW`` subtypes) applied to those 16-bit
samples: its decoding tables are ITU-T G.711's levels, and its encoder picks the level that
brackets each sample (tests check both against the standard's levels and CPython's ``audioop``).
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np
import soundfile

from omni_cache.pcm import from_int16, to_int16

__all__ = ["AudioFormat", "FORMATS", "PCM", "PCMA", "PCMU", "StreamResampler", "g711_decode", "g711_encode"]


@dataclass(frozen=True)
class AudioFormat:
    """One wire format: its API name, sample rate and libsndfile subtype (how a sample is coded)."""

    type: str
    rate: int
    subtype: str

    @property
    def bytes_per_sample(self) -> int:
        return 2 if self.subtype == "PCM_16" else 1

    def decode(self, data: bytes) -> np.ndarray:
        """Wire bytes -> float32 samples in [-1, 1] at ``rate``; ValueError for a torn sample."""
        if self.subtype == "PCM_16":
            if len(data) % 2:
                raise ValueError("audio/pcm data must be whole 16-bit samples (an even number of bytes)")
            return from_int16(np.frombuffer(data, dtype="<i2"))
        return from_int16(g711_decode(data, self.subtype))

    def encode(self, samples: np.ndarray) -> bytes:
        """float32 samples at ``rate`` -> wire bytes."""
        pcm = to_int16(samples)
        if self.subtype == "PCM_16":
            return pcm.astype("<i2").tobytes()
        return g711_encode(pcm, self.subtype)


PCM = AudioFormat("audio/pcm", 24000, "PCM_16")
PCMU = AudioFormat("audio/pcmu", 8000, "ULAW")
PCMA = AudioFormat("audio/pcma", 8000, "ALAW")
FORMATS = {f.type: f for f in (PCM, PCMU, PCMA)}


# ---- G.711 by libsndfile -----------------------------------------------------------------------
# libsndfile codes each law once over its whole domain (65,536 samples, 256 codes), through
# headerless RAW in memory; a chunk is then coded by looking its samples up. The answers are
# libsndfile's either way, but a soundfile call per 20 ms chunk costs 0.1-0.25 ms of setup (2-core
# AMD EPYC) where a lookup costs microseconds, and the input worker decodes every session's appends.


def _libsndfile_tables(subtype: str) -> tuple[np.ndarray, np.ndarray]:
    """(code of every int16 sample from -32768 up, int16 level of every code) for ``subtype``."""
    buf = io.BytesIO()
    soundfile.write(
        buf, np.arange(-32768, 32768, dtype=np.int16), 8000, format="RAW", subtype=subtype
    )  # RAW needs a rate; it plays no part in coding a sample
    levels, _ = soundfile.read(
        io.BytesIO(bytes(range(256))), format="RAW", subtype=subtype, samplerate=8000, channels=1, dtype="int16"
    )
    return np.frombuffer(buf.getvalue(), dtype=np.uint8), levels


# Built at import (a few ms), so no session's first chunk waits for them.
_TABLES = {law: _libsndfile_tables(law) for law in ("ULAW", "ALAW")}


def g711_encode(pcm: np.ndarray, subtype: str) -> bytes:
    """int16 samples -> G.711 bytes, ``subtype`` ``"ULAW"`` (mu-law) or ``"ALAW"`` (A-law)."""
    return _TABLES[subtype][0][np.asarray(pcm, dtype=np.int16).astype(np.int32) + 32768].tobytes()


def g711_decode(data: bytes, subtype: str) -> np.ndarray:
    """G.711 bytes (``subtype`` ``"ULAW"`` or ``"ALAW"``) -> int16 samples."""
    return _TABLES[subtype][1][np.frombuffer(data, dtype=np.uint8)]


# ---- resampling --------------------------------------------------------------------------------


class StreamResampler:
    """One direction of one session's audio resampled chunk by chunk with libsoxr's streaming
    resampler, so chunk boundaries leave no clicks (a whole-chunk resampler would restart its
    filter at each 20 ms append). A no-op when the rates match."""

    def __init__(self, in_rate: int, out_rate: int) -> None:
        self.in_rate, self.out_rate = in_rate, out_rate
        self._stream = None
        if in_rate != out_rate:
            import soxr

            self._stream = soxr.ResampleStream(in_rate, out_rate, 1, dtype="float32", quality="HQ")

    def __call__(self, samples: np.ndarray, last: bool = False) -> np.ndarray:
        x = np.ascontiguousarray(samples, dtype=np.float32)
        if self._stream is None:
            return x
        return np.asarray(self._stream.resample_chunk(x, last=last), dtype=np.float32)
