"""The talker listens too (issue 51): a prefill-only request runs thinker -> talker, so the talker's
prefix cache holds the user turn's rows before the turn ends.

Real parts: the tiny Qwen3-Omni pipeline (stage_configs/qwen3_omni.yaml: thinker, talker and
code2wav in their own processes, vLLM engines, ZMQ), twice: prefix caches on (vLLM's and the
hidden-state cache) and off. A 17 s user turn is three audio items (8 s + 8 s + 1 s: the thinker's
encoder windows, as a realtime session cuts a spoken turn). Checked:

* a prefill-only request of the conversation up to the end of the second window (no audio_end,
  no answer prompt) passes the thinker and the talker only (no decoder, no audio);
* the turn's answer then hits the talker's prefix cache: at least every full talker block whose
  rows come from thinker rows the hidden-state cache served (those are bitwise the rows the
  listening request handed its talker), at most the listened rows;
* its text tokens and every codebook of its codes (greedy) are the cache-off pipeline's, and the
  thinker rows it was served are bitwise the cache-off pipeline's;
* a turn listened to by the thinker alone (text-only prefill) gets no talker hit: the talker's
  hit above is the talker's listening.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from served_config import write_pipeline_config
from shared_forkers import shared_forkers

from benchmarks.chunked_audio_exactness import chunk_bounds, speech_audio
from omni_cache.config import load_config
from omni_cache.pipeline import Pipeline
from omni_cache.serving.realtime.conversation import audio_item
from omni_cache.tiny.qwen3_omni import TOKEN_ID

pytestmark = pytest.mark.vllm

RATE = 16000  # the tiny checkpoint's feature extractor rate: the window is 128,000 samples
WINDOW_FRAMES = 800
BLOCK = 32  # the talker's (and thinker's) block size in qwen3_omni.yaml
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def pipes(tmp_path_factory):
    on_cfg = write_pipeline_config(tmp_path_factory.mktemp("on"), "talker_listen_on", "qwen3_omni.yaml")
    off_cfg = write_pipeline_config(tmp_path_factory.mktemp("off"), "talker_listen_off", "qwen3_omni.yaml")
    forkers = shared_forkers()
    with (
        Pipeline(load_config(on_cfg), stage_forkers=forkers) as on,
        Pipeline(load_config(off_cfg), prefix_cache=False, stage_forkers=forkers) as off,
    ):
        yield on, off


def conversation(pieces: int, *, listening: bool) -> list[int]:
    """A system turn, then a user turn of ``pieces`` audio items side by side in one audio span;
    ``listening``: cut after the last placeholder (what a listening request sends)."""
    t = TOKEN_ID
    ids = [t["<|im_start|>"], t["system"], *b"\nYou are a voice assistant.", t["<|im_end|>"], *b"\n"]
    ids += [t["<|im_start|>"], t["user"], *b"\n", t["<|audio_start|>"]] + [t["<|audio_pad|>"]] * pieces
    if listening:
        return ids
    return ids + [t["<|audio_end|>"], t["<|im_end|>"], *b"\n", t["<|im_start|>"], t["assistant"], *b"\n"]


def turn_items(seconds: float, seed: int) -> list:
    audio = speech_audio(seconds, seed=seed)
    return [audio_item(audio[a:b], RATE) for a, b in chunk_bounds(len(audio), WINDOW_FRAMES)]


def user_start(ids: list[int]) -> int:
    t = TOKEN_ID
    return next(i for i in range(len(ids) - 1) if ids[i] == t["<|im_start|>"] and ids[i + 1] == t["user"])


def test_the_talker_listens_and_answers_as_the_whole_turn(pipes):
    on, off = pipes
    items = turn_items(17.0, seed=171)
    assert len(items) == 3 and [len(m.array) for m in items[:2]] == [128000, 128000]
    listen_ids, turn_ids = conversation(2, listening=True), conversation(3, listening=False)

    heard = on.generate([listen_ids], media=[items[:2]], max_tokens=1, prefill_only=True)[0]
    # Thinker and talker took part (they report their prefix cache), the decoder did not.
    assert set(heard.cached_tokens) == {"thinker", "talker"}, heard.cached_tokens
    assert heard.audio is None or len(heard.audio) == 0
    listened = heard.num_prompt_tokens  # the thinker's prompt, media expanded
    assert listened == len(listen_ids) + 2 * 104 - 2

    got = on.generate([turn_ids], media=[items], max_tokens=MAX_TOKENS, return_latents=True)[0]
    want = off.generate([turn_ids], media=[items], max_tokens=MAX_TOKENS, return_latents=True)[0]

    hit = got.cached_tokens["thinker"]
    assert hit >= listened // BLOCK * BLOCK, got.cached_tokens
    talker_hit = got.cached_tokens["talker"]
    start = user_start(turn_ids)
    # Talker rows from positions the thinker was served from its cache are bitwise the listening
    # request's; the rest the answer's thinker computed again (maybe not bitwise).
    assert (hit - start) // BLOCK * BLOCK <= talker_hit <= (listened - start) // BLOCK * BLOCK, got.cached_tokens
    assert talker_hit >= 4 * BLOCK  # two 8 s windows are 208 audio rows: several talker blocks

    assert got.token_ids == want.token_ids
    codes, want_codes = got.latents["talker.codes"], want.latents["talker.codes"]
    assert codes.shape == want_codes.shape and codes.shape[1] > 0
    assert torch.equal(codes, want_codes), "the listened turn's codes differ from cache off"
    thinker_rows = [n for n in got.latents if "." not in n and n != "token_ids"]
    assert thinker_rows
    for name in thinker_rows:
        assert torch.equal(got.latents[name][:hit], want.latents[name][:hit]), f"{name}: not bitwise cache-off's"
    np.testing.assert_array_equal(got.audio, want.audio)


def test_a_turn_the_thinker_alone_listened_to_gets_no_talker_hit(pipes):
    on, _ = pipes
    items = turn_items(17.0, seed=172)
    heard = on.generate(
        [conversation(2, listening=True)], media=[items[:2]], max_tokens=1, prefill_only=True, modalities=("text",)
    )[0]
    assert set(heard.cached_tokens) == {"thinker"}
    got = on.generate([conversation(3, listening=False)], media=[items], max_tokens=MAX_TOKENS)[0]
    assert got.cached_tokens["thinker"] >= heard.num_prompt_tokens // BLOCK * BLOCK
    assert got.cached_tokens["talker"] == 0
