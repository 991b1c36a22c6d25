"""Images and audio clips for the multimodal tests, encoded as a client sends them (test helper)."""

from __future__ import annotations

import base64
import io

import numpy as np
import soundfile as sf
from PIL import Image


def png_data_url(w: int = 40, h: int = 30, seed: int = 0, fmt: str = "PNG") -> str:
    """A random RGB image as a ``data:image/...;base64,`` URL."""
    rgb = np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


def clip_b64(seconds: float = 0.5, rate: int = 44100, channels: int = 1, fmt: str = "WAV",
             freq: float = 440.0) -> str:
    """A sine tone as base64 audio file bytes (OpenAI's ``input_audio.data``)."""
    t = np.arange(int(seconds * rate)) / rate
    x = (0.3 * np.sin(2 * np.pi * freq * t)).astype(np.float32)
    if channels > 1:
        x = np.stack([x] * channels, axis=1)
    buf = io.BytesIO()
    sf.write(buf, x, rate, format=fmt)
    return base64.b64encode(buf.getvalue()).decode()


def flat_png_data_url(w: int, h: int, colour: tuple[int, int, int] = (200, 30, 90)) -> str:
    """One colour, w x h: a few KiB encoded, w * h * 3 bytes decoded (what a client sends to
    make a server decode the most for the least)."""
    buf = io.BytesIO()
    Image.new("RGB", (w, h), colour).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
