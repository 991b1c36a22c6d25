"""Stage replicas placed on a Ray cluster (``server.ray_address`` / ``omni-serve --ray-address``).

Ray does placement, lifecycle and discovery; ZMQ stays the data plane. Every replica of every stage
that is not ``external`` gets one Ray actor (:class:`StageActor`), created with the resources its
stage declares (``ray: {num_cpus, num_gpus, resources, replica_resources}``); the actor owns the
replica's OS process, the same ``python -m workers ...`` a local spawn runs. The orchestrator uses
two phases because stages send to each other directly (the thinker to the talker's address):

1. :meth:`RayPlacement.place` creates the actors, waits until Ray placed each, and asks each for
   its node (Ray's node id and IP) and a free TCP port on that node: the replica's address is
   ``tcp://NODE_IP:PORT``;
2. the orchestrator fills the stage config with those addresses (``replica_addresses``) and hands
   each replica's :class:`RayRunner` to its supervisor, which starts the process through the
   actor: the actor writes the config text it is given to a file on its own node (nodes need not
   share a filesystem) and runs the stage with it.

Supervision is the local one (:class:`omni_cache.runtime.supervision.process_runner.ProcessRunner`): a process that
exits is reported as a local one is and restarted through the same actor, on the same node and
port, so its address stays and the other stages still reach it. An actor that dies (``ray.kill``,
its node lost) is reported the same way; its restart creates a new actor pinned to the same node
(hard node affinity) asking for the same port. While that node is gone the replica stays down and
is retried with back-off: re-placing it elsewhere would change its address, which the other stages
were started with.

Importing this module imports ray: the orchestrator does so only when a Ray address is set.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import queue
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray
import yaml
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from omni_cache.config import PipelineConfig, RayResources
from omni_cache.config.replicas import replica_name
from omni_cache.runtime.supervision.process_runner import StageStartError, exit_words
from omni_cache.wire.stage_auth import write_secret

logger = logging.getLogger(__name__)

#: The Ray namespace the actors are named in (``<pipeline>/<replica>``).
NAMESPACE = "omni_cache"
#: Lines of a stage's output an actor keeps until the server fetches them.
ACTOR_LINES = 2000
#: How often the server fetches a Ray-placed stage's output (and so how late its echo is).
LINES_INTERVAL_S = 0.5
#: How long one control call to an actor (start, signal) may take before it counts as lost.
CALL_TIMEOUT_S = 60.0
#: :meth:`RayRunner.poll`'s code for "the actor itself is gone" (not a process exit code).
ACTOR_LOST = -1000
#: How long closing a runner waits for the signals it still has to send.
SIGNAL_DRAIN_S = 15.0


def connect(address: str) -> bool:
    """Join the Ray cluster at ``address`` ("auto" or "HOST:PORT"); False when this process was
    already connected (then it is not ours to disconnect)."""
    if ray.is_initialized():
        return False
    # The stages' output reaches the server through RayRunner (its echo and error tails),
    # not through Ray's log forwarding, which would print every line a second time.
    ray.init(address=address, namespace=NAMESPACE, log_to_driver=False, configure_logging=False)
    return True


def disconnect() -> None:
    with contextlib.suppress(Exception):
        ray.shutdown()


def node_ip() -> str:
    """This host's IP as the Ray cluster knows it (the orchestrator's inbox binds it)."""
    return ray.util.get_node_ip_address()


def _free_port(ip: str, port: int | None) -> int:
    """A TCP port free on ``ip`` now (``port`` itself when given and free). Another process may
    take it before the stage binds it: the stage then exits and is restarted on it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((ip, port or 0))
        except OSError:
            if port:
                return port  # busy now; the stage's bind says so when it starts
            raise
        return s.getsockname()[1]


