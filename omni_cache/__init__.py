"""omni_cache: multi-stage omni serving on vLLM with a hidden-state prefix cache."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from omni_cache.pipeline import Pipeline

__all__ = ["Pipeline"]


def __getattr__(name: str) -> Any:
    # Lazy: `import omni_cache` stays cheap (no torch/zmq) until Pipeline is used.
    if name == "Pipeline":
        from omni_cache.pipeline import Pipeline

        return Pipeline
    raise AttributeError(f"module 'omni_cache' has no attribute {name!r}")
