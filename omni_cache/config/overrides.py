"""A run's effective config: the loaded file plus the overrides of the command line or the caller.

The server resolves it once (:func:`with_overrides`, a copy: the caller's object is never changed)
and hands the same serialized text (:func:`config_text`) to every stage it starts or restarts,
spawned here or placed by Ray; no stage re-reads the file the server was started from, so editing
that file while the server runs changes nothing until the server is started again.
"""

from __future__ import annotations

import copy
import os

import msgspec
import yaml

from omni_cache.config.schema import PipelineConfig


def with_overrides(
    config: PipelineConfig, *, checkpoint_dir: str | os.PathLike[str] | None = None, prefix_cache: bool = True
) -> PipelineConfig:
    """A copy of ``config`` with ``checkpoint_dir`` set (when given) and, with
    ``prefix_cache=False``, prefix caching off in every autoregressive stage (a generation stage
    has none)."""
    out = copy.deepcopy(config)
    if checkpoint_dir is not None:
        out.checkpoint_dir = str(checkpoint_dir)
    if not prefix_cache:
        for stage in out.stages:
            if stage.is_autoregressive:
                stage.prefix_cache = False
    return out


def config_text(config: PipelineConfig) -> str:
    """``config`` as the YAML a stage process loads (``python -m workers --stage-config``)."""
    return yaml.safe_dump(msgspec.to_builtins(config), sort_keys=False)
