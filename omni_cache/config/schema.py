"""The stage-config schema: the typed structs one pipeline YAML converts into (msgspec; unknown keys
are errors), their defaults, and the lookups on a pipeline (stages, inputs, topological order).

Nothing here imports vLLM or torch: loading a config is cheap and safe in any process.
"""

from __future__ import annotations

import graphlib

from collections.abc import Sequence
from typing import Annotated, Any, Literal

from msgspec import Meta, Struct, field


StageKind = Literal["autoregressive", "generation"]
FinalOutput = Literal["text", "audio"]
#: How the orchestrator picks a replica of a stage for each request (omni_cache.runtime.routing).
RoutingPolicy = Literal["prefix", "round_robin", "least_loaded"]

#: A stage's name: lowercase letters, digits, '_' and '-', at most STAGE_NAME_MAX_LENGTH of them
#: (it travels in every message, omni_cache/wire/messages.py, and names the stage's socket file).
STAGE_NAME_RE = r"^[a-z0-9_-]+$"
STAGE_NAME_MAX_LENGTH = 64

PositiveInt = Annotated[int, Meta(gt=0)]
NonNegativeInt = Annotated[int, Meta(ge=0)]
PositiveFloat = Annotated[float, Meta(gt=0)]


class _Base(Struct, forbid_unknown_fields=True, kw_only=True):
    """Common options: unknown keys are errors, fields are keyword-only."""


# --------------------------------------------------------------------------------------------------
# Schema
# --------------------------------------------------------------------------------------------------


class MediaConfig(_Base, kw_only=True):
    """Limits on the images, audio clips and videos of one chat request (omni_cache.serving.media
    and omni_cache.serving.video)."""

    #: Images and clips in one request, all messages together.
    max_items: PositiveInt = 8
    #: Encoded size of one item (the bytes of the PNG, WAV, MP3, ...).
    max_item_bytes: PositiveInt = 16 * 1024 * 1024
    #: Width x height of one image, read from its header before it is decoded.
    max_image_pixels: PositiveInt = 4096 * 4096
    #: Duration of one clip, read from its header before it is decoded.
    max_audio_seconds: PositiveFloat = 300.0
    #: Hosts whose http(s) image URLs the server fetches; none by default (data: URLs only).
    allowed_url_hosts: list[Annotated[str, Meta(min_length=1)]] = []
    #: How long fetching one such URL may take, all of it: connecting, the headers and the body.
    fetch_timeout_s: PositiveFloat = 10.0
    #: Decoded images and clips kept by content (sha256 of the encoded bytes), most recently used
    #: first, up to this many bytes of pixels / samples; 0 turns the cache off. A repeated image
    #: is then neither decoded again nor hashed again by vLLM (its digest is the item's vLLM UUID).
    decoded_cache_bytes: NonNegativeInt = 256 * 1024 * 1024
    #: Encoded size of one video (``video_url`` part); videos are checked against it instead of
    #: ``max_item_bytes``.
    max_video_bytes: PositiveInt = 64 * 1024 * 1024
    #: Duration of one video, read from its container's header before anything is decoded.
    max_video_seconds: PositiveFloat = 600.0
    #: Frames in one video file (its header's count, or duration x frame rate), before sampling.
    max_video_frames: PositiveInt = 36000
    #: Width x height of one video frame, from the header (1920 x 1080 by default).
    max_video_frame_pixels: PositiveInt = 1920 * 1080
    #: Length of a video's sound track, from the header.
    max_video_audio_seconds: PositiveFloat = 600.0
    #: Frames sampled per second of video (Qwen3-Omni's processor samples 2), then clamped to
    #: ``video_min_frames`` .. ``video_max_frames`` and to a multiple of 2 (its temporal patch).
    video_fps: PositiveFloat = 2.0
    video_min_frames: Annotated[int, Meta(ge=2)] = 4
    #: At most this many sampled frames per video (vLLM's Qwen2-VL loader caps it at 768).
    video_max_frames: Annotated[int, Meta(ge=2, le=768)] = 128
    #: A video's sound track goes to the thinker with its frames, interleaved by time (vLLM's
    #: ``mm_processor_kwargs.use_audio_in_video``), when the request has no ``input_audio`` parts
    #: and every video has a track. A request's ``mm_processor_kwargs.use_audio_in_video``
    #: overrides it (``true`` that cannot be honoured is a 400).
    use_audio_in_video: bool = True


