"""The orchestrator's in-flight requests: the only copy of each accepted request, its deadline,
and the ids recently answered (so a stage's late output for one is recognised, not aborted)."""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from omni_cache.wire.messages import StageOutput

#: How many answered request ids are remembered (late outputs of those are dropped quietly).
RECENT_IDS = 10000


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
    #: stage -> the replica serving this request there (omni_cache.runtime.routing)
    route: dict[str, int] = field(default_factory=dict)
    #: block size -> the prompt's block hashes (prefix routing; empty for a prompt with media):
    #: what this request makes its entry replica hold while it runs there
    block_hashes: dict[int, list[int]] = field(default_factory=dict)
    #: prompt tokens its entry replica is expected to compute for it (not found cached when it
    #: was routed); 0 once the entry stage sent its first output (routing's prefill backlog)
    prefill_backlog: int = 0
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)  # its client's events
    finished: dict[str, StageOutput] = field(default_factory=dict)  # stage -> its last output
    latents: dict[str, list[tuple[int, Any]]] = field(default_factory=dict)
    got_token: bool = False
    got_audio: bool = False
    done: bool = False

    def waiting_for(self) -> list[str]:
        """The participants that have not finished yet."""
        return [p for p in self.participants if p not in self.finished]


class RequestTable:
    """The requests in flight, by id; knows which have expired and which a stage was serving."""

    def __init__(self, recent_ids: int = RECENT_IDS) -> None:
        self._requests: dict[str, Request] = {}
        self._recent: OrderedDict[str, None] = OrderedDict()
        self._recent_ids = recent_ids

    def __len__(self) -> int:
        return len(self._requests)

    def add(self, req: Request) -> None:
        self._requests[req.request_id] = req

    def get(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    def all(self) -> list[Request]:
        """A snapshot (callers fail requests while iterating)."""
        return list(self._requests.values())

    def answered(self, req: Request) -> None:
        """``req`` got its terminal event: forget it, remember its id."""
        self._requests.pop(req.request_id, None)
        self.remember(req.request_id)

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
        return [r for r in self._requests.values()
                if stage in r.participants and stage not in r.finished
                and (replica is None or r.route.get(stage, 0) == replica)]

    def load(self, stage: str) -> dict[int, int]:
        """replica of ``stage`` -> the requests in flight on it (routed there, not finished
        there)."""
        out: dict[int, int] = {}
        for r in self.served_by(stage):
            i = r.route.get(stage, 0)
            out[i] = out.get(i, 0) + 1
        return out
