"""A listening request's talker prompt is the first rows of the answer's talker prompt, bitwise
(issue 51; no vLLM: the tiny Qwen3-Omni checkpoint's projections on made-up thinker rows).

The talker's prefix cache hashes its prompt embeddings per block, so the talker prompt built from a
thinker prompt that ends inside the user's turn (``TalkerPrompt.user_rows``) must equal, bit for
bit, the first rows of the prompt the whole turn's answer gets (``TalkerPrompt.build``), and its
M-RoPE positions the first positions, whatever the conversation holds before (a system turn, an
earlier user turn with text and an image, an assistant answer).
"""

from __future__ import annotations

import pytest
import torch

from omni_cache.models.qwen3_omni_talker_prompt import TalkerPrompt
from omni_cache.tiny.checkpoints import ensure_checkpoint
from omni_cache.tiny.qwen3_omni import TOKEN_ID

T = TOKEN_ID
AUDIO_ROWS = 104 * 2 + 13  # an 8 + 8 + 1 s turn in the thinker's prompt


@pytest.fixture(scope="module")
def prompt(tmp_path_factory):
    return TalkerPrompt.load(ensure_checkpoint("qwen3-omni", tmp_path_factory.mktemp("q3")))


def conversation() -> tuple[list[int], int, list[list[int]]]:
    """A whole turn's thinker prompt, the length of its listening prefix (up to the end of the
    second audio window), and its image grids."""
    ids = [T["<|im_start|>"], T["system"], *b"\nBe brief.", T["<|im_end|>"], *b"\n"]
    ids += [T["<|im_start|>"], T["user"], *b"\nLook: ", T["<|vision_start|>"]] + [T["<|image_pad|>"]] * 4
    ids += [
        T["<|vision_end|>"],
        T["<|im_end|>"],
        *b"\n",
        T["<|im_start|>"],
        T["assistant"],
        *b"\nA cat.",
        T["<|im_end|>"],
    ]
    ids += [*b"\n", T["<|im_start|>"], T["user"], *b"\n", T["<|audio_start|>"]]
    listened = len(ids) + 2 * 104
    ids += [T["<|audio_pad|>"]] * AUDIO_ROWS + [T["<|audio_end|>"], T["<|im_end|>"], *b"\n"]
    ids += [T["<|im_start|>"], T["assistant"], *b"\n"]
    return ids, listened, [[1, 4, 4]]


def test_the_listening_prefix_gives_the_first_rows_of_the_answers_talker_prompt(prompt):
    ids, listened, grids = conversation()
    g = torch.Generator().manual_seed(5)
    dim = prompt.embedding_rows([0]).shape[-1]
    # The thinker rows the answer's talker reads (the prompt's, then the answer's first tokens).
    embeds = torch.randn(len(ids) + 4, dim, generator=g)
    accept = torch.randn(len(ids) + 4, dim, generator=g)
    whole = prompt.build(ids, embeds, accept)
    part = prompt.user_rows(ids[:listened], embeds[:listened], accept[:listened])
    n = part.shape[0]
    # Everything of the conversation's user turns up to the listened audio: the earlier user turn,
    # the new turn's head and its two windows (system and assistant turns are not in it).
    assert n == len(prompt.user_positions(ids[:listened])) and n > 2 * 104
    assert torch.equal(part, whole[:n])
    # The rows of the audio not listened to yet follow; they are not in the listening prompt.
    assert not torch.equal(whole[n : n + 1], part[-1:])

    want, _ = prompt.positions(ids, grids)
    got, _ = prompt.listening_positions(ids[:listened], grids)
    assert torch.equal(got, want[:, :n])


def test_a_row_depends_on_its_own_thinker_row_only(prompt):
    """Changing the thinker rows after the listened prefix (the answer recomputes its tail)
    leaves the listened talker rows as they were."""
    ids, listened, _ = conversation()
    dim = prompt.embedding_rows([0]).shape[-1]
    g = torch.Generator().manual_seed(6)
    embeds = torch.randn(len(ids) + 4, dim, generator=g)
    accept = torch.randn(len(ids) + 4, dim, generator=g)
    other = accept.clone()
    other[listened:] += 1.0
    a = prompt.user_rows(ids, embeds, accept)
    b = prompt.user_rows(ids, embeds, other)
    n = len(prompt.user_positions(ids[:listened]))
    assert torch.equal(a[:n], b[:n]) and not torch.equal(a[n:], b[n:])


def user_positions_by_walk(ids: list[int]) -> list[int]:
    """The definition of the user turns' positions, token by token: from a `<|im_start|>` followed
    by the user role up to the next `<|im_start|>`."""
    out, in_user = [], False
    for i, tok in enumerate(ids):
        if tok == T["<|im_start|>"]:
            in_user = i + 1 < len(ids) and ids[i + 1] == T["user"]
        if in_user:
            out.append(i)
    return out


def test_the_user_turns_positions_are_found_at_once_as_by_a_walk(prompt):
    """``TalkerPrompt.user_positions`` (computed on the whole prompt at once) gives the positions
    the definition gives, whatever the turns: none, a prompt ending in a turn's `<|im_start|>`, a
    user turn first or last, empty turns back to back."""
    ids, listened, _ = conversation()
    s, u, a = T["<|im_start|>"], T["user"], T["assistant"]
    cases = [
        ids,
        ids[:listened],
        [],
        [*b"no turn at all"],
        [s],
        [s, u],
        [*b"xy", s, u, *b"hi", s],
        [s, u, s, u, s, a, *b"ok", s, u, *b"again"],
        [s, a, *b"ok", s],
    ]
    for case in cases:
        assert prompt.user_positions(case) == user_positions_by_walk(case), case
    assert len(prompt.user_positions(ids)) > AUDIO_ROWS