class RealtimeConfig(_Base, kw_only=True):
    """Limits of one ``/v1/realtime`` WebSocket session (omni_cache.serving.realtime)."""

    #: Sessions open at once; a connection beyond them is closed at once (code 1013, try later).
    max_sessions: PositiveInt = 64
    #: A session is closed (after an ``error`` event, code ``session_expired``) this long after it
    #: opened, whatever it is doing.
    max_session_s: PositiveFloat = 1800.0
    #: A session that received no client event for this long is closed (code ``idle_timeout``).
    idle_timeout_s: PositiveFloat = 300.0
    #: Audio the input buffer holds before a commit, in seconds; an append beyond it is refused
    #: (``error`` naming ``audio``, code ``input_audio_buffer_full``) and the buffer is kept.
    max_buffer_s: PositiveFloat = 60.0
    #: Client events per second, sustained (a burst of as many is allowed); an event beyond it is
    #: dropped and answered with ``error`` (code ``rate_limit_exceeded``).
    max_events_per_s: PositiveFloat = 200.0
    #: Items (messages) one conversation may hold; creating one more is refused (with the
    #: session's ``truncation`` on, its oldest turns are dropped instead).
    max_items: PositiveInt = 256
    #: Server events queued for a client and not yet sent, in bytes of their JSON: a client that
    #: stops reading is closed past it (code 1008, reason ``slow_client``) and its events freed.
    max_outbox_bytes: PositiveInt = 8 * 1024 * 1024


