"""Admission: everything that can refuse a request before it is sent, in the order the client
learns of it (the server's bounds on what is in flight, the server shutting down, its modalities,
its prompt, its sampling, the context length, the stages it needs being up).

A refusal is a :class:`~omni_cache.runtime.request_path.results.RequestError` with the HTTP status the client
sees: 400 for what the request asked, 413 for media that could never fit, 429 (with a
``Retry-After``) for what does not fit now, 503 for what the pipeline cannot do now. What passes
is an :class:`AdmittedRequest`, which the orchestrator routes and sends.

The bounds (:class:`InFlightBounds`) keep the server's memory bounded under any load: at most
``server.max_requests_in_flight`` requests at once, counted from before their body is read until
they are answered; at most ``server.max_body_bytes_in_flight`` of HTTP bodies being read, parsed
and decoded (each body's bytes are held until its request was submitted); and at most
``server.max_media_bytes_in_flight`` of decoded images and clips held by the requests, reserved
from each item's header before it is decoded. Each request holds a
:class:`Ticket` for its share; it is given back exactly once, when the request is answered or
refused. A realtime session keeps its conversation's media and text (and its input buffer's
room) in the same media bound through a :class:`MediaHold`, at most ``max_media_bytes_in_flight
/ server.realtime.max_sessions`` of it; its responses' tickets do not reserve those bytes again
(:attr:`Ticket.prepaid`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from omni_cache.config import PipelineConfig
from omni_cache.runtime.request_path.prompt_ids import prompt_ids
from omni_cache.runtime.request_path.requests import MediaItem
from omni_cache.runtime.request_path.results import RequestError
from omni_cache.runtime.request_path.topology import Topology
from omni_cache.runtime.supervision.supervisor import StageSupervisor
from omni_cache.wire.sampling import EngineSampling

#: Admission's states: before every stage was ready once, serving, shutting down.
STARTING, OPEN, CLOSED = "starting", "open", "closed"
#: Seconds a client refused for the server's bounds (429) is asked to wait (``Retry-After``).
RETRY_AFTER_S = 1


class Ticket:
    """One request's share of the bounds: its place among the requests in flight and the decoded
    media bytes it holds. :meth:`release` gives both back (idempotent)."""

    def __init__(self, bounds: InFlightBounds) -> None:
        self.bounds = bounds
        self.media_bytes = 0
        self.body_bytes = 0
        #: Media bytes of the request already held in the bounds by its owner (a realtime
        #: session's :class:`MediaHold`): not reserved a second time.
        self.prepaid = 0
        self.released = False

    def hold_media(self, nbytes: int) -> None:
        """Reserve ``nbytes`` more of decoded media (:meth:`InFlightBounds.hold`)."""
        self.bounds.hold(self, nbytes)

    def hold_body(self, nbytes: int) -> None:
        """Reserve ``nbytes`` more of the request's HTTP body (:meth:`InFlightBounds.hold_body`)."""
        self.bounds.hold_body(self, nbytes)

    def release_body(self) -> None:
        """The body was parsed and dropped: its bytes are free again."""
        self.bounds.release_body(self)

    def release(self) -> None:
        self.bounds.release(self)


class InFlightBounds:
    """What the requests in flight hold, against ``server.max_requests_in_flight``,
    ``server.max_media_bytes_in_flight`` and ``server.max_body_bytes_in_flight`` (event-loop
    thread only)."""

    def __init__(self, max_requests: int, max_media_bytes: int, max_body_bytes: int = 2**62) -> None:
        self.max_requests = max_requests
        self.max_media_bytes = max_media_bytes
        self.max_body_bytes = max_body_bytes
        self.requests = 0
        self.media_bytes = 0
        self.body_bytes = 0

    def enter(self) -> Ticket:
        """A place for one more request, or 429 when every place is taken."""
        if self.requests >= self.max_requests:
            raise RequestError(
                429,
                f"the server is at its limit of {self.max_requests} requests "
                f"in flight (server.max_requests_in_flight); retry in "
                f"{RETRY_AFTER_S} s",
                retry_after=RETRY_AFTER_S,
            )
        self.requests += 1
        return Ticket(self)

    def hold(self, ticket: Ticket, nbytes: int) -> None:
        """Reserve ``nbytes`` of decoded media for ``ticket``'s request: 413 when its media alone
        exceed the bound, 429 when they do not fit beside what the others hold now."""
        if nbytes <= 0:
            return
        mine = ticket.media_bytes + nbytes
        if mine > self.max_media_bytes:
            raise RequestError(
                413,
                f"the request's images, clips and videos decode to {mine} bytes, more "
                f"than the {self.max_media_bytes} all requests in flight may hold "
                "together (server.max_media_bytes_in_flight): send fewer or smaller",
            )
        if self.media_bytes + nbytes > self.max_media_bytes:
            raise RequestError(
                429,
                f"the requests in flight hold {self.media_bytes} bytes of "
                f"decoded media; this request's {mine} more would pass the server's "
                f"limit of {self.max_media_bytes} (server.max_media_bytes_in_flight); "
                f"retry in {RETRY_AFTER_S} s",
                retry_after=RETRY_AFTER_S,
            )
        ticket.media_bytes = mine
        self.media_bytes += nbytes

    def hold_body(self, ticket: Ticket, nbytes: int) -> None:
        """Reserve ``nbytes`` more of an HTTP body being read: 429 when the bodies being read and
        parsed now hold too much already."""
        if self.body_bytes + nbytes > self.max_body_bytes:
            raise RequestError(
                429,
                f"the requests being read hold {self.body_bytes} bytes of "
                f"body; {nbytes} more would pass the server's limit of "
                f"{self.max_body_bytes} (server.max_body_bytes_in_flight); retry in "
                f"{RETRY_AFTER_S} s",
                retry_after=RETRY_AFTER_S,
            )
        ticket.body_bytes += nbytes
        self.body_bytes += nbytes

    def release_body(self, ticket: Ticket) -> None:
        self.body_bytes -= ticket.body_bytes
        ticket.body_bytes = 0

    def release(self, ticket: Ticket) -> None:
        if ticket.released:
            return
        ticket.released = True
        self.requests -= 1
        self.media_bytes -= ticket.media_bytes
        self.release_body(ticket)


