"""Video parts without an engine (omni_cache/serving/video.py through serving/media.py): the
container header read and checked before anything is decoded, frame sampling as vLLM's Qwen2-VL
loader does it (its Qwen3-VL loader's for Qwen3-VL-family checkpoints, with the metadata that loader
writes), the decoded size reserved up front bounding what decoding holds, the digest, when a sound
track goes along (use_audio_in_video), and the Submit's UUIDs and processor kwargs."""

from __future__ import annotations

import asyncio
import base64
from pathlib import Path

import numpy as np
import pytest
import yaml
from media_samples import served_file, video_bytes

from omni_cache.config import load_config
from omni_cache.config.errors import ConfigError
from omni_cache.config.server_schema import MediaConfig
from omni_cache.models.preprocessor import QWEN2_VL, QWEN3_VL
from omni_cache.runtime.request_path.requests import AUDIO, VIDEO
from omni_cache.serving import video
from omni_cache.serving.chat_request import MediaPart
from omni_cache.serving.media import MediaDecoder, MediaError

ROOT = Path(__file__).resolve().parents[1]


def part(data: bytes, i: int = 0) -> MediaPart:
    url = "data:video/mp4;base64," + base64.b64encode(data).decode()
    return MediaPart(VIDEO, {"type": "video_url", "video_url": {"url": url}}, f"messages.0.content.{i}")


def audio_part() -> MediaPart:
    from media_samples import clip_b64

    return MediaPart(
        AUDIO, {"type": "input_audio", "input_audio": {"data": clip_b64(), "format": "wav"}}, "messages.0.content.1"
    )


def test_the_header_says_size_rate_frames_and_track_before_decoding():
    h = video.probe(video_bytes(frames=16, w=96, h=64, fps=8, audio_s=3.0), MediaConfig())
    assert (h.width, h.height, h.frames, h.fps, h.duration_s) == (96, 64, 16, 8.0, 2.0)
    assert h.has_audio and 3.0 <= h.audio_s < 3.2 and h.audio_rate == 16000
    assert not video.probe(video_bytes(), MediaConfig()).has_audio


@pytest.mark.parametrize(
    "kwargs, limits, key",
    [
        ({"w": 256, "h": 128, "frames": 4}, {"max_video_frame_pixels": 96 * 64}, "max_video_frame_pixels"),
        ({"frames": 40, "fps": 20}, {"max_video_frames": 39}, "max_video_frames"),
        ({"frames": 8, "fps": 2}, {"max_video_seconds": 3.5}, "max_video_seconds"),
        ({"audio_s": 4.0}, {"max_video_audio_seconds": 3.0}, "max_video_audio_seconds"),
        ({}, {"max_video_bytes": 1000}, "max_video_bytes"),
    ],
)
def test_each_limit_is_checked_from_the_header(monkeypatch, kwargs, limits, key):
    monkeypatch.setattr(video, "decode_frames", lambda *a: pytest.fail("decoded before the checks"))
    decoder = MediaDecoder(MediaConfig(**limits))
    with pytest.raises(MediaError) as e:
        decoder.decode_all(decoder.read_all([part(video_bytes(**kwargs))]))
    assert f"server.media.{key}" in str(e.value) and e.value.param == "messages.0.content.0.video_url.url"


@pytest.mark.parametrize(
    "frames, fps, limits, want",
    [
        (16, 8, {}, 4),  # 2 s at 2 frames a second
        (40, 8, {}, 10),
        (40, 8, {"video_max_frames": 6}, 6),
        (6, 8, {}, 4),  # 0.75 s: at least video_min_frames
        (3, 8, {}, 2),  # fewer than the minimum: every whole temporal pair
        (16, 8, {"video_fps": 4.0}, 8),
    ],
)
def test_frames_are_sampled_as_vllms_qwen2vl_loader_samples_them(frames, fps, limits, want):
    from vllm.multimodal.video import Qwen2VLVideoBackend

    data = video_bytes(frames=frames, fps=fps)
    config = MediaConfig(**limits)
    decoder = MediaDecoder(config)
    [item] = decoder.decode_all(decoder.read_all([part(data)]))
    expected, _ = Qwen2VLVideoBackend.load_bytes(
        data,
        fps=config.video_fps,
        backend="opencv",
        min_frames=config.video_min_frames,
        max_frames=config.video_max_frames,
    )
    assert item.kind == VIDEO and item.array.shape == (want, 64, 96, 3)
    assert np.array_equal(item.array, expected)
    assert item.fps == pytest.approx(want / (frames / fps))