class ServerConfig(_Base, kw_only=True):
    """The HTTP front end (OpenAI-style API) of the orchestrator."""

    host: Annotated[str, Meta(min_length=1)] = "127.0.0.1"
    #: 0 lets the OS pick a free port.
    port: Annotated[int, Meta(ge=0, le=65535)] = 8091
    #: Largest ZMQ message (header + tensor frames) a stage accepts.
    max_message_bytes: PositiveInt = 256 * 1024 * 1024
    #: Largest HTTP request body; a longer one is refused (413) while it is read.
    max_body_bytes: PositiveInt = 64 * 1024 * 1024
    #: HTTP bodies being read, parsed and decoded at once (a body's bytes count from when they
    #: are read until its request was submitted); past it 429 with Retry-After. At least
    #: max_body_bytes.
    max_body_bytes_in_flight: PositiveInt = 256 * 1024 * 1024
    #: Seconds a request body may take to arrive, from when its handler starts reading it;
    #: past it 408 (a client that declared more than it sends holds nothing longer).
    body_timeout_s: PositiveFloat = 30.0
    #: Requests in flight at once: from before their body is read until they are answered
    #: (omni_cache/runtime/admission.py). Past it a new request gets 429 with Retry-After.
    max_requests_in_flight: PositiveInt = 64
    #: Decoded images and clips (pixels x 3 bytes, samples x 4 bytes) the requests in flight hold
    #: together, reserved from each item's header before it is decoded. Past it 429 with
    #: Retry-After; a request whose media alone exceed it, 413.
    max_media_bytes_in_flight: PositiveInt = 1024 * 1024 * 1024
    #: Deadline of one client request, end to end.
    request_timeout_s: PositiveFloat = 300.0
    #: The model name clients address; ``None`` -> the pipeline's name (filled in on load).
    served_model_name: str | None = None
    #: vLLM's tool-call parser for the thinker's output (``vllm serve --tool-call-parser``, with
    #: ``--enable-auto-tool-choice``): "hermes" for Qwen3-Omni. None: requests with tools and a
    #: ``tool_choice`` other than "none" are refused, as by ``vllm serve`` without the flag.
    tool_call_parser: Annotated[str, Meta(min_length=1)] | None = None
    #: The orchestrator's ZMQ inbox, where stages send their outputs ("ipc://..." or
    #: "tcp://host:port"); ``None`` -> a socket in a directory of the server's own
    #: (omni_cache/config/addresses.py). Stages on other hosts need a tcp address here, one they
    #: can reach (the host's name); stages started by hand need it set.
    control_address: str | None = None
    #: What the orchestrator binds when that differs from the address stages connect to
    #: (``tcp://0.0.0.0:5600`` behind ``control_address: tcp://server-host:5600``); None -> bind
    #: ``control_address``.
    control_bind_address: str | None = None
    #: A file holding a shared secret (``python -m omni_cache.wire.stage_auth new-key FILE``): every
    #: ZMQ connection between the orchestrator and the stages is then authenticated and encrypted
    #: with CURVE keys derived from it. Every host needs the same file. None -> no authentication.
    stage_auth_key_file: str | None = None
    #: Every stage re-announces itself (StageReady) this often: a server started after its stages
    #: finds them, and the orchestrator watches stages started elsewhere by it.
    heartbeat_interval_s: PositiveFloat = 0.25
    #: A stage that has sent nothing for this long (a stopped process, a vanished host) is hung:
    #: marked down, its in-flight requests fail (503), a spawned one is killed and restarted, a
    #: hand-started one is back with its next announcement. A stage whose beats come while its
    #: loop stays in one step is busy, not hung, until ``stages[].step_timeout_s``. Under load a
    #: busy stage's beats can be late by seconds: keep this well above that.
    heartbeat_timeout_s: PositiveFloat = 10.0
    #: Limits on the images and audio clips a chat request may carry.
    media: MediaConfig = field(default_factory=MediaConfig)
    #: Limits of the realtime voice sessions (``/v1/realtime``).
    realtime: RealtimeConfig = field(default_factory=RealtimeConfig)
    #: Which replica of a stage (``replicas: N``) serves a request: "round_robin" (in turn),
    #: "least_loaded" (fewest of the orchestrator's requests in flight on it, ties to the lowest
    #: index) or "prefix" (the thinker replica whose prefix cache holds the longest prefix of the
    #: prompt, as its engine reports, unless it is much busier: omni_cache/runtime/routing.py;
    #: "least_loaded" when none holds any). A request's later messages to a stage go to the
    #: replica its first one went to.
    routing: RoutingPolicy = "prefix"
    #: A Ray cluster to place the stage replicas on (``omni_cache.runtime.ray_placement``):
    #: "auto" (the cluster this host joined with ``ray start``) or the head's "HOST:PORT". Every
    #: replica of every stage not ``external`` then runs as a process owned by a Ray actor, placed
    #: by the stage's ``ray`` resources, at its node's IP and a port its actor picks. None (the
    #: default): stages are spawned on this machine. ``omni-serve --ray-address`` overrides it.
    ray_address: str | None = None


class RayResources(_Base, kw_only=True):
    """What one replica of a stage asks of the Ray cluster (used only with ``server.ray_address``):
    each replica is one actor, one bundle, on one node, placed where these are free."""

    #: Logical CPUs one replica holds on its node (Ray's scheduling unit, not a thread limit).
    num_cpus: Annotated[float, Meta(ge=0)] = 1.0
    #: GPUs one replica holds; Ray gives its actor (and so the stage process) those devices
    #: through CUDA_VISIBLE_DEVICES.
    num_gpus: Annotated[float, Meta(ge=0)] = 0.0
    #: Custom resources every replica needs (``{thinker_gpu: 1}``: only nodes started with
    #: ``ray start --resources '{"thinker_gpu": N}'`` take it).
    resources: dict[str, float] = {}
    #: One map per replica, added to ``resources`` for that replica (``[{node_a: 1}, {node_b:
    #: 1}]`` pins replica 0 and replica 1 to the nodes that have those); [] = all alike.
    replica_resources: list[dict[str, float]] = []

    def for_replica(self, index: int) -> dict[str, float]:
        """The custom resources replica ``index`` asks for."""
        out = dict(self.resources)
        if self.replica_resources:
            for key, value in self.replica_resources[index].items():
                out[key] = out.get(key, 0.0) + value
        return out


