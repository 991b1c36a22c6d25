"""What the two kinds of stage runner (ARRunner, DecoderRunner) share: request accounting and how
one request fails without taking the stage down."""

from __future__ import annotations

from typing import Any

from omni_cache.config import StageConfig
from omni_cache.wire.messages import StageError


def error_message(stage: str, request_id: str, exc: BaseException) -> StageError:
    """The orchestrator's view of a failed request: ValueError means the input was bad (HTTP 400),
    anything else is the stage's fault (500)."""
    status = 400 if isinstance(exc, ValueError) else 500
    return StageError(request_id=request_id, stage=stage, message=f"{type(exc).__name__}: {exc}",
                      status=status)


class StageRunner:
    """Base of the runners: subclasses keep their in-flight requests in `requests` and implement
    `abort` (forget one request and stop its work)."""

    def __init__(self, stage: StageConfig, outbox: Any) -> None:
        self.stage, self.outbox = stage, outbox
        self.requests: dict[str, Any] = {}
        self.errors = 0
        self.total_requests = 0

    def abort(self, request_id: str) -> None:
        raise NotImplementedError

    def fail(self, request_id: str, exc: BaseException) -> None:
        self.errors += 1
        self.abort(request_id)
        self.outbox.to_orchestrator(error_message(self.stage.name, request_id, exc))

    def counters(self) -> dict[str, float]:
        return {"requests": self.total_requests, "errors": self.errors,
                "queue_depth": len(self.requests)}

    def close(self) -> None:
        pass
