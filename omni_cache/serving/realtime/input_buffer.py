"""A session's input audio buffer: what the client appended since the last commit or clear, at the
audio encoder's rate, placed on the session's input clock (milliseconds of all audio appended
since the session opened, the clock the VAD events report)."""

from __future__ import annotations

import numpy as np

from omni_cache.serving.realtime.protocol import EventError

__all__ = ["InputAudioBuffer"]


class InputAudioBuffer:
    def __init__(self, rate: int, max_seconds: float) -> None:
        self.rate = rate
        self.max_samples = int(max_seconds * rate)
        self._chunks: list[np.ndarray] = []
        self.size = 0  # samples held
        self.appended = 0  # samples appended since the session opened (the clock)
        #: Changes whenever the first sample held changes (a commit, a clear, silence dropped
        #: before speech): what was read with :meth:`head` before is not the buffer's start now.
        self.epoch = 0

    @property
    def end_ms(self) -> int:
        return self.appended * 1000 // self.rate

    @property
    def start_ms(self) -> int:
        """The clock at the first sample held."""
        return (self.appended - self.size) * 1000 // self.rate

    @property
    def duration_ms(self) -> int:
        return self.size * 1000 // self.rate

    def check_room(self, samples: int) -> None:
        """EventError when ``samples`` more would not fit."""
        if self.size + samples > self.max_samples:
            raise EventError(
                f"the input audio buffer would hold {(self.size + samples) / self.rate:.1f} s; "
                f"at most {self.max_samples / self.rate:g} s are held before a commit "
                "(server.realtime.max_buffer_s): commit or clear it",
                param="audio",
                code="input_audio_buffer_full",
            )

    def append(self, samples: np.ndarray) -> None:
        self.check_room(len(samples))
        if len(samples):
            self._chunks.append(np.asarray(samples, np.float32))
            self.size += len(samples)
            self.appended += len(samples)

    def head(self, n: int) -> np.ndarray:
        """A copy of the first ``n`` samples held (at most what is held); nothing is consumed."""
        n = min(n, self.size)
        if not n:
            return np.zeros(0, np.float32)
        parts, got = [], 0
        for chunk in self._chunks:
            parts.append(chunk[: n - got])
            got += len(parts[-1])
            if got >= n:
                break
        return np.concatenate(parts) if len(parts) > 1 else parts[0].copy()

    def take(self) -> np.ndarray:
        """Everything held, and the buffer is empty after."""
        out = np.concatenate(self._chunks) if self._chunks else np.zeros(0, np.float32)
        self.clear()
        return out

    def keep_last(self, ms: int) -> None:
        """Drop all but the last ``ms`` (silence before speech: only the prefix padding is kept)."""
        keep = ms * self.rate // 1000
        drop = self.size - keep
        if drop <= 0:
            return
        self.epoch += 1
        # Whole chunks leave from the front, the first kept one is sliced: called after every
        # tick of silence, this copies nothing (joining everything held each time did).
        while drop:
            first = self._chunks[0]
            if len(first) <= drop:
                self._chunks.pop(0)
                drop -= len(first)
            else:
                self._chunks[0], drop = first[drop:], 0
        self.size = keep

    def clear(self) -> None:
        self._chunks, self.size = [], 0
        self.epoch += 1
