"""Addresses a server chooses for what its config leaves unset.

A stage without an ``address`` and the orchestrator without ``server.control_address`` listen at
ipc sockets in a directory of this server's own, :func:`new_run_dir` (``/tmp/omni_cache/<pipeline
name>-<random>/``), chosen once when the server starts and written into the effective config its
stages are started with (:func:`with_default_addresses`), so two servers of one config on one
machine never want the same socket. An address a config spells out means exactly that address
(and two servers that spell out the same one are refused: omni_cache/wire/ipc_claims.py).

Stages started by hand cannot learn an address chosen at start: a stage that is ``external``, the
stages it sends to, and the orchestrator's inbox then need explicit addresses (validation says
so). Shared by the server and the stage processes, so it lives in the config package, which
imports neither side.
"""

from __future__ import annotations

import copy
import os
import re
import secrets

from omni_cache.config.schema import PipelineConfig

#: Where the run directories are made (the sockets' paths must stay under 107 bytes).
RUN_ROOT = "/tmp/omni_cache"
_MAX_IPC_PATH_BYTES = 107


def pipeline_dir_name(config: PipelineConfig) -> str:
    """The pipeline's name made safe for one path component (at most 24 characters)."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", config.name)[:24] or "pipeline"


def new_run_dir(config: PipelineConfig) -> str:
    """A directory name no other server uses: ``/tmp/omni_cache/<name>-<pid>-<random>`` (not
    created here)."""
    return f"{RUN_ROOT}/{pipeline_dir_name(config)}-{os.getpid()}-{secrets.token_hex(4)}"


def control_address(config: PipelineConfig) -> str | None:
    """The orchestrator's inbox as the config says it (None: the server chooses one)."""
    return config.server.control_address


def with_default_addresses(config: PipelineConfig, run_dir: str) -> PipelineConfig:
    """A copy of ``config`` where every stage Ray does not place and that has no address listens
    at ``ipc://<run_dir>/<stage>.sock`` (``<index>.sock`` when the stage's name would make the
    path too long), and the orchestrator, without ``server.control_address`` and Ray, at
    ``ipc://<run_dir>/orchestrator.sock``."""
    out = copy.deepcopy(config)
    for i, stage in enumerate(out.stages):
        if stage.address is None and not stage.replica_addresses and not out.placed_by_ray(stage):
            address = f"ipc://{run_dir}/{stage.name}.sock"
            # replica i > 0 listens at the path + ".i" (omni_cache/config/replicas.py)
            suffix = len(f".{stage.replicas - 1}") if stage.replicas > 1 else 0
            if len(address.encode()) - len("ipc://") + suffix > _MAX_IPC_PATH_BYTES:
                address = f"ipc://{run_dir}/{i}.sock"
            stage.address = address
    if out.server.control_address is None and out.server.ray_address is None:
        out.server.control_address = f"ipc://{run_dir}/orchestrator.sock"
    return out
