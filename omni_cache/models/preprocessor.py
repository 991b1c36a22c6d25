"""What a checkpoint's preprocessor expects of its inputs (``preprocessor_config.json``)."""

from __future__ import annotations

import json
from pathlib import Path

#: What audio inputs are resampled to when the model does not say (Whisper-style encoders).
DEFAULT_AUDIO_INPUT_RATE = 16000


def audio_input_rate(model_dir: str | Path) -> int:
    """The sample rate of the model's audio feature extractor (``preprocessor_config.json``'s
    ``sampling_rate``), else :data:`DEFAULT_AUDIO_INPUT_RATE`."""
    try:
        rate = json.loads((Path(model_dir) / "preprocessor_config.json").read_text()).get("sampling_rate")
    except (OSError, ValueError):
        return DEFAULT_AUDIO_INPUT_RATE
    return int(rate) if isinstance(rate, int) and rate > 0 else DEFAULT_AUDIO_INPUT_RATE
