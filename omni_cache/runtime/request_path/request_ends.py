"""A request's end: exactly one terminal event on its handle, and the stages told to drop it.

:class:`RequestEnds` is the orchestrator's part that ends requests: ``Completed`` once every stage
the request needs finished (:class:`~omni_cache.runtime.request_path.output_assembly.OutputAssembler` builds it),
``Failed`` with a status otherwise (stage died -> 503, stage error -> its status, a failure
handling its output -> 500, deadline -> 504, shutdown -> 503, client gone -> 499). Either way the
request leaves the in-flight table at once; a failed one is aborted on the live replicas that
still run its current attempt, so they stop spending steps on it.

It also tells the stages when a streaming client takes nothing (wire ``Hold``,
scheduler/client_hold.py). A hold is a lease: said again every :data:`HOLD_RENEW_S` while the
client stays paused, it lapses at the stage :data:`HOLD_LEASE_S` after it was last said. So a
"go on" lost on the way (a stage whose inbox stayed full past the send timeout) holds the request
at most that long, not until its deadline; and a request resumed on another replica (its replica
died) is held there too at the next renewal.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from omni_cache.runtime.metrics.prometheus import OrchestratorMetrics
from omni_cache.runtime.request_path.admission import CLOSED, Admission
from omni_cache.runtime.request_path.output_assembly import OutputAssembler
from omni_cache.runtime.request_path.requests import Request, RequestTable
from omni_cache.runtime.request_path.results import Failed, RequestError
from omni_cache.runtime.supervision.stage_fleet import StageFleet
from omni_cache.wire.messages import Abort, Hold

logger = logging.getLogger(__name__)

__all__ = ["HOLD_LEASE_S", "HOLD_RENEW_S", "RequestEnds"]

#: How long a stage holds a request for its paused client unless told again, and how often the
#: orchestrator tells it again: three renewals per lease, so one or two lost ones do not let it go.
HOLD_LEASE_S = 3.0
HOLD_RENEW_S = 1.0


class RequestEnds:
    """Ends the requests of ``requests``. ``spawn``: runs a coroutine in the background on the
    orchestrator's loop (the Abort sends, which nothing waits for)."""

    def __init__(
        self,
        requests: RequestTable,
        *,
        fleet: StageFleet,
        admission: Admission,
        outputs: OutputAssembler,
        metrics: OrchestratorMetrics,
        spawn: Callable[[Any], None],
    ) -> None:
        self.requests = requests
        self.fleet = fleet
        self.admission = admission
        self.outputs = outputs
        self.metrics = metrics
        self._spawn = spawn

    def serving(self, req: Request, stage: str) -> str:
        """The name of the replica of ``stage`` that serves ``req``."""
        name = self.fleet.name_of(stage, req.route.get(stage, 0))
        assert name is not None, (stage, req.route)
        return name

    def abort_on_stages(self, req: Request, *, skip: str | None = None) -> None:
        """Tell every live replica still running ``req``'s current attempt to drop it."""
        self._tell_stages(req, Abort(request_id=req.wire_id), skip=skip)

    def hold_on_stages(self, req: Request, held: bool, now: float | None = None) -> None:
        """Tell every live replica still running ``req`` to hold its work while its client takes
        nothing (``held``: for :data:`HOLD_LEASE_S`), or to go on (wire Hold)."""
        req.client_held = held
        req.hold_told_at = time.monotonic() if now is None else now
        lease = HOLD_LEASE_S if held else 0.0
        self._tell_stages(req, Hold(request_id=req.wire_id, held=held, lease_s=lease))

    def renew_holds(self, now: float) -> None:
        """Say every hold again that was last said :data:`HOLD_RENEW_S` ago or more."""
        for req in self.requests.all():
            if req.client_held and now - req.hold_told_at >= HOLD_RENEW_S:
                self.hold_on_stages(req, True, now)

    def housekeeping(self, now: float) -> None:
        """The orchestrator's periodic part: deadlines passed, holds renewed."""
        self.fail_expired(now)
        self.renew_holds(now)

    def _tell_stages(self, req: Request, msg: Any, *, skip: str | None = None) -> None:
        """Send ``msg`` to every live replica still running ``req`` (but stage ``skip``)."""
        for name in req.participants:
            sp = self.fleet.supervisor.stages.get(self.serving(req, name))
            if name != skip and name not in req.finished and sp is not None and sp.up:
                self._spawn(self.fleet.send(sp.name, msg, timeout=1.0))

    def fail_expired(self, now: float) -> None:
        """Fail (504) every request whose deadline passed, naming the stages it still waits for."""
        for req in self.requests.expired(now):
            waiting = req.waiting_for()
            self.fail(
                req,
                504,
                f"request timed out after {req.timeout_s:g} s (server.request_timeout_s); "
                f"still waiting for stage(s): {', '.join(waiting)}",
                stage=waiting[0] if waiting else None,
            )

    def fail(
        self,
        req: Request,
        status: int,
        message: str,
        *,
        stage: str | None = None,
        abort: bool = True,
        count: bool = True,
        param: str | None = None,
    ) -> None:
        """End ``req`` with ``Failed`` (once; later calls do nothing). ``stage``: the stage to blame
        (metrics, the error's ``stage``; not told to abort); ``abort``: tell the replicas still
        running it; ``count``: in the requests' status counts (not for a client that left);
        ``param``: the request field at fault (the error body's ``param``)."""
        if req.done:
            return
        req.done = True
        self.requests.answered(req)
        req.queue.put_nowait(Failed(RequestError(status, message, stage=stage, request_id=req.request_id, param=param)))
        if count:
            self.metrics.request_done(status)
            if stage is not None:
                self.metrics.stage_failed_request(stage)
        if abort and self.admission.state != CLOSED:
            self.abort_on_stages(req, skip=stage)
        logger.info("request %s failed (%d): %s", req.request_id, status, message)

    def drop_slow_client(self, req: Request, bound: str = "max_outbox_bytes", message: str = "") -> None:
        """``req``'s client let more than ``server.max_outbox_bytes`` of its answer wait (or
        took none of it for ``server.max_send_stall_s``: ``bound``, ``message``): what waits is
        dropped now, the request aborted on its stages, and its handler closes the connection
        (the queue's ``overflowed``). Counted apart, by bound, not as a failed request."""
        req.queue.drop()
        self.metrics.clients.slow_client(bound)
        self.fail(
            req,
            499,
            message
            or f"more than {req.queue.max_bytes} bytes of the answer waited for the client to read them "
            "(server.max_outbox_bytes): the connection was closed",
            count=False,
        )

    def complete(self, req: Request) -> None:
        """End ``req`` with ``Completed``: every stage it needs finished."""
        completed = self.outputs.completed(req)  # first: if this fails, the request is failed
        req.done = True
        self.requests.answered(req)
        req.queue.put_nowait(completed)
        self.metrics.request_done(None)
