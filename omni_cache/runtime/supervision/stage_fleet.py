"""The pipeline's running stage replicas as one thing: where they run, their processes, the
sockets to them, from start-up to shutdown.

:class:`StageFleet` owns the :class:`~omni_cache.runtime.supervision.placement.StagePlacement` (where each
replica runs, the config it starts with), the :class:`~omni_cache.runtime.supervision.supervisor.StageSupervisor`
(processes, readiness, restarts) and the :class:`~omni_cache.runtime.supervision.stage_links.StageLinks` (the
inbox and a socket to each replica), and the claims on the ipc paths they use. It knows nothing of
requests: it passes what the supervisor reports on to its owner (``events``: the orchestrator),
after dropping what was queued for a replica that went down.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import msgspec
import zmq

from omni_cache.config import PipelineConfig
from omni_cache.config.addresses import control_address
from omni_cache.config.identity import pipeline_hash
from omni_cache.config.replicas import Replica
from omni_cache.runtime.supervision.placement import StagePlacement
from omni_cache.runtime.supervision.stage_forker import StageForkers
from omni_cache.runtime.supervision.stage_links import StageLinks
from omni_cache.runtime.supervision.supervisor import StageEvents, StageSupervisor
from omni_cache.wire.ipc_claims import IpcClaims
from omni_cache.wire.messages import Shutdown

logger = logging.getLogger(__name__)


class StageFleet:
    """``config``: the effective config, its default addresses filled in
    (:func:`~omni_cache.config.addresses.with_default_addresses`, under ``run_dir``);
    ``control_addr``: the inbox's address (default: the config's; with Ray and none set, this
    node's IP once the cluster was joined)."""

    def __init__(
        self,
        config: PipelineConfig,
        events: StageEvents,
        *,
        run_dir: str,
        stage_argv: Sequence[str] | None,
        external: set[str],
        control_addr: str | None,
        echo_stage_logs: bool,
        start_timeout_s: float,
        shutdown_grace_s: float,
        forkers: StageForkers | None = None,
    ) -> None:
        self._config = config
        self._events = events
        self._echo = echo_stage_logs
        self._start_timeout_s = start_timeout_s
        self._grace = shutdown_grace_s
        self.control_address = control_addr or control_address(config) or ""  # "": Ray's node IP
        self.placement = StagePlacement(
            config, run_dir=run_dir, stage_argv=stage_argv, external=external, forkers=forkers
        )
        self.supervisor = StageSupervisor(
            self,
            heartbeat_timeout_s=config.server.heartbeat_timeout_s,
            announce_to=self.control_address,
            config_hash=pipeline_hash(config),
        )
        self.links = StageLinks(config, self.placement.replicas, self.supervisor, external, self.placement.run_secret)
        self._claims = IpcClaims([a for a in (self.control_address, *(r.address for r in self.replicas.values())) if a])

    @property
    def replicas(self) -> Mapping[str, Replica]:
        """Every replica by its name."""
        return self.placement.replicas

    @property
    def external(self) -> set[str]:
        """The stages started by hand."""
        return self.placement.external

    def name_of(self, stage: str, index: int) -> str | None:
        """The name of replica ``index`` of ``stage`` (None: no such replica)."""
        return self.placement.names.get((stage, index))

    # ---- start-up --------------------------------------------------------------------------------

    async def bind(self) -> None:
        """Claim the ipc paths, bind the inbox (joining the Ray cluster first when it places the
        stages) and connect to every replica. Call :meth:`close` when this fails."""
        self.placement.make_run_dir()
        # before any bind: a second pipeline on the same ipc paths would take them over
        self._claims.acquire()
        self.links.open()
        if self.placement.uses_ray:
            node_ip = await asyncio.to_thread(self.placement.join_ray)
            self.control_address = self.control_address or f"tcp://{node_ip}:*"
        bind = self._config.server.control_bind_address
        bound = self.links.bind_inbox(bind or self.control_address)
        if not bind:
            self.control_address = bound  # the port the OS picked, for tcp://host:*
        if self.placement.uses_ray:
            await asyncio.to_thread(self.placement.place, self._start_timeout_s)
        self.links.connect_all()
        self.supervisor.start_monitor()

    async def launch(self, entry: str, before_entry: Callable[[], None]) -> None:
        """Start every replica and wait until all are ready. The other stages start first; the
        ``entry`` stage's replicas after ``before_entry`` (run in a thread: resolving the entry
        model, which may write a tiny checkpoint the entry stage then finds) returned."""
        runners = await asyncio.to_thread(self.placement.runners, self.control_address)
        for stage, replica, runner, env in runners:
            self.supervisor.add(stage, runner, env, self._echo, replica)
        first = [r.name for _, r, _, _ in runners if r.stage != entry]
        self.supervisor.launch(first)
        await asyncio.to_thread(before_entry)
        self.supervisor.launch(r.name for _, r, _, _ in runners if r.stage == entry)
        await self.supervisor.wait_ready(self._start_timeout_s)

    # ---- what the supervisor reports -------------------------------------------------------------

    def on_stage_down(self, stage: str, why: str) -> None:
        try:
            self.links.reset(stage)  # what was queued for its dead process must not reach the next
        finally:
            self._events.on_stage_down(stage, why)  # its requests end or move whatever happened

    def on_stage_up(self, stage: str) -> None:
        self._events.on_stage_up(stage)

    # ---- traffic ---------------------------------------------------------------------------------

    async def send(
        self, name: str, msg: msgspec.Struct, tensors: Mapping[str, Any] | None = None, *, timeout: float | None = 5.0
    ) -> bool:
        """Send to replica ``name`` (see :meth:`StageLinks.send`)."""
        return await self.links.send(name, msg, tensors, timeout=timeout)

    async def receive(self, handle: Callable[[Any, dict[str, Any]], None]) -> None:
        """Pass every message the stages send to the inbox to ``handle`` (message, tensors), until
        the inbox is closed or the task is cancelled (:func:`pump`)."""
        await pump(self.links.recv, handle, lambda: self.links.closed)

    # ---- shutdown --------------------------------------------------------------------------------

    async def close(self) -> None:
        """Stop every stage process (Shutdown, then SIGTERM, then SIGKILL), leave Ray, close the
        sockets, release the ipc paths."""
        self.supervisor.begin_stop()
        alive = self.supervisor.alive()
        if alive:
            await asyncio.gather(
                *(self.send(name, Shutdown(reason="orchestrator closing"), timeout=0.5) for name in alive),
                return_exceptions=True,
            )
        await asyncio.to_thread(self.supervisor.stop_processes, self._grace)
        await self.supervisor.close()
        await asyncio.to_thread(self.placement.close)
        self.links.close()
        self._claims.release()

    def kill_all_sync(self, grace: float = 3.0) -> None:
        """Last resort when the event loop is gone (atexit, a crashed server): SIGTERM every stage
        process group, then SIGKILL after ``grace``."""
        self.supervisor.kill_all_sync(grace)
        self.placement.close()


async def pump(
    recv: Callable[[], Awaitable[tuple[Any, dict[str, Any]] | None]],
    handle: Callable[[Any, dict[str, Any]], None],
    closed: Callable[[], bool],
) -> None:
    """``handle`` every message ``recv`` gives (None: one the transport dropped), until a receive
    fails with the inbox ``closed``; a message ``handle`` fails on is logged and the loop goes on.

    The loop gets a turn after every message: a receive with messages waiting completes without
    one (pyzmq's future is done at once), so a burst of stage outputs (every stream's step at
    once: 30 streaming answers are 30 messages) would otherwise run back to back ahead of every
    HTTP request that arrived meanwhile, /health included."""
    while True:
        try:
            item = await recv()
        except zmq.ZMQError as e:
            if closed():
                return
            logger.warning("orchestrator inbox: %s", e)
            await asyncio.sleep(0.05)
            continue
        if item is not None:  # None: a message that did not validate (transport.py logged it)
            msg, tensors = item
            try:
                handle(msg, tensors)
            except Exception:  # noqa: BLE001 -- one bad message must not stop the loop
                logger.exception("error handling %s from a stage", type(msg).__name__)
        await asyncio.sleep(0)