@pytest.mark.parametrize(
    "frames, fps, limits, want",
    [
        (16, 8, {}, [0, 5, 10, 15]),  # 2 s at 2 frames a second, spread over the clip
        (40, 8, {}, [0, 4, 9, 13, 17, 22, 26, 30, 35, 39]),
        (14, 8, {}, [0, 4, 9, 13]),  # 1.75 s: 3 frames a second would give, at least video_min_frames
        (3, 8, {}, [0, 1, 2]),  # fewer than the minimum: every frame (no temporal pairs)
        (16, 8, {"video_fps": 3.0}, [0, 3, 6, 9, 12, 15]),
    ],
)
def test_a_qwen3_vl_model_samples_and_stamps_frames_as_vllms_qwen3vl_loader(frames, fps, limits, want):
    """Qwen3-VL / Qwen3.5 (their checkpoints' Qwen3VLVideoProcessor): the frames vLLM's Qwen3-VL
    loader picks, and the metadata it writes for them (what the processor stamps times from)."""
    from vllm.multimodal.video import Qwen3VLVideoBackend

    from omni_cache.wire.messages import MediaRef
    from workers.video_input import VideoInput

    data = video_bytes(frames=frames, fps=fps)
    config = MediaConfig(**limits)
    decoder = MediaDecoder(config, video_sampler=QWEN3_VL)
    [item] = decoder.decode_all(decoder.read_all([part(data)]))
    expected, meta = Qwen3VLVideoBackend.load_bytes(
        data, fps=config.video_fps, backend="opencv", min_frames=config.video_min_frames, max_frames=768
    )
    assert list(item.frame_indices) == meta["frames_indices"] == want
    assert np.array_equal(item.array, expected)
    assert (item.source_fps, item.source_frames) == (meta["fps"], meta["total_num_frames"]) == (fps, frames)
    ref = MediaRef(
        kind="video",
        tensor="media.0",
        fps=item.fps,
        frame_indices=list(item.frame_indices),
        source_fps=item.source_fps,
        source_frames=item.source_frames,
    )
    _, sent = VideoInput(needs_metadata=True).item(item.array, ref)
    for key in ("fps", "total_num_frames", "frames_indices", "duration", "video_backend"):
        assert sent[key] == pytest.approx(meta[key]) if key == "duration" else sent[key] == meta[key], key
    assert sent["do_sample_frames"] is False  # sampled here already
    # Qwen3-Omni's sampler is unchanged by it, and the two readings never share a digest.
    assert MediaDecoder(config).read_all([part(data)])[0].digest != decoder.read_all([part(data)])[0].digest


def test_a_video_without_its_frames_place_in_the_clip_is_refused_for_a_qwen3_vl_model():
    from omni_cache.wire.messages import MediaRef
    from workers.video_input import VideoInput

    frames = np.zeros((4, 8, 8, 3), np.uint8)
    with pytest.raises(ValueError, match="indices in the clip"):
        VideoInput(needs_metadata=True).item(frames, MediaRef(kind="video", tensor="media.0", fps=2.0))
    assert VideoInput().item(frames, MediaRef(kind="video", tensor="media.0", fps=2.0)) is frames


def test_the_sampler_is_the_one_vllm_picks_for_the_checkpoints_video_processor(tmp_path):
    import json

    from omni_cache.models.preprocessor import video_sampler
    from omni_cache.tiny import qwen3_5 as tiny_qwen3_5
    from omni_cache.tiny import qwen3_omni as tiny_qwen3_omni

    for name, config, want in (
        ("qwen3.5", tiny_qwen3_5.video_preprocessor_config(), QWEN3_VL),
        ("omni", tiny_qwen3_omni.video_preprocessor_config(), QWEN2_VL),
        ("other", {"video_processor_type": "LlavaNextVideoProcessor"}, QWEN2_VL),
    ):
        (tmp_path / name).mkdir()
        (tmp_path / name / "video_preprocessor_config.json").write_text(json.dumps(config))
        assert video_sampler(tmp_path / name) == want, name
    assert video_sampler(tmp_path / "none") == QWEN2_VL  # no video processor: Qwen3-Omni's