class MergedTaps(_Base, kw_only=True):
    """One latent from two layer taps: ``layer``'s row at every position, except at the prompt's
    image/audio/video placeholder positions, where it is ``media_layer``'s. Emitted (and cached)
    as ``layer_<layer>_media_<media_layer>``."""

    layer: Annotated[int, Meta(ge=0)] = 0
    media_layer: Annotated[int, Meta(ge=0)]


class LatentSpec(_Base, kw_only=True):
    """Which per-token latents an autoregressive stage emits (and caches) for the next stage."""

    #: The final hidden states (the input of the LM head).
    hidden: bool = False
    #: Layer taps: the residual stream entering these decoder layers (indices >= 0, unique).
    #: Tap 0 is the input embeddings, which at image and audio placeholder positions are the
    #: encoder outputs: the per-token multimodal tensors a talker reads are rows of ``layer_0``.
    layers: list[Annotated[int, Meta(ge=0)]] = []
    #: One row per position where the next stage reads one of two taps per position, chosen by
    #: whether the token is a media placeholder: Qwen3-Omni's talker reads tap 0 at text positions
    #: and its ``accept_hidden_layer`` state at image/audio positions, so ``{layer: 0,
    #: media_layer: <accept>}`` carries what it reads in half the bytes of ``layers: [0, <accept>]``
    #: (mirror, prefix-hit gather and hand-off alike).
    merged: MergedTaps | None = None

    def any(self) -> bool:
        """Whether any latent is requested."""
        return bool(self.hidden or self.layers or self.merged)

    def describe(self) -> str:
        parts = []
        if self.hidden:
            parts.append("hidden")
        if self.layers:
            parts.append("layers " + ",".join(str(i) for i in self.layers))
        if self.merged:
            parts.append(f"layer {self.merged.layer}, layer {self.merged.media_layer} at media "
                         "positions (one latent)")
        return "; ".join(parts) if parts else "none"


class EngineArgs(_Base, kw_only=True):
    """vLLM engine arguments of an autoregressive stage. ``None`` leaves vLLM's default."""

    max_model_len: PositiveInt | None = None
    #: Tokens per KV-cache block: a positive multiple of 16 (vLLM's GPU backends accept 16; the
    #: CPU attention backend needs a multiple of 32 -- not enforced here, vLLM reports it). Leave
    #: it unset for hybrid (Mamba/GatedDeltaNet) models: vLLM picks it from the state size.
    block_size: Annotated[int, Meta(gt=0, multiple_of=16)] | None = None
    max_num_seqs: PositiveInt | None = None
    max_num_batched_tokens: PositiveInt | None = None
    enable_chunked_prefill: bool | None = None
    enforce_eager: bool | None = None
    #: On GPU a fraction of the device's memory; on CPU vLLM reads it as a fraction of one NUMA
    #: node's memory (its default 0.92 fails on small machines: use about 0.3).
    gpu_memory_utilization: Annotated[float, Meta(gt=0, le=1)] | None = None
    dtype: Literal["auto", "bfloat16", "float16", "float32"] | None = None
    seed: int | None = None
    tensor_parallel_size: PositiveInt | None = None
    async_scheduling: bool | None = None
    #: The talker takes the thinker's hidden states as prompt embeddings.
    enable_prompt_embeds: bool | None = None
    trust_remote_code: bool | None = None
    kv_cache_dtype: str | None = None
    #: Hybrid models only (vLLM 0.32 knows "none" and "align"; with prefix caching on it picks
    #: "align" for GatedDeltaNet by itself).
    mamba_cache_mode: str | None = None
    #: Anything else, passed verbatim to ``vllm.EngineArgs``.
    extra: dict[str, Any] = {}

    def to_vllm_kwargs(self) -> dict[str, Any]:
        """The keyword arguments for ``vllm.EngineArgs``: the fields that are set, plus ``extra``.

        ``enable_prefix_caching`` is not among them: it comes from ``StageConfig.prefix_cache``
        (the stage's engine sets it, workers/llm_stage.py).
        """
        out: dict[str, Any] = {}
        for name in self.__struct_fields__:
            if name == "extra":
                continue
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        out.update(self.extra)
        return out


