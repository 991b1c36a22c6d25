"""A stage replica went down: the requests it was serving go on elsewhere, or end.

:class:`ReplicaLoss` is the orchestrator's part for what the supervisor reports as a replica
going down (its process died, hung, or, started elsewhere, went silent or closed its connection):
what was queued for it is forgotten by routing; each request it was serving starts again as a new
attempt on live replicas, from where its client is (:mod:`omni_cache.runtime.request_path.resume`), while every
stage it needs has a replica up and it has attempts left; otherwise it fails (503). The requests
routed to the other replicas of its stage go on untouched.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine
from typing import Any

from omni_cache.config.replicas import Replica
from omni_cache.runtime.metrics.prometheus import OrchestratorMetrics
from omni_cache.runtime.request_path.admission import CLOSED, Admission
from omni_cache.runtime.request_path.request_ends import RequestEnds
from omni_cache.runtime.request_path.requests import Request, RequestTable
from omni_cache.runtime.request_path.resume import MAX_ATTEMPTS, next_attempt, resumed_prompt, resumed_submit
from omni_cache.runtime.request_path.text_codec import TextCodec
from omni_cache.runtime.request_path.topology import Topology
from omni_cache.runtime.routing.route_planner import RoutePlanner
from omni_cache.runtime.supervision.stage_fleet import StageFleet

logger = logging.getLogger(__name__)

__all__ = ["ReplicaLoss"]


class ReplicaLoss:
    """Resumes or fails the requests of a replica that went down. ``hand_to_entry(req, msg,
    timeout=...)``: sends a request's new attempt to its entry replica (the orchestrator's, which
    fails the request when that cannot be done); ``spawn``: runs a coroutine in the background on
    the orchestrator's loop."""

    def __init__(
        self,
        topology: Topology,
        *,
        fleet: StageFleet,
        requests: RequestTable,
        routes: RoutePlanner,
        admission: Admission,
        codec: TextCodec,
        metrics: OrchestratorMetrics,
        ends: RequestEnds,
        hand_to_entry: Callable[..., Coroutine[Any, Any, None]],
        spawn: Callable[[Any], None],
    ) -> None:
        self.topology = topology
        self.fleet = fleet
        self.requests = requests
        self.routes = routes
        self.admission = admission
        self.codec = codec
        self.metrics = metrics
        self.ends = ends
        self._hand_to_entry = hand_to_entry
        self._spawn = spawn

    def on_replica_down(self, stage: str, why: str) -> None:
        """A stage replica stopped serving: drop what was queued for it and resume or fail what
        it was serving (the requests routed to the other replicas of its stage go on)."""
        replica = self.fleet.replicas[stage]
        self.routes.forget(replica)
        hint = (
            "retry when it is back" if replica.stage in self.fleet.external else "it is being restarted, retry shortly"
        )
        for req in self.requests.served_by(replica.stage, replica.index):
            if self.can_resume(req):
                self.resume(req, replica)
            else:
                self.ends.fail(
                    req, 503, f"stage {stage!r} {why} while serving this request; {hint}", stage=replica.stage
                )

    def can_resume(self, req: Request) -> bool:
        """Whether ``req`` can start again on live replicas: every stage it needs has one up (the
        dead replica is already down) and it has attempts left."""
        return (
            req.submit is not None
            and req.attempt + 1 < MAX_ATTEMPTS
            and self.admission.state != CLOSED
            and all(self.fleet.supervisor.up_replicas(s) for s in req.participants)
        )

    def resume(self, req: Request, dead: Replica) -> None:
        """Start ``req`` again as a new attempt, routed among the replicas that are up, from where
        its client is; the old attempt ends on the live replicas that still run it."""
        self.ends.abort_on_stages(req)
        old = req.wire_id
        text_from_entry = self.topology.text_stage.name == self.topology.entry.name
        entry_out = req.finished.get(self.topology.entry.name)
        answer_finished = (entry_out.finish_reason or "stop") if entry_out is not None else None
        next_attempt(req, self.codec.detokenize)
        self.requests.rekey(req, old)
        self.routes.assign(req, resumed_prompt(req, text_from_entry), req.submit.media)
        msg = resumed_submit(req, text_from_entry=text_from_entry, answer_finished=answer_finished)
        self.metrics.request_resumed(dead.stage, dead.index)
        logger.warning(
            "request %s: %s died while serving it; resumed as %s on %s after %d "
            "token(s) and %d audio sample(s) its client has",
            req.request_id,
            dead.name,
            req.wire_id,
            self.ends.serving(req, self.topology.entry.name),
            len(req.answer_tokens),
            req.audio_samples,
        )
        self._spawn(self._hand_to_entry(req, msg, timeout=10.0))
