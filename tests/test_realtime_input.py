"""Realtime input audio off the event loop (omni_cache/serving/realtime/input_worker.py): many
sessions' VAD windows scored in one Silero call give each session the events it gets alone, and
a session's append handler only hands bytes over (the model runs on the worker's thread)."""

from __future__ import annotations

import asyncio
import base64
import json
import threading
import uuid

import numpy as np
import pytest
from fake_pipeline import make_orchestrator, write_config

from benchmarks.speech_clips import pcm16, silence, speech
from omni_cache.config.server_schema import RealtimeConfig, ThreadsConfig
from omni_cache.serving.realtime import vad
from omni_cache.serving.realtime.audio_codecs import PCM, StreamResampler
from omni_cache.serving.realtime.input_worker import InputAudioWorker, InputStream, decode_appends
from omni_cache.serving.realtime.protocol import EventError, parse_client_event
from omni_cache.serving.realtime.session import RealtimeSession
from omni_cache.serving.realtime.vad_batch import BatchScorer
from omni_cache.thread_pools import ThreadPools

CHUNK = 960  # 40 ms at 24 kHz, as a real-time client sends it


class RecordingScorer(BatchScorer):
    """The batched scorer with its calls recorded: (thread id, sessions scored) per call."""

    def __init__(self, model) -> None:
        super().__init__(model)
        self.model = model
        self.calls: list[tuple[int, int]] = []

    def score(self, work):
        self.calls.append((threading.get_ident(), sum(1 for _, w in work if len(w))))
        return super().score(work)


@pytest.fixture
def threads():
    """A server's worker threads, as the app makes them (omni_cache/thread_pools.py)."""
    pools = ThreadPools(ThreadsConfig())
    yield pools
    pools.close()


@pytest.fixture(scope="module")
def model():
    return RecordingScorer(vad.load_model())


def test_the_network_is_calledforward_in_parts_as_its_own_forward_computes(model):
    """The pinned silero-vad's network splits into front, LSTM and head (else the scorer falls
    back to a forward per round); both give the same probabilities and states."""
    import torch

    assert model.split
    rng = np.random.default_rng(1)
    x = torch.from_numpy((0.2 * rng.standard_normal((9, 576))).astype(np.float32))
    state = torch.from_numpy((0.2 * rng.standard_normal((2, 4, 128))).astype(np.float32))
    with torch.inference_mode():
        p, s = model.forward_in_parts(x, [4, 3, 2], state)
        p_ref, s_ref = model.forward_by_rounds(x, [4, 3, 2], state)
    assert torch.allclose(p, p_ref, atol=1e-5) and torch.allclose(s, s_ref, atol=1e-5)


def clip(seed: int) -> np.ndarray:
    """24 kHz speech-like audio with pauses (two turns), different per seed."""
    rng = np.random.default_rng(seed)
    parts = [silence(0.2 + 0.3 * rng.random())]
    for turn in range(2):
        parts += [speech(0.8 + rng.random(), seed=seed * 10 + turn), silence(0.7 + 0.3 * rng.random())]
    return np.concatenate(parts)


def b64(samples: np.ndarray) -> str:
    return base64.b64encode(pcm16(samples)).decode()


async def hear(worker: InputAudioWorker, clips: list[np.ndarray]) -> list[tuple[list, np.ndarray]]:
    """Every clip through its own stream (server VAD on, 16 kHz encoder), all appended at once
    in 40 ms chunks; per clip its VAD events (kind, ms) and the encoder samples heard."""
    heard: list[list] = [[] for _ in clips]
    streams = [InputStream(worker, PCM, vad.RATE, heard[i].append) for i in range(len(clips))]
    for s in streams:
        s.set_detector(vad.SpeechDetector(0.5, 300))
    for i in range(0, max(map(len, clips)), CHUNK):
        for s, c in zip(streams, clips):
            if i < len(c):
                s.append(b64(c[i : i + CHUNK]), None)
    for s in streams:
        await s.drained()
    return [
        ([(e.kind, e.at_ms) for h in hs for e in h.events], np.concatenate([h.samples for h in hs])) for hs in heard
    ]


