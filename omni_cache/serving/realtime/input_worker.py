"""Every realtime session's input audio handled off the event loop, by one worker thread.

The event loop only moves bytes: ``input_audio_buffer.append`` hands its base64 text to the
session's :class:`InputStream` and returns. The worker (:class:`InputAudioWorker`, one per server
process) wakes at most every ``tick_s``, takes every stream's pending appends and, per stream,
decodes them (base64, then the wire format) and resamples them to the audio encoder's rate (and
Silero's, where that differs) in one call each; then it scores every session's new VAD windows
together (:class:`.vad_batch.BatchScorer`: a few network calls, whatever the number of sessions). What
each stream heard (:class:`Heard`) goes back to the loop in one callback per tick, and order is
kept: a stream's session handles what was heard in the order the appends came, one at a time
(its handler may wait, e.g. for a response a barge-in cancelled to end), and the session waits
for all of it (:meth:`InputStream.drained`) before any other client event, so a commit or a
clear sees every append sent before it.

Why a tick: a network call's cost grows slowly with its rows (Silero's 16 kHz network: ~0.45 ms
for one window, ~2 ms for 64, on this project's 2-core AMD EPYC machines). Woken for every
40 ms append, the worker would score one window per call; waiting ``tick_s`` lets every
session's windows of that time share the calls (:mod:`.vad_batch`), and decodes and resamples
a session's appends of that time in one call each. The price: a speech start or stop is
reported up to ``tick_s`` later than it was heard. Measured (16 sessions streaming, the worker
thread's CPU per session-second of audio): 3.4 ms at 50 ms ticks, 2.9 ms at 100 ms; 64
sessions: 2.2 and 1.7 ms (a busy machine: load average ~11).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import inspect
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from omni_cache.serving.realtime import vad
from omni_cache.serving.realtime.audio_codecs import AudioFormat, StreamResampler
from omni_cache.serving.realtime.protocol import EventError
from omni_cache.serving.realtime.vad_batch import BatchScorer

logger = logging.getLogger("omni_cache.serving.realtime")

__all__ = ["TICK_S", "Heard", "InputAudioWorker", "InputStream", "decode_appends", "shared"]

#: How long the worker lets appends gather before it handles them (see the module's docstring).
TICK_S = 0.1
#: Seconds between tries to load the voice activity model after one failed.
VAD_RETRY_S = 30.0


@dataclass
class Heard:
    """What one tick made of a stream's appends, for the session on its loop."""

    samples: np.ndarray  # their audio at the encoder's rate
    appends: int  # how many appends this covers
    events: list[vad.VadEvent] = field(default_factory=list)
    #: The detector's state after them; None: no server VAD.
    in_speech: bool | None = None
    #: (error, the append's event_id) of each append that could not be used.
    errors: list[tuple[EventError, str | None]] = field(default_factory=list)


def decode_appends(
    fmt: AudioFormat, appends: list[tuple[str, str | None]]
) -> tuple[np.ndarray, list[tuple[EventError, str | None]]]:
    """The base64 texts of ``appends`` ((data, event_id) each) as one array of float32 samples in
    ``fmt``, and an error for each that is not valid base64 or not whole samples (it is left
    out). One decode of the joined bytes: a numpy call per append costs more than its data."""
    raw: list[bytes] = []
    errors: list[tuple[EventError, str | None]] = []
    for data, event_id in appends:
        try:
            b = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError):
            errors.append((EventError("audio is not valid base64", param="audio", code="invalid_value"), event_id))
            continue
        if len(b) % fmt.bytes_per_sample:
            errors.append(
                (
                    EventError(
                        f"{fmt.type} data must be whole 16-bit samples (an even number of bytes)",
                        param="audio",
                        code="invalid_value",
                    ),
                    event_id,
                )
            )
            continue
        raw.append(b)
    return fmt.decode(b"".join(raw)), errors


