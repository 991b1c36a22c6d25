"""The orchestrator: stage processes, request routing, deadlines and failure handling.

One :class:`Orchestrator` runs inside one asyncio event loop (uvicorn's for ``omni-serve``, a
background thread's for :class:`omni_cache.pipeline.Pipeline`). It

* through its :class:`~omni_cache.runtime.supervisor.StageSupervisor`, starts one OS process per
  stage replica (``python -m workers --stage-config ... --stage NAME --replica I --orchestrator
  ADDR --parent-pid PID``, each in its own process group), waits until every replica sent
  ``StageReady``, polls them every 100 ms, restarts a replica that died, and on close sends ``Shutdown``, then SIGTERM, then
  SIGKILL to each process group; stages marked ``external`` are started by hand elsewhere: the
  supervisor waits for their announcements and watches their connections and heartbeats instead
  (and never stops them);
* with ``server.stage_auth_key_file``, makes every ZMQ connection CURVE-authenticated
  (:mod:`omni_cache.wire.stage_auth`);
* binds its inbox (a PULL socket at :func:`control_address`) and PUSHes to every stage's inbox;
  one background task receives and dispatches everything the stages send;
* picks, per request, one replica of every stage the request passes (``server.routing``,
  :mod:`omni_cache.runtime.routing`), among the replicas that are up, and sends the choice with
  the request (``Submit.route``); the requests a dying replica served go on from where their
  clients are on replicas that are up (:mod:`omni_cache.runtime.resume`), or fail (503) when
  a stage they need has none;
* owns request ids, deadlines (checked every 100 ms) and the only copy of each accepted request
  (its :class:`~omni_cache.runtime.requests.RequestTable`): every request ends in exactly one
  terminal event on its :class:`RequestHandle`, ``Completed`` or ``Failed`` (stage died -> 503,
  stage error -> the stage's status, deadline -> 504, shutdown -> 503);
* tokenizes chat messages with the entry (thinker) stage's tokenizer and rejects prompts that do
  not fit the thinker's context (400);
* answers stats queries (:meth:`Orchestrator.stage_stats`) and renders ``/metrics``.

Process supervision (launch, readiness, restarts, heartbeats, stopping) is a
:class:`~omni_cache.runtime.supervisor.StageSupervisor` the orchestrator owns; it reports a stage
going down or coming up through :meth:`Orchestrator.on_stage_down` / :meth:`Orchestrator.on_stage_up`
(the orchestrator then fails that stage's requests and resets its socket). The in-flight requests
and their deadlines live in :mod:`omni_cache.runtime.requests`; what a client gets back (events,
results, errors) in :mod:`omni_cache.runtime.results`, re-exported here.

Which stages a request needs ("participants"): the entry stage always; every stage downstream of
it as well when "audio" is among the request's modalities (the entry stage forwards to its
downstream stages only then). The request completes when every participant sent its
``StageOutput(finished=True)``.
"""

from __future__ import annotations

import asyncio
import json
import contextlib
import logging
import os
import re
import tempfile
import threading
import time
import uuid
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np
import zmq
import zmq.asyncio

from omni_cache.config import PipelineConfig, StageConfig, resolve_model
from omni_cache.config.replicas import Replica, replica_name, stage_replicas
from omni_cache.wire.ipc_claims import IpcClaims
from omni_cache.wire.messages import (
    CODES_FRAME,
    MESSAGE_TYPES,
    Abort,
    BlockEvents,
    MediaRef,
    Sampling,
    Shutdown,
    StageError,
    StageOutput,
    StageReady,
    StageStats,
    StatsQuery,
    Submit,
)
from omni_cache.serving.metrics import (
    STAGE_DONE, TTFA, TTFT, OrchestratorMetrics, RoutingSnapshot, StageSnapshot,
)
from omni_cache.runtime.heap_trim import HeapTrimmer
from omni_cache.runtime.requests import Request, RequestTable
from omni_cache.runtime.resume import (
    MAX_ATTEMPTS,
    ResumedText,
    new_samples,
    new_tokens,
    resumed_prompt,
    resumed_submit,
)
from omni_cache.runtime.block_hashes import prompt_block_hashes
from omni_cache.runtime.prefix_index import PrefixIndex
from omni_cache.runtime.affinity import AFFINITY_BLOCK_SIZE, PrefixAffinity
from omni_cache.runtime.routing import ReplicaRouter, reports_blocks
from omni_cache.runtime.tokenizer_cache import load_tokenizer

if TYPE_CHECKING:
    from omni_cache.serving.media import MediaItem
from omni_cache.runtime.results import (
    AudioDelta,
    Completed,
    Event,
    Failed,
    GenerationResult,
    RequestError,
    RequestHandle,
    TextDelta,
)
from omni_cache.wire.stage_auth import load_stage_auth
from omni_cache.runtime.supervisor import (
    DEFAULT_START_TIMEOUT_S,
    SHUTDOWN_GRACE_S,
    StageStartError,
    StageSupervisor,
    default_stage_argv,
)

logger = logging.getLogger("omni_cache.runtime.orchestrator")

__all__ = [
    "AudioDelta",
    "Completed",
    "Event",
    "Failed",
    "GenerationResult",
    "Orchestrator",
    "RequestError",
    "RequestHandle",
    "StageStartError",
    "TextDelta",
    "control_address",
    "default_stage_argv",
]

#: How long a /metrics scrape waits for the stages' StageStats.
STATS_TIMEOUT_S = 1.0
#: Status of a request the client abandoned (nginx's "client closed request").
STATUS_CLIENT_CLOSED = 499
#: How often the in-flight requests' deadlines are checked.
DEADLINE_CHECK_INTERVAL_S = 0.1
#: Sample rates accepted on a stage's audio output (telephone to studio rates).
MIN_SAMPLE_RATE, MAX_SAMPLE_RATE = 8000, 192000


#: What audio inputs are resampled to when the entry model does not say (Whisper-style encoders).
DEFAULT_AUDIO_INPUT_RATE = 16000


def audio_input_rate(model_dir: Path) -> int:
    """The sample rate of the model's audio feature extractor (``preprocessor_config.json``)."""
    try:
        rate = json.loads((model_dir / "preprocessor_config.json").read_text()).get("sampling_rate")
    except (OSError, ValueError):
        return DEFAULT_AUDIO_INPUT_RATE
    return int(rate) if isinstance(rate, int) and rate > 0 else DEFAULT_AUDIO_INPUT_RATE


def control_address(config: PipelineConfig) -> str:
    """The orchestrator's inbox: ``config.server.control_address`` if the schema has it, else
    ``ipc:///tmp/omni_cache/<pipeline name>/orchestrator.sock``."""
    addr = getattr(config.server, "control_address", None)
    if addr:
        return str(addr)
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", config.name)[:60] or "pipeline"
    return f"ipc:///tmp/omni_cache/{name}/orchestrator.sock"