class MediaHold:
    """Bytes a long-lived holder (a realtime session: its conversation, its input buffer's room)
    keeps of ``server.max_media_bytes_in_flight`` with no place among the requests: at most
    ``share`` of its own, and only what the pool has free (event-loop thread only)."""

    def __init__(self, bounds: InFlightBounds, share: int) -> None:
        self.bounds, self.share = bounds, share
        self.nbytes = 0

    def resize(self, nbytes: int) -> None:
        """Hold ``nbytes`` in all: 413 past the holder's share, 429 when the pool has not that
        much more free now (nothing changes then). Shrinking always succeeds."""
        grow = nbytes - self.nbytes
        if grow > 0 and nbytes > self.share:
            raise RequestError(
                413,
                f"{nbytes} bytes would pass this session's share of "
                f"{self.share} (server.max_media_bytes_in_flight / "
                "server.realtime.max_sessions)",
            )
        if grow > 0 and self.bounds.media_bytes + grow > self.bounds.max_media_bytes:
            raise RequestError(
                429,
                f"the server holds {self.bounds.media_bytes} bytes of media; "
                f"{grow} more would pass its limit of {self.bounds.max_media_bytes} "
                "(server.max_media_bytes_in_flight)",
                retry_after=RETRY_AFTER_S,
            )
        self.settle(nbytes)

    def settle(self, nbytes: int) -> None:
        """Hold ``nbytes`` in all, unchecked: what the holder already keeps (an answer's text
        grew, an item was dropped)."""
        self.bounds.media_bytes += nbytes - self.nbytes
        self.nbytes = nbytes

    def release(self) -> None:
        self.settle(0)


@dataclass
class AdmittedRequest:
    """A request that passed every check, ready to be routed and sent."""

    prompt_token_ids: list[int]
    modalities: tuple[str, ...]
    sampling: EngineSampling
    participants: tuple[str, ...]
    media: tuple[MediaItem, ...] = ()