class InputStream:
    """One session's input audio: its wire format, resamplers and speech detector, and the
    appends not yet heard. The worker thread uses the format, resamplers and detector while
    appends are pending; the loop changes them (:meth:`set_format`, :meth:`set_detector`, the
    detector's ``reset``) only once :meth:`drained`."""

    def __init__(
        self, worker: InputAudioWorker, fmt: AudioFormat, encoder_rate: int, on_heard: Callable[[Heard], Any]
    ) -> None:
        self.worker = worker
        self.encoder_rate = encoder_rate
        self.on_heard = on_heard
        self.detector: vad.SpeechDetector | None = None
        self.closed = False
        self._jobs: list[tuple[str, str | None]] = []  # guarded by the worker's lock
        self._in_flight = 0  # appends handed over and not yet handled (the loop's count)
        self._pending_bound = 0  # at most this many encoder samples are on their way
        self._heard_queue: deque[tuple[Heard, int]] = deque()  # heard, not yet handled
        self._handling: asyncio.Task | None = None
        self._idle: asyncio.Event | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.set_format(fmt)

    # ---- the loop's side -------------------------------------------------------------------------

    def set_format(self, fmt: AudioFormat) -> None:
        self._check_drained()
        self.format = fmt
        self.to_encoder = StreamResampler(fmt.rate, self.encoder_rate)
        # The detector reads the encoder's samples when it runs at Silero's rate (16 kHz encoders).
        self.to_vad = None if self.encoder_rate == vad.RATE else StreamResampler(fmt.rate, vad.RATE)

    def set_detector(self, detector: vad.SpeechDetector | None) -> None:
        self._check_drained()
        self.detector = detector

    def bound(self, data: str) -> int:
        """The most encoder samples the base64 text ``data`` can add (read from its length)."""
        samples = len(data) * 3 // 4 // self.format.bytes_per_sample
        return -(-samples * self.encoder_rate // self.format.rate) + 1

    @property
    def pending_samples(self) -> int:
        """At most this many encoder samples are still on their way to the buffer."""
        return self._pending_bound

    def append(self, data: str, event_id: str | None) -> None:
        """Hand over one append's base64 text; it is heard (``on_heard``) a tick or so later."""
        if self.closed:
            return
        if self.loop is None:
            self.loop = asyncio.get_running_loop()
        self._in_flight += 1
        self._pending_bound += self.bound(data)
        if self._idle is not None:
            self._idle.clear()
        self.worker.submit(self, data, event_id)

    async def drained(self) -> None:
        """Return once every append handed over has been handled (or the stream is closed)."""
        if not self._in_flight or self.closed:
            return
        if self._idle is None:
            self._idle = asyncio.Event()
        self._idle.clear()
        await self._idle.wait()

    def close(self) -> None:
        """Nothing more is heard; pending appends are dropped."""
        self.closed = True
        self.worker.forget(self)
        self._heard_queue.clear()
        if self._handling is not None:
            self._handling.cancel()
        if self._idle is not None:
            self._idle.set()

    def _heard(self, heard: Heard, bound: int) -> None:
        if self.closed:
            return
        self._heard_queue.append((heard, bound))
        if self._handling is None or self._handling.done():
            self._handling = asyncio.get_running_loop().create_task(self._handle_heard(), name="realtime-heard")

    async def _handle_heard(self) -> None:
        while self._heard_queue:
            heard, bound = self._heard_queue.popleft()
            try:
                result = self.on_heard(heard)
                if inspect.isawaitable(result):
                    await result
            except Exception:  # noqa: BLE001 -- a bug must not stop the session's audio
                logger.exception("realtime: handling heard audio failed")
            finally:
                self._in_flight -= heard.appends
                self._pending_bound -= bound  # in the buffer now (or dropped)
            if not self._in_flight and self._idle is not None:
                self._idle.set()

    def _check_drained(self) -> None:
        if self._in_flight:
            raise RuntimeError("an input stream is reconfigured only when drained (appends pending)")

    # ---- the worker's side -----------------------------------------------------------------------

    def _process(self, jobs: list[tuple[str, str | None]]) -> tuple[Heard, np.ndarray | None]:
        """Decode and resample ``jobs``: what was heard (no VAD events yet) and the VAD windows."""
        samples, errors = decode_appends(self.format, jobs)
        encoded = self.to_encoder(samples)
        heard = Heard(encoded, len(jobs), errors=errors)
        if self.detector is None:
            return heard, None
        return heard, self.detector.windows(encoded if self.to_vad is None else self.to_vad(samples))


class InputAudioWorker:
    """The thread that decodes, resamples and scores every stream's appends (it owns the Silero
    model: one model for all sessions, loaded on first use)."""

    def __init__(self, tick_s: float = TICK_S, scorer: BatchScorer | None = None) -> None:
        self.tick_s = tick_s
        #: Silero, batched; loaded by the thread when a detector first needs it.
        self.scorer = scorer
        self._load_failed_at: float | None = None  # when loading the model last failed
        self._told: weakref.WeakSet = weakref.WeakSet()  # detectors told VAD is unavailable
        self._cv = threading.Condition()
        self._ready: dict[InputStream, None] = {}  # streams with jobs, in arrival order
        self._thread: threading.Thread | None = None
        self._closing = False
        self._idle = False  # the thread waits for work (not resting between ticks)

    def submit(self, stream: InputStream, data: str, event_id: str | None) -> None:
        with self._cv:
            stream._jobs.append((data, event_id))
            self._ready[stream] = None
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="realtime-input-audio", daemon=True)
                self._thread.start()
            if self._idle:  # resting between ticks, it takes this at the next one anyway
                self._cv.notify()

    def forget(self, stream: InputStream) -> None:
        with self._cv:
            self._ready.pop(stream, None)
            stream._jobs = []

    def close(self) -> None:
        """Stop the thread (a test's worker; the server's lives as long as its process)."""
        with self._cv:
            self._closing = True
            self._cv.notify()
            thread = self._thread
        if thread is not None:
            thread.join()

    def _run(self) -> None:
        while True:
            with self._cv:
                self._idle = True
                self._cv.wait_for(lambda: self._ready or self._closing)
                self._idle = False
                if self._closing:
                    return
                work, self._ready = self._ready, {}
            started = time.monotonic()
            try:
                self._tick(list(work))
            except Exception:  # noqa: BLE001 -- a bug loses this tick's audio, not the thread
                logger.exception("realtime: the input audio worker's tick failed")
            del work  # no stream stays alive in this frame while the thread waits
            # What arrives during the rest of the tick waits for the next one (batched with it).
            with self._cv:
                self._cv.wait_for(lambda: self._closing, max(0.0, started + self.tick_s - time.monotonic()))

    def _tick(self, streams: list[InputStream]) -> None:
        out: list[tuple[InputStream, Heard, int]] = []
        scoring: list[tuple[vad.SpeechDetector, np.ndarray]] = []
        scored: list[Heard] = []
        for stream in streams:
            with self._cv:  # the loop appends to it meanwhile
                jobs, stream._jobs = stream._jobs, []
            if not jobs:  # forgotten (closed) since
                continue
            bound = sum(stream.bound(data) for data, _ in jobs)
            try:
                heard, windows = stream._process(jobs)
            except Exception:  # noqa: BLE001 -- a bug in one stream must not stop the others
                logger.exception("realtime: input audio failed")
                heard, windows = (
                    Heard(
                        np.zeros(0, np.float32),
                        len(jobs),
                        errors=[
                            (
                                EventError(
                                    "internal error while reading the input audio (in the server's log)",
                                    type="server_error",
                                    code="internal_error",
                                ),
                                jobs[-1][1],
                            )
                        ],
                    ),
                    None,
                )
            if windows is not None:
                scoring.append((stream.detector, windows))
                scored.append(heard)
            out.append((stream, heard, bound))
        if scoring:
            self._score(scoring, scored)
        self._deliver(out)

    def _score(self, scoring: list[tuple[vad.SpeechDetector, np.ndarray]], scored: list[Heard]) -> None:
        try:
            scorer = self._scorer()
            events = scorer.score(scoring) if scorer is not None else None
        except Exception:  # noqa: BLE001 -- the sessions are told; the worker goes on
            logger.exception("realtime: voice activity detection failed")
            events = None
        if events is None:
            # Each session is told once per failure, not every tick; the exception is the log's.
            for (detector, _), heard in zip(scoring, scored):
                if detector not in self._told:
                    self._told.add(detector)
                    heard.errors.append((_vad_unavailable(), None))
            events = [[] for _ in scoring]
        else:
            self._told = weakref.WeakSet()
        for (detector, _), heard, evs in zip(scoring, scored, events):
            heard.events, heard.in_speech = evs, detector.in_speech

    def _scorer(self) -> BatchScorer | None:
        """The batched Silero model, loaded on first use; None while a failed load waits for its
        retry (:data:`VAD_RETRY_S`: loading again every tick would log and fail every 100 ms)."""
        if self.scorer is not None:
            return self.scorer
        now = time.monotonic()
        if self._load_failed_at is not None and now - self._load_failed_at < VAD_RETRY_S:
            return None
        try:
            import torch

            # One thread: the batches are small (intra-op threads would spin more than they
            # help) and the event loop needs the other core. The package's import sets it too.
            torch.set_num_threads(1)
            self.scorer = BatchScorer(vad.load_model())
        except Exception:  # noqa: BLE001 -- logged once per try; the sessions are told
            self._load_failed_at = now
            logger.exception("realtime: the voice activity model did not load; next try in %g s", VAD_RETRY_S)
            return None
        self._load_failed_at = None
        return self.scorer

    @staticmethod
    def _deliver(out: list[tuple[InputStream, Heard, int]]) -> None:
        """One callback per loop for the whole tick (each wakes its loop once)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[InputStream, Heard, int]]] = {}
        for stream, heard, bound in out:
            if stream.loop is not None:
                by_loop.setdefault(stream.loop, []).append((stream, heard, bound))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_hand_over, items)
            except RuntimeError:  # the loop is closed: its sessions are gone
                pass


def _vad_unavailable() -> EventError:
    return EventError(
        "server_vad is unavailable: the voice activity model did not load on this server (in its "
        "log); set audio.input.turn_detection to null and commit the input buffer yourself",
        type="server_error",
        code="vad_unavailable",
    )


def _hand_over(items: list[tuple[InputStream, Heard, int]]) -> None:
    for stream, heard, bound in items:
        stream._heard(heard, bound)


_shared: InputAudioWorker | None = None
_shared_lock = threading.Lock()


def shared() -> InputAudioWorker:
    """The process's worker: every session of every server in this process feeds it, so their
    windows share the network calls."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = InputAudioWorker()
        return _shared