# --------------------------------------------------------------------------------------------------
# The orchestrator
# --------------------------------------------------------------------------------------------------


@dataclass
class _CheckedRequest:
    """A request that passed submit()'s checks, ready to be sent."""

    prompt_token_ids: list[int]
    modalities: tuple[str, ...]
    sampling: Sampling
    participants: tuple[str, ...]
    media: tuple[MediaItem, ...] = ()
    stream: bool = False  # Submit.stream: the client streams (stages pace its audio)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading items ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class Orchestrator:
    """Runs a pipeline's stage processes and routes requests through them (one asyncio loop).

    ``config_path``: the YAML the stage processes read (``None``: the in-memory ``config`` is
    written to a temporary file). ``checkpoint_dir`` / ``prefix_cache=False`` are forwarded to the
    stages as ``--checkpoint-dir`` / ``--no-prefix-cache``. ``tokenizer``: anything with
    ``apply_chat_template`` (default: the entry stage's, loaded with ``AutoTokenizer``).
    ``stage_argv``: the command of a stage process before its arguments (default
    ``[python, -m, workers]``). ``external_stages``: stages started by hand elsewhere, added to
    those the config marks ``external`` (not spawned; watched through their announcements and
    connections, see :class:`~omni_cache.runtime.supervisor.StageSupervisor`).

    ``supervisor`` owns the stage processes; the orchestrator is its
    :class:`~omni_cache.runtime.supervisor.StageEvents` listener.
    """

    def __init__(
        self,
        config: PipelineConfig,
        *,
        config_path: str | os.PathLike[str] | None = None,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        prefix_cache: bool = True,
        tokenizer: Any = None,
        stage_argv: Sequence[str] | None = None,
        external_stages: Iterable[str] = (),
        start_timeout_s: float | None = None,
        echo_stage_logs: bool = True,
        control_addr: str | None = None,
        shutdown_grace_s: float = SHUTDOWN_GRACE_S,
    ) -> None:
        self.config = config
        if checkpoint_dir is not None:
            config.checkpoint_dir = str(checkpoint_dir)
        if not prefix_cache:
            for s in config.stages:
                if s.kind == "autoregressive":  # a generation stage has no prefix cache
                    s.prefix_cache = False
        self._config_path = str(Path(config_path).absolute()) if config_path else None
        self._tmp_config: str | None = None
        self._checkpoint_dir = str(checkpoint_dir) if checkpoint_dir is not None else None
        self._prefix_cache = prefix_cache
        self._tokenizer = tokenizer
        #: The rate the entry model's audio inputs are resampled to (its feature extractor's).
        self.audio_input_rate = DEFAULT_AUDIO_INPUT_RATE
        self._tok_lock = threading.Lock()
        self._stage_argv = list(stage_argv) if stage_argv is not None else default_stage_argv()
        self._start_timeout_s = float(
            start_timeout_s if start_timeout_s is not None
            else getattr(config.server, "stage_start_timeout_s", None) or DEFAULT_START_TIMEOUT_S
        )
        self._echo = echo_stage_logs
        self._grace = shutdown_grace_s
        self.control_address = control_addr or control_address(config)
        self.served_model_name = config.server.served_model_name or config.name

        self._stage_cfg: dict[str, StageConfig] = {s.name: s for s in config.stages}
        self.stage_names = [s.name for s in config.topological_order()]
        self.entry = config.entry_stage()
        text = [s for s in config.stages if s.final_output == "text"]
        audio = [s for s in config.stages if s.final_output == "audio"]
        self.text_stage: StageConfig = text[0] if text else self.entry
        self.audio_stage: StageConfig | None = audio[0] if audio else None
        self.audio_sample_rate = 24000
        self._downstream_of_entry = self._reachable_from(self.entry.name)
        unknown = set(external_stages) - set(self._stage_cfg)
        if unknown:
            raise ValueError(f"external_stages: unknown stage(s) {sorted(unknown)}")
        # Stages started by hand: the argument's, and those the config marks ``external``.
        self._external = set(external_stages) | {s.name for s in config.stages if s.external}
        several = sorted(n for n in self._external if self._stage_cfg[n].replicas > 1)
        if several:
            raise ValueError(f"external_stages: {several} have several replicas; omni-serve "
                             "spawns replicas itself (replicas of a stage started by hand are not "
                             "supported)")
        #: Ray places the replicas of every stage not external (server.ray_address): their
        #: addresses are known once their actors report them (start()); till then "".
        self._ray_address = config.server.ray_address
        self._placement: Any = None  # ray_placement.RayPlacement while Ray places stages
        self._ray_connected = False  # start() joined the cluster (close() leaves it)
        #: Every stage replica by its name (omni_cache.config.replicas).
        self._replicas: dict[str, Replica] = {
            r.name: r for stage in config.stages for r in (
                [Replica(stage.name, i, replica_name(stage.name, i, stage.replicas), "", None)
                 for i in range(stage.replicas)]
                if config.placed_by_ray(stage) else stage_replicas(stage))}
        self._replica_names = {(r.stage, r.index): r.name for r in self._replicas.values()}
        self.router = ReplicaRouter(config.server.routing,
                                    {s.name: s.replicas for s in config.stages})
        #: What each entry replica's prefix cache holds, as it reports (prefix routing only).
        self.prefix_index = PrefixIndex()
        self._prefix_routing = reports_blocks(config.server.routing, self.entry.name, self.entry.name,
                                              self.entry.replicas, self.entry.prefix_cache)
        #: Later stages with a prefix cache of their own and several replicas, under ``prefix``
        #: routing: where each thinker prompt prefix's work went (omni_cache.runtime.affinity).
        self._affinity = {s.name: PrefixAffinity() for s in config.stages
                          if config.server.routing == "prefix" and s.name != self.entry.name
                          and s.replicas > 1 and s.is_autoregressive and s.prefix_cache}
        self._control_bind = config.server.control_bind_address
        self._auth: Any = None  # StageAuth when server.stage_auth_key_file is set (start())

        self.supervisor = StageSupervisor(
            self, heartbeat_timeout_s=config.server.heartbeat_timeout_s,
            announce_to=self.control_address,
        )
        self._requests = RequestTable()
        self._context_len: int | None = None  # the entry stage's, from its StageReady
        self._stats: dict[str, dict[str, float]] = {}
        self._stats_time: dict[str, float] = {}
        self._stats_waiters: set[asyncio.Event] = set()
        self.metrics = OrchestratorMetrics(self.stage_names)
        # The server's own heap: see heap_trim.py (trimmed from the deadline loop).
        self.heap = HeapTrimmer()

        self._ctx: zmq.asyncio.Context | None = None
        self._inbox: Any = None
        self._senders: dict[str, Any] = {}
        self._codec: Any = None
        self._tasks: list[asyncio.Task] = []
        self._background: set[asyncio.Task] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._started = False
        self._closing = False
        self._closed = False
        self._ready_event: asyncio.Event | None = None
        if self._ray_address is not None and control_addr is None and not config.server.control_address:
            # Stages on other nodes reach the inbox over tcp: start() binds this node's IP.
            self.control_address = ""
        self._claims = IpcClaims([a for a in (self.control_address,
                                              *(r.address for r in self._replicas.values())) if a])

    # ---- lifecycle -------------------------------------------------------------------------------

    @property
    def started(self) -> bool:
        """Whether start() completed (every stage was ready once)."""
        return self._started

    async def start(self) -> None:
        """Bind the inbox, start the stage processes and wait until every stage is ready.

        Raises :class:`StageStartError` naming the stage that did not come up (its exit code and
        the end of its output); everything started is stopped again in that case.
        """
        from omni_cache.wire.transport import AsyncReceiver, Codec

        if self._loop is not None:
            raise RuntimeError("Orchestrator.start() called twice")
        self._loop = asyncio.get_running_loop()
        self._ready_event = asyncio.Event()
        try:
            # before any bind: a second pipeline on the same ipc paths would take them over
            self._claims.acquire()
            self._codec = Codec(MESSAGE_TYPES, max_message_bytes=self.config.server.max_message_bytes)
            self._ctx = zmq.asyncio.Context()
            self._auth = load_stage_auth(self.config)
            if self._auth is not None:
                self._auth.guard(self._ctx)  # before the inbox binds
            if self._ray_address is not None:
                await asyncio.to_thread(self._join_ray)
            self._inbox = AsyncReceiver(self._ctx, self._control_bind or self.control_address,
                                        self._codec, bind=True, auth=self._auth)
            if self.control_address.endswith(":*"):
                self.control_address = self._inbox.address  # the port the OS picked
            if self._placement is not None:
                # Phase 1: the actors, and the addresses they report (module ray_placement).
                await asyncio.to_thread(self._placement.place, self._start_timeout_s)
                self._use_placed_addresses()
            for name in self._replicas:
                self._senders[name] = self._new_sender(name)
            self._tasks.append(asyncio.create_task(self._recv_loop(), name="omni-cache-recv"))
            self._tasks.append(asyncio.create_task(self._deadline_loop(), name="omni-cache-deadlines"))
            self.supervisor.start_monitor()

            # Phase 2 (Ray): each actor gets the config text with every address filled in.
            config_text = (self._ray_stage_config() if self._placement is not None else None)
            if config_text is None:
                await asyncio.to_thread(self._write_stage_config)
            for name in self.stage_names:
                stage = self._stage_cfg[name]
                env = {**os.environ, **stage.env, "PYTHONUNBUFFERED": "1"}
                for replica in stage_replicas(stage):
                    if name in self._external:
                        runner: Any = None
                    elif config_text is not None:
                        runner = self._ray_runner(stage, replica, config_text)
                    else:
                        runner = self._stage_command(stage, replica)
                    self.supervisor.add(stage, runner, env, self._echo, replica)
            # The other stages start while the entry model is resolved (a tiny checkpoint is
            # generated here, once) and its tokenizer loaded; the entry stage starts after that.
            entry = [r.name for r in stage_replicas(self.entry)]
            self.supervisor.launch(n for n in self._replicas if n not in entry)
            await asyncio.to_thread(self._load_tokenizer)
            self.supervisor.launch(entry)
            await self.supervisor.wait_ready(self._start_timeout_s)
            self._started = True
            self._ready_event.set()
            logger.info("pipeline %s: all stages ready (%s)", self.config.name, ", ".join(self.stage_names))
        except BaseException:
            await self.close()
            raise

    def _stage_command(self, stage: StageConfig, replica: Replica) -> list[str]:
        assert self._config_path is not None
        return [*self._stage_argv, "--stage-config", self._config_path,
                *self._stage_args(stage, replica), "--parent-pid", str(os.getpid())]

    def _stage_args(self, stage: StageConfig, replica: Replica) -> list[str]:
        """A stage process's arguments besides its config file and parent (the same for a local
        spawn and a Ray actor, which adds those two on its node)."""
        argv = [
            "--stage", stage.name,
            "--replica", str(replica.index),
            # bound to 0.0.0.0 (control_bind_address): spawned stages use the advertised address
            "--orchestrator", self.control_address if self._control_bind else self._inbox.address,
        ]
        if self._checkpoint_dir:
            argv += ["--checkpoint-dir", self._checkpoint_dir]
        if not self._prefix_cache:
            argv.append("--no-prefix-cache")
        return argv

    # ---- Ray placement (omni_cache.runtime.ray_placement) ----------------------------------------

    def _join_ray(self) -> None:
        from omni_cache.runtime import ray_placement  # ray is imported only when it is used

        self._ray_connected = ray_placement.connect(self._ray_address)
        if not self.control_address:
            self.control_address = f"tcp://{ray_placement.node_ip()}:*"
        self._placement = ray_placement.RayPlacement(self.config)

    def _use_placed_addresses(self) -> None:
        """The replicas listen where their actors said: the config and the senders follow."""
        by_stage: dict[str, list[str]] = {}
        for placed in sorted(self._placement.replicas.values(), key=lambda p: (p.stage, p.index)):
            by_stage.setdefault(placed.stage, []).append(placed.address)
            self._replicas[placed.name] = Replica(placed.stage, placed.index, placed.name,
                                                  placed.address, None)
        for name, addresses in by_stage.items():
            self._stage_cfg[name].replica_addresses = addresses

    def _ray_stage_config(self) -> str:
        """The stage config every Ray-placed stage reads: the pipeline's, with every replica's
        address filled in. It leaves out ray_address: a stage process does not place anything."""
        import yaml

        data = msgspec.to_builtins(self.config)
        data["server"]["ray_address"] = None
        for stage in data["stages"]:
            if stage.get("replica_addresses"):  # placed: these replace address / bind_address
                stage["address"] = stage["bind_address"] = None
        return yaml.safe_dump(data, sort_keys=False)

    def _ray_runner(self, stage: StageConfig, replica: Replica, config_text: str) -> Any:
        from omni_cache.runtime.ray_placement import RayStageRunner

        default = self._stage_argv == default_stage_argv()
        # The node's own Python runs the default command: hosts need not share a venv path.
        return RayStageRunner(self._placement.replicas[replica.name],
                              None if default else list(self._stage_argv),
                              self._stage_args(stage, replica), config_text,
                              {**stage.env})

    def placement(self) -> dict[str, dict[str, str]]:
        """Ray-placed replicas: replica name -> {"node_id", "ip", "host", "address"} ({} when
        the stages are spawned locally)."""
        if self._placement is None:
            return {}
        return {p.name: {"node_id": p.node_id, "ip": p.ip, "host": p.host, "address": p.address}
                for p in self._placement.replicas.values()}

    def _write_stage_config(self) -> None:
        """The YAML the stage processes read: the given file, or the in-memory config dumped."""
        if self._config_path is None:
            root = Path(tempfile.gettempdir()) / "omni_cache"
            root.mkdir(parents=True, exist_ok=True)
            fd, path = tempfile.mkstemp(prefix=f"{self.config.name}-", suffix=".yaml", dir=root)
            import yaml

            with os.fdopen(fd, "w") as f:
                yaml.safe_dump(msgspec.to_builtins(self.config), f, sort_keys=False)
            self._config_path = self._tmp_config = path

    def _load_tokenizer(self) -> None:
        if self._tokenizer is None:
            # Resolving the entry model first also generates a tiny checkpoint before the stage
            # process needs it (ensure_checkpoint is concurrency-safe either way).
            path = resolve_model(self.entry, self.config)
            # Its word cache bounded: the server's memory would otherwise grow with every new
            # word of every prompt for the first ~10,000 words (tokenizer_cache.py).
            self._tokenizer = load_tokenizer(path)
            self.audio_input_rate = audio_input_rate(Path(path))


    async def wait_ready(self, timeout: float | None = None) -> None:
        """Wait until start() completed (for callers that run start() in the background)."""
        assert self._ready_event is not None, "start() was not called"
        await asyncio.wait_for(self._ready_event.wait(), timeout)

    async def close(self) -> None:
        """Fail what is in flight, stop every stage process (Shutdown, SIGTERM, SIGKILL), close
        the sockets. Idempotent."""
        if self._closed:
            return
        self._closing = True
        self.supervisor.begin_stop()
        for req in self._requests.all():
            self._fail(req, 503, "the server is shutting down", abort=False)
        alive = self.supervisor.alive()
        if alive and self._codec is not None:
            await asyncio.gather(
                *(self._send(name, Shutdown(reason="orchestrator closing"), timeout=0.5)
                  for name in alive),
                return_exceptions=True,
            )
        await asyncio.to_thread(self.supervisor.stop_processes, self._grace)
        await self.supervisor.close()
        if self._placement is not None:
            await asyncio.to_thread(self._leave_ray)
        for task in self._tasks + list(self._background):
            task.cancel()
        for task in self._tasks + list(self._background):
            with contextlib.suppress(BaseException):
                await task
        self._tasks.clear()
        for sender in self._senders.values():
            with contextlib.suppress(Exception):
                sender.close()
        if self._inbox is not None:
            with contextlib.suppress(Exception):
                self._inbox.close()
        if self._auth is not None:
            with contextlib.suppress(Exception):
                self._auth.stop()
        if self._ctx is not None:
            with contextlib.suppress(Exception):
                self._ctx.destroy(linger=0)
        if self._tmp_config:
            with contextlib.suppress(OSError):
                os.unlink(self._tmp_config)
        self._claims.release()
        self._closed = True

    def _leave_ray(self) -> None:
        from omni_cache.runtime import ray_placement

        self._placement.close()
        if self._ray_connected:
            ray_placement.disconnect()
            self._ray_connected = False

    def kill_all_sync(self, grace: float = 3.0) -> None:
        """Last resort when the event loop is gone (atexit, a crashed server): SIGTERM every stage
        process group, then SIGKILL after ``grace``."""
        self.supervisor.kill_all_sync(grace)
        if self._placement is not None:
            with contextlib.suppress(Exception):
                self._leave_ray()

    # ---- what the supervisor reports -------------------------------------------------------------

    def on_stage_down(self, stage: str, why: str) -> None:
        """A stage replica stopped serving: drop what was queued for it and fail what it was
        serving (the requests routed to the other replicas of its stage go on)."""
        replica = self._replicas[stage]
        self._reset_sender(stage)
        if replica.stage == self.entry.name:
            self.prefix_index.forget(replica.index)  # its cache died with it
        if replica.stage in self._affinity:
            self._affinity[replica.stage].forget(replica.index)
        hint = ("retry when it is back" if replica.stage in self._external
                else "it is being restarted, retry shortly")
        for req in self._requests.served_by(replica.stage, replica.index):
            if self._can_resume(req):
                self._resume(req, replica)
            else:
                self._fail(req, 503, f"stage {stage!r} {why} while serving this request; {hint}",
                           stage=replica.stage)

    def on_stage_up(self, stage: str) -> None:
        """A stage replica announced itself ready: the entry stage's context length is now its."""
        if self._replicas[stage].stage == self.entry.name:
            self._context_len = self.supervisor.stages[stage].max_model_len or self._context_len

    # ---- sockets ---------------------------------------------------------------------------------

    def _new_sender(self, name: str) -> Any:
        """The socket to replica ``name``."""
        from omni_cache.wire.transport import AsyncSender

        assert self._ctx is not None
        sender = AsyncSender(self._ctx, self._replicas[name].address, self._codec, auth=self._auth)
        if self._replicas[name].stage in self._external:
            self.supervisor.watch_connection(name, sender.socket)
        return sender

    def _reset_sender(self, name: str) -> None:
        """Drop whatever is queued for a dead stage (linger 0), so its next incarnation does not
        receive stale requests."""
        old = self._senders.get(name)
        self.supervisor.unwatch_connection(name)
        if old is not None:
            with contextlib.suppress(Exception):
                old.close()
        if not self._closing:
            self._senders[name] = self._new_sender(name)

    async def _send(self, stage: str, msg: msgspec.Struct, tensors: Mapping[str, Any] | None = None,
                    *, timeout: float | None = 5.0) -> bool:
        """Send to replica ``stage`` (a one-replica stage's name is its replica's)."""
        sender = self._senders.get(stage)
        if sender is None:
            return False
        try:
            await asyncio.wait_for(sender.send(msg, tensors), timeout)
            return True
        except (asyncio.TimeoutError, zmq.ZMQError) as e:
            logger.warning("could not send %s to stage %s: %s", type(msg).__name__, stage, e or "timeout")
            return False

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ---- tokenization ----------------------------------------------------------------------------

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    def tokenize_messages(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """Chat messages -> prompt token ids through the thinker's chat template (thread-safe)."""
        if self._tokenizer is None:
            raise RuntimeError("the tokenizer is not loaded yet (start() has not run)")
        with self._tok_lock:
            out = self._tokenizer.apply_chat_template(
                [dict(m) for m in messages], add_generation_prompt=True, tokenize=True
            )
        if hasattr(out, "keys") and "input_ids" in out:  # transformers 5 returns a BatchEncoding
            out = out["input_ids"]
        if hasattr(out, "tolist"):
            out = out.tolist()
        if out and isinstance(out[0], (list, tuple)):
            out = out[0]
        return [int(t) for t in out]

    def detokenize(self, token_ids: Sequence[int]) -> str:
        if self._tokenizer is None or not hasattr(self._tokenizer, "decode"):
            return ""
        with self._tok_lock:
            return str(self._tokenizer.decode(list(token_ids), skip_special_tokens=True))

    # ---- requests --------------------------------------------------------------------------------

    @property
    def max_model_len(self) -> int | None:
        """The entry stage's context length: from its StageReady, else its engine_args."""
        if self._context_len:
            return self._context_len
        ea = self.entry.engine_args
        return ea.max_model_len if ea is not None else None

    def default_sampling(self) -> Sampling:
        d = self.entry.sampling
        return Sampling(temperature=d.temperature, top_p=d.top_p, max_tokens=d.max_tokens, seed=d.seed)

    def participants(self, modalities: Iterable[str]) -> tuple[str, ...]:
        names = {self.entry.name}
        if "audio" in modalities:
            names |= self._downstream_of_entry
        return tuple(n for n in self.stage_names if n in names)

    def _reachable_from(self, name: str) -> set[str]:
        seen: set[str] = set()
        todo = [name]
        while todo:
            for d in self.config.downstream(todo.pop()):
                if d.name not in seen:
                    seen.add(d.name)
                    todo.append(d.name)
        return seen

    async def submit(
        self,
        prompt_token_ids: Sequence[int],
        *,
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        modalities: Iterable[str] = ("text",),
        media: Sequence[MediaItem] = (),
        return_latents: bool = False,
        timeout_s: float | None = None,
        received_at: float | None = None,
        stream: bool = False,
    ) -> RequestHandle:
        """Accept a request and send it to the entry stage.

        ``media``: decoded images and clips (:mod:`omni_cache.serving.media`) for the prompt's
        placeholders, in order. The entry stage's vLLM processor expands the placeholders, so the
        context-length check here counts the prompt before expansion; the stage refuses (400) a
        prompt whose expansion does not fit.

        ``received_at`` (``time.monotonic()``) is when the request arrived, for the latency
        histograms (default: now); the deadline counts from it too.

        Raises :class:`RequestError` when it is refused up front: 400 (empty or over-long prompt,
        audio from a pipeline without an audio stage), 503 (a stage it needs is not up, shutting
        down). Otherwise the returned handle gets exactly one terminal event.
        """
        checked = self._check_request(
            prompt_token_ids, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
            seed=seed, modalities=modalities,
        )
        checked.media = tuple(media)
        checked.stream = bool(stream)  # ``stream``: the client streams (Submit.stream)
        return await self._send_request(checked, return_latents=return_latents,
                                        timeout_s=timeout_s, received_at=received_at)

    # ---- submit(): the checks --------------------------------------------------------------------

    def _check_request(self, prompt_token_ids: Sequence[int], *, max_tokens: int | None,
                       temperature: float | None, top_p: float | None, seed: int | None,
                       modalities: Iterable[str]) -> _CheckedRequest:
        """Everything that can refuse a request up front, in the order the client learns of it."""
        if self._closing or self._closed:
            raise RequestError(503, "the server is shutting down")
        mods = self._check_modalities(modalities)
        ids = self._check_prompt(prompt_token_ids)
        sampling = self._sampling(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed)
        self._check_context_length(len(ids), sampling.max_tokens)
        participants = self.participants(mods)
        self._check_available(participants)
        return _CheckedRequest(ids, mods, sampling, participants)

    def _check_modalities(self, modalities: Iterable[str]) -> tuple[str, ...]:
        mods = tuple(dict.fromkeys(["text", *[str(m) for m in modalities]]))
        bad = [m for m in mods if m not in ("text", "audio")]
        if bad:
            raise RequestError(400, f"unknown modality {bad[0]!r} (supported: 'text', 'audio')")
        if "audio" in mods and self.audio_stage is None:
            raise RequestError(400, f"pipeline {self.config.name!r} has no audio output stage")
        return mods

    @staticmethod
    def _check_prompt(prompt_token_ids: Sequence[int]) -> list[int]:
        ids = list(prompt_token_ids)
        if not ids:
            raise RequestError(400, "the prompt is empty")
        if not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) and t >= 0 for t in ids):
            raise RequestError(400, "prompt token ids must be non-negative integers")
        return [int(t) for t in ids]

    def _sampling(self, *, max_tokens: int | None, temperature: float | None, top_p: float | None,
                  seed: int | None) -> Sampling:
        """The entry stage's defaults with the request's overrides."""
        sampling = self.default_sampling()
        if max_tokens is not None:
            sampling.max_tokens = int(max_tokens)
        if temperature is not None:
            sampling.temperature = float(temperature)
        if top_p is not None:
            sampling.top_p = float(top_p)
        if seed is not None:
            sampling.seed = int(seed)
        if sampling.max_tokens < 1:
            raise RequestError(400, f"max_tokens must be at least 1, got {sampling.max_tokens}")
        return sampling

    def _check_context_length(self, n_prompt: int, max_tokens: int) -> None:
        limit = self.max_model_len
        if limit and n_prompt + max_tokens > limit:
            raise RequestError(
                400,
                f"this model's maximum context length is {limit} tokens; the prompt has {n_prompt} "
                f"tokens and max_tokens is {max_tokens} ({n_prompt + max_tokens} "
                "in total): shorten the prompt or lower max_tokens",
            )

    def _check_available(self, participants: Sequence[str]) -> None:
        if not self._started:
            raise RequestError(503, "the pipeline is still starting: "
                               + ", ".join(f"{n} ({r})" for n, r in self.not_ready().items()))
        down = [n for n in participants if not self.supervisor.is_up(n)]
        if down:
            reasons = self.not_ready()
            raise RequestError(
                503, "stage(s) not available: " + ", ".join(f"{n} ({reasons.get(n, 'down')})" for n in down)
                + "; retry shortly", stage=down[0]
            )

    # ---- submit(): sending -----------------------------------------------------------------------

    async def _send_request(self, checked: _CheckedRequest, *, return_latents: bool,
                            timeout_s: float | None, received_at: float | None) -> RequestHandle:
        """Record the request (its deadline starts) and hand it to the entry stage."""
        timeout = float(timeout_s or self.config.server.request_timeout_s)
        now = time.monotonic() if received_at is None else min(received_at, time.monotonic())
        req = Request(
            request_id=uuid.uuid4().hex,
            prompt_token_ids=checked.prompt_token_ids,
            modalities=checked.modalities,
            participants=checked.participants,
            t0=now,
            deadline=now + timeout,
            timeout_s=timeout,
            return_latents=return_latents,
        )
        self._assign_route(req, checked.prompt_token_ids, has_media=bool(checked.media))
        entry = self._replica_names[(self.entry.name, req.route[self.entry.name])]
        msg = Submit(
            request_id=req.request_id,
            prompt_token_ids=checked.prompt_token_ids,
            sampling=checked.sampling,
            modalities=list(checked.modalities),
            return_latents=return_latents,
            deadline=time.time() + timeout,
            media=[MediaRef(kind=m.kind, tensor=f"media.{i}", sample_rate=m.sample_rate,
                            uuid=m.digest)
                   for i, m in enumerate(checked.media)],
            route=dict(req.route),
            stream=checked.stream,
        )
        from omni_cache.wire.transport import MessageTooLarge

        tensors = {}
        if checked.media:
            import torch

            # Decoded media are shared read-only arrays (serving/media.py's DecodedCache); these
            # tensors are only read (sent as frames), so torch's warning about a non-writable
            # array does not apply, and it would otherwise land in the server log once.
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
                tensors = {f"media.{i}": torch.from_numpy(m.array) for i, m in enumerate(checked.media)}
        req.submit, req.media = msg, tensors
        self._requests.add(req)
        try:
            sent = await self._send(entry, msg, tensors, timeout=min(timeout, 10.0))
        except MessageTooLarge as e:
            self._fail(req, 400, f"the request is too large to send to stage {self.entry.name!r} "
                                 f"({e}); send less media or raise server.max_message_bytes",
                       stage=self.entry.name)
            return RequestHandle(self, req)
        except Exception as e:  # noqa: BLE001
            sent = False
            logger.warning("request %s: could not submit: %s", req.request_id, e)
        if not sent:
            self._fail(req, 503, f"could not hand the request to stage {self.entry.name!r}",
                       stage=self.entry.name)
        return RequestHandle(self, req)

    def _assign_route(self, req: Request, prompt: Sequence[int], *, has_media: bool) -> None:
        """Route ``req``, whose entry stage is sent ``prompt``: its replicas, the prefill it queues
        on its entry replica, and the prompt's block hashes (prefix routing; none with media)."""
        hashed = None if has_media else prompt
        chains = self._prompt_chains(hashed)
        req.route, req.prefill_backlog = self._route(req.participants, len(prompt), chains, hashed)
        req.block_hashes = chains

    def _route(self, participants: Sequence[str], prompt_tokens: int,
               chains: dict[int, list[int]], prompt: Sequence[int] | None = None
               ) -> tuple[dict[str, int], int]:
        """A replica of every participant (among those up: _check_available saw one of each),
        and the prompt tokens the chosen entry replica is expected to compute (its prefill
        backlog while the request waits there). ``chains``: the prompt's block hashes per block
        size (empty: a prompt with media, or no prefix routing); ``prompt``: its token ids (None:
        it has media), for the later stages that follow a prefix (omni_cache.runtime.affinity)."""
        route: dict[str, int] = {}
        uncached = prompt_tokens
        for stage in participants:
            up = self.supervisor.up_replicas(stage)
            load = self._requests.load(stage)
            affinity = self._affinity.get(stage)
            if affinity is not None and prompt is not None:
                chain = prompt_block_hashes(prompt, AFFINITY_BLOCK_SIZE, None)
                route[stage] = self.router.follow(stage, up, load, affinity.lookup(chain, up))
                affinity.record(chain, route[stage])
                continue
            if stage != self.entry.name or not self._prefix_routing:
                route[stage] = self.router.pick(stage, up, load)
                continue
            matched, sizes = self._matched_blocks(up, chains)
            backlog = self._prefill_backlog()
            # One block size per pipeline in practice (the replicas are identical); a replica
            # that reported none holds nothing known and has matched 0.
            size = max(sizes.values(), default=0)
            route[stage] = choice = self.router.pick(stage, up, load, matched if chains else None,
                                                     backlog=backlog, prompt_tokens=prompt_tokens,
                                                     block_size=size)
            uncached = max(1, prompt_tokens - matched.get(choice, 0) * sizes.get(choice, 0))
        return route, uncached

    def _prompt_chains(self, prompt: Sequence[int] | None) -> dict[int, list[int]]:
        """block size -> the hashes of ``prompt``'s full blocks, for every block size an entry
        replica reported (prefix routing, prompts without media)."""
        if not self._prefix_routing or prompt is None:
            return {}
        seed = self.entry.env.get("PYTHONHASHSEED", os.environ.get("PYTHONHASHSEED"))
        return {size: prompt_block_hashes(prompt, size, seed)
                for size in set(self.prefix_index.block_size.values())}

    def _matched_blocks(self, up: Sequence[int], chains: Mapping[int, list[int]]
                        ) -> tuple[dict[int, int], dict[int, int]]:
        """(entry replica -> leading blocks of the prompt it holds, replica -> its block size).

        Held is what the replica reported (the prefix index) and also what the requests in
        flight there are computing: vLLM caches a prompt's full blocks when it schedules them and
        cannot evict them while their request runs, so a request routed there now hits them (in
        the same step, even), though the replica reports them only after its step. Without this,
        a tenant's second request that arrives during its first one's prefill would see nothing
        held and be sent away, copying the prefix into the other replica's pool as well."""
        matched: dict[int, int] = {}
        sizes: dict[int, int] = {}
        running = self._requests.served_by(self.entry.name)
        for replica in up:
            size = self.prefix_index.block_size.get(replica)
            chain = chains.get(size or 0)
            if not size or chain is None:
                continue
            sizes[replica] = size
            n = self.prefix_index.matched_blocks(replica, chain)
            for r in running:
                if r.route.get(self.entry.name, 0) == replica and n < len(chain):
                    n = max(n, _common_prefix(chain, r.block_hashes.get(size, ())))
            matched[replica] = n
        return matched, sizes

    def _prefill_backlog(self) -> dict[int, int]:
        """entry replica -> the prompt tokens queued there: what its requests in flight that have
        not produced their first output found uncached when they were routed."""
        out: dict[int, int] = {}
        for r in self._requests.served_by(self.entry.name):
            if r.prefill_backlog:
                i = r.route.get(self.entry.name, 0)
                out[i] = out.get(i, 0) + r.prefill_backlog
        return out

    # ---- a replica died: the requests it served go on elsewhere (omni_cache.runtime.resume) ----

    def _can_resume(self, req: Request) -> bool:
        """Whether ``req`` can start again on live replicas: every stage it needs has one up (the
        dead replica is already down) and it has attempts left."""
        return (req.submit is not None and req.attempt + 1 < MAX_ATTEMPTS and not self._closing
                and all(self.supervisor.up_replicas(s) for s in req.participants))

    def _resume(self, req: Request, dead: Replica) -> None:
        """Start ``req`` again as a new attempt, routed among the replicas that are up, from where
        its client is; the old attempt ends on the live replicas that still run it."""
        old = req.wire_id
        for name in req.participants:
            sp = self.supervisor.stages.get(self._serving(req, name))
            if name not in req.finished and sp is not None and sp.up:
                self._spawn(self._send(sp.name, Abort(request_id=old), timeout=1.0))
        text_from_entry = self.text_stage.name == self.entry.name
        entry_out = req.finished.get(self.entry.name)
        answer_finished = (entry_out.finish_reason or "stop") if entry_out is not None else None
        req.attempt += 1
        self._requests.rekey(req, old)
        req.finished.clear()
        req.latents.clear()  # the new attempt sends every row and code from the start
        req.skip_tokens = len(req.answer_tokens)
        req.skip_samples = req.audio_samples
        if req.resumed_text is None:
            req.resumed_text = ResumedText(self.detokenize, req.answer_tokens[req.text_tokens:])
        self._assign_route(req, resumed_prompt(req, text_from_entry), has_media=bool(req.media))
        msg = resumed_submit(req, text_from_entry=text_from_entry, answer_finished=answer_finished)
        self.metrics.request_resumed(dead.stage, dead.index)
        logger.warning("request %s: %s died while serving it; resumed as %s on %s after %d "
                       "token(s) and %d audio sample(s) its client has", req.request_id, dead.name,
                       req.wire_id, self._serving(req, self.entry.name), len(req.answer_tokens),
                       req.audio_samples)
        self._spawn(self._resubmit(req, msg))

    async def _resubmit(self, req: Request, msg: Submit) -> None:
        entry = self._serving(req, self.entry.name)
        try:
            sent = await self._send(entry, msg, req.media, timeout=10.0)
        except Exception as e:  # noqa: BLE001
            logger.warning("request %s: could not resume: %s", req.request_id, e)
            sent = False
        if not sent and not req.done and req.wire_id == msg.request_id:
            self._fail(req, 503, f"could not hand the resumed request to stage {entry!r}",
                       stage=self.entry.name)

    def _serving(self, req: Request, stage: str) -> str:
        """The name of the replica of ``stage`` that serves ``req``."""
        return self._replica_names[(stage, req.route.get(stage, 0))]

    # ---- request outcomes ------------------------------------------------------------------------

    def abort(self, request_id: str, reason: str = "aborted") -> None:
        """Drop a request (client went away): fail its handle (499) and tell its stages."""
        req = self._requests.find(request_id)
        if req is not None:
            self._fail(req, STATUS_CLIENT_CLOSED, reason, count=False)

    def abort_threadsafe(self, request_id: str, reason: str = "aborted") -> None:
        """`abort` from any thread (e.g. an application holding a ServerThread): scheduled on
        the orchestrator's loop. Unknown or finished requests are ignored."""
        if self._loop is None:
            raise RuntimeError("the orchestrator is not started")
        self._loop.call_soon_threadsafe(self.abort, request_id, reason)

    @property
    def in_flight(self) -> int:
        return len(self._requests)

    async def _deadline_loop(self) -> None:
        while True:
            await asyncio.sleep(DEADLINE_CHECK_INTERVAL_S)
            now = time.monotonic()
            try:
                self._fail_expired(now)
            except Exception:  # noqa: BLE001
                logger.exception("orchestrator: deadline check failed")
            self.heap.maybe_trim(now)

    def _fail_expired(self, now: float) -> None:
        for req in self._requests.expired(now):
            waiting = req.waiting_for()
            self._fail(
                req, 504,
                f"request timed out after {req.timeout_s:g} s (server.request_timeout_s); "
                f"still waiting for stage(s): {', '.join(waiting)}",
                stage=waiting[0] if waiting else None,
            )

    def _fail(self, req: Request, status: int, message: str, *, stage: str | None = None,
              abort: bool = True, count: bool = True) -> None:
        if req.done:
            return
        req.done = True
        self._requests.answered(req)
        req.queue.put_nowait(Failed(RequestError(status, message, stage=stage, request_id=req.request_id)))
        if count:
            self.metrics.request_done(status)
            if stage is not None:
                self.metrics.stage_failed_request(stage)
        if abort and not self._closing:
            for name in req.participants:
                replica = self.supervisor.stages.get(self._serving(req, name))
                if name != stage and name not in req.finished and replica is not None and replica.up:
                    self._spawn(self._send(replica.name, Abort(request_id=req.wire_id),
                                           timeout=1.0))
        logger.info("request %s failed (%d): %s", req.request_id, status, message)

    def _complete(self, req: Request) -> None:
        req.done = True
        self._requests.answered(req)
        text_out = req.finished.get(self.text_stage.name) or req.finished.get(self.entry.name)
        entry_out = req.finished.get(self.entry.name)
        latents: dict[str, Any] = {}
        if req.latents:
            import torch

            for name, parts in req.latents.items():
                parts.sort(key=lambda p: p[0])
                # Codes frames are [num_code_groups, k]: steps run along the last dimension.
                dim = -1 if name.endswith("." + CODES_FRAME) else 0
                latents[name] = parts[0][1] if len(parts) == 1 else torch.cat([p[1] for p in parts], dim=dim)
        req.queue.put_nowait(Completed(
            finish_reason=(text_out.finish_reason if text_out else None) or "stop",
            num_prompt_tokens=(entry_out.num_prompt_tokens if entry_out else 0) or len(req.prompt_token_ids),
            cached_tokens={n: m.num_cached_tokens for n, m in req.finished.items()},
            latents=latents,
        ))
        self.metrics.request_done(None)

    # ---- receiving -------------------------------------------------------------------------------

    async def _recv_loop(self) -> None:
        while True:
            try:
                item = await self._inbox.recv()
            except asyncio.CancelledError:
                raise
            except zmq.ZMQError as e:
                if self._closing:
                    return
                logger.warning("orchestrator inbox: %s", e)
                await asyncio.sleep(0.05)
                continue
            if item is None:
                continue
            msg, tensors = item
            try:
                self._dispatch(msg, tensors)
            except Exception:  # noqa: BLE001 -- one bad message must not stop the loop
                logger.exception("orchestrator: error handling %s", type(msg).__name__)

    def _dispatch(self, msg: Any, tensors: dict[str, Any]) -> None:
        if isinstance(msg, (StageOutput, StageError, StageStats)):
            self.supervisor.heard_from(msg.stage)  # any message says the stage is alive, not only beats
        if isinstance(msg, StageOutput):
            self._on_output(msg, tensors)
        elif isinstance(msg, StageError):
            self._on_error(msg)
        elif isinstance(msg, StageReady):
            self.supervisor.on_announcement(msg)
        elif isinstance(msg, BlockEvents):
            self._on_block_events(msg)
        elif isinstance(msg, StageStats):
            name = self._replica_names.get((msg.stage, msg.replica))
            if name is None:
                logger.warning("stats from unknown stage %r replica %d, ignored", msg.stage, msg.replica)
                return
            self._stats[name] = dict(msg.counters)
            self._stats_time[name] = time.monotonic()
            for ev in self._stats_waiters:
                ev.set()
        else:
            logger.warning("orchestrator: unexpected %s message, ignored", type(msg).__name__)

    def _on_output(self, msg: StageOutput, tensors: dict[str, Any]) -> None:
        req = self._requests.get(msg.request_id)
        if req is None:
            if not self._requests.recently_answered(msg.request_id) and msg.stage in self._stage_cfg:
                # A request this orchestrator does not know (e.g. queued before a restart); the
                # output does not say which replica sent it: every replica of the stage forgets it.
                self._requests.remember(msg.request_id)
                for sp in self.supervisor.replicas_of(msg.stage):
                    self._spawn(self._send(sp.name, Abort(request_id=msg.request_id), timeout=1.0))
            return
        stage = self._stage_cfg.get(msg.stage)
        if stage is None:
            logger.warning("request %s: output from unknown stage %r, ignored", msg.request_id, msg.stage)
            return
        if msg.sample_rate and not MIN_SAMPLE_RATE <= msg.sample_rate <= MAX_SAMPLE_RATE:
            # Resampling audio at a peer's rate of 1 Hz to 24 kHz would allocate 24,000 samples
            # per sample it sent; a rate like that is a broken or hostile stage.
            self._fail(req, 500, f"stage {msg.stage!r} sent audio at {msg.sample_rate} Hz "
                       f"(accepted: {MIN_SAMPLE_RATE}..{MAX_SAMPLE_RATE})", stage=msg.stage)
            return
        now = time.monotonic()
        if stage.name == self.entry.name:
            req.prefill_backlog = 0  # its prefill is done: no longer queued work there
        # A resumed attempt sends again what its client has (omni_cache.runtime.resume).
        token_ids = new_tokens(req, msg.token_ids) if stage.final_output == "text" else []
        text = msg.text if req.resumed_text is None else req.resumed_text.add(token_ids)
        if text:
            req.text_tokens = len(req.answer_tokens)
        if token_ids or (stage.final_output == "text" and text):
            if not req.got_token:
                req.got_token = True
                self.metrics.observe(TTFT, stage.name, now - req.t0)
            req.queue.put_nowait(TextDelta(text, token_ids))
        if stage.final_output == "audio":
            audio = tensors.get("audio")
            if audio is not None and audio.numel() > 0:
                if not req.got_audio:
                    req.got_audio = True
                    self.metrics.observe(TTFA, stage.name, now - req.t0)
                import torch

                samples = new_samples(req, audio.detach().to(torch.float32).reshape(-1).numpy())
                rate = msg.sample_rate or self.audio_sample_rate
                self.audio_sample_rate = rate
                if len(samples):
                    req.queue.put_nowait(AudioDelta(np.array(samples, copy=True), rate))
        if req.return_latents and stage.is_autoregressive:
            # The entry stage's latents by their own names, a later stage's as "<stage>.<name>"
            # (e.g. "talker.codes").
            prefix = "" if stage.name == self.entry.name else f"{stage.name}."
            for name, t in tensors.items():
                if name != "audio":
                    req.latents.setdefault(prefix + name, []).append((msg.latent_start, t.clone()))
        if msg.finished:
            if stage.name not in req.finished:
                self.metrics.observe(STAGE_DONE, stage.name, now - req.t0)
            req.finished[stage.name] = msg
            if all(p in req.finished for p in req.participants):
                self._complete(req)

    def _on_block_events(self, msg: BlockEvents) -> None:
        sp = self.supervisor.replica(msg.stage, msg.replica)
        if msg.stage != self.entry.name or sp is None or not sp.up:
            return  # a replica that is down holds nothing (a late report from its old process)
        self.prefix_index.apply(msg.replica, msg.stored, msg.removed, cleared=msg.cleared,
                                block_size=msg.block_size)

    def _on_error(self, msg: StageError) -> None:
        req = self._requests.get(msg.request_id)
        if req is None:
            logger.info("stage %s: error for unknown request %s: %s", msg.stage, msg.request_id, msg.message)
            return
        status = msg.status if 400 <= msg.status <= 599 else 500
        self._fail(req, status, f"stage {msg.stage!r}: {msg.message}", stage=msg.stage)

    # ---- status ----------------------------------------------------------------------------------

    def not_ready(self) -> dict[str, str]:
        """stage -> why it is not serving: once started, the stages none of whose replicas is up;
        while starting, also those with a replica not up yet (the server takes requests once
        every replica was ready). A stage with several replicas: each one's reason that is down,
        ``thinker#1: starting; ...``."""
        out: dict[str, str] = {}
        for name in self.stage_names:
            replicas = self.supervisor.replicas_of(name)
            down = [sp for sp in replicas if not sp.up]
            if not replicas:
                out[name] = "not started"
            elif len(down) == len(replicas) or (down and not self._started):
                out[name] = (down[0].why_down() if len(replicas) == 1
                             else "; ".join(f"{sp.name}: {sp.why_down()}" for sp in down))
            elif name == self.entry.name and not self._started:
                # Stages started elsewhere can be up before the server loaded its tokenizer.
                out[name] = "up; the server is still starting (loading the tokenizer)"
        return out

    def replicas_not_ready(self) -> dict[str, str]:
        """replica name -> why it is not serving, for every replica that is not up, also where
        another replica of its stage serves."""
        return {sp.name: sp.why_down() for sp in self.supervisor.stages.values() if not sp.up}

    def stage_pids(self) -> dict[str, int | None]:
        """replica name (a one-replica stage's: the stage's name) -> pid of its running process
        (None while it is down)."""
        return self.supervisor.pids()

    async def stage_stats(self, timeout: float = STATS_TIMEOUT_S) -> dict[str, StageSnapshot]:
        """Ask every up replica for its counters; replicas that do not answer within ``timeout``
        keep their last known values (``fresh=False``). Keyed by replica name (a one-replica
        stage's: the stage's name)."""
        t0 = time.monotonic()
        targets = [sp.name for sp in self.supervisor.stages.values() if sp.up]
        ev = asyncio.Event()
        self._stats_waiters.add(ev)
        try:
            await asyncio.gather(*(self._send(n, StatsQuery(), timeout=0.2) for n in targets))
            deadline = t0 + timeout
            while any(self._stats_time.get(n, -1.0) < t0 for n in targets):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                ev.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(ev.wait(), remaining)
        finally:
            self._stats_waiters.discard(ev)
        snap = {}
        for n, replica in self._replicas.items():
            sp = self.supervisor.stages.get(n)
            snap[n] = StageSnapshot(
                up=bool(sp and sp.up),
                restarts=sp.restarts if sp else 0,
                counters=dict(self._stats.get(n, {})),
                fresh=self._stats_time.get(n, -1.0) >= t0,
                stage=replica.stage,
                replica=replica.index,
            )
        return snap

    async def render_metrics(self) -> str:
        """The Prometheus text of ``GET /metrics``."""
        return self.metrics.render(await self.stage_stats(), self.in_flight,
                                   routing=self._routing_snapshot(),
                                   heap=self.heap.counters())

    def _routing_snapshot(self) -> RoutingSnapshot:
        several = [s for s in self.config.stages if s.replicas > 1]
        in_flight = {}
        for stage in several:
            load = self._requests.load(stage.name)
            in_flight.update({(stage.name, i): load.get(i, 0) for i in range(stage.replicas)})
        blocks = ({(self.entry.name, i): self.prefix_index.blocks(i)
                   for i in range(self.entry.replicas)} if self._prefix_routing else {})
        return RoutingSnapshot(decisions=dict(self.router.decisions), in_flight=in_flight,
                               prefix_blocks=blocks)
