"""The thinker listens while the user speaks (issue 51): a turn's audio as encoder-window pieces, and
the session's listening requests (omni_cache/serving/realtime/listening.py), without stages.

The thinker side (vLLM's Qwen3-Omni thinker taking adjacent audio items, the prefix cache hit of a
listening request, answers bitwise equal) is tests/test_realtime_listening_vllm.py.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest

from omni_cache.models.preprocessor import MIN_AUDIO_SAMPLES
from omni_cache.runtime.request_path.admission import InFlightBounds
from omni_cache.runtime.request_path.results import Completed, RequestError
from omni_cache.serving.realtime import listening
from omni_cache.serving.realtime.conversation import (
    Item,
    ItemPart,
    audio_item,
    audio_parts,
    audio_runs,
    expand_audio_runs,
    render,
)
from omni_cache.serving.realtime.conversation_bounds import Prompt
from omni_cache.serving.realtime.input_buffer import InputAudioBuffer

RATE = 16000
WINDOW = 16000  # 1 s windows here (Qwen3-Omni's are 8 s)
PAD = 7


def clip(seconds: float, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).uniform(-0.5, 0.5, int(seconds * RATE)).astype(np.float32)


# ---- a turn's audio as pieces -------------------------------------------------------------------


def test_a_turn_is_cut_at_the_encoder_window_and_the_pieces_join_into_one_clip():
    samples = clip(2.5)
    parts = audio_parts(samples, RATE, WINDOW)
    assert [len(p.media.array) for p in parts] == [WINDOW, WINDOW, RATE // 2]
    assert [p.joined for p in parts] == [False, True, True]
    np.testing.assert_array_equal(np.concatenate([p.media.array for p in parts]), samples)
    assert len({p.media.digest for p in parts}) == 3
    # The same samples give the same pieces (digests): a turn prefilled while spoken and the
    # committed turn are the same items.
    assert [p.media.digest for p in audio_parts(samples.copy(), RATE, WINDOW)] == [p.media.digest for p in parts]
    # One clip in the chat message and in the client's view; every piece in the prompt's media.
    item = Item("user", parts + [ItemPart("input_text", text="and?")])
    message, media = item.message()
    assert message["content"] == [{"type": "audio"}, {"type": "text", "text": "and?"}]
    assert len(media) == 3
    assert [c.type for c in item.sdk().content] == ["input_audio", "input_text"]
    # Without a window (or a short turn) the turn stays one clip.
    assert len(audio_parts(samples, RATE, None)) == 1
    assert len(audio_parts(clip(0.5), RATE, WINDOW)) == 1


def test_a_last_piece_too_short_for_the_feature_extractor_stays_with_the_one_before():
    # Whisper's feature extractor (n_fft 400) fails on an item of n_fft // 2 samples or fewer: a
    # turn of whole windows and a few samples more once failed its response.
    def samples(n: int) -> np.ndarray:
        return np.random.default_rng(n).uniform(-0.5, 0.5, n).astype(np.float32)

    for extra in (1, 200, MIN_AUDIO_SAMPLES - 1):
        turn = samples(2 * WINDOW + extra)
        parts = audio_parts(turn, RATE, WINDOW)
        assert [len(p.media.array) for p in parts] == [WINDOW, WINDOW + extra]
        np.testing.assert_array_equal(np.concatenate([p.media.array for p in parts]), turn)
    lengths = [len(p.media.array) for p in audio_parts(samples(2 * WINDOW + MIN_AUDIO_SAMPLES), RATE, WINDOW)]
    assert lengths == [WINDOW, WINDOW, MIN_AUDIO_SAMPLES]
    # A turn of one window and a few samples stays one clip.
    assert len(audio_parts(samples(WINDOW + 5), RATE, WINDOW)) == 1


def test_each_piece_gets_its_own_placeholder_side_by_side():
    first = Item("user", audio_parts(clip(1.2, 1), RATE, WINDOW))  # 2 pieces
    answer = Item("assistant", [ItemPart("output_audio", text="ok")])
    second = Item("user", [ItemPart("input_audio", media=audio_item(clip(0.3, 2), RATE))])
    items = [first, answer, second]
    assert audio_runs(items) == [2, 1]
    messages, media = render(items, "")
    assert len(media) == 3
    ids = [1, PAD, 2, 3, 4, PAD, 5]  # as a template renders two audio parts
    assert expand_audio_runs(ids, [2, 1], PAD) == [1, PAD, PAD, 2, 3, 4, PAD, 5]
    assert expand_audio_runs(ids, [1, 1], PAD) == ids
    with pytest.raises(ValueError):
        expand_audio_runs(ids, [2, 1, 1], PAD)


def test_the_buffer_head_and_its_epoch():
    buf = InputAudioBuffer(RATE, 10.0)
    a, b = clip(0.5, 1), clip(0.7, 2)
    buf.append(a)
    buf.append(b)
    np.testing.assert_array_equal(buf.head(RATE), np.concatenate([a, b])[:RATE])
    assert buf.size == len(a) + len(b)  # nothing consumed
    epoch = buf.epoch
    buf.append(a)
    assert buf.epoch == epoch  # appends keep the start
    buf.keep_last(100)
    assert buf.epoch == epoch + 1  # the start moved
    buf.take()
    assert buf.epoch == epoch + 2
    buf.clear()
    assert buf.epoch == epoch + 3


# ---- listening requests -------------------------------------------------------------------------


class FakeHandle:
    def __init__(self) -> None:
        self.done = False
        self.aborted: str | None = None
        self._end = asyncio.Event()

    async def events(self):
        await self._end.wait()
        self.done = True
        yield Completed(finish_reason="length", num_prompt_tokens=0, cached_tokens={}, latents={})

    def finish(self) -> None:
        self._end.set()

    def abort(self, reason: str) -> None:
        self.aborted = reason
        self._end.set()


class FakePipeline:
    def __init__(self, max_requests: int = 8) -> None:
        self.admission = SimpleNamespace(bounds=InFlightBounds(max_requests, 2**40))
        self.admission.enter = self.admission.bounds.enter
        self.topology = SimpleNamespace(speaker_prefills=True)  # a talker speaks (Topology)
        self.submitted: list[dict] = []
        self.handles: list[FakeHandle] = []

    async def submit(self, ids, **kw):
        self.submitted.append({"ids": list(ids), **kw})
        h = FakeHandle()
        self.handles.append(h)
        return h


class FakeBounds:
    """conversation_bounds as the session has it: a prompt of the items, one token per text item
    and the audio placeholder once per piece, then an audio_end (9) and the answer prompt (8)."""

    audio_placeholder = PAD

    async def fit(self, items, instructions, max_tokens, truncation):
        ids, media = [], []
        for item in items:
            for part in item.content:
                if part.media is not None:
                    ids.append(PAD)
                    media.append(part.media)
                else:
                    ids.append(1)
            ids.append(9)
        return Prompt(ids + [8], media)


class FakeSession:
    def __init__(self, pipeline: FakePipeline, vad: bool = False, output: str = "text") -> None:
        self.id = "sess_test"
        self.pipeline = pipeline
        self.rate = RATE
        self.buffer = InputAudioBuffer(RATE, 60.0)
        self.bounds = FakeBounds()
        self.conversation = SimpleNamespace(items=[Item("user", [ItemPart("input_text", text="hi")])])
        self.config = SimpleNamespace(
            instructions="", max_output_tokens=5, truncation=None, output_modalities=(output,)
        )
        self.responding = False
        self.detector = object() if vad else None
        self.speech_item_id = "item_1" if vad else None


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


def test_each_complete_window_is_prefilled_up_to_its_end_and_no_further():
    async def go():
        pipeline = FakePipeline()
        session = FakeSession(pipeline)
        listener = listening.Listener(session, WINDOW, True, 8)
        session.buffer.append(clip(0.6))
        listener.poke()
        await settle()
        assert pipeline.submitted == []  # no complete window yet
        session.buffer.append(clip(0.6, 1))
        listener.poke()
        await settle()
        (req,) = pipeline.submitted
        # The conversation's prompt, then the turn's first window: no audio_end, no answer prompt.
        assert req["ids"] == [1, 9, PAD]
        assert req["max_tokens"] == 1 and req["modalities"] == ("text",) and req["session_id"] == session.id
        assert req["prefill_only"] is True
        (piece,) = req["media"]
        np.testing.assert_array_equal(piece.array, session.buffer.head(WINDOW))
        # A second window arrives while the first request runs: one request at a time, then the
        # next covers both windows.
        session.buffer.append(clip(1.0, 2))
        listener.poke()
        await settle()
        assert len(pipeline.submitted) == 1
        pipeline.handles[0].finish()
        await settle()
        assert pipeline.submitted[1]["ids"] == [1, 9, PAD, PAD]
        assert [m.digest for m in pipeline.submitted[1]["media"]][:1] == [piece.digest]
        # The committed turn's pieces are the ones prefilled.
        committed = audio_parts(session.buffer.take(), RATE, WINDOW)
        assert [p.media.digest for p in committed[:2]] == [m.digest for m in pipeline.submitted[1]["media"]]
        listener.turn_ended()
        # Still running at the commit: aborted (what it computed stays cached; the response,
        # sent next, computes the rest once).
        assert pipeline.handles[1].aborted is not None
        await settle()
        assert pipeline.admission.bounds.requests == 2  # (the fake submit never releases tickets)
        assert listener.stats.requests == 2 and listener.stats.windows == 2 and listener.stats.cut == 1
        assert listener.stats.aborted == 0
        await listener.close()

    asyncio.run(go())


def test_cleared_audio_aborts_the_listening_request_and_nothing_reaches_the_next_turn():
    async def go():
        pipeline = FakePipeline()
        session = FakeSession(pipeline)
        listener = listening.Listener(session, WINDOW, True, 8)
        old = clip(1.5, 3)
        session.buffer.append(old)
        listener.poke()
        await settle()
        first = pipeline.handles[0]
        # input_audio_buffer.clear (the session calls forget, then clears the buffer)
        listener.forget()
        session.buffer.clear()
        assert first.aborted is not None
        await settle()
        new = clip(1.2, 4)
        session.buffer.append(new)
        listener.poke()
        await settle()
        assert len(pipeline.submitted) == 2
        (piece,) = pipeline.submitted[1]["media"]
        np.testing.assert_array_equal(piece.array, new[:WINDOW])  # the new turn's audio only
        assert piece.digest != pipeline.submitted[0]["media"][0].digest
        assert listener.stats.aborted == 1
        await listener.close()
        assert pipeline.handles[1].aborted is not None  # the session closing aborts too

    asyncio.run(go())


def test_listening_waits_for_speech_and_for_the_sessions_answer_and_keeps_to_the_bounds():
    async def go():
        pipeline = FakePipeline(max_requests=4)
        session = FakeSession(pipeline, vad=True)
        listener = listening.Listener(session, WINDOW, True, 8)
        session.buffer.append(clip(2.0))
        session.speech_item_id = None  # server VAD, no speech in progress: not a turn yet
        listener.poke()
        await settle()
        session.speech_item_id = "item_2"
        session.responding = True  # its answer is not in the conversation yet
        listener.poke()
        await settle()
        assert pipeline.submitted == []
        session.responding = False
        for _ in range(3):  # 3 of 4 places taken: a listening request leaves them to answers
            pipeline.admission.bounds.enter()
        listener.poke()
        await settle()
        assert pipeline.submitted == [] and listener.stats.skipped == 1
        pipeline.admission.bounds.requests = 0
        listener.poke()
        await settle()
        assert len(pipeline.submitted) == 1
        await listener.close()
        # Switched off (server.realtime.listen_while_speaking: false) or no window: nothing is sent.
        for off in (listening.Listener(session, WINDOW, False, 8), listening.Listener(session, None, True, 8)):
            off.poke()
            await settle()
            await off.close()
        assert len(pipeline.submitted) == 1

    asyncio.run(go())


def test_a_refused_listening_request_is_skipped():
    async def go():
        pipeline = FakePipeline()

        async def refuse(ids, **kw):
            raise RequestError(503, "the thinker is down")

        pipeline.submit = refuse
        session = FakeSession(pipeline)
        listener = listening.Listener(session, WINDOW, True, 8)
        session.buffer.append(clip(1.1))
        listener.poke()
        await settle()
        assert listener.stats.skipped == 1 and listening.IN_FLIGHT == {}
        await listener.close()

    asyncio.run(go())


def test_a_listening_request_waits_while_an_answer_is_on_its_way_to_its_first_audio():
    async def go():
        pipeline = FakePipeline()
        session = FakeSession(pipeline)
        listener = listening.Listener(session, WINDOW, True, 8)
        listening.answer_starting(pipeline)  # another session's response: submitted, no delta yet
        session.buffer.append(clip(1.1))
        listener.poke()
        await asyncio.sleep(0.1)
        assert pipeline.submitted == []
        listening.answer_settled(pipeline)  # its first audio went out
        await asyncio.sleep(0.05)
        assert len(pipeline.submitted) == 1 and listening.STARTING == {}
        assert listener.stats.yielded_s >= 0.1
        await listener.close()

    asyncio.run(go())


def test_a_session_that_speaks_its_answers_has_the_talker_listen_too():
    """Its listening requests ask for audio (thinker -> talker) and are prefill-only: the talker
    prefills the user turn's rows, no decoder runs (tests/test_talker_listening_e2e.py)."""

    async def go():
        pipeline = FakePipeline()
        session = FakeSession(pipeline, output="audio")
        listener = listening.Listener(session, WINDOW, True, 8)
        session.buffer.append(clip(1.2))
        listener.poke()
        await settle()
        (req,) = pipeline.submitted
        assert req["modalities"] == ("text", "audio") and req["prefill_only"] is True
        await listener.close()

    asyncio.run(go())


