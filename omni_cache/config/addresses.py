"""Addresses derived from a pipeline config rather than written in it.

Shared by the server and the stage processes (a stage started by hand announces itself to the
orchestrator's inbox at the address its config implies), so it lives in the config package, which
imports neither side.
"""

from __future__ import annotations

import re

from omni_cache.config.schema import PipelineConfig


def pipeline_dir_name(config: PipelineConfig) -> str:
    """The pipeline's name made safe for one path component (at most 60 characters)."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", config.name)[:60] or "pipeline"


def control_address(config: PipelineConfig) -> str:
    """The orchestrator's inbox: ``server.control_address``, else
    ``ipc:///tmp/omni_cache/<pipeline name>/orchestrator.sock``."""
    if config.server.control_address:
        return config.server.control_address
    return f"ipc:///tmp/omni_cache/{pipeline_dir_name(config)}/orchestrator.sock"
