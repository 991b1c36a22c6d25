"""`latents.merged` in the worker's LatentCapture, on hand-made steps (no engine): which rows take
the media layer's state, and that the rows never alias a buffer the runner reuses.

The engine-level checks (merged rows against the two taps on the real multimodal thinker, fresh and
served from the mirror) are in test_multimodal_cache.py; the talker's parity with transformers
through the merged latent in test_qwen3_omni_pipeline.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from workers.latent_capture import LatentCapture, LatentOptions, media_token_ids

IMAGE, AUDIO = 90, 91
DIM = 4


def capture(reused: frozenset[int] = frozenset()) -> LatentCapture:
    options = LatentOptions(hidden=False, merged=(0, 2))
    return LatentCapture(
        options,
        {"layer_0_media_2": (DIM, torch.float32)},
        torch.device("cpu"),
        reused=reused,
        media_ids=torch.tensor([IMAGE, AUDIO]),
    )


def step(requests: list[tuple[str, int, list[int], int, bool]]):
    """requests: (id, first position, the step's token ids, prompt length, new). The two taps:
    tap 0 rows are +position, tap 2 rows -position, so a row says where it came from."""
    ids = [t for _, _, toks, _, _ in requests for t in toks]
    positions = [start + i for _, start, toks, _, _ in requests for i in range(len(toks))]
    pos = torch.tensor(positions, dtype=torch.float32)[:, None].expand(-1, DIM)
    new = [SimpleNamespace(req_id=r, num_computed_tokens=s) for r, s, _, _, fresh in requests if fresh]
    cached = [(r, s) for r, s, _, _, fresh in requests if not fresh]
    sched = SimpleNamespace(
        total_num_scheduled_tokens=len(ids),
        num_scheduled_tokens={r: len(toks) for r, _, toks, _, _ in requests},
        scheduled_new_reqs=new,
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[r for r, _ in cached], num_computed_tokens=[s for _, s in cached]
        ),
    )
    state = SimpleNamespace(hidden_states=None, aux_hidden_states=[pos + 1000, -(pos + 1000)])
    return sched, state, [r for r, *_ in requests], torch.tensor(ids), [p for *_, p, _ in requests]


def test_media_rows_come_from_the_media_layer_at_prompt_positions_only() -> None:
    cap = capture()
    # a: a prefill of its 6-token prompt with an image run at 2-3; b: a resumed request re-prefilling
    # its 3-token prompt and 2 generated tokens, one of them an audio placeholder id; c: a decode
    # step whose fed token is an image placeholder id (a generated token: embedded as text).
    cap.on_step(
        *step(
            [
                ("a", 0, [1, 2, IMAGE, IMAGE, 5, 6], 6, True),
                ("b", 0, [AUDIO, 7, 8, AUDIO, 9], 3, True),
                ("c", 40, [IMAGE], 12, False),
            ]
        )
    )
    rows = {r: cap.drain(r)[0].tensors["layer_0_media_2"][:, 0].tolist() for r in "abc"}
    assert rows["a"] == [1000, 1001, -1002, -1003, 1004, 1005]
    assert rows["b"] == [-1000, 1001, 1002, 1003, 1004]
    assert rows["c"] == [1040]


def test_merged_rows_never_alias_a_reused_buffer() -> None:
    # No media in the step: the rows are tap 0's, which on a model fed embeddings is the runner's
    # inputs_embeds buffer; the next step overwrites it.
    sched, state, req_ids, ids, prompt_lens = step([("a", 0, [1, 2, 3], 3, True)])
    buffer = state.aux_hidden_states[0]
    cap = capture(reused=frozenset({buffer.untyped_storage().data_ptr()}))
    cap.on_step(sched, state, req_ids, ids, prompt_lens)
    buffer.zero_()
    assert cap.drain("a")[0].tensors["layer_0_media_2"][:, 0].tolist() == [1000, 1001, 1002]


def test_media_token_ids_read_the_thinker_config() -> None:
    thinker = SimpleNamespace(image_token_id=5, audio_token_id=6, video_token_id=7)
    assert media_token_ids(SimpleNamespace(thinker_config=thinker)) == (5, 6, 7)
    assert media_token_ids(SimpleNamespace(image_token_id=3)) == (3,)
    assert media_token_ids(SimpleNamespace()) == ()
