"""A thinker request's videos as its downstream talker needs them: each video's (t, h, w) patch
grid and seconds per temporal patch, read from vLLM's processed multimodal features. The talker
places its M-RoPE positions by them (omni_cache/models/qwen3_omni_talker_prompt.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class VideoGrids:
    grids: list[list[int]] = field(default_factory=list)
    seconds_per_grid: list[float] = field(default_factory=list)


def video_grids(request: Any) -> VideoGrids:
    """The videos of a vLLM request (``Request.mm_features``), in prompt order."""
    out = VideoGrids()
    for feature in sorted(request.mm_features or (), key=lambda f: f.mm_position.offset):
        if feature.modality != "video" or feature.data is None:
            continue
        data = feature.data.get_data()
        grid = data.get("video_grid_thw")
        if grid is None:
            continue
        out.grids.append([int(x) for x in torch.as_tensor(grid).reshape(-1)[:3]])
        seconds = data.get("second_per_grid_ts")
        out.seconds_per_grid.append(float(torch.as_tensor(seconds).reshape(-1)[0]) if seconds is not None else 1.0)
    return out