class Sampling(_Base, kw_only=True):
    """How a stage samples when its request does not say: a stage's configured defaults
    (``sampling:``). The entry stage's are the server's defaults for clients (vLLM's
    ``default_sampling_params``); a request's own sampling travels as
    :class:`omni_cache.wire.sampling.EngineSampling`.

    The ranges (temperature >= 0, 0 < top_p <= 1, max_tokens >= 1) are checked by
    :mod:`omni_cache.config.validation`, with the key path of the value.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    max_tokens: int = 64
    seed: int | None = None


class GenerationArgs(_Base, kw_only=True):
    """Settings of a non-autoregressive ("generation") stage such as the codec decoder."""

    max_batch_size: PositiveInt = 16
    #: Codec codes per decode chunk (audio is streamed chunk by chunk).
    chunk_size: PositiveInt = 16
    #: torch device string: "cpu", "cuda", "cuda:1", ...
    device: Annotated[str, Meta(min_length=1)] = "cpu"


class PacingConfig(_Base, kw_only=True):
    """Playback pacing of streamed spoken answers in one stage (scheduler/pacing.py): an answer
    whose audio this stage has emitted more than ``lead_s`` ahead of its playback yields its turn
    to answers that are due (no audio yet first, then the least slack); when nothing else is due it
    runs anyway. Only answers whose client streams (``"stream": true``) and asks for audio."""

    #: False: keep the clocks and the pacing counters in /metrics, change no order (a baseline).
    enabled: bool = True
    #: Seconds of audio an answer may be ahead of its playback before it yields.
    lead_s: PositiveFloat = 1.0
    #: Autoregressive stages: seconds of audio one generated token stands for (Qwen3-Omni's talker:
    #: one code of its 12.5 Hz codec, 0.08; its thinker: one text row per talker step, 0.08).
    #: A generation stage counts the samples it emits: leave it unset there.
    token_audio_s: PositiveFloat | None = None
    #: Generation stages: windows decoded together when every ready answer is ahead (nothing is
    #: due); None: ``generation.max_batch_size``. A batch cannot be interrupted, so a small one
    #: keeps the window that becomes due next (a new answer's first audio) from waiting behind a
    #: long batch of work that was not due.
    ahead_batch_size: PositiveInt | None = None
    #: Seconds of audio beyond which an answer waits even when nothing else is due (at least
    #: ``lead_s``); None: no cap, ahead-of-time work runs whenever the stage has nothing due.
    #: A cap keeps the machine free for the next request's first audio and wastes no work on
    #: answers a listener interrupts, at the cost of answers that end no sooner than their
    #: playback allows (a closed-loop client then gets fewer answers a second).
    max_lead_s: PositiveFloat | None = None


class StageConfig(_Base, kw_only=True):
    """One stage of the pipeline, run in its own process."""

    #: Unique within the pipeline; lowercase letters, digits, '_' and '-'; at most 64 characters.
    name: Annotated[str, Meta(pattern=STAGE_NAME_RE, max_length=STAGE_NAME_MAX_LENGTH)]
    #: "autoregressive": a vLLM engine; "generation": a non-AR network (the codec decoder).
    kind: StageKind
    #: "tiny:<name>" (a checkpoint the project generates) or a filesystem path.
    model: str
    #: engine_input_source: the stages this one takes input from; [] = the client's request.
    inputs: list[str] = []
    #: "package.module.function" building this stage's inputs from its input stages' outputs.
    handoff: str | None = None
    #: Which model of a multi-model checkpoint this (autoregressive) stage runs: None -> the one
    #: vLLM maps the checkpoint to (Qwen3-Omni: the thinker); "talker" -> Qwen3-Omni's talker
    #: (workers/models/qwen3_omni_talker.py), loaded from the same folder.
    submodel: Literal["talker"] | None = None
    #: Where the stage process listens and the others connect: "ipc:///abs/path" or
    #: "tcp://host:port" (on several hosts: a name the other hosts resolve to this one).
    #: ``None`` -> a socket in a directory of the server's own, chosen when it starts
    #: (omni_cache/config/addresses.py); required on a stage started by hand and on the stages it
    #: sends to. When Ray places the stage (``server.ray_address``) its replicas listen at their
    #: node's IP and a port their actor picks, and this key is not used.
    address: str | None = None
    #: What the stage binds when that differs from ``address`` (``tcp://0.0.0.0:5601``); None ->
    #: bind ``address``. Not used when Ray places the stage.
    bind_address: str | None = None
    #: The address of each replica, when they do not follow from ``address`` (omni-serve fills
    #: it in the config it hands to Ray-placed stages, with what their actors reported); [] ->
    #: derived from ``address`` (omni_cache.config.replicas).
    replica_addresses: list[str] = []
    #: Started by hand (``python -m workers``), possibly on another host: omni-serve does not
    #: spawn it, waits for its announcement and watches its heartbeats.
    external: bool = False
    #: Identical processes of this stage, each with its own address (omni_cache.config.replicas:
    #: replica i > 0 listens at ``address`` + ".i" (ipc) or port + i (tcp)); the orchestrator
    #: routes each request to one of them (``server.routing``). Only for stages omni-serve spawns.
    replicas: PositiveInt = 1
    #: Whether (and as what) this stage's output goes back to the client.
    final_output: FinalOutput | None = None
    #: vLLM automatic prefix caching plus the hidden-state prefix cache (autoregressive only).
    prefix_cache: bool = True
    #: Where the hidden-state cache lives: pinned host memory or the accelerator.
    latent_cache_device: Literal["host", "device"] = "host"
    latents: LatentSpec = field(default_factory=LatentSpec)
    #: Required for autoregressive stages, forbidden for generation stages.
    engine_args: EngineArgs | None = None
    sampling: Sampling = field(default_factory=Sampling)
    #: Generation stages only; defaults are filled in when omitted.
    generation: GenerationArgs | None = None
    #: Extra environment of the stage process (e.g. VLLM_CPU_KVCACHE_SPACE).
    env: dict[str, str] = {}
    #: What each replica asks of the Ray cluster when Ray places the stages
    #: (``server.ray_address``); None -> one logical CPU, no GPU, no custom resource. Ignored
    #: when the stages are spawned locally; refused on an ``external`` stage.
    ray: RayResources | None = None
    #: Playback pacing of streamed spoken answers; None: this stage does not pace.
    pacing: PacingConfig | None = None
    #: A replica whose heartbeats keep coming while its loop stays inside one model step is busy,
    #: not hung, until that step has lasted this long; then it is hung (killed and restarted).
    #: Must exceed ``server.heartbeat_timeout_s`` (silence is judged by that). None -> 300 s
    #: (omni_cache/runtime/hang_watch.py says why), or the heartbeat timeout when that is longer.
    step_timeout_s: PositiveFloat | None = None
    #: Autoregressive (vLLM) stages: before announcing itself, run the paths vLLM compiles or
    #: builds on first use (logprobs, penalties, seeded and top-k/top-p sampling, structured
    #: output, each medium the stage takes) with a few tiny requests of its own, so no client's
    #: first request of a kind pays for them (workers/warmup.py); the prefix cache and the
    #: counters are reset after. False: start faster and pay on first use.
    warmup: bool = True

    def __post_init__(self) -> None:
        if self.kind == "generation" and self.generation is None:
            self.generation = GenerationArgs()

    @property
    def is_autoregressive(self) -> bool:
        return self.kind == "autoregressive"

    @property
    def uses_prefix_cache(self) -> bool:
        """Whether prefix caching (vLLM APC + the hidden-state cache) is on for this stage."""
        return self.kind == "autoregressive" and self.prefix_cache



class PipelineConfig(_Base, kw_only=True):
    """A whole pipeline: the server and its stages."""

    name: Annotated[str, Meta(min_length=1)]
    #: Where tiny:* checkpoints are generated; None -> $OMNI_CACHE_CHECKPOINTS or
    #: ~/.cache/omni_cache/checkpoints (see :func:`checkpoint_root`).
    checkpoint_dir: str | None = None
    server: ServerConfig = field(default_factory=ServerConfig)
    stages: Annotated[list[StageConfig], Meta(min_length=1)]

    def __post_init__(self) -> None:
        if self.server.served_model_name is None:
            self.server.served_model_name = self.name

    # -- lookups -----------------------------------------------------------------------------------

    def stage(self, name: str) -> StageConfig:
        """The stage called ``name``; KeyError naming the known stages otherwise."""
        for stage in self.stages:
            if stage.name == name:
                return stage
        raise KeyError(f"no stage {name!r} (stages: {', '.join(self.stage_names())})")

    def placed_by_ray(self, stage: StageConfig) -> bool:
        """Whether Ray places ``stage``'s replicas (a Ray address is set, the stage not external)."""
        return self.server.ray_address is not None and not stage.external

    def stage_names(self) -> list[str]:
        return [s.name for s in self.stages]

    def entry_stage(self) -> StageConfig:
        """The one stage with no inputs: it takes the client's request."""
        entries = [s for s in self.stages if not s.inputs]
        if len(entries) != 1:
            raise ValueError(
                f"pipeline {self.name!r} has {len(entries)} entry stages, expected exactly one"
            )
        return entries[0]

    def upstream(self, name: str) -> list[StageConfig]:
        """The stages ``name`` takes input from, in the order of its ``inputs``."""
        return [self.stage(n) for n in self.stage(name).inputs]

    def downstream(self, name: str) -> list[StageConfig]:
        """The stages that take input directly from ``name``, in config order."""
        self.stage(name)  # KeyError for an unknown name
        return [s for s in self.stages if name in s.inputs]

    def final_stages(self) -> list[StageConfig]:
        """The stages whose output goes to the client."""
        return [s for s in self.stages if s.final_output is not None]

    def topological_order(self) -> list[StageConfig]:
        """All stages, every stage after the stages it takes input from.

        Ties keep config order. ValueError if the input graph has a cycle or an unknown input.
        """
        names = set(self.stage_names())
        for s in self.stages:
            for i in s.inputs:
                if i not in names:
                    raise ValueError(f"stage {s.name!r} takes input from unknown stage {i!r}")
        by_name = {s.name: s for s in self.stages}
        sorter = graphlib.TopologicalSorter({s.name: s.inputs for s in self.stages})
        try:
            sorter.prepare()
        except graphlib.CycleError:
            cycle = find_input_cycle(self.stages) or []
            raise ValueError("input cycle: " + " -> ".join(cycle)) from None
        rank = {name: i for i, name in enumerate(by_name)}
        order: list[StageConfig] = []
        while sorter.is_active():
            ready = sorted(sorter.get_ready(), key=rank.__getitem__)  # ties keep config order
            order.extend(by_name[n] for n in ready)
            sorter.done(*ready)
        return order


def find_input_cycle(stages: Sequence[StageConfig]) -> list[str] | None:
    """A cycle in the input graph in data-flow order (``a -> b -> a``: b reads a, a reads b);
    inputs naming no stage are left out (validation reports those on their own)."""
    names = {s.name for s in stages}
    graph = {s.name: [i for i in s.inputs if i in names] for s in stages}
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as e:
        return list(e.args[1])  # each node an input of the next: data-flow order
    return None
