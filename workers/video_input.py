"""How a video's sampled frames go to vLLM's multimodal processor (the one place where the two
families of video models differ), and what comes back for the talker: each video's patch grid.

The server samples and decodes a clip's frames itself (omni_cache/serving/video.py) and sends them
``uint8 [T, H, W, 3]`` with the rate they were sampled at. vLLM's processors then want them in one
of two forms, which the model's data parser says (``video_needs_metadata``):

* Qwen3-Omni (and Qwen2.5-Omni): bare frames; the rate goes in the request's
  ``mm_processor_kwargs`` (``fps``: its temporal positions are 2 / fps seconds per patch), beside
  ``use_audio_in_video`` when the sound tracks came along.
* Qwen3-VL and Qwen3.5: ``(frames, metadata)``. Their processor writes a ``<t seconds>`` stamp before
  each pair of frames from the metadata's frame indices and rate: the metadata is what vLLM's
  Qwen3-VL loader writes for the same clip (the sampled frames' indices in the clip, the clip's
  own rate, frame count and duration), so the stamps are the times ``vllm serve`` writes. The
  frames arrive sampled: ``do_sample_frames: False``. No processor kwargs: these models read no
  sound track.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from omni_cache.wire.messages import MediaRef


@dataclass(frozen=True)
class VideoInput:
    """The form a stage's model takes videos in (default: bare frames, Qwen3-Omni's)."""

    needs_metadata: bool = False

    def item(self, frames: np.ndarray, ref: MediaRef) -> Any:
        """One video of ``multi_modal_data`` (``ref``: its rate, and where its frames are in the clip)."""
        if not self.needs_metadata:
            return frames
        count = int(frames.shape[0])
        if len(ref.frame_indices) != count or ref.source_fps <= 0 or ref.source_frames < count:
            raise ValueError(f"video {ref.tensor!r} came without its frames' indices in the clip")
        return frames, {
            "fps": float(ref.source_fps),
            "duration": ref.source_frames / float(ref.source_fps),
            "total_num_frames": int(ref.source_frames),
            "frames_indices": list(ref.frame_indices),
            "video_backend": "opencv",
            "do_sample_frames": False,
        }

    def processor_kwargs(self, fps: float, use_audio_in_video: bool) -> dict[str, Any] | None:
        """A request's ``mm_processor_kwargs`` for its videos (the first video's sampled rate)."""
        if self.needs_metadata:
            return None
        return {"fps": fps, "use_audio_in_video": use_audio_in_video}


def video_input(engine: Any) -> VideoInput:
    """What the engine's multimodal processor asks of videos (bare frames for a text-only model)."""
    processor = getattr(getattr(engine, "renderer", None), "mm_processor", None)
    if processor is None:
        return VideoInput()
    return VideoInput(needs_metadata=bool(processor.info.data_parser.video_needs_metadata))


@dataclass
class VideoGrids:
    """A thinker request's videos as its downstream talker needs them: each video's (t, h, w)
    patch grid and seconds per temporal patch, read from vLLM's processed multimodal features.
    The talker places its M-RoPE positions by them (omni_cache/models/talker_positions.py)."""

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
