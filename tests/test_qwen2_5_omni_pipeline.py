"""Qwen2.5-Omni end to end (stage_configs/qwen2_5_omni.yaml on the tiny checkpoint, float32, greedy):
thinker -> talker -> token2wav against transformers' reference
`Qwen2_5OmniForConditionalGeneration.generate(..., return_audio=True)` on the same checkpoint
(tests/qwen2_5_reference.py says where the reference is patched to run what its own forward says).

The pipeline's text tokens and talker codes (`return_latents`: ``talker.token_ids``) must equal the
reference's for text, a multi-turn chat, an audio clip, an image, a video and a video with its sound
track, each asked twice: the second time the thinker's prefix cache covers the medium (and the
talker's own prefix cache hits). The talker receives its inputs through a recording hand-off
(tests/downstream_probe.py): on the hit, the prompt embeddings of the positions the thinker's
prefix cache covered are bitwise the ones it received when the thinker computed every row (the
first, cold, request: the hidden-state cache served the hit's rows), the rows the hit computed
within FRESH_ATOL of the cold ones (check_hit_rows_equal_cold_rows says why), and for a text and an
image prompt all of them bitwise those of the same pipeline with prefix caching off, which also
equals the reference. The waveform must match within WAVE_ATOL and WAVE_RMS.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import numpy as np
import pytest
import qwen2_5_reference as ref
import torch
import yaml
from downstream_probe import PROBE_DIR_ENV, talker_inputs
from media_samples import clip_b64, png_data_url, video_data_url
from served_config import without_warmup
from shared_forkers import shared_forkers

from omni_cache.config import load_config
from omni_cache.models.qwen2_5_omni_token2wav import STREAM_MAX_ABS, STREAM_RMS
from omni_cache.pipeline import Pipeline
from omni_cache.serving.chat_request import MediaPart
from omni_cache.serving.media import MediaDecoder
from omni_cache.tiny.checkpoints import ensure_checkpoint

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
]

ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
THINKER_TOKENS = 12
TALKER_STEPS = 40  # the talker's sampling.max_tokens (random weights rarely say end-of-speech)
# token2wav in float32 over the same codes and the same initial noise. The decoder streams it in the
# reference's chunks (3 DiT blocks with 2 of past and 1 of future context): chunked flow matching is
# not exact, since the DiT's reach grows with each of its 36 evaluations, so the waveform is held to
# the decoder's measured streaming bounds (omni_cache/models/qwen2_5_omni_token2wav.py); a whole
# window equals the reference to 1e-6 (tests/test_qwen2_5_omni_token2wav.py).
WAVE_ATOL, WAVE_RMS = STREAM_MAX_ABS, STREAM_RMS
FRESH_ATOL = 1e-5  # rows a hit computes itself against the cold request's (check_hit_rows_equal_cold_rows)

PROMPTS = {
    "text": [{"role": "user", "content": "Tell me a story about a lighthouse keeper."}],
    "multi_turn": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi there."},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Say something about the sea."},
    ],
}
MEDIA_PART = {"image": {"type": "image"}, "audio": {"type": "audio"}, "video": {"type": "video"}}
PLACEHOLDER = {
    "image": "<|vision_bos|><|IMAGE|><|vision_eos|>",
    "audio": "<|audio_bos|><|AUDIO|><|audio_eos|>",
    "video": "<|vision_bos|><|VIDEO|><|vision_eos|>",
}
QUESTION = "What is in it? Describe it for a listener who cannot see or hear it."


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return ensure_checkpoint("qwen2.5-omni", tmp_path_factory.mktemp("q25omni"))


@pytest.fixture(scope="module")
def probe_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("probe")


def start_pipeline(checkpoint, probe_dir, tmp_path_factory, name: str, prefix_cache: bool = True):
    data = yaml.safe_load((ROOT / "stage_configs" / "qwen2_5_omni.yaml").read_text())
    data["name"] = name
    for stage in data["stages"]:
        if stage["kind"] == "autoregressive":
            stage["prefix_cache"] = prefix_cache
        stage["model"] = str(checkpoint)
        stage["address"] = f"ipc:///tmp/omni_cache/{name}-{os.getpid()}/{stage['name']}.sock"
        # Every stage checks every hand-off of the config it is given: all import the probe.
        stage["env"]["PYTHONPATH"] = os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])
        if stage["name"] == "talker":
            stage["sampling"]["max_tokens"] = TALKER_STEPS
            stage["handoff"] = "downstream_probe.record_qwen2_5_talker_inputs"
            stage["env"][PROBE_DIR_ENV] = str(probe_dir)
    path = tmp_path_factory.mktemp("cfg") / f"{name}.yaml"
    path.write_text(yaml.safe_dump(without_warmup(data)))  # (no test of first use here)
    return Pipeline(load_config(path), stage_forkers=shared_forkers()).start()


@pytest.fixture(scope="module")
def pipeline(checkpoint, probe_dir, tmp_path_factory):
    with start_pipeline(checkpoint, probe_dir, tmp_path_factory, "q25parity") as pipe:
        yield pipe


@pytest.fixture(scope="module")
def pipeline_off(checkpoint, tmp_path_factory):
    """The same pipeline with prefix caching (and so the hidden-state cache) off in both vLLM
    stages, recording what its talker receives in a directory of its own."""
    probe = tmp_path_factory.mktemp("probe_off")
    with start_pipeline(checkpoint, probe, tmp_path_factory, "q25off", prefix_cache=False) as pipe:
        yield pipe, probe


@pytest.fixture(scope="module")
def reference_model(checkpoint):
    return ref.load(checkpoint)


def media_items(kind: str) -> list:
    if kind == "image":
        return [MediaDecoder().image(png_data_url(84, 56, 3), "image")]
    if kind == "audio":
        return [MediaDecoder(audio_sample_rate=16000).audio(clip_b64(1.5, 44100, freq=440), "wav", "audio")]
    with_audio = kind == "video+audio"
    url = video_data_url(audio_s=2.0 if with_audio else None, seed=5)
    decoder = MediaDecoder(audio_sample_rate=16000, use_audio_in_video=with_audio)
    part = MediaPart("video", {"type": "video_url", "video_url": {"url": url}}, "video")
    return decoder.decode_all(decoder.read_all([part]))


def media_prompt(pipeline, kind: str) -> list[int]:
    part = "video" if kind.startswith("video") else kind
    return pipeline.tokenize([{"role": "user", "content": PLACEHOLDER[part] + QUESTION}])


def reference_inputs(checkpoint, kind: str, items: list) -> tuple[list[int], dict]:
    """The expanded prompt and media tensors transformers' processor makes of the same items."""
    from transformers import AutoProcessor

    proc = AutoProcessor.from_pretrained(checkpoint)
    part = "video" if kind.startswith("video") else kind
    messages = [{"role": "user", "content": [MEDIA_PART[part], {"type": "text", "text": QUESTION}]}]
    text = proc.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    if kind == "image":
        kwargs = {"images": [items[0].array]}
    elif kind == "audio":
        kwargs = {"audio": [items[0].array], "sampling_rate": items[0].sample_rate}
    else:
        kwargs = {"videos": [items[0].array], "fps": items[0].fps, "use_audio_in_video": kind == "video+audio"}
        if kind == "video+audio":
            kwargs.update(audio=[items[1].array], sampling_rate=items[1].sample_rate)
    inputs = proc(text=text, return_tensors="pt", **kwargs)
    expanded = inputs.pop("input_ids")[0].tolist()
    inputs.pop("attention_mask", None)
    if kind.startswith("video"):
        inputs["use_audio_in_video"] = kind == "video+audio"
    return expanded, dict(inputs)


