"""What the two kinds of stage runner (ARRunner, DecoderRunner) share: the table of live requests,
their deadlines, and how one request fails or ends without touching the others.

A request lives in a stage from its first input (a Submit, or its upstream's StreamStart)
until it finishes there, fails there, is aborted or passes its deadline; nothing of it stays after
that. Ending it early leaves a tombstone: upstream output for it that is still on its way (or
that arrives before the request was ever created here, when the Abort overtook it) is dropped
instead of starting the request again.

Deadlines: a request's input carries the time it has left (``time_left_s``: hosts' clocks
differ, so no point in time crosses the wire); the stage turns it into a deadline on its own
monotonic clock when the request arrives (:func:`deadline_in`) and forwards what is left of it
downstream (:func:`time_left`).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from omni_cache.config import StageConfig
from omni_cache.timeline import Timeline
from omni_cache.wire.messages import MAX_ERROR_MESSAGE, MAX_ERROR_PARAM, StageError, StageOutput, StreamStart, Submit
from omni_cache.wire.transport import SendTimeout
from scheduler.pacing import Pacer, PacingPolicy

logger = logging.getLogger(__name__)

#: Tombstones kept at most (oldest dropped first): bounds memory under an abort storm.
MAX_TOMBSTONES = 65536
#: Status of a request a stage dropped at its deadline (the orchestrator's own 504).
STATUS_DEADLINE = 504
#: Status of a request whose output a peer (a downstream stage) stopped taking: the pipeline
#: cannot serve it now.
STATUS_PEER_STUCK = 503
#: Stages drop a request this long after its deadline: the orchestrator answers the client (and
#: aborts the stages) at the deadline itself; a stage's own expiry is the backstop for a request
#: whose Abort never came (lost, or the orchestrator restarted).
DEADLINE_GRACE_S = 1.0


def deadline_in(time_left_s: float | None, now: float | None = None) -> float:
    """A received time left as this process's deadline (``time.monotonic()``; 0 = none)."""
    if time_left_s is None:
        return 0.0
    return (time.monotonic() if now is None else now) + time_left_s


def time_left(deadline: float, now: float | None = None) -> float | None:
    """What is left until ``deadline`` (from :func:`deadline_in`) as a message carries it: None
    for none, never negative."""
    if not deadline:
        return None
    return max(0.0, deadline - (time.monotonic() if now is None else now))


class DeadlineExpired(Exception):
    """A request outlived the deadline its client (or the server) gave it."""


def is_client_error(exc: BaseException) -> bool:
    """Whether the request itself was bad: a ValueError, or what vLLM files as the client's fault
    (``VLLMClientError``, e.g. more images than ``limit_mm_per_prompt`` allows)."""
    if isinstance(exc, ValueError):
        return True
    try:
        from vllm.exceptions import VLLMClientError
    except ImportError:  # a stage without vLLM (the decoder can run without it)
        return False
    return isinstance(exc, VLLMClientError)


def error_message(stage: str, request_id: str, exc: BaseException) -> StageError:
    """The orchestrator's view of a failed request: bad input is HTTP 400 (:func:`is_client_error`),
    a passed deadline is 504, a peer that stopped taking its output 503, anything else is the
    stage's fault (500)."""
    if isinstance(exc, DeadlineExpired):
        status = STATUS_DEADLINE
    elif isinstance(exc, SendTimeout):
        status = STATUS_PEER_STUCK
    else:
        status = 400 if is_client_error(exc) else 500
    message = f"{type(exc).__name__}: {exc}"
    if len(message) > MAX_ERROR_MESSAGE:  # longer would not decode (the wire bounds it)
        message = message[: MAX_ERROR_MESSAGE - 3] + "..."
    # The field vLLM's check named (VLLMValidationError.parameter: "allowed_token_ids"), the
    # error's param as `vllm serve` answers it.
    param = getattr(exc, "parameter", None)
    if not isinstance(param, str) or len(param) > MAX_ERROR_PARAM:
        param = None
    return StageError(request_id=request_id, stage=stage, message=message, status=status, param=param)


