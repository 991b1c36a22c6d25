"""vLLM's Qwen2.5-Omni thinker, with a video's sound track placed as the released model reads it.

With ``use_audio_in_video`` the prompt holds, per video, ``vision_bos audio_bos``, then the video's
and its track's tokens interleaved in chunks of ``seconds_per_chunk``, then ``audio_eos
vision_eos``. transformers' reference (the model's own rope index, which the released checkpoints
were trained with) gives both starts one M-RoPE position and both ends one position, and lays the
frames out on their (t, h, w) grid from the position after the starts. vLLM 0.32 counts the starts
and ends as two text tokens each and offsets the frames' width index by one (measured on the tiny
checkpoint: the first frame token at (29, 29, 30) where the reference has (29, 29, 29)), so every
hidden state from the track's start on differs (by up to 0.05 there) and the talker speaks other
codes. For a prompt with such a video this class lays the positions out as the reference does
(`omni_cache.models.talker_positions`, held equal to the reference's rope index by
tests/test_qwen2_5_omni_talker_input.py; the thinker's and the talker's rope index are one function
there); every other prompt keeps vLLM's positions, which equal the reference's.

Registered in place of vLLM's class for the released architecture names by `workers.models.register`.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.model_executor.models import qwen2_5_omni_thinker as vllm_thinker

from omni_cache.models.talker_positions import VisionTokens, talker_positions


class Qwen2_5OmniThinkerForConditionalGeneration(vllm_thinker.Qwen2_5OmniThinkerForConditionalGeneration):
    def get_mrope_input_positions(self, input_tokens: list[int], mm_features: list[Any]) -> tuple[torch.Tensor, int]:
        cfg = self.config
        starts = (cfg.vision_start_token_id, cfg.audio_start_token_id)
        if not any(pair == starts for pair in zip(input_tokens, input_tokens[1:])):
            return super().get_mrope_input_positions(input_tokens, mm_features)
        merge = cfg.vision_config.spatial_merge_size
        images, videos, steps = [], [], []
        for _, modality, data in self.iter_mm_features(mm_features):
            grid = [data["grid_t"], data["grid_h"] * merge, data["grid_w"] * merge] if "grid_t" in data else None
            if modality == "image":
                images.append(grid)
            elif modality == "video":
                videos.append(grid)
                steps.append(float(data["t_factor"]))  # seconds per grid x positions per second
        per_second = getattr(cfg.vision_config, "tokens_per_second", 25)
        layout = VisionTokens(
            image_id=cfg.image_token_index,
            video_id=cfg.video_token_index,
            vision_start_id=cfg.vision_start_token_id,
            spatial_merge_size=merge,
            position_id_per_seconds=1.0,  # `steps` are already in positions per grid
            audio_id=cfg.audio_token_index,
            audio_start_id=cfg.audio_start_token_id,
            interleave_chunk_s=per_second * cfg.seconds_per_chunk,  # positions per chunk, at 1 a second
        )
        return talker_positions(list(input_tokens), layout, images, videos, steps)
