"""Qwen3-Omni end to end (stage_configs/qwen3_omni.yaml on the tiny checkpoint, float32, greedy):
thinker -> talker -> code2wav against transformers' reference
`Qwen3OmniMoeForConditionalGeneration.generate(..., return_audio=True)` on the same checkpoint.

The pipeline's text tokens and every codebook of every talker step (`return_latents` brings the
talker's codes back as ``latents["talker.codes"]``) must equal the reference's; its waveform must
match within WAVE_ATOL. With the cache on, a repeated prompt (a prefix hit in both vLLM stages)
and several requests at once must still give exactly those codes.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from media_samples import clip_b64, png_data_url
from served_config import without_warmup
from shared_forkers import shared_forkers

from omni_cache.config import load_config
from omni_cache.pipeline import Pipeline
from omni_cache.serving.media import MediaDecoder
from omni_cache.tiny.checkpoints import ensure_checkpoint

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
]

ROOT = Path(__file__).resolve().parents[1]
THINKER_TOKENS = 12
TALKER_STEPS = 24  # the talker's sampling.max_tokens (random weights rarely say end-of-speech)
# code2wav in float32 over the same codes; the pipeline decodes in streaming windows with enough
# left context (omni_cache/models/code_windows.py), the reference in one 300-code chunk.
WAVE_ATOL = 1e-4
PROMPTS = {
    "text": "Tell me a story about a lighthouse keeper.",
    "multi_turn": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi there."},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Say something about the sea."},
    ],
}


AUDIO_PROMPT = [
    {"role": "user", "content": [{"type": "audio", "audio": "clip"}, {"type": "text", "text": "What do you hear?"}]}
]


def a_clip():
    """1.5 s at 44.1 kHz (not the model's 16 kHz), resampled as the server's media decoder does."""
    return MediaDecoder(audio_sample_rate=16000).audio(clip_b64(1.5, 44100, freq=440), "wav", "audio")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return ensure_checkpoint("qwen3-omni", tmp_path_factory.mktemp("q3omni"))


@pytest.fixture(scope="module")
def pipeline(checkpoint, tmp_path_factory):
    data = yaml.safe_load((ROOT / "stage_configs" / "qwen3_omni.yaml").read_text())
    name = "q3parity"
    data["name"] = name
    for stage in data["stages"]:
        stage["model"] = str(checkpoint)
        stage["address"] = f"ipc:///tmp/omni_cache/{name}-{os.getpid()}/{stage['name']}.sock"
        if stage["name"] == "talker":
            stage["sampling"]["max_tokens"] = TALKER_STEPS
    path = tmp_path_factory.mktemp("cfg") / f"{name}.yaml"
    path.write_text(yaml.safe_dump(without_warmup(data)))  # (no test of first use here)
    with Pipeline(load_config(path), stage_forkers=shared_forkers()).start() as pipe:
        yield pipe


@pytest.fixture(scope="module")
def reference_model(checkpoint):
    from transformers import Qwen3OmniMoeForConditionalGeneration

    model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32)
    return model.eval()


def reference(model, token_ids: list[int], **inputs) -> tuple[list[int], torch.Tensor, np.ndarray]:
    """Generated text ids, talker codes [G, steps] and waveform of transformers' generate
    (`inputs`: the processor's media tensors for an expanded prompt) for an answer of
    THINKER_TOKENS tokens.

    The reference's talker speaks the tokens its thinker fed through the model, which are all but
    the last one sampled; the pipeline's talker speaks the client's whole text, the last token of
    an answer cut by max_tokens included (omni_cache/handoff.py). So the reference writes one token
    more, and its first THINKER_TOKENS are the answer (an end of sequence stops both alike)."""
    captured = {}
    talker_generate = model.talker.generate

    def spy(*args, **kwargs):
        out = talker_generate(*args, **kwargs)
        captured["out"] = out
        return out

    model.talker.generate = spy
    try:
        ids = torch.tensor([token_ids])
        sequences, wav = model.generate(
            input_ids=ids,
            return_audio=True,
            thinker_max_new_tokens=THINKER_TOKENS + 1,
            thinker_eos_token_id=model.config.im_end_token_id,
            thinker_do_sample=False,
            talker_do_sample=False,
            talker_max_new_tokens=TALKER_STEPS,
            **inputs,
        )
    finally:
        model.talker.generate = talker_generate
    hidden = captured["out"].hidden_states
    codes = torch.stack([h[-1][0] for h in hidden if h[-1] is not None], dim=-1)  # [G, steps]
    answer = sequences[0, len(token_ids) : len(token_ids) + THINKER_TOKENS].tolist()
    return answer, codes, wav.reshape(-1).float().numpy()


def strip_eos(ids: list[int], eos: int) -> list[int]:
    return ids[:-1] if ids and ids[-1] == eos else ids


@pytest.mark.parametrize("kind", sorted(PROMPTS))
def test_text_codes_and_audio_equal_the_reference(pipeline, reference_model, kind):
    token_ids = pipeline.tokenize(PROMPTS[kind])
    [got] = pipeline.generate([token_ids], max_tokens=THINKER_TOKENS, return_latents=True)
    want_text, want_codes, want_wav = reference(reference_model, token_ids)
    eos = reference_model.config.im_end_token_id
    assert strip_eos(got.token_ids, eos) == strip_eos(want_text, eos)
    codes = got.latents["talker.codes"]
    assert codes.shape == want_codes.shape, (codes.shape, want_codes.shape)
    assert torch.equal(codes, want_codes)
    assert got.audio is not None and got.audio.shape == want_wav.shape
    assert np.abs(got.audio - want_wav).max() <= WAVE_ATOL


def test_answer_rows_from_the_embedding_table_are_the_thinkers_own(pipeline, checkpoint):
    """The hand-off takes an answer token's talker text row from the thinker's embedding table
    as soon as the token is sampled (omni_cache/handoff.py), a step before the thinker feeds it:
    those rows are bitwise the ones the thinker computes when it feeds the tokens."""
    from omni_cache.cache.latent_rows import merged_name
    from omni_cache.models.qwen3_omni_talker_prompt import TalkerPrompt

    token_ids = pipeline.tokenize(PROMPTS["text"])
    [got] = pipeline.generate([token_ids], max_tokens=THINKER_TOKENS, return_latents=True)
    rows = got.latents[merged_name(0, 2)]
    fed = got.token_ids[: rows.shape[0] - len(token_ids)]
    assert len(fed) == len(got.token_ids) - 1  # every answer token but the last was fed
    want = TalkerPrompt.load(checkpoint).embedding_rows(fed).to(rows.dtype)
    assert torch.equal(rows[len(token_ids) :], want)


def test_an_audio_prompt_equals_the_reference(pipeline, reference_model, checkpoint):
    from transformers import AutoProcessor

    clip = a_clip()
    proc = AutoProcessor.from_pretrained(checkpoint)
    text = proc.apply_chat_template(AUDIO_PROMPT, add_generation_prompt=True, tokenize=False)
    inputs = proc(text=text, audio=[clip.array], sampling_rate=clip.sample_rate, return_tensors="pt")
    expanded = inputs.pop("input_ids")[0].tolist()
    inputs.pop("attention_mask", None)
    prompt = pipeline.tokenize(
        AUDIO_PROMPT[:0] + [{"role": "user", "content": ("<|audio_start|><|audio_pad|><|audio_end|>What do you hear?")}]
    )
    [got] = pipeline.generate([prompt], max_tokens=THINKER_TOKENS, return_latents=True, media=[[clip]])
    want_text, want_codes, want_wav = reference(reference_model, expanded, **inputs)
    eos = reference_model.config.im_end_token_id
    assert got.num_prompt_tokens == len(expanded)
    assert strip_eos(got.token_ids, eos) == strip_eos(want_text, eos)
    assert torch.equal(got.latents["talker.codes"], want_codes)
    assert np.abs(got.audio - want_wav).max() <= WAVE_ATOL


IMAGE_PROMPT = [
    {"role": "system", "content": "Be brief."},
    {
        "role": "user",
        "content": [{"type": "image", "image": "img"}, {"type": "text", "text": "What is in the picture?"}],
    },
]


def an_image():
    return MediaDecoder().image(png_data_url(128, 96, 3), "image")


def test_an_image_prompts_talker_positions_equal_the_reference(reference_model, checkpoint):
    """The talker prompt's M-RoPE positions follow the image's grid exactly as the reference's
    rope index sets them."""
    from transformers import AutoProcessor

    from omni_cache.models.qwen3_omni_talker_prompt import TalkerPrompt

    proc = AutoProcessor.from_pretrained(checkpoint)
    text = proc.apply_chat_template(IMAGE_PROMPT, add_generation_prompt=True, tokenize=False)
    inputs = proc(text=text, images=[an_image().array], return_tensors="pt")
    ids = inputs["input_ids"][0].tolist()
    prompt = TalkerPrompt.load(checkpoint)
    positions, delta = prompt.positions(ids, inputs["image_grid_thw"].tolist())
    talker_ids = torch.tensor([prompt.talker_ids(ids)])
    want, want_delta = reference_model.talker.get_rope_index(
        talker_ids, inputs["image_grid_thw"], None, torch.ones_like(talker_ids)
    )
    assert torch.equal(positions, want[:, 0].long())
    assert delta == int(want_delta.item()) < 0


def test_an_image_prompt_equals_the_reference_also_on_a_hit(pipeline, reference_model, checkpoint):
    """Image rows reach the talker as the reference's hidden states (vision deepstack features
    excluded: workers/models/qwen3_omni_thinker.py); the same image again is a thinker hit that
    covers the image, with the same codes."""
    from transformers import AutoProcessor

    image = an_image()
    proc = AutoProcessor.from_pretrained(checkpoint)
    text = proc.apply_chat_template(IMAGE_PROMPT, add_generation_prompt=True, tokenize=False)
    inputs = proc(text=text, images=[image.array], return_tensors="pt")
    expanded = inputs.pop("input_ids")[0].tolist()
    inputs.pop("attention_mask", None)
    prompt = pipeline.tokenize(
        [
            IMAGE_PROMPT[0],
            {"role": "user", "content": ("<|vision_start|><|image_pad|><|vision_end|>What is in the picture?")},
        ]
    )
    want_text, want_codes, want_wav = reference(reference_model, expanded, **inputs)
    eos = reference_model.config.im_end_token_id
    image_end = max(i for i, t in enumerate(expanded) if t == reference_model.config.thinker_config.image_token_id)
    for attempt in range(2):
        [got] = pipeline.generate([prompt], max_tokens=THINKER_TOKENS, return_latents=True, media=[[image]])
        assert got.num_prompt_tokens == len(expanded)
        assert strip_eos(got.token_ids, eos) == strip_eos(want_text, eos)
        assert torch.equal(got.latents["talker.codes"], want_codes), attempt
        assert np.abs(got.audio - want_wav).max() <= WAVE_ATOL
        if attempt:
            assert got.cached_tokens.get("thinker", 0) > image_end


def test_prefix_hits_and_batching_keep_the_codes(pipeline, reference_model):
    token_ids = pipeline.tokenize(PROMPTS["text"])
    _, want_codes, _ = reference(reference_model, token_ids)
    before = pipeline.stats(timeout=30)
    # The same prompt three more times, all at once: prefix hits in thinker and talker, batched.
    results = pipeline.generate([token_ids] * 3, max_tokens=THINKER_TOKENS, return_latents=True)
    for r in results:
        assert torch.equal(r.latents["talker.codes"], want_codes)
        assert r.cached_tokens.get("thinker", 0) > 0
    after = pipeline.stats(timeout=30)
    hits = after["talker"]["prefix_cache_hit_tokens"] - before["talker"]["prefix_cache_hit_tokens"]
    assert hits > 0, "the talker's own prefix cache never hit on a repeated prompt"


def test_a_prompt_extending_an_earlier_one_equals_the_reference(pipeline, reference_model):
    """Turn 2 of a chat extends turn 1 (its user turn, the answer, a new user turn): the thinker
    hits through turn 1, the talker through turn 1's user rows, and the codes still equal the
    reference's for the whole turn-2 prompt."""
    first = [
        {
            "role": "user",
            "content": "Name a colour of the sea, and say why sailors of old cared so much about it on long voyages.",
        }
    ]  # over two KV blocks
    [one] = pipeline.generate([pipeline.tokenize(first)], max_tokens=THINKER_TOKENS)
    before = pipeline.stats(timeout=30)
    second = first + [{"role": "assistant", "content": one.text}, {"role": "user", "content": "And of the sky?"}]
    token_ids = pipeline.tokenize(second)
    [got] = pipeline.generate([token_ids], max_tokens=THINKER_TOKENS, return_latents=True)
    after = pipeline.stats(timeout=30)
    want_text, want_codes, want_wav = reference(reference_model, token_ids)
    eos = reference_model.config.im_end_token_id
    assert got.cached_tokens.get("thinker", 0) > 0
    assert after["talker"]["prefix_cache_hit_tokens"] > before["talker"]["prefix_cache_hit_tokens"]
    assert strip_eos(got.token_ids, eos) == strip_eos(want_text, eos)
    assert torch.equal(got.latents["talker.codes"], want_codes)
    assert np.abs(got.audio - want_wav).max() <= WAVE_ATOL


VIDEO_PROMPT = [
    {
        "role": "user",
        "content": [{"type": "video", "video": "clip"}, {"type": "text", "text": "What happens in the video?"}],
    }
]


def a_video(with_audio: bool):
    """16 frames of 96x64 at 8 fps (2 s) read as the server reads a video part: 4 frames sampled
    at 2 fps and, with ``with_audio``, its 2 s sound track at 16 kHz (use_audio_in_video)."""
    from media_samples import video_data_url

    from omni_cache.serving.chat_request import MediaPart

    url = video_data_url(audio_s=2.0 if with_audio else None, seed=5)
    decoder = MediaDecoder(audio_sample_rate=16000, use_audio_in_video=with_audio)
    part = MediaPart("video", {"type": "video_url", "video_url": {"url": url}}, "video")
    return decoder.decode_all(decoder.read_all([part]))


def video_reference_inputs(checkpoint, items):
    """The expanded prompt and media tensors transformers' processor makes of the same frames
    (and sound track), at the rate the stage's processor is given."""
    from transformers import AutoProcessor

    proc = AutoProcessor.from_pretrained(checkpoint)
    text = proc.apply_chat_template(VIDEO_PROMPT, add_generation_prompt=True, tokenize=False)
    frames, track = items[0], items[1] if len(items) > 1 else None
    kwargs = {"videos": [frames.array], "fps": frames.fps, "use_audio_in_video": track is not None}
    if track is not None:
        kwargs.update(audio=[track.array], sampling_rate=track.sample_rate)
    inputs = proc(text=text, return_tensors="pt", **kwargs)
    expanded = inputs.pop("input_ids")[0].tolist()
    inputs.pop("attention_mask", None)
    return expanded, inputs


@pytest.mark.parametrize("with_audio", [False, True], ids=["frames", "frames-and-sound"])
def test_a_video_prompt_equals_the_reference_also_on_a_hit(pipeline, reference_model, checkpoint, with_audio):
    """A video's frames (and, with use_audio_in_video, its sound track interleaved by time) reach
    the talker as the reference's hidden states, its talker positions follow the video's grid;
    the same video again is a thinker prefix hit past the video, with the same codes."""
    items = a_video(with_audio)
    expanded, inputs = video_reference_inputs(checkpoint, items)
    if with_audio:
        # transformers' talker rope index reads `config.audio_config.n_window` for a prompt with
        # audio and a video grid, which its talker config lacks (AttributeError in the reference
        # itself); the thinker's is the one it means. It only sizes the audio item: the
        # reference's positions there are plain (qwen3_omni_talker_prompt.py says why).
        reference_model.talker.config.audio_config = reference_model.config.thinker_config.audio_config
    want_text, want_codes, want_wav = reference(reference_model, expanded, use_audio_in_video=with_audio, **inputs)
    prompt = pipeline.tokenize(
        [{"role": "user", "content": ("<|vision_start|><|video_pad|><|vision_end|>What happens in the video?")}]
    )
    eos = reference_model.config.im_end_token_id
    cfg = reference_model.config.thinker_config
    video_end = max(i for i, t in enumerate(expanded) if t in (cfg.video_token_id, cfg.audio_token_id))
    for attempt in range(2):
        [got] = pipeline.generate([prompt], max_tokens=THINKER_TOKENS, return_latents=True, media=[items])
        assert got.num_prompt_tokens == len(expanded)
        assert strip_eos(got.token_ids, eos) == strip_eos(want_text, eos)
        assert torch.equal(got.latents["talker.codes"], want_codes), attempt
        assert np.abs(got.audio - want_wav).max() <= WAVE_ATOL
        if attempt:
            assert got.cached_tokens.get("thinker", 0) > video_end


def test_a_video_prompts_talker_positions_equal_the_reference(reference_model, checkpoint):
    """Without its sound track, a video's talker positions follow its grid, the temporal index
    scaled by seconds per patch, as the reference's rope index sets them."""
    from omni_cache.models.qwen3_omni_talker_prompt import TalkerPrompt

    expanded, inputs = video_reference_inputs(checkpoint, a_video(False))
    prompt = TalkerPrompt.load(checkpoint)
    grids = inputs["video_grid_thw"].tolist()
    seconds = inputs["video_second_per_grid"].tolist()
    positions, delta = prompt.positions(expanded, [], grids, seconds)
    talker_ids = torch.tensor([prompt.talker_ids(expanded)])
    want, want_delta = reference_model.talker.get_rope_index(
        talker_ids,
        None,
        inputs["video_grid_thw"],
        torch.ones_like(talker_ids),
        second_per_grids=inputs["video_second_per_grid"],
    )
    assert torch.equal(positions, want[:, 0].long())
    assert delta == int(want_delta.item()) != 0
