"""The hidden-state cache on the real multimodal thinker (tiny Qwen3-Omni, float32): image and audio
prefixes hit, the encoder does not run for cached media, and every row is right.

Two in-process engines of the checkpoint's thinker, one with vLLM's prefix cache and our mirror, one
without (the oracle). The thinker emits what a Qwen3-Omni talker reads: the final hidden state, tap 0
(the input embeddings, which at image/audio placeholder positions are the encoder outputs) and the
tap at the talker's ``accept_hidden_layer``. For each of image, audio (sent at 44.1 kHz, resampled by
the server's media decoder) and both together, a first request fills the cache and a second one with
the same media and shared text, then another question, must:

* hit at least every token up to the end of the media (``num_cached_tokens``),
* not run the encoder again (the scheduler's ``encoder_runs`` counter),
* get the served rows bitwise equal to the first request's rows at those positions,
* match the cache-off engine in every row (prompt rows at text, image and audio positions, and the
  generated rows), relative L2 error per row <= ROW_RTOL as in test_hidden_cache.py (float32: MoE
  routing flips under bfloat16 rounding would make a bf16 comparison meaningless).

The engines also emit the merged latent the shipped pipeline sends its talker (``latents.merged``:
tap 0, with the accept-layer state at the prompt's media placeholders); it must equal the two taps
chosen that way bitwise, in fresh rows and in rows a hit served.

Tap 0 at text positions is an embedding lookup, so those rows must equal the checkpoint's embedding
rows exactly, read after the request ran to its end: this is what caught rows aliasing vLLM's
``inputs_embeds`` buffer (a later step overwrote them before the stage read them).
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from media_samples import clip_b64, png_data_url
from PIL import Image
from thinker_harness import Result, close, comparable_rows, run
from thinker_pair import row_errors

from omni_cache.serving.media import MediaDecoder
from omni_cache.tiny.checkpoints import ensure_checkpoint
from omni_cache.tiny.qwen3_omni import TOKEN_ID

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
]

ROW_RTOL = 1e-4
TIE_MARGIN = 1e-3  # a greedy near-tie between the engines (nats), as in test_hidden_cache.py
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
AUDIO = "<|audio_start|><|audio_pad|><|audio_end|>"
# Shared text after the media: long enough that the hit covers whole blocks past the media.
CONTEXT = "Here is some shared context that every question about this item repeats. " * 2


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return ensure_checkpoint("qwen3-omni", tmp_path_factory.mktemp("q3omni"))


@pytest.fixture(scope="module")
def taps(path):
    accept = json.loads((path / "config.json").read_text())["talker_config"]["accept_hidden_layer"]
    return (0, accept)


def make_stage(path, taps, cache: bool):
    from workers.latent_capture import LatentOptions
    from workers.llm_stage import LLMStage

    return LLMStage(
        str(path),
        dict(
            enforce_eager=True,
            gpu_memory_utilization=0.3,
            dtype="float32",
            block_size=32,
            max_model_len=2048,
            kv_cache_memory_bytes=256 * 2**20,
            limit_mm_per_prompt={"image": 2, "audio": 2, "video": 0},
        ),
        prefix_cache=cache,
        latents=LatentOptions(hidden=True, layers=taps, merged=taps, cache=cache),
    )


@pytest.fixture(scope="module")
def engines(path, taps):
    on, off = make_stage(path, taps, True), make_stage(path, taps, False)
    yield on, off
    close(on)
    close(off)


@pytest.fixture(scope="module")
def embeddings(path):
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return f.get_tensor("thinker.model.embed_tokens.weight").float()


def tokens(text: str) -> list[int]:
    """The byte-level tokenizer of the tiny checkpoint: specials by id, every other byte is its id."""
    out, i = [], 0
    while i < len(text):
        special = next((t for t in TOKEN_ID if text.startswith(t, i)), None)
        if special:
            out.append(TOKEN_ID[special])
            i += len(special)
        else:
            out.extend(text[i].encode())
            i += 1
    return out


def chat(user: str) -> list[int]:
    return tokens(f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n")


def an_image(seed: int):
    return Image.fromarray(MediaDecoder().image(png_data_url(128, 96, seed), "image").array)


def a_clip(seed: int):
    # 44.1 kHz, not the model's 16 kHz: the media decoder resamples it
    item = MediaDecoder(audio_sample_rate=16000).audio(clip_b64(1.5, 44100, freq=300 + 100 * seed), "wav", "audio")
    return item.array, item.sample_rate


MEDIA = {
    "image": (IMAGE, lambda s: {"image": an_image(s)}),
    "audio": (AUDIO, lambda s: {"audio": a_clip(s)}),
    "both": (IMAGE + AUDIO, lambda s: {"image": an_image(s), "audio": a_clip(s)}),
}


def prompt(kind: str, seed: int, question: str) -> dict:
    placeholders, media = MEDIA[kind]
    return {"prompt_token_ids": chat(placeholders + CONTEXT + question), "multi_modal_data": media(seed)}


MEDIA_START = (TOKEN_ID["<|vision_start|>"], TOKEN_ID["<|audio_start|>"])
MEDIA_CLOSE = (TOKEN_ID["<|vision_end|>"], TOKEN_ID["<|audio_end|>"])
MEDIA_PADS = (TOKEN_ID["<|image_pad|>"], TOKEN_ID["<|audio_pad|>"])


def media_span(ids: list[int], result: Result) -> tuple[int, int]:
    """[first, end) positions of the media tokens in the expanded prompt of ``ids``: vLLM expands
    each placeholder in place, so everything before the first one keeps its position and the end
    moves by the expansion."""
    first = min(i for i, t in enumerate(ids) if t in MEDIA_START)
    last = max(i for i, t in enumerate(ids) if t in MEDIA_CLOSE)
    return first, last + 1 + result.num_prompt_tokens - len(ids)


@pytest.mark.parametrize("kind", list(MEDIA))
def test_media_prefix_hits_and_serves_the_right_rows(kind, engines, embeddings, taps):
    on, off = engines
    seed = list(MEDIA).index(kind)
    first, second = prompt(kind, seed, "Q1?"), prompt(kind, seed, "Q2, another?")
    runs_before = on.scheduler.encoder_runs
    a_on, a_off = run(on, {"a": first})["a"], run(off, {"a": first})["a"]
    runs_first = on.scheduler.encoder_runs - runs_before
    b_on, b_off = run(on, {"b": second})["b"], run(off, {"b": second})["b"]
    runs_second = on.scheduler.encoder_runs - runs_before - runs_first

    text_before, end = media_span(second["prompt_token_ids"], b_on)
    assert a_on.num_cached_tokens == 0
    assert b_on.num_cached_tokens >= end, f"{kind}: hit {b_on.num_cached_tokens} tokens, the media end at {end}"
    assert runs_first == (2 if kind == "both" else 1)
    assert runs_second == 0, f"{kind}: the encoder ran {runs_second} times for cached media"

    hit = b_on.num_cached_tokens
    for name, rows in b_on.latents.items():
        assert torch.equal(rows[:hit], a_on.latents[name][:hit]), f"{kind}/{name}: served rows differ"

    for what, x_on, x_off in (("first", a_on, a_off), ("second", b_on, b_off)):
        n = comparable_rows(x_on, x_off, f"{kind}/{what}", TIE_MARGIN)
        for name in x_on.latents:
            rel = row_errors(x_on.latents[name][:n], x_off.latents[name][:n])
            assert float(rel.max()) <= ROW_RTOL, (
                f"{kind}/{what}/{name}: row {int(rel.argmax())} off the cache-off engine by {float(rel.max()):.2e}"
            )

    # The merged latent: the accept-layer row exactly at the prompt's placeholder positions.
    merged = f"layer_0_media_{taps[1]}"
    for what, x in (("first", a_on), ("second", b_on), ("cache-off", b_off)):
        ids = torch.tensor(x.prompt_token_ids + x.token_ids[:-1])
        media = torch.isin(ids, torch.tensor(MEDIA_PADS))
        media[x.num_prompt_tokens :] = False
        assert int(media.sum()) > 0
        want = torch.where(media[:, None], x.latents[f"layer_{taps[1]}"], x.latents["layer_0"])
        assert torch.equal(x.latents[merged], want), f"{kind}/{what}: merged rows"

    # Tap 0 at text positions is the embedding of the token: the text before the media, and every
    # generated token but the last (row P + k was fed generated token k).
    for what, x in (("first", a_on), ("second", b_on), ("cache-off", b_off)):
        tap0 = x.latents["layer_0"].float()
        p = x.num_prompt_tokens
        ids = second["prompt_token_ids"][:text_before]
        assert torch.equal(tap0[:text_before], embeddings[ids]), f"{kind}/{what}: prompt tap-0 rows"
        gen = x.token_ids[:-1]
        assert torch.equal(tap0[p : p + len(gen)], embeddings[gen]), f"{kind}/{what}: generated tap-0 rows"
        # At the media positions tap 0 is the encoder output, not the placeholder's embedding.
        placeholder = embeddings[TOKEN_ID["<|image_pad|>" if kind != "audio" else "<|audio_pad|>"]]
        assert not torch.equal(tap0[text_before + 1], placeholder)


def test_new_media_runs_the_encoder(engines):
    on, _ = engines
    before = on.scheduler.encoder_runs
    new = prompt("image", 99, "Q?")
    r = run(on, {"new": new})["new"]
    assert on.scheduler.encoder_runs - before == 1
    assert r.num_cached_tokens < media_span(new["prompt_token_ids"], r)[1]