@ray.remote(max_restarts=0)  # a dead actor is replaced by RayRunner, pinned to its node
class StageActor:
    """Owns one stage replica's process on the node Ray placed it on.

    An async actor: every method runs on one event-loop thread that lives as long as the actor,
    which matters because the stage process asks Linux to SIGTERM it when the thread that
    spawned it exits (PR_SET_PDEATHSIG in ``python -m workers --parent-pid``): a thread-pool
    thread could end and take the stage with it; the loop thread ends only with the actor."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._proc: subprocess.Popen[bytes] | None = None
        self._lines: deque[str] = deque(maxlen=ACTOR_LINES)
        self._seen = 0  # lines read so far (the index after the last one in _lines)
        self._lock = threading.Lock()
        self._dir = tempfile.mkdtemp(prefix="omni_cache_stage_")

    async def reserve(self, port: int | None) -> dict[str, Any]:
        """Where this actor runs, and the port its stage will listen on."""
        ip = ray.util.get_node_ip_address()
        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "ip": ip,
            "port": _free_port(ip, port),
            "host": socket.gethostname(),
            "pid": os.getpid(),
        }

    async def where(self) -> dict[str, Any]:
        """Ray's id of this actor's node, its IP, and the pid of the stage process it runs now
        (None when none runs): what a test or an operator checks placement with."""
        running = self._proc is not None and self._proc.poll() is None
        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "ip": ray.util.get_node_ip_address(),
            "stage_pid": self._proc.pid if running and self._proc is not None else None,
        }

    async def start(
        self,
        prefix: list[str] | None,
        args: list[str],
        config_text: str,
        env: dict[str, str],
        stage_secret: str | None = None,
    ) -> tuple[int, int]:
        """Run the stage: ``prefix`` (default: this node's ``python -m workers``) plus the config
        written here, ``args``, and this actor as its parent. ``stage_secret``: the run's stage
        key (the server made it, :meth:`RayRunner` passes it), written here readable by this user
        only and named in the config as ``server.stage_auth_key_file``. Returns the stage's pid,
        and the count of output lines before its first (those are an earlier process's)."""
        if self._proc is not None and self._proc.poll() is None:
            raise RuntimeError(f"stage {self._name} is still running (pid {self._proc.pid})")
        if stage_secret is not None:
            key_path = os.path.join(self._dir, "stage_auth.key")
            with contextlib.suppress(FileNotFoundError):
                os.remove(key_path)  # an earlier start's (the same run's key)
            write_secret(key_path, stage_secret)
            data = yaml.safe_load(config_text)
            data.setdefault("server", {})["stage_auth_key_file"] = key_path
            config_text = yaml.safe_dump(data, sort_keys=False)
        path = os.path.join(self._dir, "stage_config.yaml")
        with open(path, "w") as f:
            f.write(config_text)
        argv = [
            *(prefix or [sys.executable, "-m", "workers"]),
            "--stage-config",
            path,
            *args,
            "--parent-pid",
            str(os.getpid()),
        ]
        self._proc = subprocess.Popen(
            argv,
            env={**os.environ, **env, "PYTHONUNBUFFERED": "1"},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # own process group: signals reach vLLM's helpers too
        with self._lock:
            seen = self._seen
        threading.Thread(target=self._read, args=(self._proc,), daemon=True).start()
        return self._proc.pid, seen

    def _read(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        with contextlib.suppress(Exception):
            for raw in proc.stdout:
                with self._lock:
                    self._lines.append(raw.decode("utf-8", errors="replace").rstrip("\n"))
                    self._seen += 1

    async def lines(self, since: int) -> tuple[int, list[str]]:
        """The output lines after the first ``since`` (those still kept), and the new count."""
        with self._lock:
            kept_from = self._seen - len(self._lines)
            return self._seen, list(self._lines)[max(0, since - kept_from) :]

    async def wait(self) -> int:
        """The stage process's exit code, once it exits."""
        assert self._proc is not None
        while self._proc.poll() is None:
            await asyncio.sleep(0.1)
        return int(self._proc.returncode)

    async def signal(self, sig: int) -> None:
        if self._proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self._proc.pid, sig)


@dataclass
class PlacedReplica:
    """One replica's actor and where Ray put it."""

    name: str
    stage: str
    index: int
    actor: Any
    options: dict[str, Any]
    node_id: str = ""
    ip: str = ""
    port: int = 0
    host: str = ""

    @property
    def address(self) -> str:
        return f"tcp://{self.ip}:{self.port}"


def _actor_options(res: RayResources, index: int, name: str) -> dict[str, Any]:
    return {
        "num_cpus": res.num_cpus,
        "num_gpus": res.num_gpus,
        "resources": res.for_replica(index),
        "name": name,
        "namespace": NAMESPACE,
    }


class RayPlacement:
    """The actors of one pipeline's Ray-placed replicas (phase 1 of the module doc)."""

    def __init__(self, config: PipelineConfig) -> None:
        self._config = config
        self.replicas: dict[str, PlacedReplica] = {}

    def place(self, timeout: float) -> dict[str, PlacedReplica]:
        """Create every replica's actor and wait until each is placed and has a port. Raises
        :class:`StageStartError` naming what no node offers, or what was not placed in time."""
        self._check_feasible()
        for stage in self._config.stages:
            if not self._config.placed_by_ray(stage):
                continue
            res = stage.ray or RayResources()
            for i in range(stage.replicas):
                name = replica_name(stage.name, i, stage.replicas)
                options = _actor_options(res, i, f"{self._config.name}/{name}")
                try:
                    actor = StageActor.options(**options).remote(name)
                except ValueError as e:  # the name is taken
                    raise StageStartError(
                        f"replica {name!r}: {e}; is another omni-serve of pipeline "
                        f"{self._config.name!r} running on this Ray cluster?"
                    ) from e
                self.replicas[name] = PlacedReplica(name, stage.name, i, actor, options)
        refs = {p.actor.reserve.remote(None): p for p in self.replicas.values()}
        pending = list(refs)
        deadline = time.monotonic() + timeout
        while pending:
            done, pending = ray.wait(pending, num_returns=len(pending), timeout=max(0.0, deadline - time.monotonic()))
            for ref in done:
                p = refs[ref]
                info = ray.get(ref)
                p.node_id, p.ip, p.port, p.host = info["node_id"], info["ip"], info["port"], info["host"]
                logger.info(
                    "stage %s: placed by Ray on node %s (%s, %s), listens at %s",
                    p.name,
                    p.node_id[:12],
                    p.host,
                    p.ip,
                    p.address,
                )
            if pending and time.monotonic() >= deadline:
                waiting = [refs[r] for r in pending]
                raise StageStartError(
                    "Ray placed no actor for "
                    + ", ".join(
                        f"{p.name!r} (asks {p.options['num_cpus']:g} CPU, "
                        f"{p.options['num_gpus']:g} GPU, resources {p.options['resources']})"
                        for p in waiting
                    )
                    + f" within {timeout:g} s: no node has those free (ray status shows what "
                    "each node has)"
                )
        return self.replicas

    def _check_feasible(self) -> None:
        """Fail at once when a custom resource exists on no node (Ray would wait for one)."""
        have = ray.cluster_resources()
        for stage in self._config.stages:
            if not self._config.placed_by_ray(stage) or stage.ray is None:
                continue
            for i in range(stage.replicas):
                for key in stage.ray.for_replica(i):
                    if key not in have:
                        raise StageStartError(
                            f"stage {stage.name!r} replica {i} asks for Ray resource {key!r}, "
                            f"which no node of the cluster has (the cluster has: "
                            f"{', '.join(sorted(have))}); start a node with ray start "
                            f"--resources '{{\"{key}\": 1}}'"
                        )

    def close(self) -> None:
        """Kill every actor (their stage processes were stopped; PR_SET_PDEATHSIG ends any left)."""
        for p in self.replicas.values():
            with contextlib.suppress(Exception):
                ray.kill(p.actor, no_restart=True)


@dataclass
class _Run:
    """One start of the process: what the watcher thread learned."""

    code: int | None = None
    lost: str = ""
    started: threading.Event = field(default_factory=threading.Event)


class RayRunner:
    """A :class:`~omni_cache.runtime.supervision.process_runner.ProcessRunner` whose process a :class:`StageActor`
    owns. ``args``: the stage's arguments besides its config and parent (the actor adds those);
    ``prefix``: the command before them (None: the node's ``python -m workers``);
    ``config_text``: the stage config, as YAML; ``stage_secret``: the run's stage key when the
    server made one (the actor writes it on its node, :meth:`StageActor.start`)."""

    def __init__(
        self,
        placed: PlacedReplica,
        prefix: list[str] | None,
        args: list[str],
        config_text: str,
        env: dict[str, str],
        stage_secret: str | None = None,
    ) -> None:
        self.placed = placed
        self._prefix = prefix
        self._args = args
        self._config_text = config_text
        self._env = env
        self._stage_secret = stage_secret
        self.argv = [*(prefix or ["python", "-m", "workers"]), "--stage-config", "(written on its node)", *args]
        self.pid: int | None = None
        self._run: _Run | None = None
        self._actor_lost = False
        # Signals go out from a thread of their own, in order (see signal()).
        self._signals: queue.SimpleQueue[tuple[_Run, int] | None] = queue.SimpleQueue()
        self._signaller: threading.Thread | None = None

    @property
    def where(self) -> str:
        p = self.placed
        return f"Ray node {p.node_id[:12]} ({p.host}, {p.ip})"

    def start(self, on_line: Callable[[str], None]) -> None:
        run = self._run = _Run()
        threading.Thread(
            target=self._watch, args=(run, on_line), name=f"omni-cache-ray-{self.placed.name}", daemon=True
        ).start()

    def _watch(self, run: _Run, on_line: Callable[[str], None]) -> None:
        """Start the process through the actor, relay its output, record how it ended."""
        seen = 0
        try:
            if self._actor_lost:
                self._replace_actor()
            actor = self.placed.actor
            self.pid, seen = ray.get(
                actor.start.remote(self._prefix, self._args, self._config_text, self._env, self._stage_secret),
                timeout=CALL_TIMEOUT_S,
            )
            run.started.set()
            exited = actor.wait.remote()
            while True:
                done, _ = ray.wait([exited], timeout=LINES_INTERVAL_S)
                seen, lines = ray.get(actor.lines.remote(seen), timeout=CALL_TIMEOUT_S)
                for line in lines:
                    on_line(line)
                if done:
                    run.code = ray.get(exited)
                    return
        except Exception as e:  # noqa: BLE001 -- the actor died, its node went, a call timed out
            self._actor_lost = True
            first = (str(e).strip().splitlines() or [""])[0][:300]
            run.lost = (
                f"its Ray actor on {self.where} is gone ({type(e).__name__}: {first}); it is re-placed on the same node"
            )
            run.code = ACTOR_LOST
        finally:
            run.started.set()

    def _replace_actor(self) -> None:
        """A new actor on the dead one's node, asking for the same port (the same address)."""
        p = self.placed
        with contextlib.suppress(Exception):
            ray.kill(p.actor, no_restart=True)  # frees its name if it still lingers
        options = dict(p.options)
        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(p.node_id, soft=False)
        actor = StageActor.options(**options).remote(p.name)
        info = ray.get(actor.reserve.remote(p.port), timeout=CALL_TIMEOUT_S)
        p.actor = actor
        if info["port"] != p.port:
            raise RuntimeError(f"the new actor got port {info['port']}, not {p.port}")
        self._actor_lost = False
        logger.info("stage %s: new Ray actor on node %s, same address %s", p.name, p.node_id[:12], p.address)

    def poll(self) -> int | None:
        return self._run.code if self._run is not None else None

    def describe_exit(self, code: int) -> str:
        if code == ACTOR_LOST and self._run is not None and self._run.lost:
            return self._run.lost
        return f"{exit_words(code)} on {self.where}"

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the stage's process group through its actor, without waiting for it:
        the supervisor calls this on the server's event loop, exactly when a node hangs, and
        the actor's call can then take CALL_TIMEOUT_S + 10 s. A thread of this runner's sends
        the signals in the order given."""
        run = self._run
        if run is None or self._actor_lost:
            return  # nothing started, or nothing left to signal through
        if self._signaller is None:
            self._signaller = threading.Thread(
                target=self._send_signals, daemon=True, name=f"omni-cache-ray-signal-{self.placed.name}"
            )
            self._signaller.start()
        self._signals.put((run, int(sig)))

    def _send_signals(self) -> None:
        while (item := self._signals.get()) is not None:
            run, sig = item
            # Also after the exit: the group may still hold the stage's helpers (the supervisor
            # SIGKILLs them then, as it does locally). Before the start a signal would be lost.
            run.started.wait(CALL_TIMEOUT_S)
            with contextlib.suppress(Exception):
                ray.get(self.placed.actor.signal.remote(sig), timeout=10.0)

    def wait(self, timeout: float) -> bool:
        end = time.monotonic() + timeout
        while self.poll() is None and self._run is not None:
            if time.monotonic() >= end:
                return False
            time.sleep(0.05)
        return True

    def close(self) -> None:
        """Deliver the signals still queued (for at most SIGNAL_DRAIN_S), then kill the actor
        (blocking: the supervisor closes runners off the event loop)."""
        if self._signaller is not None:
            self._signals.put(None)
            self._signaller.join(SIGNAL_DRAIN_S)
            self._signaller = None
        with contextlib.suppress(Exception):
            ray.kill(self.placed.actor, no_restart=True)


__all__ = [
    "ACTOR_LOST",
    "NAMESPACE",
    "PlacedReplica",
    "RayPlacement",
    "RayRunner",
    "StageActor",
    "connect",
    "disconnect",
    "node_ip",
]
