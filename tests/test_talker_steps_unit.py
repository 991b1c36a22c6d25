"""Unit tests of the talker's step machinery that need no engine: streamed rows and the codec
logits rules (the engine-level behaviour is in tests/test_qwen3_omni_pipeline.py)."""

from types import SimpleNamespace

import pytest
import torch

from scheduler import streamed_rows
from scheduler.streamed_rows import StreamedRows


def test_rows_arrive_then_pad_after_done():
    pad = torch.full((4,), -1.0)
    s = StreamedRows(pad)
    assert not s.has(0)
    s.add(torch.arange(8.0).reshape(2, 4))
    assert s.has(1) and not s.has(2)
    s.add(torch.arange(8.0, 12.0).reshape(1, 4), done=True)
    assert s.has(2) and s.has(50)  # past the end: the pad row
    got = s.rows(torch.tensor([0, 2, 3, 7]))
    assert torch.equal(got[0], torch.arange(4.0))
    assert torch.equal(got[1], torch.arange(8.0, 12.0))
    assert torch.equal(got[2], pad) and torch.equal(got[3], pad)
    with pytest.raises(ValueError, match="after the stream was marked done"):
        s.add(torch.zeros(1, 4))


def test_rows_of_the_wrong_width_are_refused():
    s = StreamedRows(torch.zeros(4))
    with pytest.raises(ValueError, match="3 wide, expected 4"):
        s.add(torch.zeros(1, 3))


def test_a_request_is_starved_until_the_row_of_its_last_output_arrives():
    req = SimpleNamespace(num_output_tokens=0)
    assert not streamed_rows.is_starved(req)  # no rows attached: a plain request
    s = StreamedRows(torch.zeros(2))
    streamed_rows.attach(req, s)
    assert not streamed_rows.is_starved(req)  # prefill needs no row
    req.num_output_tokens = 1  # the next forward feeds output 0: needs row 0
    assert streamed_rows.is_starved(req)
    s.add(torch.zeros(1, 2))
    assert not streamed_rows.is_starved(req)
    req.num_output_tokens = 3
    assert streamed_rows.is_starved(req)
    s.add(None, done=True)  # the text ended: pad rows from here on
    assert not streamed_rows.is_starved(req)


def test_codec_logits_penalise_generated_codes_and_suppress_control_codes():
    pytest.importorskip("vllm")
    from omni_cache.handoff import codec_logits_args
    from workers.codec_logits import CodecLogits

    proc = CodecLogits.__new__(CodecLogits)  # new_req_logits_processor reads only the params
    params = SimpleNamespace(extra_args=codec_logits_args(2.0, (6, 10), keep=[8]))
    rule = proc.new_req_logits_processor(params)
    logits = torch.tensor([1.0, -1.0, 4.0, 0.5, 0.0, 0.0, 9.0, 9.0, 9.0, 9.0])
    out = rule([0, 1, 1], logits.clone())
    assert out[0] == 0.5 and out[1] == -2.0  # transformers' rule: divide positives, multiply negatives
    assert out[2] == 4.0  # not generated: untouched
    assert out[8] == 9.0  # the kept (end-of-speech) code
    assert torch.isinf(out[[6, 7, 9]]).all() and (out[[6, 7, 9]] < 0).all()
    assert proc.new_req_logits_processor(SimpleNamespace(extra_args=None)) is None


def test_residual_codes_sample_as_the_reference_only_when_the_talker_samples():
    pytest.importorskip("vllm")
    from vllm import SamplingParams

    from workers.talker_steps import residual_picker, sample_top_k_top_p

    greedy = SimpleNamespace(sampling_params=SamplingParams(temperature=0.0), generator=None)
    assert residual_picker([greedy, greedy]) is None  # greedy talker: greedy codebooks

    # Nucleus: one id holding 90% of the mass is all that survives top_p 0.8.
    peaked = torch.full((64,), -10.0)
    peaked[7] = 10.0
    assert {int(sample_top_k_top_p(peaked, 50, 0.8)) for _ in range(20)} == {7}
    # Top-k: only the 50 largest of 64 flat-ish logits are ever drawn; a seeded generator repeats.
    flat = torch.linspace(0.0, 0.1, 64)
    draws = [int(sample_top_k_top_p(flat, 50, 1.0)) for _ in range(400)]
    assert min(draws) >= 14 and len(set(draws)) > 20

    def seeded(seed):
        g = torch.Generator().manual_seed(seed)
        return [int(sample_top_k_top_p(flat, 50, 0.8, g)) for _ in range(10)]

    assert seeded(3) == seeded(3) != seeded(4)

    sampling = SimpleNamespace(
        sampling_params=SamplingParams(temperature=0.9, seed=1), generator=torch.Generator().manual_seed(1)
    )
    pick = residual_picker([greedy, sampling])
    logits = torch.stack([flat, flat])
    rows = torch.stack([pick(logits.clone()) for _ in range(30)])
    assert (rows[:, 0] == 63).all()  # the greedy request keeps the argmax
    assert len(set(rows[:, 1].tolist())) > 1


def test_a_placeholder_typed_as_text_is_a_text_position():
    """A user's text "look <|image_pad|>" with a spoken answer: the thinker (vLLM) took the
    token as text, the talker refused the request ("the talker prompt has image tokens but the
    thinker sent no image grids", a 400 for plain text). A placeholder after its vision_start
    still needs its grid."""
    from omni_cache.models.talker_positions import VisionTokens, talker_positions

    vision = VisionTokens(image_id=5, video_id=6, vision_start_id=4)
    positions, delta = talker_positions([1, 2, 5, 3], vision, [])
    assert positions.tolist() == [[0, 1, 2, 3]] * 3 and delta == 0
    with pytest.raises(ValueError, match="more images than the 0 grids"):
        talker_positions([1, 4, 5, 3], vision, [])
