"""The orchestrator's in-flight requests: the only copy of each accepted request, its deadline,
and the ids recently answered (so a stage's late output for one is recognised, not aborted)."""

from __future__ import annotations

import time
import uuid
import warnings
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from omni_cache.runtime.request_path.client_events import ClientEvents
from omni_cache.wire.messages import MediaRef, StageOutput, Submit
from omni_cache.wire.sampling import EngineSampling

#: How many answered request ids are remembered (late outputs of those are dropped quietly).
RECENT_IDS = 10000


#: MediaItem kinds.
IMAGE, AUDIO, VIDEO = "image", "audio", "video"


@dataclass
class MediaItem:
    """One decoded image or clip a request carries for its prompt's placeholders: an RGB image
    ``uint8 [H, W, 3]`` or a mono clip ``float32 [n]`` (read-only when it came through the
    server's decoded-media cache: several requests share it). Decoding is the server's
    (omni_cache/serving/media.py); the orchestrator only sends these as tensor frames."""

    kind: str  # IMAGE | AUDIO | VIDEO
    array: np.ndarray
    sample_rate: int = 0  # audio only
    digest: str = ""  # sha256 hex of kind, target rate and encoded bytes ("" if not known)
    #: A video's sampled frames ``uint8 [T, H, W, 3]``: their rate (frames per second of video).
    fps: float = 0.0
    #: A video: the indices of its sampled frames in the clip, and the clip's own rate and frame
    #: count (a Qwen3-VL-family processor stamps each pair of frames with its time from them).
    frame_indices: tuple[int, ...] = ()
    source_fps: float = 0.0
    source_frames: int = 0
    #: An audio item that is the sound track of the video before it (use_audio_in_video).
    in_video: bool = False


@dataclass(eq=False)
class Request:
    """One accepted request, from submit() to its terminal event."""

    request_id: str
    prompt_token_ids: list[int]
    modalities: tuple[str, ...]
    participants: tuple[str, ...]  # the stages it needs, in topological order
    t0: float  # time.monotonic() when it arrived
    deadline: float  # time.monotonic() by which it fails with 504
    timeout_s: float
    return_latents: bool
    #: A prefill-only request (wire ``Submit.prefill_only``): a realtime session listening.
    prefill_only: bool = False
    #: stage -> the replica serving this request there (omni_cache.runtime.routing.replica_router)
    route: dict[str, int] = field(default_factory=dict)
    #: block size -> the prompt's block hashes (prefix routing; empty for a prompt with media):
    #: what this request makes its entry replica hold while it runs there
    block_hashes: dict[int, list[int]] = field(default_factory=dict)
    #: prompt tokens its entry replica is expected to compute for it (not found cached when it
    #: was routed); 0 once the entry stage sent its first output (routing's prefill backlog)
    prefill_backlog: int = 0
    queue: ClientEvents = field(default_factory=ClientEvents)  # its client's events, counted in bytes
    finished: dict[str, StageOutput] = field(default_factory=dict)  # stage -> its last output
    latents: dict[str, list[tuple[int, Any]]] = field(default_factory=dict)
    got_token: bool = False
    got_audio: bool = False
    done: bool = False
    #: Its prompt as the entry stage's engine expanded the media placeholders (the first output
    #: of a media request says; None until then, and for a prompt without media).
    engine_prompt_token_ids: list[int] | None = None
    #: The Submit that started it and its media frames: a resumed attempt is built from them.
    submit: Submit | None = None
    media: dict[str, Any] = field(default_factory=dict)
    #: How often it moved to live replicas because one serving it died (omni_cache.runtime.request_path.resume).
    attempt: int = 0
    #: What its client got so far: the answer's token ids and the audio samples.
    answer_tokens: list[int] = field(default_factory=list)
    audio_samples: int = 0
    #: Of the current attempt's output, what the client already has from earlier attempts.
    skip_tokens: int = 0
    skip_samples: int = 0
    #: How many of answer_tokens the client's text covers (those after it are held back: their
    #: bytes are not a whole character yet)
    text_tokens: int = 0
    #: A resumed request's text, decoded by the orchestrator (omni_cache.runtime.request_path.resume)
    resumed_text: Any = None
    #: Its share of the server's bounds (omni_cache.runtime.request_path.admission.Ticket), given back when
    #: it is answered.
    ticket: Any = None
    #: Its streaming client takes nothing now (wire Hold), and when the stages were last told so.
    client_held: bool = False
    hold_told_at: float = 0.0

    @property
    def wire_id(self) -> str:
        """The id the stages know the current attempt by: a resumed attempt gets a new one, so
        the late outputs of the attempt it replaces are recognised as stale and dropped."""
        return self.request_id if self.attempt == 0 else f"{self.request_id}.r{self.attempt}"

    def waiting_for(self) -> list[str]:
        """The participants that have not finished yet."""
        return [p for p in self.participants if p not in self.finished]


