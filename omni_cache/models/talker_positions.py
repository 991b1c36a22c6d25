"""M-RoPE positions of a talker prompt, as the omni references' rope index lays them out.

Qwen2.5-Omni and Qwen3-Omni place a talker prompt's positions the same way their thinkers do: plain
positions (the three axes together) for text and audio tokens, and, at an image's or a video's
tokens, its patch grid's (t, h, w) positions from the position after its ``vision_start`` token;
the text after it goes on from their maximum plus one. A video's temporal index is scaled to time:
patch k sits at ``int(k * seconds_per_grid * position_id_per_seconds)`` (an image: one frame, 0).
A video interleaved with its sound track (``use_audio_in_video``: vision_start, audio_start, then
the video's and the track's tokens in chunks of ``seconds_per_chunk``, then audio_end, vision_end)
differs by family. Qwen2.5-Omni's talker lays it out as its thinker does (``interleave_chunk_s``
set): both starts at one position, the video's grid positions and the track's plain positions from
the next, each cut into chunks of ``position_id_per_seconds * seconds_per_chunk`` temporal
positions and taken in the prompt's order (video chunk, audio chunk, ...), both ends at one
position after their maximum. Qwen3-Omni's talker rope index is not told of the track and reads
such a video as audio: plain positions (``interleave_chunk_s`` 0).
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
    audio_id: int = -1
    audio_start_id: int = -1
    #: Seconds per chunk of a video interleaved with its sound track (0: such a video is plain).
    interleave_chunk_s: float = 0.0


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
    # An image's tokens follow its vision_start (the walk below checks each has its grid): one
    # without, a placeholder the client typed as text ("<|image_pad|>"), is a text position, as
    # the thinker's engine placed it (vLLM positions media by its items, not by token ids).
    if len(seconds) != len(video_grids):
        raise ValueError(f"{len(video_grids)} video grids but {len(seconds)} seconds per grid")
    if vision.vision_start_id not in ids:
        # Text and audio only (a voice conversation): plain positions, built without the walk
        # below, whose per-token cost grew a long session's hand-off.
        return torch.arange(len(ids), dtype=torch.long).expand(3, -1).contiguous(), 0
    columns: list[list[int]] = []
    nxt, i, seen = 0, 0, {vision.image_id: 0, vision.video_id: 0}
    while i < len(ids):
        kind = ids[i + 1] if ids[i] == vision.vision_start_id and i + 1 < len(ids) else None
        if kind == vision.audio_start_id and vision.interleave_chunk_s:
            k = seen[vision.video_id]
            if k >= len(video_grids) or k >= len(seconds):
                raise ValueError(f"the prompt has more videos than the {len(video_grids)} grids sent")
            i, nxt = _interleaved(ids, i, nxt, video_grids[k], seconds[k], vision, columns)
            seen[vision.video_id] = k + 1
        elif kind in seen:
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


def _interleaved(
    ids: list[int], i: int, nxt: int, grid: list[int], seconds: float, vision: VisionTokens, columns: list[list[int]]
) -> tuple[int, int]:
    """Append the columns of the video-with-track item that starts at ``ids[i]`` (its vision_start);
    returns the index after it and the next free position."""
    j = i + 2
    n_video = n_audio = 0
    while j < len(ids) and ids[j] in (vision.video_id, vision.audio_id):
        n_video += ids[j] == vision.video_id
        n_audio += ids[j] == vision.audio_id
        j += 1
    columns += [[nxt] * 3, [nxt] * 3]  # vision_start, audio_start
    start = nxt + 1
    step = seconds * vision.position_id_per_seconds
    video = _grid_columns(start, grid, step, n_video, vision.spatial_merge_size, "video")
    audio = [[start + a] * 3 for a in range(n_audio)]
    per_chunk = int(vision.position_id_per_seconds * vision.interleave_chunk_s)
    video_cuts, audio_cuts = _chunks(video, per_chunk, start), _chunks(audio, per_chunk, start)
    for m in range(max(len(video_cuts), len(audio_cuts))):
        for part, cuts in ((video, video_cuts), (audio, audio_cuts)):
            if m < len(cuts):
                columns += part[cuts[m][0] : cuts[m][1]]
    end = max(max(col) for col in columns) + 1
    columns += [[end] * 3, [end] * 3]  # audio_end, vision_end
    return j + 2, end + 1


def _chunks(cols: list[list[int]], per_chunk: int, start: int) -> list[tuple[int, int]]:
    """[start, stop) index ranges of ``cols`` cut where the temporal position (from ``start``)
    reaches the next multiple of ``per_chunk``; a cut is made per token that crosses one, so a
    jump over several multiples makes one cut per token, as the reference's chunked index does."""
    cuts, first, chunk = [], 0, 1
    for i, col in enumerate(cols):
        if col[0] - start >= chunk * per_chunk:
            cuts.append((first, i))
            first, chunk = i, chunk + 1
    cuts.append((first, len(cols)))
    return cuts