def strip_stop(ids: list[int], stop: list[int]) -> list[int]:
    return ids[:-1] if ids and ids[-1] in stop else ids


def check_against_reference(got, want_text, want_codes, want_wav, model) -> None:
    eos = model.config.thinker_config.text_config.eos_token_id
    assert strip_stop(got.token_ids, [eos]) == strip_stop(want_text, [eos])
    codes = got.latents["talker.token_ids"].tolist()
    assert codes == want_codes
    assert got.audio is not None and got.audio.shape == want_wav.shape
    assert np.abs(got.audio - want_wav).max() <= WAVE_ATOL
    assert float(np.sqrt(np.mean((got.audio - want_wav) ** 2))) <= WAVE_RMS


def check_hit_rows_equal_cold_rows(probe_dir: Path, prompt: list[int], cached: int) -> None:
    """The talker's inputs of the hit (second request) against the cold one's (first): the rows
    of the prompt's first ``cached`` positions, which the hidden-state cache served, bitwise; the
    rows the hit computed itself (the rest of its prompt, its answer's) within FRESH_ATOL. vLLM's
    CPU attention gives a position a result that depends on how its prompt was split into cached
    and computed parts on some CPUs (AMD EPYC Zen 3: up to 2e-6 after a video prompt's hit), not
    on others (Zen 5: bitwise); that is vLLM's prefix caching, not the mirror."""
    recorded = talker_inputs(probe_dir)[tuple(prompt)]
    assert len(recorded) >= 2 and cached > 0
    cold, hit = recorded[0], recorded[-1]
    assert torch.equal(hit["prompt_embeds"][:cached], cold["prompt_embeds"][:cached])
    for key in ("prompt_embeds", "rows"):
        assert hit[key].shape == cold[key].shape
        assert float((hit[key] - cold[key]).abs().max()) <= FRESH_ATOL, key


