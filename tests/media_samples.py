"""Images and audio clips for the multimodal tests, encoded as a client sends them (test helper)."""

from __future__ import annotations

import base64
import contextlib
import http.server
import io
import threading
from collections.abc import Iterator

import numpy as np
import soundfile as sf
from PIL import Image


def png_data_url(w: int = 40, h: int = 30, seed: int = 0, fmt: str = "PNG") -> str:
    """A random RGB image as a ``data:image/...;base64,`` URL."""
    rgb = np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


def clip_b64(seconds: float = 0.5, rate: int = 44100, channels: int = 1, fmt: str = "WAV", freq: float = 440.0) -> str:
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


def video_bytes(
    frames: int = 16,
    w: int = 96,
    h: int = 64,
    fps: int = 8,
    *,
    audio_s: float | None = None,
    seed: int = 0,
    fmt: str = "mp4",
    faststart: bool = False,
    noise: bool = True,
) -> bytes:
    """A video of random frames (MPEG-4 part 2, which every FFmpeg build encodes) and, when
    ``audio_s`` is given, an AAC sound track of a sine tone that long (16 kHz mono).
    ``faststart``: the MP4 index goes before the frames (so a truncated file keeps its header).
    ``noise=False``: flat frames of a changing colour (a few bytes each, however large)."""
    import os
    import tempfile

    import av

    rng = np.random.default_rng(seed)
    fd, path = tempfile.mkstemp(suffix="." + fmt)
    os.close(fd)
    try:
        options = {"movflags": "faststart"} if faststart else {}
        with av.open(path, "w", format=fmt, options=options) as c:
            v = c.add_stream("mpeg4", rate=fps)
            v.width, v.height, v.pix_fmt = w, h, "yuv420p"
            a = c.add_stream("aac", rate=16000) if audio_s is not None else None
            if a is not None:
                a.layout = "mono"
            for _ in range(frames):
                img = (
                    rng.integers(0, 255, (h, w, 3), dtype=np.uint8)
                    if noise
                    else np.full((h, w, 3), rng.integers(0, 255, 3), dtype=np.uint8)
                )
                for p in v.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                    c.mux(p)
            for p in v.encode():
                c.mux(p)
            if a is not None:
                n = int(audio_s * 16000)
                tone = (0.3 * np.sin(2 * np.pi * (330 + 40 * seed) * np.arange(n) / 16000)).astype(np.float32)
                for off in range(0, n, 1024):
                    frame = av.AudioFrame.from_ndarray(tone[None, off : off + 1024], format="fltp", layout="mono")
                    frame.sample_rate, frame.pts = 16000, off
                    for p in a.encode(frame):
                        c.mux(p)
                for p in a.encode():
                    c.mux(p)
        with open(path, "rb") as f:
            return f.read()
    finally:
        os.remove(path)


def video_data_url(**kwargs) -> str:
    return "data:video/mp4;base64," + base64.b64encode(video_bytes(**kwargs)).decode()


@contextlib.contextmanager
def served_file(data: bytes, content_type: str, name: str) -> Iterator[str]:
    """An http server on 127.0.0.1 answering every GET with ``data`` as ``content_type`` (no
    Content-Length: its size shows only while reading); yields the URL of ``name`` on it (a media
    URL for the server's allowed hosts)."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 -- http.server's name
            self.send_response(200)
            self.send_header("Content-Type", content_type)
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/{name}"
    finally:
        server.shutdown()
