"""Listening while the user speaks, on the tiny Qwen3-Omni thinker in vLLM (issue 51), with the
hidden-state cache: a turn's audio as adjacent 8 s pieces, and a listening request's prefix.

A 9 s turn is two audio items (8 s + 1 s) whose placeholders sit side by side in one audio span.
Checked, on a cache-on engine (vLLM's prefix cache and our mirror) and a cache-off one:

* the expanded prompt's token ids are the whole clip's, and the greedy answer too (the thinker
  class positions a run of adjacent audio items as one clip: vLLM's own layout fails on it);
* a listening request (the prompt up to the end of the first piece, no audio_end, max_tokens 1)
  leaves the blocks the turn's request then hits: at least every full block of the listened
  prompt, the encoder not run again for the first piece;
* the rows the hit serves are bitwise the rows the listening request computed and the cache-off
  engine's rows, and every row is within the hidden-cache tolerance of the cache-off engine
  (tests/test_multimodal_cache.py's);
* the turn's answer is the cache-off engine's, token for token.
"""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest
import torch
from thinker_harness import close, comparable_rows, run
from thinker_pair import row_errors

from benchmarks.chunked_audio_exactness import chunk_bounds, speech_audio
from omni_cache.tiny.checkpoints import ensure_checkpoint
from omni_cache.tiny.qwen3_omni import TOKEN_ID

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
]

ROW_RTOL = 1e-4  # tests/test_multimodal_cache.py's
TIE_MARGIN = 1e-3
BLOCK = 32
RATE = 16000


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
            block_size=BLOCK,
            max_model_len=2048,
            kv_cache_memory_bytes=256 * 2**20,
            limit_mm_per_prompt={"image": 0, "audio": 4, "video": 0},
        ),
        prefix_cache=cache,
        latents=LatentOptions(hidden=True, layers=taps, cache=cache),
    )


@pytest.fixture(scope="module")
def engines(path, taps):
    on, off = make_stage(path, taps, True), make_stage(path, taps, False)
    yield on, off
    close(on)
    close(off)


def chat_ids(pieces: int, question: str = "What did I say?") -> list[int]:
    """The byte-level tiny tokenizer's chat prompt of one user turn: one audio span holding
    ``pieces`` placeholders, then the question."""
    t = TOKEN_ID
    text = [*b"user\n"]
    return (
        [t["<|im_start|>"], *text, t["<|audio_start|>"]]
        + [t["<|audio_pad|>"]] * pieces
        + [t["<|audio_end|>"], *question.encode(), t["<|im_end|>"], *b"\n", t["<|im_start|>"], *b"assistant\n"]
    )


def test_a_listened_turn_hits_and_answers_as_the_whole_turn(engines):
    on, off = engines
    audio = speech_audio(9.0, seed=91)
    pieces = [audio[a:b] for a, b in chunk_bounds(len(audio), 800)]
    assert [len(p) for p in pieces] == [128000, 16000]
    turn = {"prompt_token_ids": chat_ids(2), "multi_modal_data": {"audio": [(p, RATE) for p in pieces]}}
    whole = {"prompt_token_ids": chat_ids(1), "multi_modal_data": {"audio": [(audio, RATE)]}}
    pad = TOKEN_ID["<|audio_pad|>"]
    first_pad = turn["prompt_token_ids"].index(pad)
    listen = {
        "prompt_token_ids": turn["prompt_token_ids"][: first_pad + 1],
        "multi_modal_data": {"audio": [(pieces[0], RATE)]},
    }

    w_off = run(off, {"w": whole}, max_tokens=8)["w"]
    t_off = run(off, {"t": turn}, max_tokens=8)["t"]
    # Same tokens as the whole clip (its 117 audio tokens = 104 + 13), same greedy answer.
    assert t_off.prompt_token_ids == w_off.prompt_token_ids
    assert t_off.prompt_token_ids.count(pad) == 117
    assert t_off.token_ids == w_off.token_ids

    runs0 = on.scheduler.encoder_runs
    heard = run(on, {"l": listen}, max_tokens=1)["l"]
    assert on.scheduler.encoder_runs - runs0 == 1
    listened = first_pad + 104  # the listening request's prompt, expanded
    assert heard.num_prompt_tokens == listened
    t_on = run(on, {"t": turn}, max_tokens=8)["t"]
    hit = t_on.num_cached_tokens
    assert hit >= listened // BLOCK * BLOCK, f"hit {hit} of the {listened} tokens listened to"
    assert on.scheduler.encoder_runs - runs0 == 2  # only the second piece was encoded again
    for name, rows in t_on.latents.items():
        assert torch.equal(rows[:hit], heard.latents[name][:hit]), f"{name}: served rows differ"

    assert t_on.token_ids == t_off.token_ids
    n = comparable_rows(t_on, t_off, "listened turn", TIE_MARGIN)
    for name in t_on.latents:
        rel = row_errors(t_on.latents[name][:n], t_off.latents[name][:n])
        assert float(rel.max()) <= ROW_RTOL, f"{name}: row {int(rel.argmax())} off by {float(rel.max()):.2e}"
    # The served rows are bitwise the cache-off engine's too (float32; held on this project's
    # 2-core x86 hosts, where the listening prefix and the whole prompt run the same kernels).
    for name in t_on.latents:
        assert torch.equal(t_on.latents[name][:hit], t_off.latents[name][:hit]), f"{name}: not bitwise cache-off's"
    np.testing.assert_array_equal(np.concatenate(pieces), audio)
