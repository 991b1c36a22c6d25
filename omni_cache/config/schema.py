"""The stage-config schema: the typed structs one pipeline YAML converts into (msgspec; unknown keys
are errors), their defaults, and the lookups on a pipeline (stages, inputs, topological order).

Nothing here imports vLLM or torch: loading a config is cheap and safe in any process.
"""

from __future__ import annotations

import graphlib
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from msgspec import Meta, field

from omni_cache.config.server_schema import ServerConfig
from omni_cache.config.struct_base import ConfigStruct, PositiveFloat, PositiveInt

StageKind = Literal["autoregressive", "generation"]
FinalOutput = Literal["text", "audio"]

#: A stage's name: lowercase letters, digits, '_' and '-', at most STAGE_NAME_MAX_LENGTH of them
#: (it travels in every message, omni_cache/wire/messages.py, and names the stage's socket file).
STAGE_NAME_RE = r"^[a-z0-9_-]+$"
STAGE_NAME_MAX_LENGTH = 64

# --------------------------------------------------------------------------------------------------
# Schema
# --------------------------------------------------------------------------------------------------


class RayResources(ConfigStruct, kw_only=True):
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


class MergedTaps(ConfigStruct, kw_only=True):
    """One latent from two layer taps: ``layer``'s row at every position, except at the prompt's
    image/audio/video placeholder positions, where it is ``media_layer``'s. Emitted (and cached)
    as ``layer_<layer>_media_<media_layer>``."""

    layer: Annotated[int, Meta(ge=0)] = 0
    media_layer: Annotated[int, Meta(ge=0)]


class LatentSpec(ConfigStruct, kw_only=True):
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
            parts.append(f"layer {self.merged.layer}, layer {self.merged.media_layer} at media positions (one latent)")
        return "; ".join(parts) if parts else "none"


class EngineArgs(ConfigStruct, kw_only=True):
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


class Sampling(ConfigStruct, kw_only=True):
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


class GenerationArgs(ConfigStruct, kw_only=True):
    """Settings of a non-autoregressive ("generation") stage such as the codec decoder."""

    max_batch_size: PositiveInt = 16
    #: Codec codes per decode chunk (audio is streamed chunk by chunk).
    chunk_size: PositiveInt = 16
    #: torch device string: "cpu", "cuda", "cuda:1", ...
    device: Annotated[str, Meta(min_length=1)] = "cpu"


class PacingConfig(ConfigStruct, kw_only=True):
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


class StageConfig(ConfigStruct, kw_only=True):
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
    #: (omni_cache/runtime/supervision/hang_watch.py says why), or the heartbeat timeout when that is longer.
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


class PipelineConfig(ConfigStruct, kw_only=True):
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
            raise ValueError(f"pipeline {self.name!r} has {len(entries)} entry stages, expected exactly one")
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