class Admission:
    """The checks, with what they read: the entry stage's defaults and context length, and which
    stages are up (``supervisor``, read only)."""

    def __init__(self, config: PipelineConfig, topology: Topology, supervisor: StageSupervisor) -> None:
        self._config = config
        self._topology = topology
        self._supervisor = supervisor
        self.state = STARTING
        #: What the requests in flight hold (their tickets).
        self.bounds = InFlightBounds(
            config.server.max_requests_in_flight,
            config.server.max_media_bytes_in_flight,
            config.server.max_body_bytes_in_flight,
        )
        #: The entry stage's context length as its engine reported it (StageReady); None before.
        self.context_len: int | None = None

    @property
    def max_model_len(self) -> int | None:
        """The entry stage's context length: what it reported, else its engine_args."""
        if self.context_len:
            return self.context_len
        ea = self._topology.entry.engine_args
        return ea.max_model_len if ea is not None else None

    def default_sampling(self) -> EngineSampling:
        """The entry stage's configured ``sampling`` (the server hands the same values to vLLM's
        ``to_sampling_params`` as its defaults: omni_cache/serving/chat_sampling.py)."""
        d = self._topology.entry.sampling
        return EngineSampling(temperature=d.temperature, top_p=d.top_p, max_tokens=d.max_tokens, seed=d.seed)

    def enter(self) -> Ticket:
        """A place among the requests in flight (429 when none is free); take it before reading
        anything of the request, and give it back when it ends (:meth:`Ticket.release`)."""
        return self.bounds.enter()

    def hold_media(self, ticket: Ticket, decoded_bytes: Sequence[int]) -> None:
        """Reserve the decoded size of a request's media items (known from their headers) before
        they are decoded: 413 when they could never be sent in one message or held at all, 429
        when they do not fit now."""
        total = sum(decoded_bytes)
        limit = self._config.server.max_message_bytes
        if total > limit:
            raise RequestError(
                413,
                f"the request's images and clips decode to {total} bytes; they "
                f"travel to the entry stage in one message of at most {limit} "
                "bytes (server.max_message_bytes): send fewer or smaller",
            )
        ticket.hold_media(max(0, total - ticket.prepaid) - ticket.media_bytes)

    def check(
        self,
        prompt_token_ids: Sequence[int],
        *,
        ticket: Ticket | None = None,
        sampling: EngineSampling | None = None,
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        modalities: Iterable[str] = ("text",),
        media: Sequence[MediaItem] = (),
        prefill_only: bool = False,
    ) -> AdmittedRequest:
        """The admitted request, or :class:`RequestError` for the first check it fails.
        ``sampling``: the request's, as the server resolved it; without it the entry stage's
        defaults with ``max_tokens``, ``temperature``, ``top_p`` and ``seed`` where given.
        ``ticket``: the request's place in the bounds; its media are held on it (what they hold
        decoded, beyond what was reserved from their headers). ``prefill_only``: the stages it
        passes (:meth:`Topology.participants`) are those of a prefill-only request."""
        if ticket is not None:
            self.hold_media(ticket, [m.array.nbytes for m in media])
        if self.state == CLOSED:
            raise RequestError(503, "the server is shutting down")
        mods = self._modalities(modalities)
        ids = _prompt(prompt_token_ids)
        if sampling is None:
            sampling = self.sampling(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed)
        elif (max_tokens, temperature, top_p, seed) != (None, None, None, None):
            raise TypeError("check() takes sampling= or its fields, not both")
        if sampling.max_tokens < 1:
            raise RequestError(400, f"max_tokens must be at least 1, got {sampling.max_tokens}")
        self._context_length(len(ids), sampling.max_tokens)
        if prefill_only and "audio" in mods and not self._topology.speaker_prefills:
            raise RequestError(400, "a prefill-only request asks for audio only where a talker speaks the text")
        participants = self._topology.participants(mods, prefill_only)
        self._available(participants)
        return AdmittedRequest(ids, mods, sampling, participants, tuple(media))

    def _modalities(self, modalities: Iterable[str]) -> tuple[str, ...]:
        mods = tuple(dict.fromkeys(["text", *[str(m) for m in modalities]]))
        bad = [m for m in mods if m not in ("text", "audio")]
        if bad:
            raise RequestError(400, f"unknown modality {bad[0]!r} (supported: 'text', 'audio')")
        if "audio" in mods and self._topology.audio_stage is None:
            raise RequestError(400, f"pipeline {self._config.name!r} has no audio output stage")
        return mods

    def sampling(
        self,
        *,
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        seed: int | None = None,
    ) -> EngineSampling:
        """The entry stage's defaults with these overrides (the Python API's sampling)."""
        sampling = self.default_sampling()
        if max_tokens is not None:
            sampling.max_tokens = int(max_tokens)
        if temperature is not None:
            sampling.temperature = float(temperature)
        if top_p is not None:
            sampling.top_p = float(top_p)
        if seed is not None:
            sampling.seed = int(seed)
        return sampling

    def _context_length(self, n_prompt: int, max_tokens: int) -> None:
        limit = self.max_model_len
        if limit and n_prompt + max_tokens > limit:
            raise RequestError(
                400,
                f"this model's maximum context length is {limit} tokens; the prompt has {n_prompt} "
                f"tokens and max_tokens is {max_tokens} ({n_prompt + max_tokens} "
                "in total): shorten the prompt or lower max_tokens",
            )

    def _available(self, participants: Sequence[str]) -> None:
        if self.state == STARTING:
            raise RequestError(
                503, "the pipeline is still starting: " + ", ".join(f"{n} ({r})" for n, r in self.not_ready().items())
            )
        down = [n for n in participants if not self._supervisor.is_up(n)]
        if down:
            reasons = self.not_ready()
            raise RequestError(
                503,
                "stage(s) not available: "
                + ", ".join(f"{n} ({reasons.get(n, 'down')})" for n in down)
                + "; retry shortly",
                stage=down[0],
            )

    def not_ready(self) -> dict[str, str]:
        """stage -> why it is not serving (see :meth:`StageSupervisor.not_ready`)."""
        return self._supervisor.not_ready(
            self._topology.stage_names, entry=self._topology.entry.name, starting=self.state == STARTING
        )


def _prompt(prompt_token_ids: Sequence[int]) -> list[int]:
    # The server's ids come checked from its tokenizer thread (prompt_ids.py says why); only a
    # Python API caller's own are checked here, on the event loop.
    ids = prompt_ids(prompt_token_ids)
    if not ids:
        raise RequestError(400, "the prompt is empty")
    return ids
