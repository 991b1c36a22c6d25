"""Server-side voice activity detection with Silero VAD (the ``silero-vad`` package ships its
TorchScript model; it runs on the server's torch, no torchaudio or onnxruntime needed).

Silero scores 32 ms windows (512 samples at 16 kHz, each preceded by the 64 samples before it)
with a speech probability and carries an LSTM state from one window to the next. One model
serves every session: each :class:`SpeechDetector` keeps its own context and state, and
:mod:`.vad_batch` scores all sessions' windows together.

The turn rule is the Realtime API's ``server_vad``: speech starts at the first window scoring
``threshold`` or more; it stops once the score stayed below ``threshold - 0.15`` (Silero's own
hysteresis) for ``silence_duration_ms``. Times are milliseconds on the session's input clock (all
audio appended since the session opened), as ``audio_start_ms`` / ``audio_end_ms`` report them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["RATE", "SpeechDetector", "VadEvent", "load_model"]

#: The rate Silero runs at here (it also takes 8 kHz; 16 kHz is its better model).
RATE = 16000
WINDOW = 512
WINDOW_MS = WINDOW * 1000 // RATE
#: Samples of the previous window each window is scored with (the package's context_size_samples).
CONTEXT = 64
#: Silero's LSTM: (h, c), 128 wide.
STATE_SHAPE = (2, 128)
#: Silero's hysteresis: speech goes on while the score stays above threshold - this.
HYSTERESIS = 0.15


@dataclass(frozen=True)
class VadEvent:
    kind: str  # "start" | "stop"
    at_ms: int


def load_model() -> Any:
    """The package's Silero model (its wrapper; :mod:`.vad_batch` calls the 16 kHz network
    inside it). ~0.1 s: load it off the event loop."""
    import warnings

    from silero_vad import load_silero_vad

    with warnings.catch_warnings():  # its loader's deprecated importlib/jit calls, not ours
        warnings.simplefilter("ignore", DeprecationWarning)
        return load_silero_vad(onnx=False)


class SpeechDetector:
    """One session's audio as Silero sees it: the samples waiting for a whole window, the
    network's context and state after the last window scored, and the turn rule's position."""

    def __init__(self, threshold: float, silence_duration_ms: int) -> None:
        self.threshold = threshold
        self.silence_duration_ms = silence_duration_ms
        self.in_speech = False
        self.context = np.zeros(CONTEXT, np.float32)
        self.state = np.zeros(STATE_SHAPE, np.float32)
        self._pending = np.zeros(0, np.float32)
        self._clock_ms = 0  # end of the last scored window, on the input clock
        self._silence_from: int | None = None

    def configure(self, threshold: float, silence_duration_ms: int) -> None:
        self.threshold, self.silence_duration_ms = threshold, silence_duration_ms

    def windows(self, samples: np.ndarray) -> np.ndarray:
        """``samples`` (16 kHz) added to what waits; every whole window now, ``[k, WINDOW]``
        (the rest waits for the next call)."""
        x = np.concatenate([self._pending, np.asarray(samples, np.float32)])
        n = len(x) // WINDOW * WINDOW
        self._pending = x[n:]
        return x[:n].reshape(-1, WINDOW)

    def step(self, p: float) -> VadEvent | None:
        """The next window scored ``p``: the event it makes, if any."""
        window_start_ms = self._clock_ms
        self._clock_ms += WINDOW_MS
        if not self.in_speech:
            if p >= self.threshold:
                self.in_speech, self._silence_from = True, None
                return VadEvent("start", window_start_ms)
            return None
        if p >= self.threshold - HYSTERESIS:
            self._silence_from = None
            return None
        if self._silence_from is None:
            self._silence_from = window_start_ms
        if self._clock_ms - self._silence_from >= self.silence_duration_ms:
            self.in_speech, self._silence_from = False, None
            return VadEvent("stop", self._clock_ms)
        return None

    def reset(self) -> None:
        """Forget the speech in progress (the buffer was cleared); the clock goes on."""
        self.in_speech, self._silence_from = False, None