@pytest.mark.parametrize("kind", sorted(PROMPTS))
def test_text_prompts_equal_the_reference_cold_and_on_a_hit(pipeline, reference_model, probe_dir, kind):
    token_ids = pipeline.tokenize(PROMPTS[kind])
    want = ref.reference(reference_model, token_ids, thinker_tokens=THINKER_TOKENS, talker_steps=TALKER_STEPS)
    before = pipeline.stats(timeout=30)
    for attempt in range(2):
        [got] = pipeline.generate([token_ids], max_tokens=THINKER_TOKENS, return_latents=True)
        check_against_reference(got, *want, reference_model)
        if attempt:
            assert got.cached_tokens.get("thinker", 0) > 0
    after = pipeline.stats(timeout=30)
    assert after["talker"]["prefix_cache_hit_tokens"] > before["talker"]["prefix_cache_hit_tokens"]
    check_hit_rows_equal_cold_rows(probe_dir, token_ids, got.cached_tokens["thinker"])


@pytest.mark.parametrize("kind", ["audio", "image", "video", "video+audio"])
def test_media_prompts_equal_the_reference_cold_and_on_a_hit_past_the_medium(
    pipeline, reference_model, checkpoint, probe_dir, kind
):
    items = media_items(kind)
    expanded, inputs = reference_inputs(checkpoint, kind, items)
    want = ref.reference(reference_model, expanded, thinker_tokens=THINKER_TOKENS, talker_steps=TALKER_STEPS, **inputs)
    cfg = reference_model.config.thinker_config
    media_ids = (cfg.image_token_index, cfg.video_token_index, cfg.audio_token_index)
    media_end = max(i for i, t in enumerate(expanded) if t in media_ids)
    prompt = media_prompt(pipeline, kind)
    for attempt in range(2):
        [got] = pipeline.generate([prompt], max_tokens=THINKER_TOKENS, return_latents=True, media=[items])
        assert got.num_prompt_tokens == len(expanded)
        check_against_reference(got, *want, reference_model)
        if attempt:
            assert got.cached_tokens.get("thinker", 0) > media_end
    check_hit_rows_equal_cold_rows(probe_dir, expanded, got.cached_tokens["thinker"])


def test_a_speaker_changes_the_speech_and_the_reference_agrees(pipeline, reference_model):
    token_ids = pipeline.tokenize(PROMPTS["text"])
    want = ref.reference(
        reference_model, token_ids, thinker_tokens=THINKER_TOKENS, talker_steps=TALKER_STEPS, speaker="Ethan"
    )
    [got] = pipeline.generate([token_ids], max_tokens=THINKER_TOKENS, return_latents=True, voice="ethan")
    check_against_reference(got, *want, reference_model)
    [chelsie] = pipeline.generate([token_ids], max_tokens=THINKER_TOKENS, return_latents=True)
    assert not np.array_equal(chelsie.audio, got.audio)


def test_several_at_once_keep_the_codes(pipeline, reference_model):
    token_ids = pipeline.tokenize(PROMPTS["text"])
    _, want_codes, _ = ref.reference(
        reference_model, token_ids, thinker_tokens=THINKER_TOKENS, talker_steps=TALKER_STEPS
    )
    results = pipeline.generate([token_ids] * 3, max_tokens=THINKER_TOKENS, return_latents=True)
    for r in results:
        assert r.latents["talker.token_ids"].tolist() == want_codes


@pytest.mark.parametrize("kind", ["text", "image"])
def test_cache_off_equals_the_reference_and_a_hits_talker_inputs_equal_cache_off(
    pipeline, pipeline_off, reference_model, checkpoint, probe_dir, kind
):
    """With prefix caching off the pipeline gives the reference's text, codes and audio too; and
    the talker's inputs of a request whose thinker prefix was served by the hidden-state cache are
    bitwise those of the cache-off pipeline's request."""
    off, off_probe = pipeline_off
    if kind == "text":
        items, prompt = [], pipeline.tokenize(PROMPTS["text"])
        expanded, inputs = prompt, {}
    else:
        items = media_items(kind)
        expanded, inputs = reference_inputs(checkpoint, kind, items)
        prompt = media_prompt(pipeline, kind)
    want = ref.reference(reference_model, expanded, thinker_tokens=THINKER_TOKENS, talker_steps=TALKER_STEPS, **inputs)
    media = [items] if items else None
    [got_off] = off.generate([prompt], max_tokens=THINKER_TOKENS, return_latents=True, media=media)
    check_against_reference(got_off, *want, reference_model)
    assert got_off.cached_tokens.get("thinker", 0) == 0
    for _ in range(2):  # the second is a hit, whatever ran before
        [got] = pipeline.generate([prompt], max_tokens=THINKER_TOKENS, return_latents=True, media=media)
    assert got.cached_tokens.get("thinker", 0) > 0
    hit = talker_inputs(probe_dir)[tuple(expanded)][-1]
    [cache_off] = talker_inputs(off_probe)[tuple(expanded)]
    assert torch.equal(hit["prompt_embeds"], cache_off["prompt_embeds"])
    assert torch.equal(hit["rows"], cache_off["rows"])
