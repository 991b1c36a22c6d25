"""The stage process: one inbox, a model runner, and the sockets to downstream stages.

Loop: take every message waiting in the inbox (without blocking while the model has work), hand it
to the runner, run one model step, send what the step produced. The runner (`ARRunner` for vLLM
stages, `DecoderRunner` for the codec decoder) decides what a message means for its model; this
module only moves messages and keeps the process honest: a request that fails gets a StageError,
not silence, and fails alone (see workers/runner.py); requests past their deadline are dropped;
the process exits when told to, on SIGTERM/SIGINT, or when its parent dies.

Every path of the loop is guarded: a request's own work (its input, its step output) fails that
request alone; what belongs to no request (a stats query, an Abort, the housekeeping, the block
report) is logged and counted (``loop_errors``) and the loop goes on. Only a model step that fails
:data:`MAX_FAILED_STEPS` times in a row ends the process, for the supervisor to restart it. The
loop stamps its progress (workers/loop_progress.py) for the heartbeats, so the server tells a
loop busy in one long step from a stopped process and from a loop stuck past its
``stages[].step_timeout_s`` (omni_cache/runtime/supervision/hang_watch.py). Tests can hold it inside one step
(workers/step_hold.py, test-only).
"""

from __future__ import annotations

import logging
import os
import signal
import time
from typing import Any

import torch
import zmq

from omni_cache.config import PipelineConfig, StageConfig
from omni_cache.config.identity import pipeline_hash
from omni_cache.config.replicas import reports_blocks, stage_replicas
from omni_cache.heap_trim import HeapTrimmer
from omni_cache.wire.messages import (
    MESSAGE_TYPES,
    Abort,
    BlockSnapshotQuery,
    Hold,
    Shutdown,
    StageOutput,
    StageStats,
    StatsQuery,
    Submit,
)
from omni_cache.wire.stage_auth import load_stage_auth
from omni_cache.wire.transport import Codec, Receiver
from workers.announcer import Announcer
from workers.block_reporter import BlockReporter
from workers.loop_progress import LoopProgress
from workers.outbox import Outbox, send_timeout_s
from workers.step_hold import StepHold

logger = logging.getLogger(__name__)

#: How often the loop looks for requests past their deadline and for peers that went away.
HOUSEKEEPING_INTERVAL_S = 0.1
#: Model steps that may fail in a row (each failing every request then in the stage) before the
#: process gives up and exits for the supervisor to restart it: the engine is broken, not a request.
MAX_FAILED_STEPS = 3
#: How long the loop waits for input when the model has nothing to step.
IDLE_WAIT_MS = 50
#: A loop path that keeps failing logs its traceback on the first failure in a row, then every
#: this many (the housekeeping runs ten times a second).
LOG_EVERY_FAILURES = 100