def reference_events(model: RecordingScorer, clip24k: np.ndarray) -> list[tuple[str, int]]:
    """The package's own per-window API (one stream per model object) and the same turn rule."""
    import torch

    x = StreamResampler(24000, vad.RATE)(np.frombuffer(pcm16(clip24k), "<i2").astype(np.float32) / 32768)
    detector, events = vad.SpeechDetector(0.5, 300), []
    model.model.reset_states()
    with torch.inference_mode():
        for w in detector.windows(x):
            event = detector.step(float(model.model(torch.from_numpy(w.copy()), vad.RATE)))
            if event is not None:
                events.append((event.kind, event.at_ms))
    return events


def test_batched_vad_gives_each_session_its_events_alone(model):
    clips = [clip(seed) for seed in range(6)]
    worker = InputAudioWorker(tick_s=0.02, scorer=model)
    try:
        together = asyncio.run(hear(worker, clips))
        batched_calls = [rows for _, rows in model.calls]
        alone = [asyncio.run(hear(worker, [c]))[0] for c in clips]
    finally:
        worker.close()
    assert max(batched_calls) == len(clips)  # one call scored every session's windows
    for (events, samples), (events_alone, samples_alone), c in zip(together, alone, clips):
        assert [k for k, _ in events] == ["start", "stop", "start", "stop"], events
        assert events == events_alone == reference_events(model, c)
        # Chunked through the worker = the whole clip resampled at once.
        whole = StreamResampler(24000, vad.RATE)(np.frombuffer(pcm16(c), "<i2").astype(np.float32) / 32768)
        assert np.array_equal(samples, samples_alone) and np.array_equal(samples, whole)
    assert {tid for tid, _ in model.calls} == {worker_thread_id(model)}


def worker_thread_id(model: RecordingScorer) -> int:
    ids = {tid for tid, _ in model.calls}
    assert len(ids) == 1 and threading.get_ident() not in ids
    return ids.pop()


def test_bad_appends_are_errors_and_the_rest_is_heard():
    good = np.zeros(480, "<i2").tobytes()
    samples, errors = decode_appends(
        PCM, [(base64.b64encode(good).decode(), "a"), ("%%%", "b"), (base64.b64encode(b"\x00" * 3).decode(), "c")]
    )
    assert len(samples) == 480
    assert [(e.param, eid) for e, eid in errors] == [("audio", "b"), ("audio", "c")]
    assert "base64" in errors[0][0].message and "whole 16-bit samples" in errors[1][0].message


def test_an_append_is_bounded_before_it_is_decoded():
    stream = InputStream(InputAudioWorker(), PCM, 16000, lambda heard: None)
    for n in (1, 2, 480, 959, 960, 24000):
        data = b64(np.zeros(n, np.float32))
        out = StreamResampler(24000, 16000)(np.zeros(n, np.float32))
        assert len(out) <= stream.bound(data) <= n * 2 // 3 + 2


def pipeline():
    """A fake pipeline's orchestrator, not started: what a session reads of it while no
    response is asked for (its encoder's rate, 16 kHz, and its bounds)."""
    return make_orchestrator(write_config(f"rtin_{uuid.uuid4().hex[:8]}"))


def client_event(**event) -> object:
    return parse_client_event(json.dumps(event))[0]


