"""The Realtime API's audio formats: bytes on the WebSocket <-> float32 samples, and streaming
resampling between the client's rate and the rates the pipeline needs.

Three formats, as the API names them (``session.audio.input.format`` / ``.output.format``):

* ``audio/pcm``: 16-bit little-endian mono PCM at 24 kHz (the default);
* ``audio/pcmu`` / ``audio/pcma``: G.711 mu-law / A-law, one byte per sample at 8 kHz.

G.711 follows ITU-T G.711 as the classic Sun reference implements it (mu-law on the 14 most
significant bits with bias 0x84, A-law on 13 with even-bit inversion 0x55), so its bytes match
every telephony stack's (tests check them against CPython's ``audioop``). Decoding is a 256-entry
table; encoding a ``searchsorted`` over the segment ends.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["AudioFormat", "FORMATS", "PCM", "PCMA", "PCMU", "StreamResampler", "alaw_decode",
           "alaw_encode", "float_to_int16", "ulaw_decode", "ulaw_encode"]


@dataclass(frozen=True)
class AudioFormat:
    """One wire format: its API name and sample rate."""

    type: str
    rate: int

    @property
    def bytes_per_sample(self) -> int:
        return 2 if self.type == PCM.type else 1

    def decode(self, data: bytes) -> np.ndarray:
        """Wire bytes -> float32 samples in [-1, 1] at ``rate``; ValueError for a torn sample."""
        if self.type == PCM.type:
            if len(data) % 2:
                raise ValueError("audio/pcm data must be whole 16-bit samples (an even number of bytes)")
            return np.frombuffer(data, dtype="<i2").astype(np.float32) / 32768.0
        codes = np.frombuffer(data, dtype=np.uint8)
        linear = ulaw_decode(codes) if self.type == PCMU.type else alaw_decode(codes)
        return linear.astype(np.float32) / 32768.0

    def encode(self, samples: np.ndarray) -> bytes:
        """float32 samples at ``rate`` -> wire bytes."""
        pcm = float_to_int16(samples)
        if self.type == PCM.type:
            return pcm.astype("<i2").tobytes()
        codes = ulaw_encode(pcm) if self.type == PCMU.type else alaw_encode(pcm)
        return codes.tobytes()


PCM = AudioFormat("audio/pcm", 24000)
PCMU = AudioFormat("audio/pcmu", 8000)
PCMA = AudioFormat("audio/pcma", 8000)
FORMATS = {f.type: f for f in (PCM, PCMU, PCMA)}


def float_to_int16(samples: np.ndarray) -> np.ndarray:
    x = np.nan_to_num(np.asarray(samples, dtype=np.float32), nan=0.0, posinf=1.0, neginf=-1.0)
    return np.round(np.clip(x, -1.0, 32767 / 32768) * 32768.0).astype(np.int16)


# ---- G.711 mu-law ------------------------------------------------------------------------------

_ULAW_BIAS = 0x84
_ULAW_CLIP = 8159  # on the 14-bit magnitude
_ULAW_SEG_END = np.array([0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF, 0x1FFF], dtype=np.int32)


def ulaw_encode(pcm: np.ndarray) -> np.ndarray:
    """int16 samples -> mu-law bytes (uint8)."""
    v = np.asarray(pcm, dtype=np.int32) >> 2
    mask = np.where(v < 0, 0x7F, 0xFF)
    v = np.minimum(np.abs(v), _ULAW_CLIP) + (_ULAW_BIAS >> 2)
    seg = np.searchsorted(_ULAW_SEG_END, v, side="left")
    code = (np.minimum(seg, 7) << 4) | ((v >> (np.minimum(seg, 7) + 1)) & 0xF)
    code = np.where(seg >= 8, 0x7F, code)
    return (code ^ mask).astype(np.uint8)


def _ulaw_table() -> np.ndarray:
    u = ~np.arange(256, dtype=np.int32) & 0xFF
    t = (((u & 0x0F) << 3) + _ULAW_BIAS) << ((u & 0x70) >> 4)
    return np.where(u & 0x80, _ULAW_BIAS - t, t - _ULAW_BIAS).astype(np.int16)


_ULAW_TO_LINEAR = _ulaw_table()


def ulaw_decode(codes: np.ndarray) -> np.ndarray:
    """mu-law bytes -> int16 samples."""
    return _ULAW_TO_LINEAR[np.asarray(codes, dtype=np.uint8)]


# ---- G.711 A-law -------------------------------------------------------------------------------

_ALAW_SEG_END = np.array([0x1F, 0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF], dtype=np.int32)


def alaw_encode(pcm: np.ndarray) -> np.ndarray:
    """int16 samples -> A-law bytes (uint8)."""
    v = np.asarray(pcm, dtype=np.int32) >> 3
    mask = np.where(v >= 0, 0xD5, 0x55)
    v = np.where(v >= 0, v, -v - 1)
    seg = np.searchsorted(_ALAW_SEG_END, v, side="left")
    s = np.minimum(seg, 7)
    quant = np.where(s < 2, v >> 1, v >> np.maximum(s, 1)) & 0xF
    code = np.where(seg >= 8, 0x7F, (s << 4) | quant)
    return (code ^ mask).astype(np.uint8)


def _alaw_table() -> np.ndarray:
    a = np.arange(256, dtype=np.int32) ^ 0x55
    seg = (a & 0x70) >> 4
    t = ((a & 0x0F) << 4) + np.where(seg == 0, 8, 0x108)
    t = np.where(seg > 1, t << np.maximum(seg - 1, 0), t)
    return np.where(a & 0x80, t, -t).astype(np.int16)


_ALAW_TO_LINEAR = _alaw_table()


def alaw_decode(codes: np.ndarray) -> np.ndarray:
    """A-law bytes -> int16 samples."""
    return _ALAW_TO_LINEAR[np.asarray(codes, dtype=np.uint8)]


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