class StageProcess:
    """One replica (``replica``, see omni_cache.config.replicas) of ``stage``."""

    def __init__(
        self,
        config: PipelineConfig,
        stage: StageConfig,
        *,
        orchestrator: str | None,
        parent_pid: int | None = None,
        prefix_cache: bool | None = None,
        replica: int = 0,
    ) -> None:
        self.config, self.stage = config, stage
        self.replica = stage_replicas(stage)[replica]
        self.parent_pid = parent_pid
        self.prefix_cache = stage.prefix_cache if prefix_cache is None else prefix_cache
        self.ctx = zmq.Context()
        self.codec = Codec(MESSAGE_TYPES, config.server.max_message_bytes)
        self.orchestrator = orchestrator
        self.auth = load_stage_auth(config)
        if self.auth is not None:
            self.auth.guard(self.ctx)  # before the inbox binds: no unauthenticated peer gets in
        self.inbox = Receiver(
            self.ctx, self.replica.bind_address or self.replica.address, self.codec, bind=True, auth=self.auth
        )
        self.outbox = Outbox(
            self.ctx,
            self.codec,
            {s.name: [r.address for r in stage_replicas(s)] for s in config.downstream(stage.name)},
            orchestrator,
            auth=self.auth,
            send_timeout_s=send_timeout_s(config.server.heartbeat_timeout_s),
        )
        self.announcer: Announcer | None = None
        self.stopping = False
        self.runner: Any = None
        self.failed_steps = 0
        self.stepped = False  # the last iteration ran a model step: do not wait for input
        self.next_housekeeping = 0.0
        self.heap = HeapTrimmer()
        self.progress = LoopProgress()
        self.hold = StepHold.from_env()  # tests only (workers/step_hold.py)
        #: Failures outside any request (each logged); and, per loop path (a fixed set of
        #: names), how many in a row.
        self.loop_errors = 0
        self.failing: dict[str, int] = {}

    # ---- lifecycle -------------------------------------------------------------------------
    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._stop)
        signal.signal(signal.SIGINT, self._stop)
        report = reports_blocks(
            self.config.server.routing,
            self.stage.name,
            self.config.entry_stage().name,
            self.stage.replicas,
            self.prefix_cache,
        )
        return self.serve(make_runner(self.config, self.stage, self.outbox, self.prefix_cache, report_blocks=report))

    def serve(self, runner: Any) -> int:
        """Announce the stage and run its loop with ``runner`` until told to stop (Shutdown, a
        signal, the parent gone); then close everything. Raises the model step's error when
        steps failed :data:`MAX_FAILED_STEPS` times in a row."""
        self.runner = runner
        self.blocks = BlockReporter(self.stage.name, self.replica.index, runner.take_block_changes)
        if self.orchestrator:
            self.announcer = Announcer(
                self.ctx,
                self.codec,
                self.orchestrator,
                self.stage.name,
                interval_s=self.config.server.heartbeat_interval_s,
                max_model_len=self.runner.max_model_len,
                auth=self.auth,
                replica=self.replica.index,
                progress=self.progress,
                config_hash=pipeline_hash(self.config),
            )
            # Queued on the outbox (the announcer drops beats while nobody listens): a server
            # that is already up hears it at once; the announcer's beats follow.
            self._outside_requests("announcing the stage", lambda: self.outbox.to_orchestrator(self.announcer.message))
            self.announcer.start()
        logger.info(
            "stage %s ready (pid %d) at %s%s",
            self.replica.name,
            os.getpid(),
            self.replica.address,
            f" (bound to {self.replica.bind_address})" if self.replica.bind_address else "",
        )
        try:
            while not self.stopping:
                if self.stepped or self.runner.requests:
                    self.progress.moved()
                else:  # about to wait for input holding nothing: however long, not stuck
                    self.progress.waiting()
                self._drain_inbox(block_ms=0 if self.stepped else IDLE_WAIT_MS)
                self.stepped = self._step()
                self._housekeeping()
        finally:
            if self.announcer is not None:
                self.announcer.stop()
            self.runner.close()
            self.outbox.close()
            self.inbox.close()
            if self.auth is not None:
                self.auth.stop()
            self.ctx.term()
        return 0

    def _step(self) -> bool:
        """One model step, if the model has work; whether it ran. The runner fails the requests
        an error is attributable to and goes on; an error that escapes it (the engine itself)
        fails every request the stage holds, and a few of those in a row end the process (the
        supervisor restarts it)."""
        try:
            if not self.runner.has_work():
                return False
            if self.hold is not None:
                self.hold.maybe_hold()
            self.runner.step()
        except Exception as exc:
            self.failed_steps += 1
            self.loop_errors += 1
            logger.exception("stage %s: model step failed (%d in a row)", self.stage.name, self.failed_steps)
            if self.failed_steps >= MAX_FAILED_STEPS:
                raise
            self.runner.fail_all(exc)
            return True
        self.failed_steps = 0
        self._outside_requests("the block report", self._report_blocks)
        return True

    def _outside_requests(self, what: str, work: Any) -> None:
        """Run loop work that belongs to no request: a failure is logged and counted, and the
        loop goes on (the requests are each guarded on their own)."""
        try:
            work()
        except Exception:  # noqa: BLE001 -- the loop must go on serving the requests
            self.loop_errors += 1
            in_a_row = self.failing[what] = self.failing.get(what, 0) + 1
            if in_a_row % LOG_EVERY_FAILURES == 1:
                logger.exception(
                    "stage %s: %s failed (%d in a row, %d failures outside requests so far)",
                    self.stage.name,
                    what,
                    in_a_row,
                    self.loop_errors,
                )
            return
        if self.failing.pop(what, 0):
            logger.info("stage %s: %s works again", self.stage.name, what)

    def _report_blocks(self) -> None:
        """Tell the orchestrator what this step changed in the prefix cache (prefix routing)."""
        self.blocks.report(self.outbox.to_orchestrator)

    def _housekeeping(self) -> None:
        now = time.monotonic()
        if now < self.next_housekeeping:
            return
        self.next_housekeeping = now + HOUSEKEEPING_INTERVAL_S
        self._outside_requests("expiring requests past their deadline", self.runner.expire)
        self._outside_requests("checking the downstream peers", self.outbox.check_peers)
        self._outside_requests("checking the parent process", self._check_parent)
        self._outside_requests("trimming the heap", lambda: self.heap.maybe_trim(now))

    def _stop(self, *_: Any) -> None:
        self.stopping = True

    def _check_parent(self) -> None:
        if self.parent_pid and os.getppid() != self.parent_pid:
            logger.warning("stage %s: parent %d is gone, exiting", self.stage.name, self.parent_pid)
            self.stopping = True

    # ---- messages --------------------------------------------------------------------------
    def _drain_inbox(self, block_ms: int) -> None:
        timeout = block_ms
        while True:
            got = self.inbox.recv(timeout_ms=timeout)
            if got is None:
                return
            self.progress.moved()
            timeout = 0
            self._handle(*got)

    def _handle(self, msg: Any, tensors: dict[str, torch.Tensor]) -> None:
        if isinstance(msg, (Submit, StageOutput)):
            self.runner.guarded(msg.request_id, lambda: self.runner.accept(msg, tensors))
        elif isinstance(msg, Shutdown):
            self.stopping = True
        elif isinstance(msg, BlockSnapshotQuery):
            self.blocks.request_snapshot()
        elif isinstance(msg, StatsQuery):
            self._outside_requests("answering a stats query", self._send_stats)
        elif isinstance(msg, Abort):
            # The request is forgotten here even when this raises (StageRunner.abort).
            self._outside_requests("handling an Abort", lambda: self.runner.abort(msg.request_id))
        elif isinstance(msg, Hold):
            self._outside_requests("handling a Hold", lambda: self.runner.hold(msg.request_id, msg.held, msg.lease_s))
        else:
            logger.warning("stage %s: ignoring unexpected %s", self.stage.name, type(msg).__name__)

    def _send_stats(self) -> None:
        self.outbox.to_orchestrator(
            StageStats(
                stage=self.stage.name,
                replica=self.replica.index,
                counters={
                    **self.runner.counters(),
                    **self.heap.counters(),
                    "peer_resets": self.outbox.peer_resets,
                    "send_timeouts": self.outbox.send_timeouts,
                    "loop_errors": self.loop_errors,
                },
            )
        )


def make_runner(
    config: PipelineConfig, stage: StageConfig, outbox: Outbox, prefix_cache: bool, report_blocks: bool = False
) -> Any:
    from omni_cache.config import resolve_model

    model = resolve_model(stage, config)
    if stage.kind == "generation":
        from workers.decoder_runner import DecoderRunner

        return DecoderRunner(config, stage, model, outbox)
    from workers.ar_runner import ARRunner

    return ARRunner(config, stage, model, outbox, prefix_cache, report_blocks=report_blocks)


def serve_stage(
    config: PipelineConfig,
    stage_name: str,
    *,
    orchestrator: str | None,
    parent_pid: int | None,
    prefix_cache: bool | None,
    replica: int = 0,
) -> int:
    stage = config.stage(stage_name)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    return StageProcess(
        config, stage, orchestrator=orchestrator, parent_pid=parent_pid, prefix_cache=prefix_cache, replica=replica
    ).run()