def test_append_hands_bytes_over_and_events_come_in_order(model, monkeypatch, threads):
    from omni_cache.serving.realtime import input_worker

    worker = InputAudioWorker(scorer=model)
    monkeypatch.setattr(input_worker, "shared", lambda: worker)
    model.calls.clear()
    sent: list = []

    async def go():
        session = RealtimeSession(pipeline(), sent.append, limits=RealtimeConfig(), served_model="m", threads=threads)
        await session.open()
        await session.handle(
            client_event(
                type="session.update",
                session={
                    "type": "realtime",
                    "audio": {
                        "input": {
                            "turn_detection": {
                                "type": "server_vad",
                                "create_response": False,
                                "silence_duration_ms": 300,
                            }
                        }
                    },
                },
            )
        )
        audio = clip(7)
        for i in range(0, len(audio), CHUNK):
            before = len(sent)
            await session.handle(
                client_event(type="input_audio_buffer.append", audio=b64(audio[i : i + CHUNK]), event_id=f"ev_{i}")
            )
            # Nothing was sent while the handler ran (and nothing scored on this thread, below):
            # it only handed the bytes over.
            assert len(sent) == before
        await session.handle(client_event(type="input_audio_buffer.clear"))  # waits for the appends
        await session.close()

    try:
        asyncio.run(go())
    finally:
        worker.close()
    types = [e.type for e in sent]
    turn = [
        "input_audio_buffer.speech_started",
        "input_audio_buffer.speech_stopped",
        "input_audio_buffer.committed",
        "conversation.item.added",
        "conversation.item.done",
    ]
    assert types == ["session.created", "session.updated", *turn, *turn, "input_audio_buffer.cleared"]
    starts = [e.audio_start_ms for e in sent if e.type == "input_audio_buffer.speech_started"]
    stops = [e.audio_end_ms for e in sent if e.type == "input_audio_buffer.speech_stopped"]
    assert starts[0] < stops[0] < starts[1] < stops[1], (starts, stops)
    assert model.calls and worker_thread_id(model) != threading.get_ident()


def test_a_full_buffer_refuses_the_append_at_once(threads):
    async def go():
        session = RealtimeSession(
            pipeline(), lambda e: None, limits=RealtimeConfig(max_buffer_s=1.0), served_model="m", threads=threads
        )
        await session.open()
        await session.handle(
            client_event(
                type="session.update", session={"type": "realtime", "audio": {"input": {"turn_detection": None}}}
            )
        )
        session.on_input_audio_buffer_append(
            client_event(type="input_audio_buffer.append", audio=b64(np.zeros(20000, np.float32)))
        )
        with pytest.raises(EventError) as refused:  # 0.83 s on its way + 0.5 s > 1 s
            session.on_input_audio_buffer_append(
                client_event(type="input_audio_buffer.append", audio=b64(np.zeros(12000, np.float32)))
            )
        await session.audio_in.drained()
        held_ms = session.buffer.duration_ms
        await session.close()
        return refused.value, held_ms

    err, held_ms = asyncio.run(go())
    assert err.code == "input_audio_buffer_full" and err.param == "audio"
    assert 700 <= held_ms <= 834  # the resampler holds back its filter's delay until a commit


def test_a_vad_model_that_does_not_load_is_tried_once_and_each_session_told_once(monkeypatch, caplog):
    """Before: every 100 ms tick loaded the model again, logged the traceback again and sent each
    session another error event carrying the exception's text."""
    calls = []

    def broken():
        calls.append(1)
        raise RuntimeError("no such file /srv/secret/silero.jit")

    monkeypatch.setattr(vad, "load_model", broken)
    worker = InputAudioWorker(tick_s=0.02)
    heard: list[list] = [[], []]

    async def go():
        streams = [InputStream(worker, PCM, vad.RATE, heard[i].append) for i in range(2)]
        for s in streams:
            s.set_detector(vad.SpeechDetector(0.5, 300))
        audio = clip(3)
        for i in range(0, len(audio), CHUNK):  # many ticks' worth of appends
            for s in streams:
                s.append(b64(audio[i : i + CHUNK]), None)
            await asyncio.sleep(0.005)
        for s in streams:
            await s.drained()

    try:
        with caplog.at_level("ERROR", logger="omni_cache.serving.realtime"):
            asyncio.run(go())
    finally:
        worker.close()
    assert len(calls) == 1  # the next try waits VAD_RETRY_S
    assert len([r for r in caplog.records if "did not load" in r.getMessage()]) == 1
    for session in heard:
        errors = [e for h in session for e, _ in h.errors]
        assert [e.code for e in errors] == ["vad_unavailable"], errors
        assert "turn_detection to null" in errors[0].message and "secret" not in errors[0].message
        assert sum(len(h.samples) for h in session) > 0  # the audio itself is still heard
