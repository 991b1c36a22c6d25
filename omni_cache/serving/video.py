"""Video parts: a container's header checked against ``server.media``, then its frames sampled and
decoded, and its sound track read, as the pinned vLLM reads videos for Qwen3-Omni.

Reading (:func:`probe`) opens the container with PyAV (FFmpeg's demuxers) and reads what its
header and stream headers say, decoding nothing: the video stream's width and height, frame rate
and frame count (estimated from duration x rate where the container does not store it), the
duration, and the sound track's length. Each is checked against its ``server.media`` key before
anything is decoded, so a file claiming 100,000 frames of 20,000 x 20,000 pixels costs a header
read. The frames the model will see are known then too (:func:`sampled_indices`: the sampling of
vLLM's loader for the entry stage's model: for Qwen3-Omni ``Qwen2VLVideoBackend``, a port of
transformers' ``Qwen2VLVideoProcessor.sample_frames``: ``video_fps`` frames a second, between
``video_min_frames`` and ``video_max_frames``, a multiple of the temporal patch of 2; for Qwen3-VL
and Qwen3.5 ``Qwen3VLVideoBackend``, the same count unrounded, spread by ``linspace``), which gives
the decoded size the server reserves (omni_cache/runtime/request_path/admission.py) before it decodes.

Decoding (:func:`decode_frames`) is vLLM's own loader (OpenCV), which reads the sampled frames
into ``uint8 [T, H, W, 3]`` RGB; a stream that yields fewer frames than its header promised
(corrupt, truncated) is a MediaError, not a shorter video. The sound track (:func:`decode_track`)
is vLLM's ``load_audio_pyav`` (mono, bounded by the probed length), resampled with libsoxr to the
thinker's audio rate like an ``input_audio`` clip. Resizing to the vision encoder's pixel budget is
the thinker's processor's (the checkpoint's ``video_preprocessor_config.json``).
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass

import numpy as np

from omni_cache.config.server_schema import MediaConfig
from omni_cache.models.preprocessor import QWEN2_VL, QWEN3_VL

#: Frames per temporal patch of Qwen3-Omni's vision encoder: sampled frame counts are multiples.
TEMPORAL_PATCH = 2
#: A sound track decodes a little longer than its header says (an AAC track's last frame is
#: padded to 1024 samples, its first primed): this much is reserved beyond the header's length,
#: and a track is cut there, so what decoding holds stays within what was reserved.
TRACK_SLACK_S = 0.25


class VideoProblem(ValueError):
    """A video that cannot be used (the caller turns it into a 400 naming the part)."""


@dataclass(frozen=True)
class VideoHeader:
    """What a video's container says about it, before anything is decoded."""

    width: int
    height: int
    frames: int  # in the file (the header's count, or duration x rate)
    fps: float  # the video stream's frame rate
    duration_s: float
    audio_s: float | None  # the sound track's length; None without one
    audio_rate: int = 0

    @property
    def has_audio(self) -> bool:
        return self.audio_s is not None


def probe(data: bytes, limits: MediaConfig) -> VideoHeader:
    """The container's header, checked against ``limits``; VideoProblem naming the limit or
    what is wrong with the file."""
    import av

    try:
        container = av.open(io.BytesIO(data), mode="r")
    except (av.error.FFmpegError, ValueError, OSError) as e:
        raise VideoProblem(f"video could not be read ({_why(e)}); send an MP4, WebM, MKV, MOV or AVI file") from None
    with container:
        if not container.streams.video:
            raise VideoProblem("the file has no video stream (send audio as an input_audio part)")
        stream = container.streams.video[0]
        ctx = stream.codec_context
        width, height = int(ctx.width or 0), int(ctx.height or 0)
        rate = stream.average_rate or stream.guessed_rate or stream.base_rate
        fps = float(rate) if rate else 0.0
        duration = _seconds(stream.duration, stream.time_base)
        if duration <= 0 and container.duration:
            duration = container.duration / 1e6  # av.time_base: microseconds
        frames = int(stream.frames or 0)
        if frames <= 0 and duration > 0 and fps > 0:
            frames = math.ceil(duration * fps)
        if duration <= 0 and frames > 0 and fps > 0:
            duration = frames / fps
        audio_s, audio_rate = None, 0
        if container.streams.audio:
            a = container.streams.audio[0]
            audio_rate = int(a.codec_context.sample_rate or a.rate or 0)
            audio_s = _seconds(a.duration, a.time_base)
            if audio_s <= 0 and container.duration:
                audio_s = container.duration / 1e6
    header = VideoHeader(width, height, frames, fps, duration, audio_s, audio_rate)
    _check(header, limits)
    return header


def _seconds(duration: int | None, time_base) -> float:
    return float(duration * time_base) if duration and time_base else 0.0


def _check(h: VideoHeader, limits: MediaConfig) -> None:
    if h.width <= 0 or h.height <= 0:
        raise VideoProblem("video stream has no frame size in its header")
    if h.fps <= 0 or h.frames <= 0 or h.duration_s <= 0:
        raise VideoProblem(
            "video stream has no frame rate, frame count or duration in its header (an empty or unfinished file?)"
        )
    if h.width * h.height > limits.max_video_frame_pixels:
        raise VideoProblem(
            f"video frames are {h.width}x{h.height} pixels; at most "
            f"{limits.max_video_frame_pixels} pixels per frame are accepted "
            "(server.media.max_video_frame_pixels)"
        )
    if h.duration_s > limits.max_video_seconds:
        raise VideoProblem(
            f"video is {h.duration_s:.1f} s long; at most "
            f"{limits.max_video_seconds:g} s are accepted (server.media.max_video_seconds)"
        )
    if h.frames > limits.max_video_frames:
        raise VideoProblem(
            f"video has {h.frames} frames; at most {limits.max_video_frames} are "
            "accepted (server.media.max_video_frames)"
        )
    if h.audio_s is not None and h.audio_s > limits.max_video_audio_seconds:
        raise VideoProblem(
            f"video's sound track is {h.audio_s:.1f} s long; at most "
            f"{limits.max_video_audio_seconds:g} s are accepted "
            "(server.media.max_video_audio_seconds)"
        )


