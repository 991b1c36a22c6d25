"""The modules the request path imports on first use, imported while the server starts.

The serving modules import vLLM's protocol classes, Pillow, soundfile and the like inside the
functions that need them, so that importing ``omni_cache.serving`` stays cheap for the CLI's
config checks and for tests. A server pays those imports on the first request of each kind
instead: measured ~90 ms for the first chat request and ~60 ms more for the first image on a
2-core AMD EPYC (benchmarks.first_request), enough to make a fresh server's first answer twice as
slow as its second. :func:`preload` imports them in a thread while the stages start, which takes
longer anyway.

It also builds the OpenAI SDK's pydantic models that the request path validates and sends: the SDK
defers each model's build to its first use (``defer_build``, its ``DEFER_PYDANTIC_BUILD``), so a
fresh server's first realtime session built the classes of its events on the event loop, a stall
of up to 53 ms on a 2-vCPU Zen 4 (benchmarks.hostile_lag) that every other client waited out.
"""

from __future__ import annotations

import importlib
import logging

logger = logging.getLogger(__name__)

#: Every module a function of omni_cache/serving imports on first use, a package standing for its
#: submodules (tests/test_preload.py checks the list against the source).
REQUEST_PATH_MODULES = (
    "av",
    "openai.types.chat.chat_completion_audio",
    "openai.types.realtime",
    "PIL.Image",
    "pydantic",
    "silero_vad",
    "soundfile",
    "soxr",
    "torch",
    "uvicorn",
    "vllm.entrypoints.generate.base.protocol",
    "vllm.entrypoints.openai.chat_completion.protocol",
    "vllm.entrypoints.serve.engine.protocol",
    "vllm.entrypoints.serve.exception_handling.error_response",
    "vllm.entrypoints.serve.exception_handling.register",
    "vllm.entrypoints.serve.utils.api_utils",
    "vllm.entrypoints.serve.utils.tool_calls_utils",
    "vllm.multimodal.media.audio",
    "vllm.multimodal.video",
    "vllm.multimodal.video_decoders",
    "vllm.parser",
    "vllm.renderers.chat_utils",
    "vllm.renderers.hf",
    "vllm.sampling_params",
)

#: Modules that libraries of the request path import on their own first use, on the event loop:
#: anyio's asyncio back end (starlette's first streamed response opens an anyio task group: ~40
#: ms on a 2-vCPU Zen 3) and httpcore (httpx's first client, for the first media URL: ~50 ms).
#: Found by tests/test_first_use_imports.py, which records what a fresh server imports on its loop.
LIBRARY_FIRST_USE_MODULES = ("anyio._backends._asyncio", "httpcore")

#: Packages whose pydantic models are built at start-up rather than on first use: the SDK's
#: realtime events and items, the chat API's audio, and the shared types they hold (~220 models,
#: ~60 ms and ~3 MiB).
DEFERRED_MODEL_PACKAGES = ("openai.types.realtime", "openai.types.chat", "openai.types.shared")


def preload() -> list[str]:
    """Import :data:`REQUEST_PATH_MODULES` and :data:`LIBRARY_FIRST_USE_MODULES`, and register
    Pillow's image plugins (its first ``Image.open`` would); returns the modules that failed to
    import (logged, not raised: the request that needs one reports the error as before)."""
    failed = []
    for name in REQUEST_PATH_MODULES + LIBRARY_FIRST_USE_MODULES:
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - a missing optional module fails its request later
            logger.warning("preloading %s failed: %s", name, e)
            failed.append(name)
    if "PIL.Image" not in failed:
        from PIL import Image

        Image.init()
    build_deferred_models()
    return failed


def build_deferred_models(packages: tuple[str, ...] = DEFERRED_MODEL_PACKAGES) -> int:
    """Build every imported pydantic model of ``packages`` whose build was deferred; returns how
    many were built. A model that cannot be built yet (a name it refers to is not defined) is left
    to its first use, as before."""
    from pydantic import BaseModel

    built, seen, stack = 0, set(), [BaseModel]
    while stack:
        for cls in stack.pop().__subclasses__():
            if cls in seen:
                continue
            seen.add(cls)
            stack.append(cls)
            if cls.__module__.startswith(packages) and not cls.__pydantic_complete__:
                built += cls.model_rebuild(raise_errors=False) is not False
    return built
