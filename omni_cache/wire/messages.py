"""The messages stages and the orchestrator exchange (frame 0 of every ZMQ message).

Topology: every stage binds a PULL socket at its `address` (its inbox); the orchestrator binds one
PULL socket at `control_address(config)` (its inbox). A stage PUSHes its output to the inboxes of
its downstream stages and, when its output is final (or the request asked for latents), to the
orchestrator. The orchestrator PUSHes `Submit` to the entry stage and `Abort`/`StatsQuery` to every
stage.

Messages by kind (as vLLM keeps `EngineCoreRequest` apart from `EngineCoreOutputs`): a request's
stream from one stage to a downstream stage opens with a `StreamStart` and goes on with
`StageOutput`s.
- `StageOutput` is one delta: what every output carries (tokens and text new since the previous
  one, where its latent rows start, whether and why the request finished here) and the usage so
  far (`num_prompt_tokens`, `num_cached_tokens`: the orchestrator reads them from the stage's final
  output, so they travel with every delta rather than once).
- `StreamStart` is the stream's first delta (a `StageOutput` subclass with its own tag, so code
  that reads deltas takes it as one) plus what travels once per (request, stage): the request's
  context (`modalities`, `sampling`, `deadline`, `return_latents`, `route`, as its `Submit` gave
  them) and the prompt as this stage's engine saw it (`prompt_token_ids`, `image_grids`). A
  downstream stage opens a request on a `StreamStart` and drops a `StageOutput` for a request it
  does not hold (the rest of a stream whose start it never saw). Only stages get it: the
  orchestrator wrote the request's context itself, and takes plain `StageOutput`s.
A separate header sent before the first delta would cost a second message per stream and an
ordering rule between the two; the subclass keeps one message and one order.

Tensors never go in these headers; they travel as frames next to them (see transport.py):
- `StageOutput` from an autoregressive stage: its latents by name ("hidden", "layer_<k>", ...),
  rows for token positions `latent_start ..`;
- `StageOutput` from a multi-codebook talker to the decoder: "codes", integers
  `[num_quantizers, k]`, the codes new since its previous output (a one-codebook talker sends its
  codes as `token_ids`; see `omni_cache.handoff.CODES_FRAME`);
- `StageOutput` from the decoder: "audio", float32 mono samples at `sample_rate`;
- `Submit` with media: one frame per `MediaRef` (decoded pixels or samples, never encoded files).
"""

from __future__ import annotations

from typing import Any

import msgspec

# The client's sampling travels as the same struct that holds a stage's configured defaults.
from omni_cache.config.schema import Sampling


# Talker -> decoder: a multi-codebook talker (Qwen3-Omni's) sends, with each StageOutput, the
# codes new since its previous one as the tensor frame CODES_FRAME: integers [num_code_groups, k],
# every codebook, audio codes only (in [0, codebook_size)). A one-codebook talker (the tiny one)
# sends its codes as the StageOutput's token_ids instead.
CODES_FRAME = "codes"


class MediaRef(msgspec.Struct, kw_only=True):
    """One image or audio clip of a Submit; its samples travel as the tensor frame ``tensor``:
    an image as ``uint8 [H, W, 3]`` RGB, a clip as ``float32 [n]`` mono at ``sample_rate``."""

    kind: str  # "image" | "audio"
    tensor: str
    sample_rate: int = 0
    #: The server's content digest of the item (omni_cache/serving/media.py), passed to vLLM as
    #: its UUID; "" when unknown (vLLM then hashes the array itself).
    uuid: str = ""


class Submit(msgspec.Struct, tag="submit", kw_only=True):
    """Orchestrator -> entry stage: a new client request, already tokenized. Its media fill the
    prompt's image/audio placeholders in order (the entry stage's vLLM processor expands them)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: Sampling
    modalities: list[str] = msgspec.field(default_factory=lambda: ["text"])  # "audio": run downstream
    return_latents: bool = False  # also send the entry stage's latents to the orchestrator
    deadline: float = 0.0  # unix time after which stages drop the request (0 = none)
    media: list[MediaRef] = []
    #: stage -> the replica of it that serves this request (the orchestrator's choice, for every
    #: stage the request passes); each stage forwards it with its first output downstream, where
    #: it picks the replica the request's stream goes to. A stage missing here: replica 0.
    route: dict[str, int] = {}
    #: A resumed request (omni_cache.runtime.resume): the last ``resumed_tokens`` of
    #: ``prompt_token_ids`` are the answer's first tokens, which its client already has. The stage
    #: sends them again with its first output, as if it had generated them.
    resumed_tokens: int = 0
    #: With ``resumed_tokens``: the answer was complete (this finish reason); the stage recomputes
    #: it for the stages downstream and generates nothing new.
    answer_finished: str = ""


class StageOutput(msgspec.Struct, tag="output", kw_only=True):
    """A stage's streamed output for one request: what is new since its previous output."""

    request_id: str
    stage: str
    seq: int  # 0, 1, 2, ... per (request, stage): receivers can check order
    token_ids: list[int] = []
    text: str = ""
    latent_start: int = 0
    finished: bool = False
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens this stage's prefix cache let it skip (so far)
    sample_rate: int = 0  # decoder output only


