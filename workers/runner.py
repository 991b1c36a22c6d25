"""What the two kinds of stage runner (ARRunner, DecoderRunner) share: request accounting and how
one request fails without taking the stage down."""

from __future__ import annotations

from typing import Any

from omni_cache.config import StageConfig
from omni_cache.wire.messages import StageError


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
    anything else is the stage's fault (500)."""
    status = 400 if is_client_error(exc) else 500
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
