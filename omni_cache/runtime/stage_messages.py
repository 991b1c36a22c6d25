"""What the stages send, each message to the part of the orchestrator it concerns.

:class:`StageMessages` is the receive loop's dispatch: every ``StageOutput``, ``StageOutputs``
(one engine step's outputs, each handled as a ``StageOutput`` in turn), ``StageError`` and
``StageStats`` says its stage is alive; an output goes to routing (what the replica now holds) and
to output assembly, and completes its request when it was the last one needed; an error fails its
request with the stage's status; ``StageReady`` goes to the supervisor, ``BlockEvents`` to
routing, ``StageStats`` to the counters board. An output of a request this server does not know
(queued before a restart) makes every replica of its stage forget it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from omni_cache.config import PipelineConfig
from omni_cache.runtime.metrics.prometheus import OrchestratorMetrics
from omni_cache.runtime.request_path.output_assembly import BadOutput, OutputAssembler
from omni_cache.runtime.request_path.request_ends import RequestEnds
from omni_cache.runtime.request_path.requests import RequestTable
from omni_cache.runtime.request_path.topology import Topology
from omni_cache.runtime.routing.route_planner import RoutePlanner
from omni_cache.runtime.supervision.stage_fleet import StageFleet
from omni_cache.runtime.supervision.stats import StageStatsBoard
from omni_cache.wire.messages import (
    Abort,
    BlockEvents,
    BlockSnapshotQuery,
    StageError,
    StageOutput,
    StageOutputs,
    StageReady,
    StageStats,
)

logger = logging.getLogger(__name__)

__all__ = ["StageMessages"]


class StageMessages:
    """Dispatches the stages' messages to the orchestrator's parts (it owns none of them).
    ``spawn``: runs a coroutine in the background on the orchestrator's loop."""

    def __init__(
        self,
        config: PipelineConfig,
        topology: Topology,
        *,
        fleet: StageFleet,
        requests: RequestTable,
        routes: RoutePlanner,
        outputs: OutputAssembler,
        metrics: OrchestratorMetrics,
        stats: StageStatsBoard,
        ends: RequestEnds,
        spawn: Callable[[Any], None],
    ) -> None:
        self.config = config
        self.topology = topology
        self.fleet = fleet
        self.requests = requests
        self.routes = routes
        self.outputs = outputs
        self.metrics = metrics
        self.stats = stats
        self.ends = ends
        self._spawn = spawn

    def on_message(self, msg: Any, tensors: dict[str, Any]) -> None:
        """One message from a stage (the receive loop's dispatch)."""
        supervisor = self.fleet.supervisor
        if isinstance(msg, (StageOutput, StageOutputs, StageError, StageStats)):
            supervisor.heard_from(msg.stage)  # any message says the stage is alive, not only beats
        if isinstance(msg, StageOutput):
            self._on_output(msg, tensors)
        elif isinstance(msg, StageOutputs):  # one step's outputs without tensors
            for output in msg.outputs:
                self._on_output(output, {})
        elif isinstance(msg, StageError):
            self._on_error(msg)
        elif isinstance(msg, StageReady):
            supervisor.on_announcement(msg)
        elif isinstance(msg, BlockEvents):
            if not self.routes.on_block_events(msg):  # a report was lost: ask for all it holds
                name = self.fleet.name_of(msg.stage, msg.replica)
                if name is not None:
                    self._spawn(self.fleet.send(name, BlockSnapshotQuery(), timeout=1.0))
        elif isinstance(msg, StageStats):
            name = self.fleet.name_of(msg.stage, msg.replica)
            if name is None:
                logger.warning("stats from unknown stage %r replica %d, ignored", msg.stage, msg.replica)
                return
            self.stats.record(name, msg.counters)
        else:
            logger.warning("orchestrator: unexpected %s message, ignored", type(msg).__name__)

    def _on_output(self, msg: StageOutput, tensors: dict[str, Any]) -> None:
        req = self.requests.get(msg.request_id)
        if req is None:
            if not self.requests.recently_answered(msg.request_id) and msg.stage in self.topology.stage_names:
                # A request this orchestrator does not know (e.g. queued before a restart); the
                # output does not say which replica sent it: every replica of the stage forgets it.
                self.requests.remember(msg.request_id)
                for sp in self.fleet.supervisor.replicas_of(msg.stage):
                    self._spawn(self.fleet.send(sp.name, Abort(request_id=msg.request_id), timeout=1.0))
            return
        if msg.stage not in self.topology.stage_names:
            logger.warning("request %s: output from unknown stage %r, ignored", msg.request_id, msg.stage)
            return
        try:
            self.routes.output_seen(req, msg.stage, msg.media_layout)
            if self.outputs.add(req, self.config.stage(msg.stage), msg, tensors, time.monotonic()):
                self.ends.complete(req)
            elif req.queue.over:  # its client stopped reading: its answer is not kept for it
                self.ends.drop_slow_client(req)
        except BadOutput as e:
            self.ends.fail(req, 500, str(e), stage=msg.stage)
        except Exception:  # noqa: BLE001 -- a bug: this request ends now, not at its deadline
            logger.exception("request %s: handling stage %s's output failed", req.request_id, msg.stage)
            self.metrics.output_failed(msg.stage)
            # The exception's text stays in the log (it can name paths and internals): the client
            # gets a stable message and the request id to find it there.
            self.ends.fail(
                req,
                500,
                f"the server failed on stage {msg.stage!r}'s output (logged for request {req.request_id})",
                stage=msg.stage,
            )

    def _on_error(self, msg: StageError) -> None:
        req = self.requests.get(msg.request_id)
        if req is None:
            logger.info("stage %s: error for unknown request %s: %s", msg.stage, msg.request_id, msg.message)
            return
        status = msg.status if 400 <= msg.status <= 599 else 500
        self.ends.fail(req, status, f"stage {msg.stage!r}: {msg.message}", stage=msg.stage, param=msg.param)