def _sampling(limits: MediaConfig) -> dict:
    return {
        "min_frames": limits.video_min_frames,
        "max_frames": limits.video_max_frames,
        "temporal_patch_size": TEMPORAL_PATCH,
    }


def _backend(sampler: str):
    from vllm.multimodal.video import Qwen2VLVideoBackend, Qwen3VLVideoBackend

    return {QWEN2_VL: Qwen2VLVideoBackend, QWEN3_VL: Qwen3VLVideoBackend}[sampler]


def sampled_indices(header: VideoHeader, limits: MediaConfig, sampler: str = QWEN2_VL) -> list[int]:
    """The frame indices the model sees, as vLLM's loader for the model (``sampler``) picks them:
    Qwen2-VL's (a multiple of the temporal patch) or Qwen3-VL's (``linspace`` rounded)."""
    from vllm.multimodal.video_decoders import VideoSourceMetadata, VideoTargetMetadata

    source = VideoSourceMetadata(header.frames, header.fps, header.duration_s)
    target = VideoTargetMetadata(num_frames=-1, fps=limits.video_fps, max_duration=300)
    if header.frames < TEMPORAL_PATCH:
        raise VideoProblem(f"video has {header.frames} frame(s); at least {TEMPORAL_PATCH} are needed")
    return _backend(sampler).compute_frames_index_to_sample(source, target, **_sampling(limits))


def sampled_fps(header: VideoHeader, num_frames: int) -> float:
    """The rate of the sampled frames (frames per second of video): the thinker's processor
    places their temporal positions by it (seconds per temporal patch = 2 / rate)."""
    return num_frames / (header.frames / header.fps)


def decode_frames(data: bytes, header: VideoHeader, limits: MediaConfig, sampler: str, expected: int) -> np.ndarray:
    """The sampled frames, ``uint8 [T, H, W, 3]`` RGB, read by vLLM's loader for the model (OpenCV);
    ``expected``: how many it samples (``len(sampled_indices(...))``, which the caller has)."""
    try:
        frames, _ = _backend(sampler).load_bytes(data, fps=limits.video_fps, backend="opencv", **_sampling(limits))
    except Exception as e:  # noqa: BLE001 - a crafted stream fails anywhere in the loader
        # (a corrupt file made vLLM's sampler divide by the zero frames it found): a 400, not a 500
        raise VideoProblem(f"video stream is corrupt: it could not be decoded ({_why(e)})") from None
    frames = np.asarray(frames)
    if frames.ndim != 4 or frames.shape[0] != expected or frames.shape[-1] != 3:
        raise VideoProblem(
            f"video stream is corrupt: {frames.shape[0] if frames.ndim == 4 else 0} of "
            f"its {expected} sampled frames could be decoded"
        )
    if frames.shape[1:3] != (header.height, header.width):
        raise VideoProblem(
            f"video frames decode as {frames.shape[2]}x{frames.shape[1]}, not the "
            f"{header.width}x{header.height} its header says"
        )
    return np.ascontiguousarray(frames, dtype=np.uint8)


def decode_track(data: bytes, header: VideoHeader, rate: int) -> np.ndarray:
    """The sound track, mono ``float32`` at ``rate`` (vLLM's ``load_audio_pyav``, then libsoxr)."""
    from vllm.multimodal.media.audio import load_audio_pyav

    try:
        samples, native = load_audio_pyav(
            io.BytesIO(data), sr=None, mono=True, max_duration_s=(header.audio_s or 0) + 1.0
        )
    except (ValueError, RuntimeError, OSError) as e:
        raise VideoProblem(f"video's sound track could not be decoded ({_why(e)})") from None
    if samples.size == 0:
        raise VideoProblem("video's sound track has no samples")
    if int(native) != rate:
        import soxr

        samples = soxr.resample(samples, int(native), rate)
    return np.ascontiguousarray(samples[: _track_samples(header, rate)], dtype=np.float32)


def _track_samples(header: VideoHeader, rate: int) -> int:
    return math.ceil(((header.audio_s or 0) + TRACK_SLACK_S) * rate)


def decoded_bytes(header: VideoHeader, num_frames: int, audio_rate: int, with_audio: bool) -> int:
    """What decoding will hold: the sampled RGB frames, and the track at ``audio_rate`` in float32."""
    frames = num_frames * header.width * header.height * 3
    track = _track_samples(header, audio_rate) * 4 if with_audio else 0
    return frames + track


def _why(e: Exception) -> str:
    """An exception as a client reads it. FFmpeg's errors (PyAV's ``FFmpegError``) write their
    errno and the file they read, here ``'<none>'`` for the server's buffer: "[Errno 1094995529]
    Invalid data found when processing input: '<none>'"; their ``strerror`` is the reason."""
    return f"{type(e).__name__}: {getattr(e, 'strerror', None) or e}"
