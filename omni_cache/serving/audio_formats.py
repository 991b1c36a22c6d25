"""The audio output formats of the chat API, as OpenAI's chat completions define them.

``audio.format`` is one of ``wav``, ``flac``, ``mp3``, ``opus`` (in an Ogg container) or ``pcm16``
(raw little-endian 16-bit samples, no header). Everything is 24 kHz mono: the decoder stage's float
waveform is resampled by libsoxr if its rate differs and quantized to 16 bits by the one quantizer
both APIs share (:func:`omni_cache.pcm.to_int16`). The
container formats are encoded by libsndfile (the ``soundfile`` package, whose wheels bundle it with
FLAC, LAME/mpg123 and Opus). Streamed audio is always ``pcm16``, as OpenAI's API requires: chunks
of a compressed stream would not decode on their own. OpenAI's ``aac`` has no encoder in
libsndfile and is refused.
"""

from __future__ import annotations

import io

import numpy as np

from omni_cache.pcm import SAMPLE_RATE, resample, to_int16, to_pcm16

__all__ = ["FORMATS", "STREAM_FORMAT", "UnsupportedFormat", "check_format", "encode_audio"]

#: format -> (libsndfile container, libsndfile subtype); ``pcm16`` has no container.
_CONTAINERS: dict[str, tuple[str, str]] = {
    "wav": ("WAV", "PCM_16"),
    "flac": ("FLAC", "PCM_16"),
    "mp3": ("MP3", "MPEG_LAYER_III"),
    "opus": ("OGG", "OPUS"),
}
FORMATS: tuple[str, ...] = (*_CONTAINERS, "pcm16")
STREAM_FORMAT = "pcm16"


class UnsupportedFormat(ValueError):
    """An ``audio.format`` this server cannot produce (in this mode); the message names the ones it can."""


def check_format(fmt: str, *, stream: bool) -> str:
    """``fmt`` when the server can answer in it, else :class:`UnsupportedFormat`."""
    if fmt not in FORMATS:
        raise UnsupportedFormat(
            f"audio.format {fmt!r} is not supported; supported formats: " + ", ".join(repr(f) for f in FORMATS)
        )
    if stream and fmt != STREAM_FORMAT:
        raise UnsupportedFormat(
            f"audio.format {fmt!r} cannot be streamed: a streamed answer's audio "
            f"is {STREAM_FORMAT!r} (24 kHz mono 16-bit little-endian)"
        )
    return fmt


def encode_audio(samples: np.ndarray, sample_rate: int, fmt: str) -> bytes:
    """``samples`` (float, mono, at ``sample_rate``) as a 24 kHz file (or raw PCM) in ``fmt``."""
    if fmt == "pcm16":
        return to_pcm16(samples, sample_rate)
    import soundfile

    container, subtype = _CONTAINERS[fmt]
    # Written from our int16 samples, not floats: a file's samples are then the pcm16 bytes of the
    # same answer (libsndfile's own float quantizer floors in soundfile 0.14's 1.2.2).
    buf = io.BytesIO()
    soundfile.write(buf, to_int16(resample(samples, sample_rate)), SAMPLE_RATE, format=container, subtype=subtype)
    return buf.getvalue()
