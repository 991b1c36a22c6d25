"""The window decoder a checkpoint folder holds (:class:`~omni_cache.models.code_windows.WindowDecoder`):
Qwen3-Omni's code2wav, Qwen2.5-Omni's token2wav or the tiny codec, chosen by the folder's ``config.json``."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from omni_cache.models.code_windows import WindowDecoder
from omni_cache.models.codec_decoder import CodecDecoder, CodecWindowDecoder
from omni_cache.models.qwen2_5_omni_token2wav import Token2WavDecoder
from omni_cache.models.qwen3_omni_code2wav import Code2WavDecoder


def load_window_decoder(path: str | Path, device: str | torch.device = "cpu") -> WindowDecoder:
    """The decoder a checkpoint folder holds: a Qwen3-Omni folder (``model_type`` ``qwen3_omni_moe``)
    -> its code2wav, in float32; a Qwen2.5-Omni folder (``qwen2_5_omni``) -> its token2wav (DiT and
    BigVGAN, float32, with the folder's speakers); anything else -> the tiny codec (``tiny:decoder``)."""
    path = Path(path)
    config = path / "config.json"
    try:
        model_type = json.loads(config.read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError) as e:
        raise ValueError(f"{config}: cannot read the decoder's config ({e})") from e
    if model_type == "qwen3_omni_moe":
        return Code2WavDecoder.from_pretrained(path, device=device)
    if model_type == "qwen2_5_omni":
        return Token2WavDecoder.from_pretrained(path, device=device)
    return CodecWindowDecoder(CodecDecoder.from_pretrained(path, device=device))