class RequestTable:
    """The requests in flight, by id; knows which have expired and which a stage was serving."""

    def __init__(self, recent_ids: int = RECENT_IDS) -> None:
        self._requests: dict[str, Request] = {}  # by wire id
        self._clients: dict[str, Request] = {}  # the same, by the client's request id
        self._recent: OrderedDict[str, None] = OrderedDict()
        self._recent_ids = recent_ids

    def __len__(self) -> int:
        return len(self._requests)

    def add(self, req: Request) -> None:
        self._requests[req.wire_id] = req
        self._clients[req.request_id] = req

    def rekey(self, req: Request, old_wire_id: str) -> None:
        """``req`` is known by a new wire id (it was resumed); its old one is answered."""
        self._requests.pop(old_wire_id, None)
        self.remember(old_wire_id)
        self._requests[req.wire_id] = req

    def get(self, wire_id: str) -> Request | None:
        """The request a stage's message is about (by the id the stages know)."""
        return self._requests.get(wire_id)

    def find(self, request_id: str) -> Request | None:
        """The request by the id its client knows."""
        return self._clients.get(request_id)

    def all(self) -> list[Request]:
        """A snapshot (callers fail requests while iterating)."""
        return list(self._requests.values())

    def answered(self, req: Request) -> None:
        """``req`` got its terminal event: forget it, remember its id, give its share of the
        server's bounds back (its ticket)."""
        self._requests.pop(req.wire_id, None)
        self._clients.pop(req.request_id, None)
        self.remember(req.wire_id)
        # Its decoded media go with the bytes its ticket gives back: the client's handle keeps
        # the request a while longer (its answer is still being sent), and the arrays would
        # outlive their reservation (a flood of videos saw one request's frames held past it).
        req.media = {}
        if req.ticket is not None:
            req.ticket.release()

    def remember(self, request_id: str) -> None:
        self._recent[request_id] = None
        while len(self._recent) > self._recent_ids:
            self._recent.popitem(last=False)

    def recently_answered(self, request_id: str) -> bool:
        return request_id in self._recent

    def expired(self, now: float) -> list[Request]:
        """The requests whose deadline passed."""
        return [r for r in self._requests.values() if now >= r.deadline]

    def served_by(self, stage: str, replica: int | None = None) -> list[Request]:
        """The requests that still wait for ``stage`` (for its replica ``replica``, when given)."""
        return [
            r
            for r in self._requests.values()
            if stage in r.participants
            and stage not in r.finished
            and (replica is None or r.route.get(stage, 0) == replica)
        ]

    def load(self, stage: str) -> dict[int, int]:
        """replica of ``stage`` -> the requests in flight on it (routed there, not finished
        there)."""
        out: dict[int, int] = {}
        for r in self.served_by(stage):
            i = r.route.get(stage, 0)
            out[i] = out.get(i, 0) + 1
        return out


def new_request(
    prompt_token_ids: list[int],
    modalities: tuple[str, ...],
    participants: tuple[str, ...],
    *,
    received_at: float | None,
    timeout: float,
    return_latents: bool,
    ticket: Any,
    max_outbox_bytes: int = 2**62,
) -> Request:
    """A request accepted now: a new id, its deadline ``timeout`` seconds after it was received
    (``received_at``, ``time.monotonic()``; None: now)."""
    now = time.monotonic() if received_at is None else min(received_at, time.monotonic())
    return Request(
        request_id=uuid.uuid4().hex,
        prompt_token_ids=prompt_token_ids,
        modalities=modalities,
        participants=participants,
        t0=now,
        deadline=now + timeout,
        timeout_s=timeout,
        return_latents=return_latents,
        ticket=ticket,
        queue=ClientEvents(max_outbox_bytes),
    )


def submit_message(
    req: Request, sampling: EngineSampling, media: Sequence[MediaItem], *, stream: bool = False, voice: str = ""
) -> Submit:
    """The Submit that hands ``req`` (routed) to its entry stage; its media travel as the frames
    :func:`media_frames` makes. Its ``time_left_s`` is set when it is sent (:func:`with_time_left`).
    ``stream``: its client streams the answer (stages pace its audio)."""
    return Submit(
        request_id=req.request_id,
        prompt_token_ids=req.prompt_token_ids,
        sampling=sampling,
        modalities=list(req.modalities),
        return_latents=req.return_latents,
        media=[
            MediaRef(
                kind=m.kind,
                tensor=f"media.{i}",
                sample_rate=m.sample_rate,
                uuid=m.digest,
                fps=m.fps,
                frame_indices=list(m.frame_indices),
                source_fps=m.source_fps,
                source_frames=m.source_frames,
                in_video=m.in_video,
            )
            for i, m in enumerate(media)
        ],
        route=dict(req.route),
        stream=stream,
        voice=voice,
        prefill_only=req.prefill_only,
    )


def with_time_left(msg: Submit, req: Request, now: float | None = None) -> Submit:
    """``msg`` carrying what is left of ``req``'s time now (its deadline is this process's
    monotonic clock; the stages turn the time left into deadlines on theirs)."""
    now = time.monotonic() if now is None else now
    return msgspec.structs.replace(msg, time_left_s=max(0.0, req.deadline - now))


def media_frames(media: Sequence[MediaItem]) -> dict[str, Any]:
    """The tensor frames of a request's media (``media.<i>``)."""
    if not media:
        return {}
    import torch

    # Decoded media are shared read-only arrays (serving/media.py's DecodedCache); these tensors
    # are only read (sent as frames), so torch's warning about a non-writable array does not
    # apply, and it would otherwise land in the server log once.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return {f"media.{i}": torch.from_numpy(m.array) for i, m in enumerate(media)}
