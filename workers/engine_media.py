"""A request's media in vLLM's terms: the prompt's ``multi_modal_data``, ``multi_modal_uuids`` and
``mm_processor_kwargs`` from a Submit's media (decoded frames the orchestrator sent, each named
by a :class:`~omni_cache.wire.messages.MediaRef`), and the layout the engine reports back for
the router: how it expanded those items in the prompt.

The autoregressive stage's runner (workers/ar_runner.py) calls these for the entry stage.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from omni_cache.wire.messages import MAX_MEDIA_NAME, MediaLayout, MediaRef, MediaSpan
from workers.video_input import VideoInput

if TYPE_CHECKING:  # annotations only: the engine's module need not load to build a prompt
    from workers.llm_stage import StepOutput

__all__ = ["media_layout", "mm_processor_kwargs", "multi_modal_data", "multi_modal_uuids"]


def multi_modal_data(
    media: list[MediaRef], tensors: dict[str, torch.Tensor], video: VideoInput = VideoInput()
) -> dict[str, list]:
    """A Submit's media as vLLM's ``multi_modal_data``: PIL images, ``(samples, rate)`` clips and
    videos in the form the model takes (``video``), in prompt order. A frame that is missing or not
    what its MediaRef says is a ValueError (400)."""
    from PIL import Image

    out: dict[str, list] = {}
    for ref in media:
        t = tensors.get(ref.tensor)
        if ref.kind == "image" and t is not None and t.dtype == torch.uint8 and t.dim() == 3 and t.shape[-1] == 3:
            out.setdefault("image", []).append(Image.fromarray(t.numpy()))
        elif (
            ref.kind == "audio" and t is not None and t.dtype == torch.float32 and t.dim() == 1 and ref.sample_rate > 0
        ):
            out.setdefault("audio", []).append((t.numpy(), ref.sample_rate))
        elif (
            ref.kind == "video"
            and t is not None
            and t.dtype == torch.uint8
            and t.dim() == 4
            and t.shape[-1] == 3
            and ref.fps > 0
        ):
            out.setdefault("video", []).append(video.item(t.numpy(), ref))
        else:
            raise ValueError(f"media item {ref.tensor!r} ({ref.kind}) is missing or malformed")
    return out


def mm_processor_kwargs(media: list[MediaRef], video: VideoInput = VideoInput()) -> dict[str, Any] | None:
    """vLLM's ``mm_processor_kwargs`` for a Submit with videos: the rate of their sampled frames
    (Qwen3-Omni's processor takes one per request: the first video's; its temporal positions
    are 2 / fps seconds per patch) and ``use_audio_in_video`` when their sound tracks came along;
    None for a model that reads the rate from each video's metadata (workers/video_input.py).
    A video frame that came without a rate is a ValueError (400)."""
    videos = [ref for ref in media if ref.kind == "video"]
    if not videos:
        return None
    return video.processor_kwargs(videos[0].fps, any(ref.in_video for ref in media))


def multi_modal_uuids(media: list[MediaRef], video: VideoInput = VideoInput()) -> dict[str, list] | None:
    """vLLM's ``multi_modal_uuids`` for a Submit's media (the server's content digests), laid out
    as ``multi_modal_data``; None unless every item has one. A video's processed inputs depend on
    the request's processor kwargs too (:func:`mm_processor_kwargs`): its UUID and its sound
    track's carry them, so vLLM's caches never mix two readings of one file."""
    if not media or not all(ref.uuid for ref in media):
        return None
    kwargs = mm_processor_kwargs(media, video)
    suffix = "" if kwargs is None else f":fps={kwargs['fps']:.6g}:av={int(kwargs['use_audio_in_video'])}"
    out: dict[str, list] = {}
    for ref in media:
        uuid = ref.uuid + suffix if ref.kind == "video" or ref.in_video else ref.uuid
        out.setdefault(ref.kind, []).append(uuid)
    return out


def media_layout(out: StepOutput) -> MediaLayout | None:
    """How the engine expanded a media prompt (its first output): the client's
    ``prompt_token_ids`` and, for the router, its items' spans (none for a name too long for the
    wire: the router then just does not learn these items). None for a prompt without media."""
    if not out.media_spans:
        return None
    too_long = any(len(m) > MAX_MEDIA_NAME or len(i) > MAX_MEDIA_NAME for m, i, _, _ in out.media_spans)
    return MediaLayout(
        prompt_token_ids=list(out.prompt_token_ids or ()),
        spans=[] if too_long else [MediaSpan(*span) for span in out.media_spans],
    )
