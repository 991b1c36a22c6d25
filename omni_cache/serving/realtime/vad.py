"""Server-side voice activity detection with Silero VAD (the ``silero-vad`` package ships its
TorchScript model; it runs on the server's torch, no torchaudio or onnxruntime needed).

Silero scores 32 ms windows (512 samples at 16 kHz) with a speech probability and keeps a
recurrent state between them, so each session has its own model instance. The turn rule is the
Realtime API's ``server_vad``: speech starts at the first window scoring ``threshold`` or more;
it stops once the score stayed below ``threshold - 0.15`` (Silero's own hysteresis) for
``silence_duration_ms``. Times are milliseconds on the session's input clock (all audio appended
since the session opened), as ``audio_start_ms`` / ``audio_end_ms`` report them.
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
#: Silero's hysteresis: speech goes on while the score stays above threshold - this.
HYSTERESIS = 0.15


@dataclass(frozen=True)
class VadEvent:
    kind: str  # "start" | "stop"
    at_ms: int


def load_model() -> Any:
    """A fresh Silero model (its recurrent state is per session); ~0.1 s, call off the loop."""
    import warnings

    from silero_vad import load_silero_vad

    with warnings.catch_warnings():  # its loader's deprecated importlib/jit calls, not ours
        warnings.simplefilter("ignore", DeprecationWarning)
        return load_silero_vad(onnx=False)


class SpeechDetector:
    """Feeds 16 kHz audio to one Silero model and turns its scores into start/stop events."""

    def __init__(self, model: Any, threshold: float, silence_duration_ms: int) -> None:
        self.model = model
        self.threshold = threshold
        self.silence_duration_ms = silence_duration_ms
        self.in_speech = False
        self._pending = np.zeros(0, np.float32)
        self._clock_ms = 0  # end of the last scored window, on the input clock
        self._silence_from: int | None = None

    def configure(self, threshold: float, silence_duration_ms: int) -> None:
        self.threshold, self.silence_duration_ms = threshold, silence_duration_ms

    def feed(self, samples: np.ndarray) -> list[VadEvent]:
        """Score every whole window of ``samples`` (the rest waits for the next call)."""
        import torch

        x = np.concatenate([self._pending, np.asarray(samples, np.float32)])
        n = len(x) // WINDOW * WINDOW
        self._pending = x[n:]
        events: list[VadEvent] = []
        with torch.inference_mode():
            for i in range(0, n, WINDOW):
                p = float(self.model(torch.from_numpy(x[i:i + WINDOW]), RATE))
                start = self._clock_ms
                self._clock_ms += WINDOW_MS
                event = self._step(p, start)
                if event is not None:
                    events.append(event)
        return events

    def _step(self, p: float, window_start_ms: int) -> VadEvent | None:
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
