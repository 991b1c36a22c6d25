"""The pipeline's stage-config schema, its loader and its validation.

One YAML file describes a whole pipeline: the HTTP server, and the stages (thinker, talker,
decoder, ...), each run in its own process and joined by ZMQ. The file is read with a YAML safe
loader (duplicate keys refused), checked key by key against the typed structs of the schema
(unknown keys are errors; every problem is reported) and converted with ``msgspec.convert``.
Checks that span fields or stages (the input graph, addresses, hand-off functions, model
references) run after the conversion, in :func:`validate_config`.

Every error names the file, the key path and what was expected::

    stage_configs/x.yaml: stages[1].engine_args.block_size: expected int, got str '32' (line 41)

The parts live in their own modules and are re-exported here: the schema
(:mod:`omni_cache.config.schema`), errors (:mod:`omni_cache.config.errors`), reading
(:mod:`omni_cache.config.loading`), the key-by-key conversion (:mod:`omni_cache.config.conversion`)
and the cross-field checks (:mod:`omni_cache.config.validation`);
this module resolves what a config names (hand-off functions, model paths).

Nothing here imports vLLM or torch: loading a config is cheap and safe in any process.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from omni_cache.config.errors import ConfigError, ConfigIssue, format_key_path
from omni_cache.config.loading import load_config, parse_config
from omni_cache.config.schema import (
    EngineArgs,
    GenerationArgs,
    LatentSpec,
    PacingConfig,
    PipelineConfig,
    RayResources,
    Sampling,
    StageConfig,
)
from omni_cache.config.server_schema import ServerConfig
from omni_cache.config.validation import import_handoff, validate_config
from omni_cache.tiny.registry import (
    CHECKPOINTS_ENV,
    DEFAULT_CHECKPOINT_DIR,
    TINY_MODELS,
    TINY_PREFIX,
    resolve_checkpoint_dir,
)

__all__ = [
    "CHECKPOINTS_ENV",
    "DEFAULT_CHECKPOINT_DIR",
    "TINY_MODELS",
    "ConfigError",
    "ConfigIssue",
    "EngineArgs",
    "GenerationArgs",
    "LatentSpec",
    "PacingConfig",
    "PipelineConfig",
    "RayResources",
    "Sampling",
    "ServerConfig",
    "StageConfig",
    "checkpoint_root",
    "format_key_path",
    "load_config",
    "parse_config",
    "resolve_handoff",
    "resolve_model",
    "validate_config",
]


def resolve_handoff(dotted: str) -> Callable[..., Any]:
    """Import ``package.module.function`` and return the function; ConfigError saying why not."""
    try:
        return import_handoff(dotted)
    except ValueError as e:
        raise ConfigError(f"handoff {dotted!r}: {e}") from e.__cause__


def checkpoint_root(config: PipelineConfig | None = None) -> Path:
    """Where tiny:* checkpoints live: config.checkpoint_dir, else $OMNI_CACHE_CHECKPOINTS, else
    ~/.cache/omni_cache/checkpoints (absolute, ``~`` expanded)."""
    return resolve_checkpoint_dir(config.checkpoint_dir if config is not None else None)


def resolve_model(stage: StageConfig, config: PipelineConfig) -> str:
    """The model path a stage loads.

    ``tiny:NAME`` generates the checkpoint if needed (``omni_cache.tiny.checkpoints.ensure_checkpoint``
    under :func:`checkpoint_root`); a path is returned absolute, with ``~`` expanded.
    """
    if stage.model.startswith(TINY_PREFIX):
        name = stage.model[len(TINY_PREFIX) :]
        if name not in TINY_MODELS:
            raise ConfigError(f"stage {stage.name!r}: unknown tiny checkpoint {name!r}")
        from omni_cache.tiny.checkpoints import ensure_checkpoint  # lazy: it imports torch

        return str(ensure_checkpoint(name, checkpoint_root(config)))
    return str(Path(stage.model).expanduser().absolute())
