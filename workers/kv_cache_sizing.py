"""One way to size a stage's KV cache that does what it says.

On CPU, vLLM 0.32 reads the legacy environment variable ``VLLM_CPU_KVCACHE_SPACE`` (GiB) while it
builds the engine config and lets it overwrite the ``kv_cache_memory_bytes`` engine argument. The
shipped configs set the variable in each stage's ``env``, so a user who sizes one stage's pool with
``engine_args.extra.kv_cache_memory_bytes`` would silently get the variable's size instead. The
engine argument is the more specific of the two (one engine, in bytes), so it wins: the stage
drops the variable from its own environment before vLLM reads it and says so. Either way, the stage
logs the pool the engine actually got (:func:`describe_pool`).
"""

from __future__ import annotations

import logging
from collections.abc import MutableMapping
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["ENV_VAR", "describe_pool", "resolve_kv_cache_size"]

ENV_VAR = "VLLM_CPU_KVCACHE_SPACE"
_GIB = 2**30


def resolve_kv_cache_size(stage: str, engine_args: dict[str, Any], environ: MutableMapping[str, str]) -> str:
    """Make sure at most one KV-cache size reaches vLLM; returns where the size comes from.

    When both ``kv_cache_memory_bytes`` and a non-empty ``VLLM_CPU_KVCACHE_SPACE`` are set, the
    variable is removed from ``environ`` (this stage process's environment) and a warning names
    the stage and both values.
    """
    explicit = engine_args.get("kv_cache_memory_bytes")
    env_value = environ.get(ENV_VAR, "")
    if explicit is not None and env_value != "":
        logger.warning(
            "stage %s: engine_args kv_cache_memory_bytes=%d (%.3f GiB) and %s=%s GiB are both set; "
            "vLLM would let the variable win without a word: using kv_cache_memory_bytes and "
            "ignoring %s in this stage",
            stage,
            int(explicit),
            int(explicit) / _GIB,
            ENV_VAR,
            env_value,
            ENV_VAR,
        )
        del environ[ENV_VAR]
        return f"engine_args kv_cache_memory_bytes={int(explicit)} ({ENV_VAR}={env_value} ignored)"
    if explicit is not None:
        return f"engine_args kv_cache_memory_bytes={int(explicit)}"
    if env_value != "":
        return f"{ENV_VAR}={env_value} GiB"
    return "vLLM's memory profiling (neither kv_cache_memory_bytes nor " + ENV_VAR + " set)"


def describe_pool(cache_config: Any) -> str:
    """The KV pool an engine got, from its (initialized) ``vllm_config.cache_config``."""
    blocks = getattr(cache_config, "num_gpu_blocks", None)
    block_size = getattr(cache_config, "block_size", None)
    size = getattr(cache_config, "kv_cache_memory_bytes", None)
    parts = []
    if blocks is not None and block_size:
        parts.append(f"{blocks} blocks x {block_size} tokens = {blocks * block_size} token slots")
    if size:
        parts.append(f"{int(size) / _GIB:.3f} GiB")
    return ", ".join(parts) or "unknown (the engine did not report its KV-cache size)"
