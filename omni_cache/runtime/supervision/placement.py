"""Where each stage replica runs and what it is started with: spawned on this machine, placed on a
Ray cluster (``server.ray_address``, :mod:`omni_cache.runtime.supervision.ray_placement`), or started by hand
elsewhere (``external``: nothing to start).

Every stage process, first start or restart, local or Ray, is started with the same effective
config: the pipeline the server runs (the file plus the run's overrides,
:mod:`omni_cache.config.overrides`), serialized once into :attr:`StagePlacement.config_text` after
Ray placement filled in the replicas' addresses. Spawned stages read it from a file this module
writes in the server's run directory (where the sockets the config left to the server are,
:mod:`omni_cache.config.addresses`; removed on close); Ray actors write the same text on their
node.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import weakref
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from omni_cache.config import PipelineConfig, StageConfig
from omni_cache.config.errors import IssueCollector
from omni_cache.config.overrides import config_text
from omni_cache.config.replicas import Replica, replica_name, stage_replicas
from omni_cache.config.stage_addresses import check_hand_started
from omni_cache.runtime.supervision.process_runner import ProcessRunner, default_stage_argv, spawned_stage_env
from omni_cache.runtime.supervision.stage_forker import ForkedRunner, StageForkers, forks_here
from omni_cache.wire.stage_auth import new_secret

logger = logging.getLogger(__name__)


class StagePlacement:
    """``config``: the effective config (this object fills in Ray-placed replicas' addresses);
    ``run_dir``: this server's directory (its default sockets, the stages' config file);
    ``stage_argv``: the command of a stage process before its arguments; ``external``: the stages
    started by hand; ``forkers``: the caller's stage forkers (it closes them: ``omni-serve``'s,
    started as it loaded, :func:`~omni_cache.runtime.supervision.stage_forker.prestart`), None:
    its own, started when a stage first needs one and closed with this object."""

    def __init__(
        self,
        config: PipelineConfig,
        *,
        run_dir: str,
        stage_argv: Sequence[str] | None,
        external: set[str],
        forkers: StageForkers | None = None,
    ) -> None:
        self._config = config
        self.run_dir = run_dir
        # new_run_dir made it: removed on close, or at exit for a server never started or closed
        self._remove_run_dir = weakref.finalize(self, shutil.rmtree, run_dir, ignore_errors=True)
        self._stage_argv = list(stage_argv) if stage_argv is not None else default_stage_argv()
        self.external = external
        #: Every stage replica by its name (omni_cache.config.replicas); a Ray-placed one's
        #: address is "" until its actor reported it (:meth:`place`).
        self.replicas: dict[str, Replica] = {
            r.name: r
            for stage in config.stages
            for r in (
                [
                    Replica(stage.name, i, replica_name(stage.name, i, stage.replicas), "", None)
                    for i in range(stage.replicas)
                ]
                if config.placed_by_ray(stage)
                else stage_replicas(stage)
            )
        }
        #: (stage, replica index) -> replica name.
        self.names = {(r.stage, r.index): r.name for r in self.replicas.values()}
        #: The config text every stage process is started with (:meth:`runners` sets it).
        self.config_text: str | None = None
        self._ray: Any = None  # ray_placement.RayPlacement while Ray places stages
        #: The run's stage key when Ray places the stages and the config names none: they listen on
        #: their nodes' network addresses, so their traffic is authenticated all the same (the
        #: orchestrator and every actor hold it, no file is shared). Not with stages started by
        #: hand (they could not know it: such a pipeline needs server.stage_auth_key_file) nor
        #: where server.allow_unauthenticated_stages says the network is trusted.
        server = config.server
        makes_key = self.uses_ray and not external and server.stage_auth_key_file is None
        self.run_secret = new_secret() if makes_key and not server.allow_unauthenticated_stages else None
        self._ray_connected = False  # we joined the cluster (close() leaves it)
        #: Where spawned stages are forked from (``server.stage_launch: fork``, the default command).
        self._forkers = forkers if forkers is not None else StageForkers()
        self._owns_forkers = forkers is None

    @property
    def _forks(self) -> bool:
        """Whether stages spawned here are forked from a forker (:func:`forks_here`): only the
        default command (a custom ``stage_argv`` is run as given)."""
        return forks_here(self._config) and self._stage_argv == default_stage_argv()

    @property
    def uses_ray(self) -> bool:
        return self._config.server.ray_address is not None

    # ---- Ray -------------------------------------------------------------------------------------

    def join_ray(self) -> str:
        """Join the cluster (blocking); this node's IP, which the orchestrator's inbox binds."""
        from omni_cache.runtime.supervision import ray_placement  # ray is imported only when it is used

        self._ray_connected = ray_placement.connect(self._config.server.ray_address)
        self._ray = ray_placement.RayPlacement(self._config)
        return ray_placement.node_ip()

    def place(self, timeout: float) -> None:
        """Create the Ray actors and wait for their addresses (blocking): the replicas, and the
        config the stages are started with, follow them."""
        self._ray.place(timeout)
        by_stage: dict[str, list[str]] = {}
        for placed in sorted(self._ray.replicas.values(), key=lambda p: (p.stage, p.index)):
            by_stage.setdefault(placed.stage, []).append(placed.address)
            self.replicas[placed.name] = Replica(placed.stage, placed.index, placed.name, placed.address, None)
        for name, addresses in by_stage.items():
            self._config.stage(name).replica_addresses = addresses

    # ---- what each replica is started with -------------------------------------------------------

    def runners(
        self, orchestrator_address: str
    ) -> list[tuple[StageConfig, Replica, ProcessRunner | list[str] | None, dict[str, str]]]:
        """For every replica, in topological order: its stage, the replica, what runs it (a
        Ray runner, the command to spawn here, or None when it is started by hand) and its
        environment. Serializes the config the processes read (blocking: writes a file)."""
        self.config_text = self._process_config_text()
        config_path = None if self.uses_ray else self._write_config(self.config_text)
        out = []
        for stage in self._config.topological_order():
            for replica in stage_replicas(stage):
                args = ["--stage", stage.name, "--replica", str(replica.index), "--orchestrator", orchestrator_address]
                runner: Any
                if stage.name in self.external:
                    runner, env = None, {}
                elif self.uses_ray:
                    runner, env = self._ray_runner(replica, args), dict(stage.env)
                else:
                    runner = [*self._stage_argv, "--stage-config", config_path, *args, "--parent-pid", str(os.getpid())]
                    env = spawned_stage_env(stage.env, self._forkers.base_env if self._forks else None)
                    if self._forks:
                        forked_args = runner[len(self._stage_argv) :]
                        runner = ForkedRunner(self._forkers, runner, forked_args, env, replica.name)
                out.append((stage, replica, runner, env))
        return out

    def _process_config_text(self) -> str:
        """The effective config as a stage process loads it: without ``ray_address`` (a stage
        process places nothing), placed stages at their ``replica_addresses`` only."""
        text_config = self._config
        if self.uses_ray:
            import copy

            text_config = copy.deepcopy(self._config)
            text_config.server.ray_address = None
            for stage in text_config.stages:
                if stage.replica_addresses:  # placed: these replace address / bind_address
                    stage.address = stage.bind_address = None
        return config_text(text_config)

    def make_run_dir(self) -> None:
        """The run directory, readable by this user only, before any socket binds in it
        (new_run_dir made it already; it is removed on close, or when this object goes)."""
        os.makedirs(self.run_dir, 0o700, exist_ok=True)

    def _write_config(self, text: str) -> str:
        path = Path(self.run_dir) / "stage_config.yaml"
        path.write_text(text)
        return str(path)

    def _ray_runner(self, replica: Replica, args: list[str]) -> ProcessRunner:
        from omni_cache.runtime.supervision.ray_placement import RayRunner

        default = self._stage_argv == default_stage_argv()
        assert self.config_text is not None
        # The node's own Python runs the default command: hosts need not share a venv path.
        return RayRunner(
            self._ray.replicas[replica.name],
            None if default else list(self._stage_argv),
            args,
            self.config_text,
            dict(self._config.stage(replica.stage).env),
            self.run_secret,
        )

    # ---- closing ---------------------------------------------------------------------------------

    def close(self) -> None:
        """Leave the Ray cluster (its actors end), end the stage forkers and remove the run
        directory (blocking)."""
        if self._owns_forkers:
            self._forkers.close()
        if self._ray is not None:
            from omni_cache.runtime.supervision import ray_placement

            with contextlib.suppress(Exception):
                self._ray.close()
            if self._ray_connected:
                ray_placement.disconnect()
                self._ray_connected = False
        self._remove_run_dir()  # once: later calls do nothing


def external_stages_of(config: PipelineConfig, extra: Iterable[str]) -> set[str]:
    """The stages started by hand: ``extra`` and those the config marks ``external``. ConfigError
    when one of them (or a stage it sends to, or the orchestrator's inbox) has no address in
    ``config``: a stage started by hand cannot learn one the server chooses."""
    names = {s.name: s for s in config.stages}
    unknown = set(extra) - set(names)
    if unknown:
        raise ValueError(f"external_stages: unknown stage(s) {sorted(unknown)}")
    external = set(extra) | {s.name for s in config.stages if s.external}
    several = sorted(n for n in external if names[n].replicas > 1)
    if several:
        raise ValueError(
            f"external_stages: {several} have several replicas; omni-serve spawns "
            "replicas itself (replicas of a stage started by hand are not supported)"
        )
    issues = IssueCollector(None)
    check_hand_started(config, external, issues)
    issues.raise_if_any()
    return external