def test_what_is_reserved_bounds_what_decoding_holds():
    decoder = MediaDecoder(MediaConfig(), audio_sample_rate=16000)
    encoded = decoder.read_all([part(video_bytes(frames=24, fps=8, audio_s=3.0))])
    items = decoder.decode_all(encoded)
    assert [i.kind for i in items] == [VIDEO, AUDIO] and items[1].in_video
    held = sum(i.array.nbytes for i in items)
    assert held <= encoded[0].decoded_bytes <= held + 16000 * 4 // 2  # within half a second of samples


def test_the_digest_covers_the_bytes_and_the_sampling():
    data = video_bytes(seed=1)
    digest = MediaDecoder().read_all([part(data)])[0].digest
    assert MediaDecoder().read_all([part(data)])[0].digest == digest
    assert MediaDecoder(MediaConfig(video_fps=1.0)).read_all([part(data)])[0].digest != digest
    assert MediaDecoder().read_all([part(video_bytes(seed=2))])[0].digest != digest


def test_a_sound_track_goes_along_where_it_can():
    with_track, silent = video_bytes(audio_s=2.0), video_bytes()

    def kinds(parts, **kwargs):
        decoder = MediaDecoder(**kwargs)
        return [(i.kind, i.in_video) for i in decoder.decode_all(decoder.read_all(parts))]

    assert kinds([part(with_track)]) == [(VIDEO, False), (AUDIO, True)]
    assert kinds([part(with_track)], limits=MediaConfig(use_audio_in_video=False)) == [(VIDEO, False)]
    assert kinds([part(with_track)], use_audio_in_video=False) == [(VIDEO, False)]
    # By default a request whose tracks cannot all go along sends frames only ...
    assert kinds([part(with_track), part(silent, 1)]) == [(VIDEO, False), (VIDEO, False)]
    assert kinds([part(with_track), audio_part()]) == [(VIDEO, False), (AUDIO, False)]
    # ... and one that asked for them is told why not.
    for parts, why in (([part(silent)], "has no sound track"), ([part(with_track), audio_part()], "input_audio parts")):
        with pytest.raises(MediaError) as e:
            kinds(parts, use_audio_in_video=True)
        assert why in str(e.value) and e.value.param == "mm_processor_kwargs.use_audio_in_video"


def test_the_submits_uuids_carry_the_processor_kwargs():
    from omni_cache.wire.messages import MediaRef
    from workers.engine_media import mm_processor_kwargs, multi_modal_uuids

    refs = [
        MediaRef(kind="image", tensor="media.0", uuid="i"),
        MediaRef(kind="video", tensor="media.1", uuid="v", fps=2.0),
        MediaRef(kind="audio", tensor="media.2", uuid="a", sample_rate=16000, in_video=True),
    ]
    assert mm_processor_kwargs(refs) == {"fps": 2.0, "use_audio_in_video": True}
    assert multi_modal_uuids(refs) == {"image": ["i"], "video": ["v:fps=2:av=1"], "audio": ["a:fps=2:av=1"]}
    assert mm_processor_kwargs(refs[:1]) is None and multi_modal_uuids(refs[:1]) == {"image": ["i"]}
    assert multi_modal_uuids(refs[:2]) == {"image": ["i"], "video": ["v:fps=2:av=0"]}


def test_min_frames_above_max_frames_is_a_config_error(tmp_path):
    data = yaml.safe_load((ROOT / "stage_configs" / "qwen3_omni.yaml").read_text())
    data["server"].setdefault("media", {}).update({"video_min_frames": 10, "video_max_frames": 8})
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError) as e:
        load_config(path, check_paths=False)
    assert "server.media.video_min_frames" in str(e.value) and "video_max_frames" in str(e.value)


