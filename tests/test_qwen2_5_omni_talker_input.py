"""Qwen2.5-Omni's talker inputs (omni_cache/models/qwen2_5_omni_talker_input.py) against transformers'
reference on the tiny checkpoint: the talker prompt's M-RoPE positions equal the reference talker's
rope index for text, image, audio, video and a video interleaved with its sound track
(use_audio_in_video); the speaker row and codec specials are the reference's; an unknown voice is
refused naming the checkpoint's speakers. No vLLM: seconds."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from media_samples import video_data_url

from omni_cache.models.qwen2_5_omni_talker_input import Qwen25TalkerInput
from omni_cache.serving.chat_request import MediaPart
from omni_cache.serving.media import MediaDecoder
from omni_cache.tiny.checkpoints import ensure_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return ensure_checkpoint("qwen2.5-omni", tmp_path_factory.mktemp("q25"))


@pytest.fixture(scope="module")
def hf(checkpoint):
    from transformers import AutoProcessor, Qwen2_5OmniForConditionalGeneration

    cls = Qwen2_5OmniForConditionalGeneration
    model = super(cls, cls).from_pretrained(checkpoint, dtype=torch.float32)
    model.load_speakers(checkpoint / "spk_dict.pt")
    return model.eval(), AutoProcessor.from_pretrained(checkpoint)


@pytest.fixture(scope="module")
def talker(checkpoint):
    return Qwen25TalkerInput.load(checkpoint)


def _clip(seconds: float) -> np.ndarray:
    t = np.arange(int(seconds * 16000)) / 16000
    return (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)


def _video(with_audio: bool):
    url = video_data_url(audio_s=3.0 if with_audio else None, frames=24, seed=3)
    decoder = MediaDecoder(audio_sample_rate=16000, use_audio_in_video=with_audio)
    part = MediaPart("video", {"type": "video_url", "video_url": {"url": url}}, "video")
    return decoder.decode_all(decoder.read_all([part]))


def _inputs(proc, kind: str):
    content = {"text": [], "image": [{"type": "image"}], "audio": [{"type": "audio"}]}.get(kind, [{"type": "video"}])
    messages = [{"role": "user", "content": [*content, {"type": "text", "text": "What is it?"}]}]
    text = proc.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    kwargs: dict = {}
    if kind == "image":
        kwargs["images"] = [np.random.default_rng(0).integers(0, 256, (56, 84, 3), dtype=np.uint8)]
    elif kind == "audio":
        kwargs.update(audio=[_clip(1.5)], sampling_rate=16000)
    elif kind.startswith("video"):
        items = _video(kind == "video+audio")
        kwargs.update(videos=[items[0].array], fps=items[0].fps, use_audio_in_video=kind == "video+audio")
        if kind == "video+audio":
            kwargs.update(audio=[items[1].array], sampling_rate=items[1].sample_rate)
    return proc(text=text, return_tensors="pt", **kwargs)


@pytest.mark.parametrize("kind", ["text", "image", "audio", "video", "video+audio"])
def test_talker_positions_equal_the_reference_rope_index(hf, talker, kind):
    model, proc = hf
    inputs = _inputs(proc, kind)
    ids = inputs["input_ids"][0].tolist()
    speaker = talker.speaker("")
    rope_ids = talker.prompt_ids(ids, 97, speaker)
    grids = lambda k: inputs[k].tolist() if k in inputs else []  # noqa: E731
    seconds = inputs["video_second_per_grid"].tolist() if "video_second_per_grid" in inputs else []
    positions, delta = talker.positions(rope_ids, grids("image_grid_thw"), grids("video_grid_thw"), seconds)
    text_ids = torch.tensor([rope_ids])
    audio_lengths = inputs["feature_attention_mask"].sum(-1) if "feature_attention_mask" in inputs else None
    want, want_delta = model.talker.get_rope_index(
        text_ids,
        inputs.get("image_grid_thw"),
        inputs.get("video_grid_thw"),
        torch.ones_like(text_ids),
        kind == "video+audio",
        audio_lengths,
        inputs.get("video_second_per_grid"),
    )
    assert torch.equal(positions, want[:, 0].long())
    assert delta == int(want_delta.item())
    if kind in ("image", "video", "video+audio"):
        assert delta != 0  # the grid really moved the positions


def test_speaker_row_and_codec_specials_are_the_references(hf, talker):
    model, _ = hf
    rows = torch.randn(5, model.config.thinker_config.text_config.hidden_size)
    assert sorted(talker.speakers) == ["Chelsie", "Ethan"]  # the loop checks each (none loaded: nothing)
    for name in talker.speakers:
        prompt = talker.prompt(rows, name)
        embed = model.thinker.get_input_embeddings()
        codec = model.talker.get_input_embeddings()
        bos = embed(torch.tensor([model.speaker_map[name]["bos_token"]]))[0]
        assert torch.equal(prompt[:4], rows[:4])
        assert torch.equal(prompt[4], bos + codec(torch.tensor([model.talker.codec_pad_token]))[0])
        assert torch.equal(prompt[5], rows[4] + codec(torch.tensor([model.talker.codec_bos_token]))[0])
    assert talker.stop_ids() == [model.talker.codec_pad_token, model.talker.codec_eos_token]
    assert talker.penalized_prompt_ids() == [
        model.talker.codec_mask_token,
        model.talker.codec_pad_token,
        model.talker.codec_bos_token,
    ]


def test_rows_add_the_token_embedding_except_at_media_placeholders(hf, talker):
    model, _ = hf
    ids = [97, 98, next(iter(talker.media_ids)), 99]
    hidden = torch.randn(4, model.config.thinker_config.text_config.hidden_size)
    embed = model.thinker.get_input_embeddings()(torch.tensor(ids))
    want = hidden + embed
    want[2] = hidden[2]
    assert torch.equal(talker.rows(hidden, ids), want)


def test_voices_resolve_to_the_checkpoints_speakers(talker):
    assert talker.speaker("") == talker.speaker("default") == "Chelsie"
    assert talker.speaker("ethan") == "Ethan"
    with pytest.raises(ValueError, match="unknown voice 'alloy'; this checkpoint speaks with Chelsie, Ethan"):
        talker.speaker("alloy")