def stage_pacer(stage: StageConfig) -> Pacer | None:
    """The pacer of a stage with a ``pacing`` block (the vLLM stages' scheduler and the decoder's
    batcher read the same policy); None without one."""
    if stage.pacing is None:
        return None
    return Pacer(PacingPolicy(stage.pacing.lead_s, stage.pacing.enabled, stage.pacing.max_lead_s))


class StageRunner:
    """Base of the runners: subclasses keep their in-flight requests in `requests` (values with a
    `deadline` attribute: ``time.monotonic()``, 0 = none, :func:`deadline_in`; and a `held` flag,
    :meth:`hold`) and implement `drop` (forget one request and stop its work in the model)."""

    def __init__(
        self, stage: StageConfig, outbox: Any, *, tombstone_ttl_s: float, timeline: Timeline | None = None
    ) -> None:
        self.stage, self.outbox = stage, outbox
        #: When each request passed this stage's points on its way to the first audio
        #: (omni_cache/timeline.py; off unless OMNI_CACHE_TIMELINE_DIR is set).
        self.timeline = timeline if timeline is not None else Timeline(stage.name)
        self.requests: dict[str, Any] = {}
        self.errors = 0
        self.expired = 0
        self.client_holds = 0  # requests held for their client (hold), counted once per pause
        #: request id -> when its hold lapses unless said again (wire Hold.lease_s)
        self.hold_leases: dict[str, float] = {}
        self.hold_lapses = 0
        self.total_requests = 0
        # request id -> monotonic time after which the tombstone is forgotten. By then its
        # upstream stages have dropped the request too (they honour the same deadline).
        self.tombstones: OrderedDict[str, float] = OrderedDict()
        self.tombstone_ttl_s = tombstone_ttl_s

    # ---- subclasses ------------------------------------------------------------------------
    def drop(self, request_id: str) -> None:
        raise NotImplementedError

    def hold(self, request_id: str, held: bool, lease_s: float = 0.0) -> None:
        """Hold the request's work while its streaming client takes nothing, or let it go on
        (wire Hold; scheduler/client_hold.py): its ``held`` is set and :meth:`held_changed`
        called. A hold with a ``lease_s`` lapses that long after it was last said
        (:meth:`lapse_holds`); 0: until told otherwise. An unknown request (ended meanwhile) is
        ignored."""
        req = self.requests.get(request_id)
        if req is None:
            return
        if held and lease_s > 0:
            self.hold_leases[request_id] = time.monotonic() + lease_s
        else:
            self.hold_leases.pop(request_id, None)
        if held == req.held:
            return  # a renewal
        if held:
            self.client_holds += 1
        req.held = held
        self.held_changed(req)

    def lapse_holds(self, now: float) -> None:
        """Let go the requests whose hold was not said again within its lease: the "go on" was
        lost, or the orchestrator stopped saying it for another reason; the request goes on."""
        for request_id, until in list(self.hold_leases.items()):
            if until > now:
                continue
            del self.hold_leases[request_id]
            if (req := self.requests.get(request_id)) is not None and req.held:
                logger.info("stage %s: request %s's client hold lapsed, it goes on", self.stage.name, request_id)
                self.hold_lapses += 1
                self.hold(request_id, False)

    def held_changed(self, req: Any) -> None:
        """A request's ``held`` changed: a runner whose own scheduling reads it needs nothing more
        (the decoder's); one that runs a vLLM engine tells its scheduler (ARRunner)."""

    # ---- ending requests -------------------------------------------------------------------
    def abort(self, request_id: str) -> None:
        """Forget the request, and drop whatever of it still arrives from upstream (also when
        stopping its work in the model raises, which it then passes on)."""
        try:
            self.drop(request_id)
        finally:
            self.requests.pop(request_id, None)
            self._bury(request_id)
            self.outbox.forget(request_id)

    def fail(self, request_id: str, exc: BaseException) -> None:
        """End the request here and tell the orchestrator why (a StageError). Never raises: what
        goes wrong on the way is logged, and the orchestrator's deadline answers the client if
        the error cannot reach it."""
        self.errors += 1
        try:
            self.abort(request_id)
        except Exception:  # noqa: BLE001 -- it is forgotten here all the same
            logger.exception("stage %s: dropping failed request %s raised", self.stage.name, request_id)
        try:
            self.outbox.to_orchestrator(error_message(self.stage.name, request_id, exc))
        except Exception as send_exc:  # noqa: BLE001 -- SendTimeout: the orchestrator is stuck
            logger.error(
                "stage %s: could not report request %s's failure (%s): %s", self.stage.name, request_id, exc, send_exc
            )

    def guarded(self, request_id: str, work: Callable[[], Any]) -> None:
        """Run one request's work; if it raises, that request fails (StageError naming this stage
        and the cause) and the others go on."""
        try:
            work()
        except Exception as exc:  # noqa: BLE001 -- one request must not take the stage down
            logger.warning(
                "stage %s: request %s failed: %s: %s",
                self.stage.name,
                request_id,
                type(exc).__name__,
                exc,
                # The request's own fault (vLLM's VLLMClientError, e.g. a grammar that does not
                # compile, is no ValueError) or a stuck peer: one line, no traceback per request.
                exc_info=not (is_client_error(exc) or isinstance(exc, SendTimeout)),
            )
            self.fail(request_id, exc)

    def fail_all(self, exc: BaseException) -> None:
        for request_id in list(self.requests):
            self.fail(request_id, exc)

    def expire(self, now: float | None = None) -> None:
        """Drop the requests past their deadline (the orchestrator answers their clients 504; this
        keeps a stage from working on, or holding, a request nobody waits for), and let go the
        client holds past their lease."""
        now = time.monotonic() if now is None else now
        late = [rid for rid, r in self.requests.items() if 0 < r.deadline <= now - DEADLINE_GRACE_S]
        for request_id in late:
            self.expired += 1
            logger.info("stage %s: request %s passed its deadline, dropped", self.stage.name, request_id)
            self.fail(request_id, DeadlineExpired(f"deadline passed in stage {self.stage.name!r}"))
        while self.tombstones and next(iter(self.tombstones.values())) <= now:
            self.tombstones.popitem(last=False)
        self.lapse_holds(now)

    def is_dead(self, msg: Submit | StageOutput) -> bool:
        """Whether input for a request this stage does not hold must be dropped: it ended here
        (tombstone), it is the rest of a stream whose start this stage never saw (not a Submit
        or StreamStart), or it arrives with no time left (its sender was past its deadline)."""
        if self.tombstones.pop(msg.request_id, None) is not None:
            # Seen once: the rest of its stream has no StreamStart and is dropped without it.
            return True
        if not isinstance(msg, (Submit, StreamStart)):
            return True
        return msg.time_left_s is not None and msg.time_left_s <= 0

    def _bury(self, request_id: str) -> None:
        self.tombstones[request_id] = time.monotonic() + self.tombstone_ttl_s
        self.tombstones.move_to_end(request_id)
        while len(self.tombstones) > MAX_TOMBSTONES:
            self.tombstones.popitem(last=False)

    # ---- status ----------------------------------------------------------------------------
    def take_block_changes(self, snapshot: bool = False) -> Any:
        """What the stage's prefix cache gained and lost since the last call
        (scheduler/block_events.py BlockChanges; ``snapshot``: all it holds), or None when it does
        not report them."""
        return None

    def counters(self) -> dict[str, float]:
        return {
            "requests": self.total_requests,
            "errors": self.errors,
            "queue_depth": len(self.requests),
            "expired": self.expired,
            "client_holds": self.client_holds,
            "client_hold_lapses": self.hold_lapses,
        }

    def close(self) -> None:
        self.timeline.close()
