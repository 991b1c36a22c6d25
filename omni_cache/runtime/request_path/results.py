"""What a request's client gets: its events, its result, its error."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from omni_cache.wire.messages import TokenLogprob

if TYPE_CHECKING:
    from omni_cache.runtime.request_path.requests import Request


class RequestError(Exception):
    """A request that ended in an error; ``status`` is the HTTP status the client should see,
    ``retry_after`` (seconds) when it may try again then (429)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        stage: str | None = None,
        request_id: str | None = None,
        retry_after: int | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.stage = stage
        self.request_id = request_id
        self.retry_after = retry_after
        #: The request field at fault, where the stage's check named one (the body's ``param``).
        self.param = param

    def __repr__(self) -> str:
        return f"RequestError({self.status}, {self.message!r}, stage={self.stage!r})"


@dataclass
class TextDelta:
    """New text of the text stage (``text`` may be empty while a UTF-8 sequence is incomplete,
    or while a stop string may still be forming)."""

    text: str
    token_ids: list[int]
    #: Per token of ``token_ids``, its log-probabilities (vLLM's order: the sampled token first,
    #: then the top ones); None when the request asked for none.
    logprobs: list[list[TokenLogprob]] | None = None
    #: The text stage's last output for the request.
    last: bool = False
    #: The prompt's tokens as the text stage's engine counted them (media expanded).
    num_prompt_tokens: int = 0


@dataclass
class AudioDelta:
    """New audio of the audio stage: float32 mono samples."""

    audio: np.ndarray
    sample_rate: int


@dataclass
class Completed:
    """Terminal event: every stage the request needed finished."""

    finish_reason: str
    num_prompt_tokens: int
    #: stage -> prompt tokens its prefix cache let it skip (``StageOutput.num_cached_tokens``).
    cached_tokens: dict[str, int]
    #: The entry stage's latents (only when asked for), name -> [tokens, dim] tensor.
    latents: dict[str, Any]
    #: vLLM's stop reason with a "stop" finish: the stop string, or the stop token id (None:
    #: end of sequence).
    stop_reason: int | str | None = None
    #: The text the stage that speaks the answer was given (its transcript); None without audio.
    transcript: str | None = None


@dataclass
class Failed:
    """Terminal event: the request failed."""

    error: RequestError


Event = TextDelta | AudioDelta | Completed | Failed


@dataclass
class GenerationResult:
    """One finished request."""

    request_id: str
    text: str
    token_ids: list[int]
    #: float32 mono samples, or None when no audio was asked for.
    audio: np.ndarray | None
    sample_rate: int
    #: stage -> prompt tokens served from that stage's prefix cache.
    cached_tokens: dict[str, int]
    #: The thinker's latents (name -> torch tensor, one row per token), when asked for.
    latents: dict[str, Any] = field(default_factory=dict)
    finish_reason: str = "stop"
    num_prompt_tokens: int = 0


class HandleOwner(Protocol):
    """What a handle asks of whoever accepted its request (the orchestrator)."""

    #: The rate of the audio stage's output (for a result whose audio was empty).
    audio_sample_rate: int

    def abort(self, request_id: str, reason: str = "aborted") -> None:
        """Drop the request and tell its stages."""

    def detokenize(self, token_ids: Sequence[int]) -> str:
        """Token ids -> text."""

    def drop_slow_client(self, request_id: str, bound: str, message: str) -> None:
        """End the request as a slow client's, past ``bound``."""

    def hold(self, request_id: str, held: bool) -> None:
        """Hold the request's work at its stages while its client takes nothing, or go on."""


class RequestHandle:
    """The client side of one accepted request: its events (streaming) or its result."""

    def __init__(self, orchestrator: HandleOwner, request: Request) -> None:
        self._orch = orchestrator
        self._req = request
        self.request_id = request.request_id
        self.prompt_token_ids = request.prompt_token_ids
        self.modalities = request.modalities
        self._terminal = False

    @property
    def engine_prompt_token_ids(self) -> list[int]:
        """The prompt as the entry stage's engine saw it, media placeholders expanded (what vLLM
        answers as ``prompt_token_ids``): known once the entry stage's first output came; the
        prompt sent until then and for a prompt without media."""
        return self._req.engine_prompt_token_ids or self.prompt_token_ids

    @property
    def overflowed(self) -> asyncio.Event:
        """Set when its client let more than ``server.max_outbox_bytes`` of the answer wait:
        the request was ended and its handler should close the connection."""
        return self._req.queue.overflowed

    @property
    def done(self) -> bool:
        """Whether the terminal event was consumed."""
        return self._terminal

    async def events(self) -> AsyncIterator[Event]:
        """TextDelta/AudioDelta events, then exactly one Completed or Failed."""
        while not self._terminal:
            event = await self._req.queue.get()
            if isinstance(event, (Completed, Failed)):
                self._terminal = True
            yield event

    async def result(self) -> GenerationResult:
        """Wait for the whole answer; raises :class:`RequestError` if the request failed."""
        text: list[str] = []
        token_ids: list[int] = []
        audio: list[np.ndarray] = []
        sample_rate = 0
        try:
            async for event in self.events():
                if isinstance(event, TextDelta):
                    text.append(event.text)
                    token_ids.extend(event.token_ids)
                elif isinstance(event, AudioDelta):
                    audio.append(event.audio)
                    sample_rate = event.sample_rate
                elif isinstance(event, Failed):
                    raise event.error
                else:
                    assert isinstance(event, Completed)
                    joined = "".join(text)
                    if not joined and token_ids:
                        # Off the event loop: a whole answer, behind the tokenizer's lock.
                        joined = await asyncio.to_thread(self._orch.detokenize, token_ids)
                    wants_audio = "audio" in self.modalities
                    return GenerationResult(
                        request_id=self.request_id,
                        text=joined,
                        token_ids=token_ids,
                        audio=(np.concatenate(audio) if audio else np.zeros(0, np.float32)) if wants_audio else None,
                        sample_rate=sample_rate or (self._orch.audio_sample_rate if wants_audio else 0),
                        cached_tokens=event.cached_tokens,
                        latents=event.latents,
                        finish_reason=event.finish_reason,
                        num_prompt_tokens=event.num_prompt_tokens,
                    )
        finally:
            if not self._terminal:
                self.abort("the caller stopped waiting")
        raise RequestError(500, "request ended without a result", request_id=self.request_id)

    def drop_slow_client(self, bound: str, message: str) -> None:
        """Its client is past ``bound`` (a ``server`` key): the request ends as a slow client's,
        what waits for it is dropped and :attr:`overflowed` is set (loop thread only)."""
        self._orch.drop_slow_client(self.request_id, bound, message)
        self._req.queue.drop()  # answered already: what waits goes all the same

    def hold(self, held: bool) -> None:
        """Its client takes nothing now (``held``) or takes again: the stages hold its work or go
        on (scheduler/client_hold.py; loop thread only)."""
        if not self._terminal:
            self._orch.hold(self.request_id, held)

    def abort(self, reason: str = "aborted by the client") -> None:
        """Forget the request and tell the stages to drop it (idempotent; loop thread only)."""
        self._orch.abort(self.request_id, reason)
