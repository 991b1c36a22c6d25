"""M-RoPE positions of a talker prompt, as the omni references' rope index lays them out.

Qwen2.5-Omni and Qwen3-Omni place a talker prompt's positions the same way their thinkers do: plain
positions (the three axes together) for text and audio tokens, and, at an image's or a video's
tokens, its patch grid's (t, h, w) positions from the position after its ``vision_start`` token;
the text after it goes on from their maximum plus one. A video's temporal index is scaled to time:
patch k sits at ``int(k * seconds_per_grid * position_id_per_seconds)`` (an image: one frame, 0).
A video interleaved with its sound track (``use_audio_in_video``) is not laid out here: the
references' talker rope index reads such a video (vision_start followed by audio_start) as audio.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class VisionTokens:
    """The token ids and sizes a rope index needs from a checkpoint's config."""

    image_id: int
    video_id: int
    vision_start_id: int
    spatial_merge_size: int = 2
    position_id_per_seconds: float = 25.0


def talker_positions(
    ids: list[int],
    vision: VisionTokens,
    image_grids: list[list[int]],
    video_grids: list[list[int]] | None = None,
    video_seconds_per_grid: list[float] | None = None,
) -> tuple[torch.Tensor, int]:
    """The M-RoPE positions [3, len(ids)] of a prompt and its decode delta (the positions of later
    steps are their index plus it)."""
    video_grids, seconds = video_grids or [], video_seconds_per_grid or []
    if vision.image_id in ids and not image_grids:
        raise ValueError("the talker prompt has image tokens but the thinker sent no image grids")
    if len(seconds) != len(video_grids):
        raise ValueError(f"{len(video_grids)} video grids but {len(seconds)} seconds per grid")
    columns: list[list[int]] = []
    nxt, i, seen = 0, 0, {vision.image_id: 0, vision.video_id: 0}
    while i < len(ids):
        kind = ids[i + 1] if ids[i] == vision.vision_start_id and i + 1 < len(ids) else None
        if kind in seen:
            columns.append([nxt] * 3)  # vision_start
            n = 1
            while i + 1 + n < len(ids) and ids[i + 1 + n] == kind:
                n += 1
            k = seen[kind]
            if kind == vision.image_id:
                grids, what, step = image_grids, "image", 0.0  # one frame: temporal index 0
            else:
                grids, what = video_grids, "video"
                step = seconds[k] * vision.position_id_per_seconds if k < len(seconds) else 0.0
            if k >= len(grids):
                raise ValueError(f"the prompt has more {what}s than the {len(grids)} grids sent")
            columns += _grid_columns(nxt + 1, grids[k], step, n, vision.spatial_merge_size, f"{what} {k}")
            nxt = max(max(col) for col in columns) + 1
            i += 1 + n
            seen[kind] = k + 1
        else:
            columns.append([nxt] * 3)
            nxt += 1
            i += 1
    positions = torch.tensor(columns, dtype=torch.long).T.contiguous()
    return positions, int(positions.max()) + 1 - positions.shape[1]


def _grid_columns(start: int, grid: list[int], step: float, n: int, merge: int, what: str) -> list[list[int]]:
    """(t, h, w) positions of a grid's n tokens from ``start``: patch k's temporal index is
    ``int(k * step)`` (the reference's float positions, whole where its step is)."""
    t, h, w = grid
    hh, ww = h // merge, w // merge
    if t * hh * ww != n:
        raise ValueError(f"{what}: grid {t}x{h}x{w} does not match its {n} tokens")
    return [[start + int(k * step), start + r, start + c] for k in range(t) for r in range(hh) for c in range(ww)]
