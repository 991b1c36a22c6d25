"""The orchestrator: one pipeline's requests, from acceptance to their one terminal event.

One :class:`Orchestrator` runs in one asyncio event loop (uvicorn's for ``omni-serve``, a background
thread's for :class:`omni_cache.pipeline.Pipeline`). It coordinates parts it owns, each with its own
state and module, as vLLM's engine client owns its engine processes:

* ``fleet`` (:mod:`~omni_cache.runtime.supervision.stage_fleet`): the stage replicas: where they run, the one
  config they start with, their processes (the supervisor reports one going down or up:
  :meth:`Orchestrator.on_stage_down` / :meth:`Orchestrator.on_stage_up`), the sockets to them;
* ``codec`` (:mod:`~omni_cache.runtime.request_path.text_codec`): the thinker's tokenizer;
* ``admission`` (:mod:`~omni_cache.runtime.request_path.admission`): the checks that refuse a request up front;
* ``routes`` (:mod:`~omni_cache.runtime.routing.route_planner`): one replica of every stage a request
  passes, from what the replicas hold and are busy with (``server.routing``);
* the in-flight requests (:mod:`~omni_cache.runtime.request_path.requests`): the only copy of each, its
  deadline and route; a request whose replica died starts again on live replicas from where its
  client is (:mod:`~omni_cache.runtime.request_path.resume`);
* ``outputs`` (:mod:`~omni_cache.runtime.request_path.output_assembly`): the stages' outputs turned into the
  client's events; ``metrics`` and the stages' counters (:mod:`~omni_cache.runtime.supervision.stats`);
* ``ends`` (:mod:`~omni_cache.runtime.request_path.request_ends`): every request's end, exactly one terminal
  event on its :class:`~omni_cache.runtime.request_path.results.RequestHandle`, ``Completed`` (every stage it
  needs finished) or ``Failed`` (stage died -> 503, stage error -> its status, a failure handling
  its output -> 500, deadline -> 504, shutdown -> 503);
* ``inbox`` (:mod:`~omni_cache.runtime.stage_messages`): the dispatch of what the stages send;
* ``losses`` (:mod:`~omni_cache.runtime.replica_loss`): a replica down, its requests resumed or failed.

What stays here is coordination: start and close, a request's intake and its hand-off to the entry
stage, aborts, the deadline loop, and what the rest of the server reads.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from omni_cache.config import PipelineConfig, resolve_model
from omni_cache.config.addresses import new_run_dir, with_default_addresses
from omni_cache.config.overrides import with_overrides
from omni_cache.config.stage_exposure import exposed_sockets
from omni_cache.heap_trim import HeapTrimmer
from omni_cache.models.preprocessor import (
    DEFAULT_AUDIO_INPUT_RATE,
    QWEN2_VL,
    audio_input_rate,
    audio_pieces,
    video_sampler,
)
from omni_cache.models.voices import DEFAULT_VOICE, checkpoint_voices
from omni_cache.runtime.metrics.loop_lag import watch_loop_lag
from omni_cache.runtime.metrics.prometheus import OrchestratorMetrics, StageSnapshot
from omni_cache.runtime.replica_loss import ReplicaLoss
from omni_cache.runtime.request_path.admission import CLOSED, OPEN, Admission, Ticket
from omni_cache.runtime.request_path.output_assembly import OutputAssembler
from omni_cache.runtime.request_path.request_ends import RequestEnds
from omni_cache.runtime.request_path.requests import (
    Request,
    RequestTable,
    media_frames,
    new_request,
    submit_message,
    with_time_left,
)
from omni_cache.runtime.request_path.results import RequestHandle
from omni_cache.runtime.request_path.text_codec import TextCodec
from omni_cache.runtime.request_path.topology import Topology
from omni_cache.runtime.routing.route_planner import RoutePlanner
from omni_cache.runtime.stage_messages import StageMessages
from omni_cache.runtime.supervision.placement import external_stages_of
from omni_cache.runtime.supervision.stage_fleet import StageFleet
from omni_cache.runtime.supervision.stats import StageStatsBoard
from omni_cache.runtime.supervision.supervisor import DEFAULT_START_TIMEOUT_S, SHUTDOWN_GRACE_S
from omni_cache.tasks import cancel_and_wait
from omni_cache.timeline import Timeline
from omni_cache.wire.messages import Submit
from omni_cache.wire.sampling import EngineSampling
from omni_cache.wire.transport import MessageTooLarge

if TYPE_CHECKING:  # used in annotations only
    from omni_cache.runtime.request_path.requests import MediaItem

logger = logging.getLogger(__name__)

__all__ = ["Orchestrator"]

#: How long a /metrics scrape waits for the stages' StageStats.
STATS_TIMEOUT_S = 1.0
#: Status of a request the client abandoned (nginx's "client closed request").
STATUS_CLIENT_CLOSED = 499
#: How often the in-flight requests' deadlines are checked.
DEADLINE_CHECK_INTERVAL_S = 0.1


class Orchestrator:
    """Runs a pipeline's stage processes and routes requests through them (one asyncio loop).

    ``config`` is copied, never changed: ``checkpoint_dir`` / ``prefix_cache=False`` apply to the copy, and the
    addresses it leaves unset are sockets in a directory of this server's (:mod:`omni_cache.config.addresses`);
    every stage process is started with that copy (:mod:`omni_cache.runtime.supervision.placement`).
    ``tokenizer``: anything with ``apply_chat_template`` (default: the entry stage's). ``stage_argv``: the
    command of a stage process before its arguments (default ``[python, -m, workers]``). ``external_stages``:
    stages started by hand elsewhere, added to those the config marks ``external`` (not spawned; watched through
    their announcements and connections). ``control_addr``: the inbox's address (default:
    ``server.control_address``, else a socket in this server's directory). ``stage_forkers``: the caller's (it
    closes them): omni-serve's, started as it loaded (:mod:`~omni_cache.runtime.supervision.stage_forker`)."""

    def __init__(
        self,
        config: PipelineConfig,
        *,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        prefix_cache: bool = True,
        tokenizer: Any = None,
        stage_argv: Sequence[str] | None = None,
        external_stages: Iterable[str] = (),
        start_timeout_s: float | None = None,
        echo_stage_logs: bool = True,
        control_addr: str | None = None,
        shutdown_grace_s: float = SHUTDOWN_GRACE_S,
        manage_heap: bool = False,
        stage_forkers: Any = None,
    ) -> None:
        # Stages started by hand need the addresses the config spells out: checked before the server picks the rest.
        external = external_stages_of(config, external_stages)
        run_dir = new_run_dir(config)
        self.config = config = with_default_addresses(
            with_overrides(config, checkpoint_dir=checkpoint_dir, prefix_cache=prefix_cache), run_dir
        )
        self.topology = topology = Topology.of(config)
        self.served_model_name = config.server.served_model_name or config.name
        self.fleet = StageFleet(
            config,
            self,
            run_dir=run_dir,
            stage_argv=stage_argv,
            external=external,
            control_addr=control_addr,
            echo_stage_logs=echo_stage_logs,
            start_timeout_s=(DEFAULT_START_TIMEOUT_S if start_timeout_s is None else float(start_timeout_s)),
            shutdown_grace_s=shutdown_grace_s,
            forkers=stage_forkers,
        )
        #: The stage processes (read only: the fleet's).
        self.supervisor = self.fleet.supervisor
        self.codec = TextCodec(tokenizer)
        #: The rate the entry model's audio inputs are resampled to (its feature extractor's).
        self.audio_input_rate = DEFAULT_AUDIO_INPUT_RATE
        #: The entry model's audio encoder window (samples) and placeholder id: realtime turns are cut so.
        self.audio_window_samples: int | None = None
        self.audio_placeholder_id: int | None = None
        self.video_sampler = QWEN2_VL  # vLLM's video loader for the entry model (set at start)
        self.voices: tuple[str, ...] = (DEFAULT_VOICE,)  # the entry checkpoint's speakers (set at start)
        self.admission = Admission(config, topology, self.supervisor)
        #: The requests in flight (the only copy of each).
        self.requests = RequestTable()
        self.routes = RoutePlanner(config, topology, self.supervisor, self.requests)
        self.metrics = OrchestratorMetrics(topology.stage_names)
        self.timeline = Timeline("server")  # omni_cache/timeline.py: off unless OMNI_CACHE_TIMELINE_DIR is set
        self.outputs = OutputAssembler(topology, self.metrics, self.timeline)
        self._stats = StageStatsBoard()
        self.ends = RequestEnds(
            self.requests,
            fleet=self.fleet,
            admission=self.admission,
            outputs=self.outputs,
            metrics=self.metrics,
            spawn=self._spawn,
        )
        self.inbox = StageMessages(
            config,
            topology,
            fleet=self.fleet,
            requests=self.requests,
            routes=self.routes,
            outputs=self.outputs,
            metrics=self.metrics,
            stats=self._stats,
            ends=self.ends,
            spawn=self._spawn,
        )
        self.losses = ReplicaLoss(
            topology,
            fleet=self.fleet,
            requests=self.requests,
            routes=self.routes,
            admission=self.admission,
            codec=self.codec,
            metrics=self.metrics,
            ends=self.ends,
            hand_to_entry=self._hand_to_entry,
            spawn=self._spawn,
        )
        # The server's own heap (omni_cache/heap_trim.py, trimmed from the deadline loop): only a process of
        # its own (omni-serve: manage_heap); a caller's (the Python API, a notebook's) keeps its allocator.
        self.heap = HeapTrimmer(manage=manage_heap)
        self._tasks: list[asyncio.Task] = []
        self._background: set[asyncio.Task] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready_event: asyncio.Event | None = None
        self._started = False
        self._closed = False

    # ---- what the rest of the server reads -------------------------------------------------------

    @property
    def audio_sample_rate(self) -> int:
        """The audio stage's output rate (its last audio's)."""
        return self.outputs.audio_sample_rate

    @property
    def started(self) -> bool:
        """Whether start() completed (every stage was ready once)."""
        return self._started

    def tokenize_messages(self, messages: Sequence[Mapping[str, Any]], **template: Any) -> list[int]:
        """Chat messages -> prompt token ids through the thinker's chat template (thread-safe); a text
        too long for the context is refused untokenized (omni_cache/runtime/request_path/text_codec.py)."""
        return self.codec.tokenize_messages(messages, max_tokens=self.admission.max_model_len, **template)

    def detokenize(self, token_ids: Sequence[int]) -> str:
        return self.codec.detokenize(token_ids)

    @property
    def in_flight(self) -> int:
        return len(self.requests)

    # ---- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        """Bind the inbox, start the stage processes and wait until every stage is ready.

        Raises :class:`StageStartError` naming the stage that did not come up (its exit code and
        the end of its output); everything started is stopped again in that case.
        """
        if self._loop is not None:
            raise RuntimeError("Orchestrator.start() called twice")
        self._loop = asyncio.get_running_loop()
        self._ready_event = asyncio.Event()
        _warn_unauthenticated(self.config)
        try:
            await self.fleet.bind()
            for name, coro in [
                ("recv", self.fleet.receive(self.on_message)),
                ("deadlines", self._deadline_loop()),
                ("loop-lag", watch_loop_lag(self.metrics.loop_lag.observe)),
            ]:
                self._tasks.append(asyncio.create_task(coro, name=f"omni-cache-{name}"))
            await self.fleet.launch(self.topology.entry.name, self._load_entry_model)
            self.admission.state = OPEN
            self._started = True
            self._ready_event.set()
            logger.info("pipeline %s: all stages ready (%s)", self.config.name, ", ".join(self.topology.stage_names))
        except BaseException:
            await self.close()
            raise

    def _load_entry_model(self) -> None:
        # Resolving the entry model first also generates a tiny checkpoint before the stage
        # process needs it (ensure_checkpoint is concurrency-safe either way).
        path = resolve_model(self.topology.entry, self.config)
        self.codec.load(path)
        self.audio_input_rate = audio_input_rate(path)
        pieces = audio_pieces(path, self.codec.tokenizer)
        if pieces is not None:
            self.audio_window_samples, self.audio_placeholder_id = pieces
        self.video_sampler = video_sampler(path)
        self.voices = checkpoint_voices(path)

    async def wait_ready(self, timeout: float | None = None) -> None:
        """Wait until start() completed (for callers that run start() in the background)."""
        assert self._ready_event is not None, "start() was not called"
        await asyncio.wait_for(self._ready_event.wait(), timeout)

    async def close(self) -> None:
        """Fail what is in flight, stop every stage process (Shutdown, SIGTERM, SIGKILL), close
        the sockets. Idempotent."""
        if self._closed:
            return
        self.admission.state = CLOSED
        self.supervisor.begin_stop()
        for req in self.requests.all():
            self.ends.fail(req, 503, "the server is shutting down", abort=False)
        await cancel_and_wait(*self._tasks, *self._background)
        self._tasks.clear()
        await self.fleet.close()
        self.timeline.close()
        self._closed = True

    def kill_all_sync(self, grace: float = 3.0) -> None:
        """Last resort when the event loop is gone (atexit, a crashed server): SIGTERM every stage
        process group, then SIGKILL after ``grace``."""
        self.fleet.kill_all_sync(grace)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ---- what the supervisor reports -------------------------------------------------------------

    def on_stage_down(self, stage: str, why: str) -> None:
        """A stage replica stopped serving: drop what was queued for it and resume or fail what
        it was serving (:mod:`~omni_cache.runtime.replica_loss`)."""
        self.losses.on_replica_down(stage, why)

    def on_stage_up(self, stage: str) -> None:
        """A stage replica announced itself ready: the entry stage's context length is now its."""
        if self.fleet.replicas[stage].stage == self.topology.entry.name:
            self.admission.context_len = self.supervisor.stages[stage].max_model_len or self.admission.context_len

    # ---- requests --------------------------------------------------------------------------------

    async def submit(
        self,
        prompt_token_ids: Sequence[int],
        *,
        sampling: EngineSampling | None = None,
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        modalities: Iterable[str] = ("text",),
        media: Sequence[MediaItem] = (),
        return_latents: bool = False,
        timeout_s: float | None = None,
        received_at: float | None = None,
        session_id: str | None = None,
        ticket: Ticket | None = None,
        stream: bool = False,
        voice: str = "",
        prefill_only: bool = False,
    ) -> RequestHandle:
        """Accept a request and send it to the entry stage; :class:`RequestError` when it is
        refused up front (:mod:`omni_cache.runtime.request_path.admission`), else a handle that gets exactly
        one terminal event. ``sampling``: the entry stage's, as the server resolved it (vLLM's
        ``SamplingParams`` fields); without it, the stage's defaults with ``max_tokens`` ...
        ``seed`` where given. ``media``: decoded images and clips for the prompt's placeholders,
        in order; the context-length check counts the prompt before the entry stage's processor
        expands them (the stage refuses, 400, a prompt whose expansion does not fit).
        ``received_at`` (``time.monotonic()``): when the request arrived (latency histograms; the
        deadline counts from it). ``session_id``: requests of one session (a realtime
        conversation) stay on the replicas its first request went to. ``ticket``: its place in
        the server's bounds, taken before its body was read (None: here). ``stream``: its client
        plays it as it comes (stages pace its audio: docs/pacing.md). ``voice``: the speaker of
        its spoken answer, one of :attr:`voices` ("" or ``default``: the checkpoint's default).
        ``prefill_only``: its stages only prefill its prompt (wire ``Submit.prefill_only``)."""
        ticket = ticket or self.admission.enter()
        try:
            admitted = self.admission.check(
                prompt_token_ids,
                ticket=ticket,
                sampling=sampling,
                max_tokens=max_tokens,
                temperature=temperature,
                top_p=top_p,
                seed=seed,
                modalities=modalities,
                media=media,
                prefill_only=prefill_only,
            )
            # Hashing grows with the prompt: off the event loop (omni_cache.runtime.routing.route_planner).
            hashes = await asyncio.to_thread(self.routes.hasher(admitted.prompt_token_ids, admitted.media))
            timeout = float(timeout_s or self.config.server.request_timeout_s)
            req = new_request(
                admitted.prompt_token_ids,
                admitted.modalities,
                admitted.participants,
                received_at=received_at,
                timeout=timeout,
                return_latents=return_latents,
                ticket=ticket,
                max_outbox_bytes=self.config.server.max_outbox_bytes,
            )
            req.prefill_only = prefill_only
            self.routes.assign(req, admitted.prompt_token_ids, admitted.media, session_id=session_id, hashes=hashes)
            req.submit = submit_message(
                req, admitted.sampling, admitted.media, stream=stream, voice="" if voice == DEFAULT_VOICE else voice
            )
            req.media = media_frames(admitted.media)
            self.requests.add(req)
        except BaseException:
            ticket.release()  # refused (or cancelled) before it was accepted
            raise
        self.timeline.mark(req.request_id, "received", req.t0)
        self.timeline.mark(req.request_id, "submitted")
        await self._hand_to_entry(req, req.submit, timeout=min(timeout, 10.0))
        return RequestHandle(self, req)

    async def _hand_to_entry(self, req: Request, msg: Submit, *, timeout: float) -> None:
        """Send ``req``'s current attempt to its entry replica; fail it when that cannot be done
        (unless a later attempt replaced it meanwhile)."""
        entry = self.topology.entry.name
        try:
            sent = await self.fleet.send(
                self.ends.serving(req, entry), with_time_left(msg, req), req.media, timeout=timeout
            )
        except MessageTooLarge as e:
            self.ends.fail(
                req,
                400,
                f"the request is too large to send to stage {entry!r} ({e}); "
                "send less media or raise server.max_message_bytes",
                stage=entry,
            )
            return
        except Exception as e:  # noqa: BLE001
            logger.warning("request %s: could not send it to %s: %s", req.request_id, entry, e)
            sent = False
        if not sent and req.wire_id == msg.request_id:
            self.ends.fail(req, 503, f"could not hand the request to stage {entry!r}", stage=entry)

    def end_session(self, session_id: str) -> None:
        """The session's replicas are no longer kept for it (its client went away)."""
        self.routes.end_session(session_id)

    def abort(self, request_id: str, reason: str = "aborted") -> None:
        """Drop a request (client went away): fail its handle (499) and tell its stages."""
        req = self.requests.find(request_id)
        if req is not None:
            self.ends.fail(req, STATUS_CLIENT_CLOSED, reason, count=False)

    def hold(self, request_id: str, held: bool) -> None:
        """Its streaming client takes nothing (``held``) or again: scheduler/client_hold.py."""
        if (req := self.requests.find(request_id)) is not None:
            self.ends.hold_on_stages(req, held)

    def drop_slow_client(self, request_id: str, bound: str, message: str) -> None:
        """A streaming client past ``bound`` (a ``server`` key): ends as a slow client's, counted."""
        req = self.requests.find(request_id)
        if req is not None:
            self.ends.drop_slow_client(req, bound, message)
        else:  # already answered: its handler still closes the connection
            self.metrics.clients.slow_client(bound)

    def abort_threadsafe(self, request_id: str, reason: str = "aborted") -> None:
        """`abort` from any thread, run on the orchestrator's loop (unknown or finished: ignored)."""
        if self._loop is None:
            raise RuntimeError("the orchestrator is not started")
        self._loop.call_soon_threadsafe(self.abort, request_id, reason)

    # ---- a request's end -------------------------------------------------------------------------

    async def _deadline_loop(self) -> None:
        while True:
            await asyncio.sleep(DEADLINE_CHECK_INTERVAL_S)
            now = time.monotonic()
            try:
                self.ends.housekeeping(now)  # deadlines, client holds' renewals
            except Exception:  # noqa: BLE001
                logger.exception("orchestrator: deadline check failed")
            if self.heap.due(now):  # in a thread: malloc_trim takes milliseconds, with the GIL free
                await asyncio.to_thread(self.heap.maybe_trim, now)

    # ---- what the stages send --------------------------------------------------------------------

    def on_message(self, msg: Any, tensors: dict[str, Any]) -> None:
        """One message from a stage (the receive loop's dispatch: :mod:`~omni_cache.runtime.stage_messages`)."""
        self.inbox.on_message(msg, tensors)

    # ---- status ----------------------------------------------------------------------------------

    def not_ready(self) -> dict[str, str]:
        """stage -> why it is not serving (see :meth:`StageSupervisor.not_ready`)."""
        return self.admission.not_ready()

    def replicas_not_ready(self) -> dict[str, str]:
        """replica name -> why it is not serving, for every replica that is not up, also where
        another replica of its stage serves."""
        return self.supervisor.replicas_not_ready()

    def stage_pids(self) -> dict[str, int | None]:
        """replica name (a one-replica stage's: the stage's name) -> pid of its running process
        (None while it is down)."""
        return self.supervisor.pids()

    async def stage_stats(self, timeout: float = STATS_TIMEOUT_S) -> dict[str, StageSnapshot]:
        """Ask every up replica for its counters; replicas that do not answer within ``timeout``
        keep their last known values (``fresh=False``). Keyed by replica name (a one-replica
        stage's: the stage's name)."""
        return await self._stats.collect(self.fleet, timeout)

    async def render_metrics(self) -> str:
        """The Prometheus text of ``GET /metrics``."""
        return self.metrics.render(
            await self.stage_stats(), self.in_flight, routing=self.routes.snapshot(), heap=self.heap.counters()
        )


def _warn_unauthenticated(config: PipelineConfig) -> None:
    """Loud at every start: sockets reachable from the network take anyone's messages."""
    if config.server.stage_auth_key_file is None and config.server.allow_unauthenticated_stages:
        for key, address in exposed_sockets(config):
            logger.warning(
                "%s binds %s beyond loopback without a stage key (server.allow_unauthenticated_stages): "
                "anyone who reaches it can send this pipeline's stages messages",
                ".".join(str(k) for k in key),
                address,
            )
