"""Resuming a request on live replicas (omni_cache.runtime.request_path.resume) in pieces, without processes:
the resumed Submit, what the client is not sent twice, and the entry stage's rewrite of a resumed
request's first output (workers/ar_runner.py). The end-to-end kills are in test_replicas.py (fake
stages) and test_replicas_e2e.py (vLLM)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omni_cache.runtime.request_path.requests import Request, RequestTable, with_time_left
from omni_cache.runtime.request_path.resume import ResumedText, new_samples, new_tokens, resumed_submit
from omni_cache.wire.messages import Submit
from omni_cache.wire.sampling import EngineSampling
from workers.ar_request import resumed_as_undisturbed
from workers.llm_stage import StepOutput


def request(max_tokens: int = 10) -> Request:
    req = Request(
        request_id="abc",
        prompt_token_ids=[1, 2, 3],
        modalities=("text", "audio"),
        participants=("thinker", "talker"),
        t0=0.0,
        deadline=1e9,
        timeout_s=60.0,
        return_latents=False,
        route={"thinker": 1, "talker": 0},
    )
    req.submit = Submit(
        request_id="abc",
        prompt_token_ids=[1, 2, 3],
        sampling=EngineSampling(max_tokens=max_tokens, temperature=0.7, seed=5),
        modalities=["text", "audio"],
        route=dict(req.route),
    )
    return req


def test_a_resumed_submit_carries_the_answer_so_far_and_asks_for_the_rest():
    req = request()
    req.answer_tokens = [7, 8, 9, 10]
    req.attempt, req.route = 1, {"thinker": 0, "talker": 1}
    msg = resumed_submit(req, text_from_entry=True, answer_finished=None)
    assert msg.request_id == "abc.r1" == req.wire_id
    assert msg.prompt_token_ids == [1, 2, 3, 7, 8, 9, 10] and msg.resumed_tokens == 4
    assert msg.sampling.max_tokens == 6 and msg.sampling.temperature == 0.7 and msg.sampling.seed == 5
    assert msg.answer_finished == "" and msg.route == {"thinker": 0, "talker": 1}
    assert msg.modalities == ["text", "audio"]
    # Sent, it carries what is left of the request's time (its deadline is the server's
    # monotonic clock): the time left then, not the first attempt's, and never below 0.
    assert with_time_left(msg, req, now=req.deadline - 7.5).time_left_s == 7.5
    assert with_time_left(msg, req, now=req.deadline + 1).time_left_s == 0.0
    assert req.submit.prompt_token_ids == [1, 2, 3]  # the original is kept for a later attempt


def test_a_complete_answer_is_only_recomputed():
    req = request(max_tokens=4)
    req.answer_tokens = [7, 8]
    req.attempt = 2
    msg = resumed_submit(req, text_from_entry=True, answer_finished="stop")
    assert (msg.resumed_tokens, msg.answer_finished, msg.sampling.max_tokens) == (2, "stop", 1)
    # every token sent, the finished output lost with the replica: the answer hit its length
    req.answer_tokens = [7, 8, 9, 10]
    msg = resumed_submit(req, text_from_entry=True, answer_finished=None)
    assert (msg.answer_finished, msg.sampling.max_tokens) == ("length", 1)


def test_nothing_sent_yet_or_text_from_a_later_stage_starts_the_answer_again():
    req = request()
    msg = resumed_submit(req, text_from_entry=True, answer_finished=None)
    assert (msg.prompt_token_ids, msg.resumed_tokens, msg.sampling.max_tokens) == ([1, 2, 3], 0, 10)
    req.answer_tokens = [7]
    msg = resumed_submit(req, text_from_entry=False, answer_finished="stop")
    assert (msg.prompt_token_ids, msg.resumed_tokens, msg.answer_finished) == ([1, 2, 3], 0, "")


def test_the_client_gets_each_token_and_sample_once():
    req = request()
    assert new_tokens(req, [7, 8]) == [7, 8]
    req.skip_tokens = 2  # a resumed attempt sends them again
    assert new_tokens(req, [7]) == [] and new_tokens(req, [8, 9, 10]) == [9, 10]
    assert req.answer_tokens == [7, 8, 9, 10] and req.skip_tokens == 0
    assert len(new_samples(req, np.zeros(100, np.float32))) == 100
    req.skip_samples = 100
    assert len(new_samples(req, np.zeros(60, np.float32))) == 0
    assert len(new_samples(req, np.arange(60, dtype=np.float32))) == 20
    assert req.audio_samples == 120 and req.skip_samples == 0


def test_the_table_knows_a_resumed_request_by_its_new_wire_id_only():
    table = RequestTable()
    req = request()
    table.add(req)
    req.attempt = 1
    table.rekey(req, "abc")
    assert table.get("abc") is None and table.recently_answered("abc")
    assert table.get("abc.r1") is req and table.find("abc") is req
    table.answered(req)
    assert table.find("abc") is None and len(table) == 0 and table.recently_answered("abc.r1")


def first_output(prompt_len: int, tokens: list[int]) -> StepOutput:
    """A first output after a prefill of ``prompt_len`` positions: one row per position fed."""
    rows = torch.arange(prompt_len, dtype=torch.float32)[:, None].repeat(1, 4)
    return StepOutput(
        request_id="abc.r1",
        token_ids=tokens,
        text="x",
        finished=False,
        finish_reason=None,
        num_prompt_tokens=prompt_len,
        num_cached_tokens=3,
        latent_start=0,
        latents={"hidden": rows},
        prompt_token_ids=[1, 2, 3, 7, 8][:prompt_len],
    )


def test_the_entry_stage_sends_a_resumed_request_as_the_undisturbed_stream():
    # undisturbed: prompt [1, 2, 3], after sampling 7, 8, 9: rows of positions 0..4
    out = first_output(5, [9])
    resumed_as_undisturbed(out, [7, 8], "")
    assert out.token_ids == [7, 8, 9] and out.text == "x" and not out.finished
    assert out.num_prompt_tokens == 3 and out.prompt_token_ids == [1, 2, 3]
    assert out.latents["hidden"].shape[0] == 5


def test_a_recomputed_complete_answer_drops_the_extra_token_and_row():
    # the answer was [7, 8] (finished): an undisturbed run fed positions 0..3, never 8's
    out = first_output(5, [42])
    resumed_as_undisturbed(out, [7, 8], "stop")
    assert out.token_ids == [7, 8] and out.text == "" and out.finished
    assert out.finish_reason == "stop" and out.num_prompt_tokens == 3
    assert out.latents["hidden"][:, 0].tolist() == [0.0, 1.0, 2.0, 3.0]


@pytest.mark.parametrize("k, prompt", [(3, [1, 2, 3]), (-1, [1, 2])])
def test_a_stage_refuses_resumed_tokens_outside_the_prompt(k, prompt):
    from workers.ar_runner import ARRunner

    runner = ARRunner.__new__(ARRunner)  # the check comes first: no engine is needed to reach it
    msg = Submit(request_id="x", prompt_token_ids=prompt, sampling=EngineSampling(), resumed_tokens=k)
    with pytest.raises(ValueError, match="resumed_tokens"):
        runner.accept(msg, {})


def byte_text(ids) -> str:
    """A byte-level detokenizer: token i is byte i (as the tiny checkpoints' byte symbols)."""
    return bytes(ids).decode("utf-8", errors="replace")


def test_resumed_text_goes_on_from_the_client_s_text_across_a_split_character():
    # the client got "ok " and é's first byte (held back: no text for it yet)
    text = ResumedText(byte_text, [0xC3])
    assert text.add([]) == ""
    assert text.add([0xA9]) == "é" and text.add(list(b"!")) == "!"
    # a character split over three new tokens is written once it is whole
    assert text.add([0xE2]) == "" and text.add([0x82]) == "" and text.add([0xAC]) == "€"
    # invalid bytes are written (as U+FFFD) once later text follows, however many were held
    text = ResumedText(byte_text, [0xFF] * 6)
    assert text.add([0xFE]) == "" and text.add(list(b"a")) == "\ufffd" * 7 + "a"