class StreamStart(StageOutput, tag="start", kw_only=True):
    """Stage -> downstream stage: a request's first output (seq 0), with what the stage it goes to
    needs once to run the request."""

    # The request's Submit.modalities: a stage forwards downstream only when "audio" is asked for.
    modalities: list[str] = msgspec.field(default_factory=lambda: ["text"])
    sampling: Sampling | None = None  # the client's sampling (Submit.sampling)
    deadline: float = 0.0  # the request's Submit.deadline
    # The request's Submit.return_latents: every autoregressive stage then also sends its tensors
    # (latents, a talker's codes) to the orchestrator.
    return_latents: bool = False
    # The request's Submit.route: it picks the downstream replica this message goes to; the rest
    # of the stream follows it there (workers/outbox.py).
    route: dict[str, int] = {}
    # The prompt as the stage's engine saw it (media placeholders expanded): Qwen3-Omni's talker
    # finds the user turn and media in it.
    prompt_token_ids: list[int] = []
    # Per image of that prompt, its (t, h, w) patch grid.
    image_grids: list[list[int]] = []

    @classmethod
    def opening(cls, first: StageOutput, **once: Any) -> StreamStart:
        """The stream's first delta ``first`` with what travels once (the fields above)."""
        return cls(**msgspec.structs.asdict(first), **once)


class StageError(msgspec.Struct, tag="error", kw_only=True):
    """Any process -> orchestrator: request `request_id` failed in `stage`."""

    request_id: str
    stage: str
    message: str
    status: int = 500  # the HTTP status the client should see


class Abort(msgspec.Struct, tag="abort", kw_only=True):
    """Orchestrator -> stages: forget this request (client went away, deadline, another stage
    failed)."""

    request_id: str


class StageReady(msgspec.Struct, tag="ready", kw_only=True):
    """Stage -> orchestrator, once its model is loaded and it serves, then again every
    ``server.heartbeat_interval_s``: the announcement doubles as heartbeat, so a server started
    (or restarted) after its stages finds them, and a silent stage started elsewhere is noticed."""

    stage: str
    pid: int
    #: Which replica of the stage this process is (omni_cache.config.replicas).
    replica: int = 0
    max_model_len: int = 0
    #: Random per stage process: a new value means the stage was restarted (pids can repeat
    #: across hosts).
    incarnation: str = ""
    host: str = ""  # the stage's hostname, for messages


class StatsQuery(msgspec.Struct, tag="stats_query", kw_only=True):
    """Orchestrator -> stage: send your counters (a StageStats, to the orchestrator's inbox)."""


class StageStats(msgspec.Struct, tag="stats", kw_only=True):
    """Stage -> orchestrator: cumulative counters (prefix_cache_*_tokens, latent_rows_*, ...)."""

    stage: str
    counters: dict[str, float]
    replica: int = 0  # which replica of the stage counted them


class Shutdown(msgspec.Struct, tag="shutdown", kw_only=True):
    reason: str = ""


class BlockEvents(msgspec.Struct, tag="blocks", kw_only=True):
    """Stage -> orchestrator, after a step that changed it: what the replica's prefix cache gained
    and lost since its last report (vLLM's KV-cache events, net per block hash; see
    scheduler/block_events.py), for prefix routing (omni_cache/runtime/routing.py)."""

    stage: str
    replica: int = 0
    #: Block hashes (vLLM's 64-bit form) its prefix cache holds now.
    stored: list[int] = []
    #: Block hashes it no longer holds (evicted).
    removed: list[int] = []
    #: The prefix cache was reset before these changes: forget what it held.
    cleared: bool = False
    block_size: int = 0


Message = (Submit | StreamStart | StageOutput | StageError | Abort | StageReady | StatsQuery
           | StageStats | Shutdown | BlockEvents)
MESSAGE_TYPES = (Submit, StreamStart, StageOutput, StageError, Abort, StageReady, StatsQuery,
                 StageStats, Shutdown, BlockEvents)
