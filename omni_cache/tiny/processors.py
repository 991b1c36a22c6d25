"""The processor files the tiny checkpoints share with the released ones: the Qwen2-VL style image
and video processor fields (each family sets its class, normalization, patch size and bounds) and
Qwen's Whisper feature extractor for audio (128 mel bins at 16 kHz, 30 s windows)."""

from __future__ import annotations

__all__ = ["vision_processor", "whisper_features"]


def vision_processor(processor_class: str, *, mean: list[float], std: list[float], patch_size: int) -> dict:
    """The fields every family's image and video processor file starts with."""
    return {
        "processor_class": processor_class,
        "do_convert_rgb": True,
        "do_normalize": True,
        "do_rescale": True,
        "do_resize": True,
        "image_mean": mean,
        "image_std": std,
        "rescale_factor": 1 / 255,
        "patch_size": patch_size,
        "temporal_patch_size": 2,
        "merge_size": 2,
    }


def whisper_features() -> dict:
    """The omni models' audio feature extractor, as the released preprocessor_config.json has it."""
    return {
        "feature_extractor_type": "WhisperFeatureExtractor",
        "feature_size": 128,
        "sampling_rate": 16000,
        "hop_length": 160,
        "chunk_length": 300,
        "n_fft": 400,
        "n_samples": 300 * 16000,
        "nb_max_frames": 300 * 16000 // 160,
        "padding_side": "right",
        "padding_value": 0.0,
        "return_attention_mask": True,
        "dither": 0.0,
    }