def test_every_piece_of_a_turn_a_few_samples_past_a_window_passes_the_models_processor():
    # The oracle is the checkpoint's own processor (transformers', which vLLM applies to each
    # audio item): it refused a last piece of n_fft // 2 samples or fewer.
    from transformers import AutoProcessor

    from omni_cache.models.preprocessor import audio_pieces
    from omni_cache.tiny.checkpoints import ensure_checkpoint

    path = ensure_checkpoint("qwen3-omni")
    processor = AutoProcessor.from_pretrained(path)
    window, _ = audio_pieces(path, processor.tokenizer)
    # The bound is the processor's own: half an n_fft fails it (what MIN_AUDIO_SAMPLES guards).
    with pytest.raises(RuntimeError, match="Padding size"):
        processor(text="<|audio_pad|>", audio=[np.zeros(MIN_AUDIO_SAMPLES // 2, np.float32)], return_tensors="pt")
    for extra in (100, 200, MIN_AUDIO_SAMPLES):
        turn = np.random.default_rng(extra).uniform(-0.5, 0.5, window + extra).astype(np.float32)
        for part in audio_parts(turn, RATE, window):
            out = processor(text="<|audio_pad|>", audio=[part.media.array], return_tensors="pt")
            assert out["feature_attention_mask"].sum() > 0
