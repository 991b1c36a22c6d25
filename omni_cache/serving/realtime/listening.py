"""The thinker listens while the user speaks (issue 51): a turn's audio is prefilled as it arrives.

A user turn's audio is in the prompt as pieces of the thinker's audio-encoder window
(:func:`.conversation.audio_parts`: 8 s for Qwen3-Omni, where cut audio encodes as the whole clip
does), one multimodal item each, side by side in one audio span. While the turn is spoken, each
time the input buffer completes another window the session sends the thinker a **prefill-only
request**: the prompt the turn's response will have (the conversation, fitted as a response's
prompt is), cut after the last complete window (no ``audio_end``, no generation prompt),
``max_tokens`` 1, prefill-only (wire ``Submit.prefill_only``), its output dropped. vLLM's prefix
cache then holds those blocks (their hashes carry each window's digest) and the hidden-state cache
their latents; the turn's response, whose prompt begins with the same tokens and items, hits them
and computes only the tail window and the answer. When the session's answers are spoken, the
talker listens too: the request also runs thinker -> talker, whose hand-off builds the talker
prompt of the user turns so far (``TalkerPrompt.user_rows``: the first rows of the answer's
talker prompt, bitwise, from the thinker rows the hidden-state cache serves the answer) and the
talker prefills it (one code, dropped; no decoder). Without it the talker prefilled the whole new
turn (about 13 rows per second of speech) after the thinker's first token, on the way to the first
audio. Nothing in the engine is held between windows: a request that is
abandoned leaves only evictable cached blocks that no other prompt can match.

Bounds: at most one listening request per session at a time (a window that completes meanwhile is
taken by the next one, which covers everything before it), at most
``server.realtime.max_listening_requests`` in the server, and each takes a place among
``server.max_requestsIN_FLIGHT`` only while a quarter of them stays free: a listening request
never takes the place an answer needs, and one that cannot be sent is skipped (the response
computes that audio itself). None runs while the session's own response is in flight (its
answer is not in the conversation yet), and one waits (up to 1 s) while any response of the
server is between its submission and its first delta: answers on their way to first audio go
first. vLLM schedules the requests already decoding before
new prefill in each step, so answers being spoken go first. ``server.realtime.listen_while_speaking:
false`` turns it off (the pieces stay: the prompts are the same either way).

Clearing audio (``input_audio_buffer.clear``, a detected speech start trimming the buffer, the
session closing) aborts the listening request in flight and forgets the pieces: the next turn's
pieces are cut from the new buffer. At a commit the request in flight runs to its end (its blocks
are the response's) and the listener starts over on the next turn.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

from omni_cache.runtime.request_path.results import RequestError
from omni_cache.serving.realtime.conversation import Item, ItemPart, audio_item
from omni_cache.tasks import wait_ended

logger = logging.getLogger("omni_cache.serving.realtime")

__all__ = ["IN_FLIGHT", "STARTING", "TOTALS", "Listener", "ListenStats", "answer_settled", "answer_starting"]

#: Listening requests in flight, per pipeline (its id()): the server-wide bound.
IN_FLIGHT: dict[int, int] = {}


@dataclass
class ListenStats:
    requests: int = 0  # listening requests sent
    windows: int = 0  # windows they prefilled (the furthest each reached, summed per turn)
    aborted: int = 0  # aborted by a clear / a trimmed buffer / the session closing
    cut: int = 0  # still running at the turn's commit: aborted, the response takes over
    skipped: int = 0  # not sent: the server's bounds
    yielded_s: float = 0.0  # time listening requests waited for answers' first deltas
    busy_s: float = 0.0  # listening requests' time from submit to their end, summed
    longest_s: float = 0.0  # the longest one


#: Responses sent and not yet at their first delta, per pipeline (its id()): a listening request
#: waits (at most :data:`MAX_YIELD_S`) while there are any, so it does not take CPU from an
#: answer's way to its first audio (the thinker, talker and decoder share the host's cores).
STARTING: dict[int, int] = {}
MAX_YIELD_S = 1.0


def answer_starting(pipeline: Any) -> None:
    STARTING[id(pipeline)] = STARTING.get(id(pipeline), 0) + 1


def answer_settled(pipeline: Any) -> None:
    key = id(pipeline)
    STARTING[key] = STARTING.get(key, 0) - 1
    if STARTING[key] <= 0:
        del STARTING[key]


#: Every session's counts, summed (this server process).
TOTALS = ListenStats()


def _count(stats: ListenStats, field_name: str, n: float = 1) -> None:
    setattr(stats, field_name, getattr(stats, field_name) + n)
    setattr(TOTALS, field_name, getattr(TOTALS, field_name) + n)


class Listener:
    """One session's listening: ``poke`` after audio was added, ``forget`` when the buffer's
    audio was dropped, ``turn_ended`` after a commit took it, ``close`` with the session."""

    def __init__(self, session: Any, window: int | None, enabled: bool, max_requests: int) -> None:
        self.session = session
        self.window = window
        self.enabled = bool(enabled and window)
        self.max_requests = max_requests
        self.stats = ListenStats()
        self._parts: list[ItemPart] = []  # the current turn's complete windows, as prompt pieces
        self._epoch = -1  # the buffer epoch the pieces were cut from
        self._fed = 0  # windows of this turn a listening request covered (sent)
        self._handle: Any = None
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._closed = False

    # ---- the session's calls ---------------------------------------------------------------------

    def poke(self) -> None:
        if not self.enabled or self._closed:
            return
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name=f"listen-{self.session.id}")
        self._wake.set()

    def forget(self) -> None:
        """The buffer's audio was dropped: abort the listening request in flight, forget the pieces."""
        if self._handle is not None and not self._handle.done:
            self._handle.abort("realtime listening: the audio was cleared")
            _count(self.stats, "aborted")
        self._reset()

    def turn_ended(self) -> None:
        """A commit took the buffer: the listening request in flight is aborted too. What it
        computed stays in the prefix cache (vLLM hashes a block when its tokens are scheduled and
        takes an abort between steps), and the turn's response, sent right after, computes the
        rest once instead of both computing it (a window completed just before the commit)."""
        if self._handle is not None and not self._handle.done:
            self._handle.abort("realtime listening: the turn was committed")
            _count(self.stats, "cut")
        self._reset()

    async def close(self) -> None:
        self._closed = True
        self.forget()
        if self._task is not None:
            self._task.cancel()
            await wait_ended([self._task])

    # ---- the work --------------------------------------------------------------------------------

    def _reset(self) -> None:
        self._parts, self._fed, self._epoch = [], 0, -1

    def _listening(self) -> bool:
        s = self.session
        if s.responding:
            return False
        if s.detector is not None:
            return s.speech_item_id is not None  # speech in progress
        return s.buffer.size > 0

    def _complete(self) -> int:
        """Complete windows in the buffer now (the pieces cut so far brought up to date)."""
        buf = self.session.buffer
        if buf.epoch != self._epoch:
            self._parts, self._fed, self._epoch = [], 0, buf.epoch
        n = buf.size // self.window
        if n > len(self._parts):
            samples = buf.head(n * self.window)
            rate = self.session.rate
            for k in range(len(self._parts), n):
                piece = samples[k * self.window : (k + 1) * self.window]
                self._parts.append(ItemPart("input_audio", media=audio_item(piece, rate), joined=k > 0))
        return n

    async def _loop(self) -> None:
        while not self._closed:
            await self._wake.wait()
            self._wake.clear()
            try:
                while self._listening() and self._complete() > self._fed:
                    if not await self._prefill():
                        break
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 -- listening is an optimisation: the response still runs
                logger.exception("realtime listening failed in session %s", self.session.id)
                self._reset()

    async def _prefill(self) -> bool:
        """One listening request up to the last complete window; False when it could not be sent."""
        s, pipeline = self.session, self.session.pipeline
        epoch, parts = self._epoch, list(self._parts)
        key = id(pipeline)
        bounds = pipeline.admission.bounds
        if IN_FLIGHT.get(key, 0) >= self.max_requests or bounds.requests >= bounds.max_requests * 3 // 4:
            _count(self.stats, "skipped")
            return False
        turn = Item("user", parts)
        c = s.config
        # The talker listens too when the answer will be spoken and the pipeline's speaker is a
        # talker (it has a prompt; a decoder reading the thinker directly has none).
        talker = c.output_modalities[0] == "audio" and pipeline.topology.speaker_prefills
        modalities = ("text", "audio") if talker else ("text",)
        items = list(s.conversation.items) + [turn]
        prompt = await s.bounds.fit(items, c.instructions, c.max_output_tokens, c.truncation)
        waited = time.monotonic()
        while STARTING.get(key) and time.monotonic() - waited < MAX_YIELD_S:
            await asyncio.sleep(0.01)  # an answer is on its way to its first audio: it goes first
        _count(self.stats, "yielded_s", time.monotonic() - waited)
        if self._epoch != epoch or not self._listening():
            return False  # the audio changed meanwhile
        ids = prompt.token_ids
        placeholder = s.bounds.audio_placeholder
        last = len(ids) - 1 - ids[::-1].index(placeholder)
        ids = ids[: last + 1]  # up to the last complete window: no audio_end, no answer prompt
        try:
            ticket = pipeline.admission.enter()
        except RequestError:
            _count(self.stats, "skipped")
            return False
        ticket.prepaid = sum(m.array.nbytes for m in prompt.media)  # held by the session already
        IN_FLIGHT[key] = IN_FLIGHT.get(key, 0) + 1
        try:
            self._handle = handle = await pipeline.submit(
                ids,
                max_tokens=1,
                modalities=modalities,
                prefill_only=True,
                media=prompt.media,
                received_at=time.monotonic(),
                session_id=s.id,
                ticket=ticket,
            )
            _count(self.stats, "windows", len(parts) - self._fed)
            self._fed = len(parts)
            _count(self.stats, "requests")
            sent = time.monotonic()
            async for _ in handle.events():  # the one token and its end, dropped
                pass
            took = time.monotonic() - sent
            _count(self.stats, "busy_s", took)
            for stats in (self.stats, TOTALS):
                stats.longest_s = max(stats.longest_s, took)
        except RequestError as e:
            logger.debug("realtime listening request refused: %s", e)
            _count(self.stats, "skipped")
            return False
        finally:
            IN_FLIGHT[key] -= 1
            if not IN_FLIGHT[key]:
                del IN_FLIGHT[key]
            self._handle = None
        return True
