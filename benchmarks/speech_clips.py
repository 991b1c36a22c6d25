"""Speech-like audio made here (no recordings, no TTS on CI): for the realtime tests and benchmark.

A voice detector such as Silero scores tones and noise as non-speech, so a clip must look like
speech: a glottal pulse train at a gliding pitch (100-170 Hz) through three vowel formant
resonators, in syllables of ~220 ms with a rising and falling envelope. Seeded: the same seed
gives the same clip, a different seed different syllables (and so different prompt audio).
"""

from __future__ import annotations

import numpy as np

from omni_cache.pcm import pcm16  # a clip as audio/pcm, quantized as the server quantizes

__all__ = ["RATE", "pcm16", "silence", "speech", "turn_clip"]

RATE = 24000  # the Realtime API's audio/pcm rate
# (F1, F2, F3) in Hz of a few vowels.
VOWELS = ((730, 1090, 2440), (270, 2290, 3010), (300, 870, 2240), (530, 1840, 2480), (570, 840, 2410))
BANDWIDTHS = (80, 100, 120)
SYLLABLE_S = 0.22


def _resonance(f: float, bw: float, rate: int, n: int = 600) -> np.ndarray:
    """Impulse response of a two-pole resonator at ``f`` Hz with bandwidth ``bw``."""
    r = np.exp(-np.pi * bw / rate)
    theta = 2 * np.pi * f / rate
    k = np.arange(n)
    return (1 - r) * r**k * np.sin((k + 1) * theta) / np.sin(theta)


def speech(seconds: float, seed: int = 0, rate: int = RATE) -> np.ndarray:
    """``seconds`` of vowel-like syllables, float32 in [-0.5, 0.5]."""
    rng = np.random.default_rng(seed)
    n = int(seconds * rate)
    out = np.zeros(n)
    pos = 0
    while pos < n:
        length = min(int(SYLLABLE_S * rate) + int(rng.integers(-rate // 20, rate // 20)), n - pos)
        t = np.arange(length) / rate
        f0 = rng.uniform(100, 170) * (1 + 0.1 * np.sin(2 * np.pi * 3 * t))
        pulses = (np.diff(np.floor(np.cumsum(f0) / rate), prepend=0) > 0).astype(float)
        formants = VOWELS[int(rng.integers(len(VOWELS)))]
        voiced = sum(np.convolve(pulses, _resonance(f, bw, rate))[:length] for f, bw in zip(formants, BANDWIDTHS))
        out[pos : pos + length] = voiced * np.sin(np.pi * np.arange(length) / length) ** 0.5
        pos += length
    return (0.5 * out / (np.abs(out).max() + 1e-9)).astype(np.float32)


def silence(seconds: float, rate: int = RATE) -> np.ndarray:
    return np.zeros(int(seconds * rate), np.float32)


def turn_clip(seconds: float, seed: int, rate: int = RATE) -> np.ndarray:
    """One user turn: speech between 0.3 s silences."""
    return np.concatenate([silence(0.3, rate), speech(seconds - 0.6, seed, rate), silence(0.3, rate)])
