"""What a checkpoint's preprocessor expects of its inputs (``preprocessor_config.json``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

#: What audio inputs are resampled to when the model does not say (Whisper-style encoders).
DEFAULT_AUDIO_INPUT_RATE = 16000
#: The shortest clip (samples at the input rate) the omni models' audio feature extractor takes.
#: Whisper's (Qwen2.5-Omni's and Qwen3-Omni's: ``n_fft`` 400 at 16 kHz) reflect-pads ``n_fft //
#: 2`` samples on each side of a clip and fails on one no longer than that, deep in the thinker's
#: processor; the server asks for one ``n_fft`` (25 ms) and refuses a shorter clip up front.
MIN_AUDIO_SAMPLES = 400


#: The most one side of an image (or a video's frames) may be times the other: the Qwen-VL image
#: and video processors (``smart_resize``, Qwen2.5-Omni's, Qwen3-Omni's and Qwen3.5's) refuse a
#: longer, thinner one deep in the thinker's processor; the server refuses it up front.
MAX_ASPECT_RATIO = 200


def too_thin(what: str, width: int, height: int) -> str | None:
    """The error for a picture beyond :data:`MAX_ASPECT_RATIO`, or None."""
    ratio = max(width, height) / max(1, min(width, height))
    if ratio <= MAX_ASPECT_RATIO:
        return None
    return (
        f"{what} is {width}x{height} pixels, one side {ratio:.0f} times the other; at most "
        f"{MAX_ASPECT_RATIO} is accepted (the model's image processor takes no thinner picture)"
    )


def too_short(what: str, samples: int, rate: int) -> str | None:
    """The error for a clip of ``samples`` at ``rate`` shorter than :data:`MIN_AUDIO_SAMPLES`, or
    None."""
    if samples >= MIN_AUDIO_SAMPLES:
        return None
    return (
        f"{what} is {samples * 1000 / rate:.1f} ms long; at least {MIN_AUDIO_SAMPLES * 1000 / rate:g} ms "
        "are accepted (the model's audio feature extractor takes no shorter clip)"
    )


def audio_input_rate(model_dir: str | Path) -> int:
    """The sample rate of the model's audio feature extractor (``preprocessor_config.json``'s
    ``sampling_rate``), else :data:`DEFAULT_AUDIO_INPUT_RATE`."""
    try:
        rate = json.loads((Path(model_dir) / "preprocessor_config.json").read_text()).get("sampling_rate")
    except (OSError, ValueError):
        return DEFAULT_AUDIO_INPUT_RATE
    return int(rate) if isinstance(rate, int) and rate > 0 else DEFAULT_AUDIO_INPUT_RATE


def audio_window_samples(model_dir: str | Path) -> int | None:
    """Samples (at the feature extractor's rate) of one attention window of the model's audio
    encoder, where audio cut into separate items encodes as the whole clip does; None when the
    encoder has no such window (only Qwen3-Omni's audio tower is known to have one).

    Qwen3-Omni (``thinker_config.audio_config``): convolutions over chunks of ``2 * n_window`` mel
    frames (position restarting at each), attention within ``n_window_infer`` frames; one mel
    frame is ``hop_length`` samples (``preprocessor_config.json``). A window is a whole number of
    convolution chunks, so a cut every ``n_window_infer * hop_length`` samples changes only the
    mel front end's frames at the cut (issue 51; docs/realtime.md)."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
        pre = json.loads((Path(model_dir) / "preprocessor_config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict) or config.get("model_type") != "qwen3_omni_moe":
        return None
    audio = (config.get("thinker_config") or {}).get("audio_config") or {}
    window, conv, hop = audio.get("n_window_infer"), audio.get("n_window"), pre.get("hop_length")
    if not all(isinstance(v, int) and v > 0 for v in (window, conv, hop)) or window % (2 * conv):
        return None
    return window * hop


#: vLLM's video loaders by name (``vllm.multimodal.video``): Qwen2-VL's (Qwen3-Omni's processor)
#: and Qwen3-VL's (Qwen3-VL and Qwen3.5).
QWEN2_VL, QWEN3_VL = "qwen2_vl", "qwen3_vl"


def video_sampler(model_dir: str | Path) -> str:
    """The name of vLLM's video loader for the model (``qwen2_vl`` or ``qwen3_vl``): vLLM picks it by
    the checkpoint's video processor class (``video_preprocessor_config.json``'s
    ``video_processor_type``), and the server samples frames as that loader does. Qwen2-VL's
    (Qwen3-Omni's) when the checkpoint names another or none."""
    from vllm.multimodal.video import get_video_loader_backend_for_processor

    try:
        config = json.loads((Path(model_dir) / "video_preprocessor_config.json").read_text())
    except (OSError, ValueError):
        return QWEN2_VL
    name = config.get("video_processor_type") if isinstance(config, dict) else None
    backend = get_video_loader_backend_for_processor(name) if isinstance(name, str) else None
    return backend if backend in (QWEN2_VL, QWEN3_VL) else QWEN2_VL


def audio_pieces(model_dir: str | Path, tokenizer: Any) -> tuple[int, int] | None:
    """(:func:`audio_window_samples`, the tokenizer's audio placeholder id): a realtime turn's
    audio is cut into items of that many samples, their placeholders side by side; None when the
    model has no such window or the tokenizer names no audio token (the turn is kept whole)."""
    window = audio_window_samples(model_dir)
    token = getattr(tokenizer, "audio_token", None)
    placeholder = tokenizer.convert_tokens_to_ids(token) if isinstance(token, str) else None
    if window is None or not isinstance(placeholder, int) or placeholder < 0:
        return None
    return window, placeholder
