"""The decoder stage's runner with a real decoder and a real ZMQ outbox (no vLLM, no stage
process): batches cut to max_batch_size lose nothing, one request's bad codes fail it alone,
deadlines and aborts leave nothing behind; on the tiny codec (one codebook, codes as token ids) and
on Qwen3-Omni's code2wav (``tiny:qwen3-omni``, four codebooks, codes as ``[Q, k]`` tensor frames).
The same runner under a real pipeline and a burst of requests: tests/test_concurrency_e2e.py.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from decoder_harness import make_runner, sent_so_far

from omni_cache.handoff import CODES_FRAME, FIRST_CHUNK_CODES, GenerateJob
from omni_cache.models.codec_decoder import CodecDecoder
from omni_cache.models.qwen3_omni_code2wav import CHUNKED_ATOL, Code2WavDecoder
from omni_cache.wire.messages import StageError, StageOutput, StreamStart
from workers.decoder_runner import DecoderRunner
from workers.runner import DEADLINE_GRACE_S, time_left

ROOT = Path(__file__).resolve().parents[1]
END_WAIT_S = 60.0  # how long received() waits for the requests it is told will end


@pytest.fixture
def runner(tmp_path):
    runner, close = make_runner(tmp_path, "tiny:decoder")
    yield runner
    close()


def codes(seed: int, n: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def feed(
    runner: DecoderRunner, rid: str, seq: int, ids: list[int], finished: bool, time_left_s: float | None = None
) -> None:
    msg = StageOutput(request_id=rid, stage="talker", seq=seq, token_ids=ids, finished=finished)
    if seq == 0:  # a stream opens with its StreamStart
        msg = StreamStart.opening(msg, time_left_s=time_left_s)
    runner.guarded(rid, lambda: runner.accept(msg, {}))


def run(runner: DecoderRunner) -> None:
    while runner.has_work():
        runner.step()


def received(runner: DecoderRunner, ends: set[str]) -> tuple[dict[str, torch.Tensor], dict[str, StageError]]:
    """Audio per finished request (chunks in seq order) and errors, from the orchestrator socket.
    Waits until every request in ``ends`` has ended (its last audio chunk or an error): ZMQ's I/O
    thread delivers what the runner sent in its own time, which on a loaded machine can be seconds
    (a fixed 200 ms window lost messages under a load average of 10); then takes whatever else
    arrives within 200 ms."""
    parts: dict[str, list[tuple[int, torch.Tensor, bool]]] = {}
    errors = {}
    ended: set[str] = set()
    deadline = time.monotonic() + END_WAIT_S
    while True:
        waiting = not ends <= ended and time.monotonic() < deadline
        got = runner.inbox.recv(timeout_ms=1000 if waiting else 200)
        if got is None:
            if waiting:
                continue
            break
        msg, tensors = got
        if isinstance(msg, StageError):
            errors[msg.request_id] = msg
            ended.add(msg.request_id)
        else:
            parts.setdefault(msg.request_id, []).append((msg.seq, tensors["audio"].clone(), msg.finished))
            if msg.finished:
                ended.add(msg.request_id)
    audio = {}
    for rid, chunks in parts.items():
        assert [s for s, _, _ in chunks] == list(range(len(chunks))), f"{rid}: out of order"
        if chunks[-1][2]:
            audio[rid] = torch.cat([a for _, a, _ in chunks])
    return audio, errors


def whole(runner: DecoderRunner, ids: list[int]) -> torch.Tensor:
    decoder: CodecDecoder = runner.decoder.codec
    return decoder(torch.tensor([ids]))[0]


def test_more_requests_than_the_batch_all_get_all_their_audio(runner):
    streams = {f"r{i}": codes(i, 20 + 7 * i) for i in range(5)}
    # Codes arrive interleaved, a few at a time, while the decoder steps in between.
    for seq in range(4):
        for rid, ids in streams.items():
            part = ids[seq * len(ids) // 4 : (seq + 1) * len(ids) // 4]
            feed(runner, rid, seq, part, finished=seq == 3)
        runner.step()
    run(runner)
    audio, errors = received(runner, set(streams))
    assert not errors and set(audio) == set(streams)
    spc = runner.decoder.samples_per_code
    for rid, ids in streams.items():
        assert audio[rid].shape[0] == len(ids) * spc
        assert torch.equal(audio[rid], whole(runner, ids).float())
    assert runner.requests == {}


def test_a_new_requests_first_window_goes_before_other_requests_chunks(runner):
    """Two requests already streaming have full chunks queued; a third's first window is
    decoded in the next step, alone, and its audio is the first to leave."""
    for rid in ("a", "b"):
        feed(runner, rid, 0, codes(1, 40), finished=False)
        runner.step()  # their first windows
    sent_so_far(runner)  # (all of them: one that came late would be taken for the next step's)
    for rid in ("a", "b"):
        feed(runner, rid, 1, codes(2, 200), finished=False)  # several full chunks each
    feed(runner, "new", 0, codes(3, 40), finished=False)
    runner.step()
    assert [(msg.request_id, msg.seq) for msg, _ in sent_so_far(runner)] == [("new", 0)]  # and nothing else
    run(runner)
    for rid in ("a", "b", "new"):
        runner.abort(rid)


def test_bad_codes_fail_that_request_only(runner):
    good = {f"g{i}": codes(i, 30) for i in range(3)}
    for rid, ids in good.items():
        feed(runner, rid, 0, ids, finished=True)
    feed(runner, "neg", 0, [1, 2, -5], finished=True)  # refused on arrival
    run(runner)
    audio, errors = received(runner, set(good) | {"neg"})
    assert set(audio) == set(good) and set(errors) == {"neg"}
    assert errors["neg"].stage == "decoder" and errors["neg"].status == 400
    assert "-5" in errors["neg"].message


def test_a_window_the_codec_rejects_fails_alone(runner):
    """A hand-off that produced an out-of-range code: checked per window before the batch runs."""
    good = codes(1, 30)
    feed(runner, "good", 0, good, finished=True)
    feed(runner, "bad", 0, codes(2, 30), finished=True)
    runner.requests["bad"].jobs[0].window.codes[0, 0] = 10_000  # as a broken hand-off would
    run(runner)
    audio, errors = received(runner, {"good", "bad"})
    assert set(audio) == {"good"} and set(errors) == {"bad"}
    assert "outside the codebook" in errors["bad"].message
    assert torch.equal(audio["good"], whole(runner, good).float())


def test_a_request_opens_only_on_a_stream_start(runner):
    """A plain StageOutput for a request the stage does not hold is the rest of a stream whose
    StreamStart it never saw (even at seq 0): dropped, nothing starts."""
    runner.guarded(
        "headless",
        lambda: runner.accept(
            StageOutput(request_id="headless", stage="talker", seq=0, token_ids=codes(1, 30), finished=True), {}
        ),
    )
    assert runner.requests == {} and not runner.has_work() and runner.total_requests == 0
    feed(runner, "opened", 0, codes(1, 30), finished=True)
    run(runner)
    audio, errors = received(runner, {"opened"})
    assert set(audio) == {"opened"} and not errors


def test_a_hand_off_job_of_the_wrong_kind_fails_its_request_alone(runner):
    """The decoder runs DecodeJobs: a hand-off that returns another kind fails the request it
    returned it for (500, naming the type); the request beside it gets all its audio."""
    handoff = runner.handoff

    def mixed_up(ctx, up, state):
        if up.token_ids[:1] == [7]:
            return [GenerateJob(prompt_token_ids=[1])]
        return handoff(ctx, up, state)

    runner.handoff = mixed_up
    good = codes(2, 30)
    feed(runner, "good", 0, good, finished=True)
    feed(runner, "wrong", 0, [7, 8, 9], finished=True)
    run(runner)
    audio, errors = received(runner, {"good", "wrong"})
    assert set(audio) == {"good"} and set(errors) == {"wrong"}
    assert errors["wrong"].status == 500 and "GenerateJob" in errors["wrong"].message
    assert torch.equal(audio["good"], whole(runner, good).float())


def test_abort_before_the_first_message_leaves_nothing(runner):
    runner.abort("early")  # the Abort overtook the talker's first output
    feed(runner, "early", 0, codes(3, 10), finished=False)
    feed(runner, "early", 1, codes(4, 10), finished=True)
    assert "early" not in runner.requests and not runner.has_work()
    # The tombstone is used up by the first message: it does not accumulate.
    assert "early" not in runner.tombstones
    feed(runner, "late", 0, codes(5, 10), finished=False)
    runner.abort("late")  # mid-request: forgotten, its rest dropped
    feed(runner, "late", 1, codes(6, 10), finished=True)
    assert runner.requests == {} and not runner.has_work()
    audio, errors = received(runner, set())
    assert not audio and not errors


def test_deadline_drops_the_request_and_its_late_input(runner):
    t0 = time.monotonic()
    feed(runner, "slow", 0, codes(7, 10), finished=False, time_left_s=0.2)
    feed(runner, "past", 0, codes(8, 10), finished=True, time_left_s=0.0)  # no time left
    assert list(runner.requests) == ["slow"]
    runner.expire(now=t0 + 0.5)  # within the grace the orchestrator's Abort gets
    assert list(runner.requests) == ["slow"]
    runner.expire(now=time.monotonic() + 0.2 + DEADLINE_GRACE_S)
    assert runner.requests == {} and runner.counters()["expired"] == 1
    feed(runner, "slow", 1, codes(9, 10), finished=True)  # upstream still sending
    assert runner.requests == {}
    audio, errors = received(runner, {"slow"})
    assert set(errors) == {"slow"} and errors["slow"].status == 504
    assert "deadline" in errors["slow"].message


def test_a_deadline_is_time_left_on_this_process_clock(runner, monkeypatch):
    """A request that arrives with 60 s left is held for 60 s by this process's monotonic clock,
    wherever its wall clock is (hosts' clocks differ, and jump), and forwarded with what is left."""
    monkeypatch.setattr(time, "time", lambda: 4e9)  # this host's wall clock is far ahead
    feed(runner, "clock", 0, codes(3, 10), finished=False, time_left_s=60.0)
    runner.expire()
    assert list(runner.requests) == ["clock"]
    deadline = runner.requests["clock"].deadline
    assert time_left(deadline, now=deadline - 42.0) == 42.0  # forwarded downstream as time left
    assert time_left(deadline, now=deadline + 5) == 0.0 and time_left(0.0) is None
    runner.expire(now=deadline + DEADLINE_GRACE_S)
    assert runner.requests == {}
    _, errors = received(runner, {"clock"})
    assert errors["clock"].status == 504


# ---- Qwen3-Omni's code2wav: codes as [num_quantizers, k] frames ----------------------------------


@pytest.fixture(scope="module")
def q3_runner(tmp_path_factory):
    runner, close = make_runner(tmp_path_factory.mktemp("q3"), "tiny:qwen3-omni")
    yield runner
    close()


def frames(seed: int, n: int, q: int = 4) -> torch.Tensor:
    return torch.randint(0, 256, (q, n), generator=torch.Generator().manual_seed(seed))


def feed_frame(runner: DecoderRunner, rid: str, seq: int, codes: torch.Tensor, finished: bool) -> None:
    cls = StreamStart if seq == 0 else StageOutput  # a stream opens with its StreamStart
    runner.guarded(
        rid,
        lambda: runner.accept(cls(request_id=rid, stage="talker", seq=seq, finished=finished), {CODES_FRAME: codes}),
    )


def stream_frames(runner: DecoderRunner, streams: dict[str, torch.Tensor], pieces: list[int]) -> None:
    """Each request's codes in `len(pieces)` messages (cut at the given fractions of its length, in
    percent), interleaved across requests, the decoder stepping between messages."""
    for seq in range(len(pieces)):
        for rid, codes in streams.items():
            n = codes.shape[-1]
            lo, hi = n * sum(pieces[:seq]) // 100, n * sum(pieces[: seq + 1]) // 100
            feed_frame(runner, rid, seq, codes[:, lo:hi], finished=seq == len(pieces) - 1)
        runner.step()
    run(runner)


def test_code2wav_stage_streams_each_request_as_its_whole_decode(q3_runner):
    """Three requests' [4, k] code frames in several messages each: every request's streamed audio
    equals a whole-sequence decode, and transformers' own code2wav, within CHUNKED_ATOL."""
    from transformers import Qwen3OmniMoeForConditionalGeneration

    runner = q3_runner
    decoder: Code2WavDecoder = runner.decoder
    assert isinstance(decoder, Code2WavDecoder)  # picked from the folder's config.json
    # 66 codes: its last windows start past the 56 codes of left context the decoder needs.
    streams = {"a": frames(1, 66), "b": frames(2, 21), "c": frames(3, 30)}
    stream_frames(runner, streams, [5, 20, 30, 45])  # the first message: a short first chunk
    audio, errors = received(runner, set(streams))
    assert not errors and set(audio) == set(streams) and runner.requests == {}
    model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(
        runner.handoff_ctx.model_path, dtype=torch.float32
    ).eval()
    spc, tail = decoder.samples_per_code, decoder.receptive_field.tail_samples
    for rid, codes in streams.items():
        whole = decoder.decode(codes)
        with torch.no_grad():
            ref = model.code2wav(codes[None])[0, 0]
        assert audio[rid].shape == whole.shape == (codes.shape[-1] * spc - tail,)
        torch.testing.assert_close(audio[rid], whole, atol=CHUNKED_ATOL, rtol=0)
        torch.testing.assert_close(audio[rid], ref, atol=CHUNKED_ATOL, rtol=0)
        assert audio[rid].std() > 0.05  # a real signal, not silence


def test_code2wav_stage_first_audio_after_a_short_chunk(q3_runner):
    """Audio starts once FIRST_CHUNK_CODES codes have arrived (code2wav needs no lookahead: the
    first chunk's audio ends tail_samples early, the next chunk starts there)."""
    runner = q3_runner
    codes = frames(4, 30)
    rf = runner.decoder.receptive_field
    need = FIRST_CHUNK_CODES + rf.right_codes
    feed_frame(runner, "early", 0, codes[:, : need - 1], finished=False)
    assert not runner.has_work()
    feed_frame(runner, "early", 1, codes[:, need - 1 : need], finished=False)
    run(runner)
    msg, tensors = sent_so_far(runner)[0]
    assert need == FIRST_CHUNK_CODES
    assert msg.seq == 0 and tensors["audio"].shape == (
        FIRST_CHUNK_CODES * runner.decoder.samples_per_code - rf.lag_samples,
    )
    runner.abort("early")


def test_code2wav_stage_bad_codes_fail_that_request_alone(q3_runner):
    """A code outside [0, 256) in codebook 3 after audio already left, a frame of the wrong
    number of codebooks, and codes sent as token ids: each fails its request (400, naming it);
    the request decoding beside them gets all its audio."""
    runner = q3_runner
    good, bad = frames(5, 24), frames(6, 24)
    bad[3, 18] = 256  # in the second message
    streams = {"good": good, "range": bad}
    stream_frames(runner, streams, [50, 50])
    feed_frame(runner, "shape", 0, frames(7, 10, q=3), finished=True)
    runner.guarded(
        "ids",
        lambda: runner.accept(
            StreamStart(request_id="ids", stage="talker", seq=0, token_ids=[1, 2, 3], finished=True), {}
        ),
    )
    audio, errors = received(runner, {"good", "range", "shape", "ids"})
    assert set(audio) == {"good"} and set(errors) == {"range", "shape", "ids"}
    assert all(e.status == 400 and e.stage == "decoder" for e in errors.values())
    assert "code 256 of codebook 3 is outside the codebook [0, 256)" in errors["range"].message
    assert "num_quantizers=4" in errors["shape"].message
    assert "tensor frame" in errors["ids"].message
    torch.testing.assert_close(audio["good"], runner.decoder.decode(good), atol=CHUNKED_ATOL, rtol=0)
    assert runner.requests == {}
