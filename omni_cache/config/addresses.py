"""Addresses a server chooses for what its config leaves unset.

A stage without an ``address`` and the orchestrator without ``server.control_address`` listen at
ipc sockets in a directory of this server's own, :func:`new_run_dir` (``<root>/<pipeline
name>-<pid>-<random>/``, made by ``tempfile.mkdtemp``), chosen once when the server starts and
written into the effective config its stages are started with (:func:`with_default_addresses`),
so two servers of one config on one machine never want the same socket.

The root is the user's own, never shared with other users: ``$XDG_RUNTIME_DIR/omni_cache`` when
that is set (systemd's per-user runtime directory), else ``/tmp/omni_cache-<uid>``, made 0700 and
refused (:class:`RunDirError`) when it is not a directory of this user's that only this user may
write: in a shared ``/tmp`` another user could otherwise make the root first and read or replace
the sockets and the stage config in it. An address a config spells out means exactly that address
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
import stat
import tempfile

from omni_cache.config.schema import PipelineConfig

__all__ = [
    "RunDirError",
    "checked_run_root",
    "control_address",
    "new_run_dir",
    "pipeline_dir_name",
    "run_root",
    "with_default_addresses",
]

_MAX_IPC_PATH_BYTES = 107
#: A root longer than this (an unusual $XDG_RUNTIME_DIR) would leave the sockets' paths too
#: little of their 107 bytes: the /tmp root is used then.
_MAX_ROOT_BYTES = 48


class RunDirError(RuntimeError):
    """The run directories' root cannot be trusted or made; the message says why and what to do."""


def run_root() -> str:
    """Where this user's run directories are made (not created here): ``$XDG_RUNTIME_DIR/
    omni_cache`` when set (and short enough), else ``/tmp/omni_cache-<uid>``."""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isabs(xdg) and len(os.path.join(xdg, "omni_cache").encode()) <= _MAX_ROOT_BYTES:
        return os.path.join(xdg, "omni_cache")
    return f"/tmp/omni_cache-{os.getuid()}"


def checked_run_root() -> str:
    """:func:`run_root`, created 0700 when missing; :class:`RunDirError` when it is not a
    directory (a symlink is not followed), another user owns it, or group or others may write
    to it."""
    root = run_root()
    try:
        os.mkdir(root, 0o700)
    except FileExistsError:
        pass
    except OSError as e:
        raise RunDirError(f"cannot create the run directories' root {root}: {e.strerror}") from None
    st = os.lstat(root)
    if not stat.S_ISDIR(st.st_mode):
        raise RunDirError(
            f"the run directories' root {root} is not a directory (a symlink or a file is not followed); remove it"
        )
    if st.st_uid != os.getuid():
        raise RunDirError(
            f"the run directories' root {root} is owned by uid {st.st_uid}, not by "
            f"this user (uid {os.getuid()}): another user may read or replace the "
            "sockets in it; remove it, or set XDG_RUNTIME_DIR to a directory of yours"
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise RunDirError(
            f"the run directories' root {root} may be written by its group or "
            f"others (mode {stat.S_IMODE(st.st_mode):04o}); chmod 700 it"
        )
    return root


def pipeline_dir_name(config: PipelineConfig) -> str:
    """The pipeline's name made safe for one path component (at most 24 characters)."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", config.name)[:24] or "pipeline"


def new_run_dir(config: PipelineConfig) -> str:
    """A new directory of this server's own, ``<root>/<name>-<pid>-<random>`` (created 0700 by
    ``tempfile.mkdtemp`` under :func:`checked_run_root`; its owner removes it)."""
    return tempfile.mkdtemp(prefix=f"{pipeline_dir_name(config)}-{os.getpid()}-", dir=checked_run_root())


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