@pytest.fixture
def video_host():
    data = video_bytes(seed=3)
    with served_file(data, "video/mp4", "clip.mp4") as url:
        yield url, data


def test_a_video_url_is_fetched_from_an_allowed_host_within_max_video_bytes(video_host):
    url, data = video_host
    remote = MediaPart(VIDEO, {"type": "video_url", "video_url": {"url": url}}, "messages.0.content.0")
    decoder = MediaDecoder(MediaConfig(allowed_url_hosts=["127.0.0.1"]))
    asyncio.run(decoder.fetch_all([remote]))  # as the server does: awaited on its loop
    [fetched] = decoder.decode_all(decoder.read_all([remote]))
    [sent] = decoder.decode_all(decoder.read_all([part(data)]))
    assert fetched.digest == sent.digest and np.array_equal(fetched.array, sent.array)
    with pytest.raises(MediaError, match="video_url from host '127.0.0.1' is not fetched"):
        asyncio.run(MediaDecoder().fetch_all([remote]))
    with pytest.raises(MediaError, match="server.media.max_video_bytes"):
        asyncio.run(
            MediaDecoder(MediaConfig(allowed_url_hosts=["127.0.0.1"], max_video_bytes=1000)).fetch_all([remote])
        )


def test_the_benchmarks_video_workload_sends_one_readable_video_to_all():
    from benchmarks.workloads import Sizes, build_workload, messages_for, prompt_tokens_expected

    warmup, sessions = build_workload("video", Sizes(num_requests=3, unique_tokens=20), seed=1)
    parts = [messages_for(s, 0, [])[0]["content"] for s in warmup + sessions]
    urls = {p[0]["video_url"]["url"] for p in parts}
    assert len(urls) == 1 and len({p[1]["text"] for p in parts}) == 4
    assert prompt_tokens_expected(sessions[0], 0, []) is None
    decoder = MediaDecoder()
    video_part = MediaPart(VIDEO, parts[0][0], "messages.0.content.0")
    items = decoder.decode_all(decoder.read_all([video_part]))
    assert [(i.kind, i.in_video) for i in items] == [(VIDEO, False), (AUDIO, True)]
    assert items[0].array.shape == (4, 64, 96, 3)


def test_a_sound_track_shorter_than_the_feature_extractor_takes_is_refused(monkeypatch):
    # AAC (media_samples' tracks) holds at least a 1,024-sample frame: a shorter track, as another
    # codec can hold, stands in by the decoded track cut to 10 ms.
    decode_track = video.decode_track
    monkeypatch.setattr(video, "decode_track", lambda *a: decode_track(*a)[:160])
    decoder = MediaDecoder(MediaConfig(), audio_sample_rate=16000)
    encoded = decoder.read_all([part(video_bytes(frames=8, fps=8, audio_s=1.0))])
    with pytest.raises(MediaError, match="the video's sound track is 10.0 ms long; at least 25 ms") as e:
        decoder.decode_all(encoded)
    assert e.value.param == encoded[0].param


def test_a_video_thinner_than_the_video_processor_takes_is_refused_from_its_header():
    with pytest.raises(MediaError, match="video is 404x2 pixels, one side 202 times the other") as e:
        MediaDecoder().read_all([part(video_bytes(frames=4, w=404, h=2))])
    assert e.value.param == "messages.0.content.0.video_url.url"
    assert MediaDecoder().read_all([part(video_bytes(frames=4, w=400, h=2))])[0].kind == VIDEO


def test_a_file_ffmpeg_cannot_read_is_refused_in_ffmpegs_words_alone():
    """FFmpeg's error text carries its errno and the file it read, the server's buffer: the
    client read "(InvalidDataError: [Errno 1094995529] Invalid data found when processing
    input: '<none>')"."""
    with pytest.raises(video.VideoProblem) as e:
        video.probe(b"this is a text file, not a video at all\n" * 20, MediaConfig())
    assert str(e.value) == (
        "video could not be read (InvalidDataError: Invalid data found when processing input); "
        "send an MP4, WebM, MKV, MOV or AVI file"
    )
