"""The messages stages and the orchestrator exchange (frame 0 of every ZMQ message).

Topology: every stage binds a PULL socket at its `address` (its inbox); the orchestrator binds one
PULL socket at `server.control_address` (its inbox). A stage PUSHes its output to the inboxes of
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
  context (`modalities`, `sampling`, `time_left_s`, `return_latents`, `route`, as its `Submit` gave
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

Every field's range is declared in its type (msgspec ``Meta``: ids and counts non-negative, sample
rates and block sizes in range, strings bounded), so a frame with a value out of range fails to
decode and is dropped by the receiver (transport.py), which goes on with the next one: a broken
or hostile peer's value never reaches the state it would corrupt.

Deadlines travel as time left (``time_left_s``, seconds), never as a point in time: hosts' clocks
differ, and each process measures time by its own monotonic clock. A receiver turns the time left
into its own deadline on receipt, and forwards what is left of it downstream the same way.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from omni_cache.config.schema import STAGE_NAME_MAX_LENGTH, STAGE_NAME_RE
from omni_cache.wire.sampling import EngineSampling

#: The highest audio rate on the wire (a client's clip, a stage's audio), Hz.
MAX_SAMPLE_RATE = 384_000
#: The longest StageError message; a stage cuts a longer one (workers/runner.py).
MAX_ERROR_MESSAGE = 8192
#: The longest StageError param (a request field's name); a longer one is not sent.
MAX_ERROR_PARAM = 256
#: The longest modality or multimodal identifier a MediaSpan carries (a stage sends no layout
#: with a longer one: the output carrying it would not decode).
MAX_MEDIA_NAME = 512

#: A request's id: the orchestrator's (uuid hex; ".r<attempt>" for a resumed attempt).
RequestId = Annotated[str, Meta(min_length=1, max_length=128)]
StageName = Annotated[str, Meta(pattern=STAGE_NAME_RE, max_length=STAGE_NAME_MAX_LENGTH)]
Count = Annotated[int, Meta(ge=0)]
#: A token id or an audio code (vLLM keeps them in int32).
TokenId = Annotated[int, Meta(ge=0, lt=2**31)]
#: 0: not audio (or not known).
SampleRate = Annotated[int, Meta(ge=0, le=MAX_SAMPLE_RATE)]
Modality = Literal["text", "audio"]
#: A stop string the client sent (its length is vLLM's to judge; this bounds the frame).
StopString = Annotated[str, Meta(max_length=1 << 16)]
#: A vLLM finish reason ("stop", "length", ...).
FinishReason = Annotated[str, Meta(max_length=32)]
# A speaker of the pipeline's talker and decoder ("" = the checkpoint's default).
Voice = Annotated[str, Meta(max_length=64)]
#: Seconds a request has left when the message carrying it is sent (None: no deadline).
TimeLeft = Annotated[float, Meta(ge=0)] | None
#: A block hash as vLLM's KV events carry it: the low 64 bits of the digest (msgpack's
#: integers end at 2**64 - 1 anyway).
BlockHash = Annotated[int, Meta(ge=0)]
#: One image's (t, h, w) patch grid.
PatchGrid = Annotated[list[Count], Meta(min_length=3, max_length=3)]


# Talker -> decoder: a multi-codebook talker (Qwen3-Omni's) sends, with each StageOutput, the
# codes new since its previous one as the tensor frame CODES_FRAME: integers [num_code_groups, k],
# every codebook, audio codes only (in [0, codebook_size)). A one-codebook talker (the tiny one)
# sends its codes as the StageOutput's token_ids instead.
CODES_FRAME = "codes"


class MediaRef(msgspec.Struct, kw_only=True):
    """One image, audio clip or video of a Submit; its samples travel as the tensor frame
    ``tensor``: an image as ``uint8 [H, W, 3]`` RGB, a clip as ``float32 [n]`` mono at
    ``sample_rate``, a video's sampled frames as ``uint8 [T, H, W, 3]`` at ``fps``."""

    kind: Literal["image", "audio", "video"]
    tensor: Annotated[str, Meta(min_length=1, max_length=64)]
    sample_rate: SampleRate = 0
    #: The server's content digest of the item (omni_cache/serving/media.py), passed to vLLM as
    #: its UUID; "" when unknown (vLLM then hashes the array itself).
    uuid: Annotated[str, Meta(max_length=128)] = ""
    #: A video: the rate of its sampled frames (frames per second of video).
    fps: Annotated[float, Meta(ge=0, le=1000)] = 0.0
    #: A video: its sampled frames' indices in the clip, the clip's rate and frame count (what a
    #: Qwen3-VL-family processor stamps the frames' times from; empty / 0 when not known).
    frame_indices: Annotated[list[Annotated[int, Meta(ge=0)]], Meta(max_length=768)] = []
    source_fps: Annotated[float, Meta(ge=0, le=1000)] = 0.0
    source_frames: Annotated[int, Meta(ge=0)] = 0
    #: An audio clip that is the sound track of the video before it: the thinker reads both
    #: interleaved by time (vLLM's ``use_audio_in_video``).
    in_video: bool = False


class Submit(msgspec.Struct, tag="submit", kw_only=True):
    """Orchestrator -> entry stage: a new client request, already tokenized. Its media fill the
    prompt's image/audio placeholders in order (the entry stage's vLLM processor expands them)."""

    request_id: RequestId
    prompt_token_ids: Annotated[list[TokenId], Meta(min_length=1)]
    sampling: EngineSampling
    # "audio": run the stages downstream too.
    modalities: list[Modality] = msgspec.field(default_factory=lambda: ["text"])
    return_latents: bool = False  # also send the entry stage's latents to the orchestrator
    #: The time the request has left (its stages drop it once that passed, after a grace).
    time_left_s: TimeLeft = None
    media: list[MediaRef] = []
    #: stage -> the replica of it that serves this request (the orchestrator's choice, for every
    #: stage the request passes); each stage forwards it with its first output downstream, where
    #: it picks the replica the request's stream goes to. A stage missing here: replica 0.
    route: dict[StageName, Count] = {}
    #: A resumed request (omni_cache.runtime.request_path.resume): the last ``resumed_tokens`` of
    #: ``prompt_token_ids`` are the answer's first tokens, which its client already has. The stage
    #: sends them again with its first output, as if it had generated them.
    resumed_tokens: Count = 0
    #: With ``resumed_tokens``: the answer was complete (this finish reason); the stage recomputes
    #: it for the stages downstream and generates nothing new.
    answer_finished: FinishReason = ""
    #: The client streams the answer (it plays audio as it comes): stages with ``pacing`` pace
    #: its audio to playback (scheduler/pacing.py). Forwarded downstream in the StreamStart.
    stream: bool = False
    #: The speaker of a spoken answer (the request's ``audio.voice``; "" = the checkpoint's
    #: default): the talker and decoder stages read it from the StreamStart.
    voice: Voice = ""
    #: A prefill-only request (a realtime session listening while its user speaks,
    #: omni_cache/serving/realtime/listening.py): the prompt is taken into the prefix caches of
    #: the entry stage and, with "audio", of the stage that speaks its text (the talker); that
    #: stage writes nothing downstream. Its output is dropped by its sender.
    prefill_only: bool = False


class MediaSpan(msgspec.Struct, array_like=True):
    """One media item of a prompt as the entry stage's engine placed it: its modality, vLLM's
    identifier of it (the key of its prefix-cache blocks) and its run in the expanded prompt."""

    modality: Annotated[str, Meta(max_length=MAX_MEDIA_NAME)]
    identifier: Annotated[str, Meta(max_length=MAX_MEDIA_NAME)]
    offset: Count
    length: Count


class MediaLayout(msgspec.Struct, kw_only=True):
    """Entry stage -> orchestrator, with a media request's first output: its prompt as the
    engine expanded it (the client's ``prompt_token_ids``, as `vllm serve` answers them) and where
    each item sits, so the router can hash later prompts with the same media as the engine does
    (omni_cache/runtime/routing/media_layouts.py; no spans where an item's name is too long for the wire)."""

    prompt_token_ids: list[TokenId]
    spans: list[MediaSpan]


class TokenLogprob(msgspec.Struct, array_like=True):
    """One entry of a generated position's log-probabilities, as vLLM's output processor made
    it: the id, its log-probability and its decoded text (None where vLLM did not decode it)."""

    token_id: TokenId
    logprob: float  # -inf for a token the sampler had excluded
    token: str | None = None


class StageOutput(msgspec.Struct, tag="output", kw_only=True):
    """A stage's streamed output for one request: what is new since its previous output.

    The entry stage sends the orchestrator every token it generated and the client's text (vLLM's
    detokenizer output: stop strings cut, held back while a stop string may still be forming). A
    stage that speaks gets only the tokens whose text the client has (their text in ``text``), so
    it never speaks a stop string or what follows it (workers/spoken_tokens.py)."""

    request_id: RequestId
    stage: StageName
    seq: Count  # 0, 1, 2, ... per (request, stage): receivers can check order
    token_ids: list[TokenId] = []
    text: str = ""
    latent_start: Count = 0
    finished: bool = False
    finish_reason: FinishReason | None = None
    #: vLLM's stop reason with a "stop" finish: the stop string, or the stop token id (None: EOS).
    stop_reason: TokenId | StopString | None = None
    #: Per token of ``token_ids``, its log-probabilities in vLLM's order (the sampled token first,
    #: then the top ones); None when the request asked for none.
    logprobs: list[list[TokenLogprob]] | None = None
    num_prompt_tokens: Count = 0
    num_cached_tokens: Count = 0  # prompt tokens this stage's prefix cache let it skip (so far)
    sample_rate: SampleRate = 0  # decoder output only
    #: A downstream stage's final output to the orchestrator: the text of the upstream tokens it
    #: took in (a talker: the text it was given to speak; the answer's audio transcript).
    input_text: str = ""
    #: The entry stage's first output to the orchestrator of a request with media: how its
    #: engine expanded the prompt (the client's prompt_token_ids; prefix routing of media prompts).
    media_layout: MediaLayout | None = None


class StreamStart(StageOutput, tag="start", kw_only=True):
    """Stage -> downstream stage: a request's first output (seq 0), with what the stage it goes to
    needs once to run the request."""

    # The request's Submit.modalities: a stage forwards downstream only when "audio" is asked for.
    modalities: list[Modality] = msgspec.field(default_factory=lambda: ["text"])
    sampling: EngineSampling | None = None  # the client's sampling (Submit.sampling)
    # What is left of the request's time when the stage sends it (the stage's own deadline, from
    # its input's time_left_s): the receiver's deadline is that much from when it arrives.
    time_left_s: TimeLeft = None
    # The request's Submit.return_latents: every autoregressive stage then also sends its tensors
    # (latents, a talker's codes) to the orchestrator.
    return_latents: bool = False
    # The request's Submit.route: it picks the downstream replica this message goes to; the rest
    # of the stream follows it there (workers/outbox.py).
    route: dict[StageName, Count] = {}
    # The prompt as the stage's engine saw it (media placeholders expanded): Qwen3-Omni's talker
    # finds the user turn and media in it.
    prompt_token_ids: list[TokenId] = []
    # Per image of that prompt, its (t, h, w) patch grid.
    image_grids: list[PatchGrid] = []
    # Per video of that prompt, its (t, h, w) patch grid and seconds per temporal patch.
    video_grids: list[PatchGrid] = []
    video_seconds_per_grid: list[Annotated[float, Meta(ge=0)]] = []
    # The request's Submit.stream: the client streams, so the stages downstream pace its audio to
    # playback.
    stream: bool = False
    # The request's Submit.voice: the speaker the talker and decoder stages speak with.
    voice: Voice = ""
    # The request's Submit.prefill_only: the receiver prefills its prompt and sends nothing on.
    prefill_only: bool = False

    @classmethod
    def opening(cls, first: StageOutput, **once: Any) -> StreamStart:
        """The stream's first delta ``first`` with what travels once (the fields above)."""
        return cls(**msgspec.structs.asdict(first), **once)


#: Most outputs in one StageOutputs: a step of the largest batch vLLM schedules (max_num_seqs)
#: fits many times over.
MAX_STEP_OUTPUTS = 4096


class StageOutputs(msgspec.Struct, tag="outputs", kw_only=True):
    """Stage -> orchestrator: the outputs of one engine step that carry no tensors, in the order
    the stage made them, as one message (workers/outbox.py). A step of many streaming requests
    is otherwise as many messages, each one a receive and a decode on the server's event loop,
    which every client waits behind (vLLM's engine core sends a step's outputs together too)."""

    stage: StageName
    outputs: Annotated[list[StageOutput], Meta(max_length=MAX_STEP_OUTPUTS)]


class StageError(msgspec.Struct, tag="error", kw_only=True):
    """Any process -> orchestrator: request `request_id` failed in `stage`."""

    request_id: RequestId
    stage: StageName
    message: Annotated[str, Meta(max_length=MAX_ERROR_MESSAGE)]
    # The HTTP status the client should see; one that is not an error status reaches the client
    # as 500 (the orchestrator's rule), so the request still ends with this error.
    status: Annotated[int, Meta(ge=100, le=599)] = 500
    # The request field at fault, as vLLM names it (``VLLMValidationError.parameter``): the
    # error body's ``param``, as `vllm serve` gives it.
    param: Annotated[str, Meta(max_length=MAX_ERROR_PARAM)] | None = None


class Abort(msgspec.Struct, tag="abort", kw_only=True):
    """Orchestrator -> stages: forget this request (client went away, deadline, another stage
    failed)."""

    request_id: RequestId


class Hold(msgspec.Struct, tag="hold", kw_only=True):
    """Orchestrator -> stages: the request's streaming client has taken none of its answer for a
    while (``held``) or takes it again: a held request's work waits where it is
    (scheduler/client_hold.py)."""

    request_id: RequestId
    held: bool
    #: How long a stage holds it (held only; 0: until told otherwise). The orchestrator says it
    #: again while its client takes nothing (omni_cache/runtime/request_path/request_ends.py) and
    #: a hold not said again lapses: a lost "go on" keeps a request held at most this long.
    lease_s: Annotated[float, Meta(ge=0)] = 0.0


#: The version of these messages' shapes, in every StageReady: raised when a message changes so
#: that processes of different code would misread each other (msgspec fills a missing field with
#: its default and drops an unknown one, silently).
#: 2: BlockEvents.seq, BlockSnapshotQuery; 3: Hold; 4: Hold.lease_s; 5: StageOutputs; 6: StageError.param.
PROTOCOL_VERSION = 6


class StageReady(msgspec.Struct, tag="ready", kw_only=True):
    """Stage -> orchestrator, once its model is loaded and it serves, then again every
    ``server.heartbeat_interval_s``: the announcement doubles as heartbeat, so a server started
    (or restarted) after its stages finds them, a silent stage is noticed, and (``busy``,
    ``stalled_s``) a stage whose loop stopped moving while it works is noticed too."""

    stage: StageName
    pid: Count
    #: Which replica of the stage this process is (omni_cache.config.replicas).
    replica: Count = 0
    max_model_len: Count = 0
    #: Random per stage process: a new value means the stage was restarted (pids can repeat
    #: across hosts).
    incarnation: Annotated[str, Meta(max_length=64)] = ""
    host: Annotated[str, Meta(max_length=255)] = ""  # the stage's hostname, for messages
    #: Whether the stage's loop was working (not waiting for input while it holds nothing) at its
    #: last progress stamp (workers/loop_progress.py).
    busy: bool = False
    #: Seconds since the stage's loop last moved, on the stage's own clock when it sent this.
    stalled_s: Annotated[float, Meta(ge=0.0)] = 0.0
    #: The sender's PROTOCOL_VERSION (0: code from before it was sent) and its pipeline's hash
    #: (omni_cache.config.identity): the orchestrator refuses a stage whose either differs.
    protocol: Count = 0
    config_hash: Annotated[str, Meta(max_length=64)] = ""


class StatsQuery(msgspec.Struct, tag="stats_query", kw_only=True):
    """Orchestrator -> stage: send your counters (a StageStats, to the orchestrator's inbox)."""


class StageStats(msgspec.Struct, tag="stats", kw_only=True):
    """Stage -> orchestrator: cumulative counters (prefix_cache_*_tokens, latent_rows_*, ...)."""

    stage: StageName
    counters: dict[Annotated[str, Meta(max_length=128)], float]
    replica: Count = 0  # which replica of the stage counted them


class Shutdown(msgspec.Struct, tag="shutdown", kw_only=True):
    reason: Annotated[str, Meta(max_length=1024)] = ""


class BlockEvents(msgspec.Struct, tag="blocks", kw_only=True):
    """Stage -> orchestrator, after a step that changed it: what the replica's prefix cache gained
    and lost since its last report (vLLM's KV-cache events, net per block hash; see
    scheduler/block_events.py), for prefix routing (omni_cache/runtime/routing/replica_router.py)."""

    stage: StageName
    replica: Count = 0
    #: Block hashes (vLLM's 64-bit form) its prefix cache holds now.
    stored: list[BlockHash] = []
    #: Block hashes it no longer holds (evicted).
    removed: list[BlockHash] = []
    #: The prefix cache was reset before these changes: forget what it held.
    cleared: bool = False
    #: Tokens per block of the engine that reports (the router hashes prompts in blocks of it).
    block_size: Annotated[int, Meta(ge=1)]
    #: A hybrid (recurrent) engine: a hit also needs a state at its last block; ``state_*`` say
    #: which hashes have one (scheduler/block_events.py).
    recurrent: bool = False
    state_stored: list[BlockHash] = []
    state_removed: list[BlockHash] = []
    #: Tokens per hash step (vLLM's hash_block_size; 0: block_size). A full block's hash is the
    #: chain's at the block's end, so the router hashes prompts in steps of this.
    hash_block_size: Annotated[int, Meta(ge=0)] = 0
    #: This replica process's reports numbered from 1 (0: unnumbered). A report the router did
    #: not get (a send that timed out) leaves a gap: the stage then sends, or the router asks for
    #: (BlockSnapshotQuery), a snapshot: ``cleared`` with every hash it holds in ``stored``.
    seq: Count = 0


#: What a block report says beside who sent it (``stage``, ``replica``) and its number (``seq``):
#: the fields a stage's block changes (scheduler/block_events.py ``BlockChanges``) and a
#: ``BlockEvents`` share, under the same names, and what the router's index applies of either
#: (omni_cache/runtime/routing/prefix_index.py ``PrefixIndex.apply_report``).
BLOCK_REPORT_FIELDS = (
    "stored",
    "removed",
    "cleared",
    "block_size",
    "hash_block_size",
    "recurrent",
    "state_stored",
    "state_removed",
)


def block_report(changes: Any) -> dict[str, Any]:
    """The report fields of ``changes`` (a ``BlockChanges`` or a ``BlockEvents``) by name: the one
    mapping from a replica's block changes to a message and to the router's index."""
    return {name: getattr(changes, name) for name in BLOCK_REPORT_FIELDS}


class BlockSnapshotQuery(msgspec.Struct, tag="block_snapshot_query", kw_only=True):
    """Orchestrator -> stage: its block reports had a gap; send every hash you hold (a BlockEvents
    with ``cleared``) with your next report."""


Message = (
    Submit
    | StreamStart
    | StageOutput
    | StageOutputs
    | StageError
    | Abort
    | Hold
    | StageReady
    | StatsQuery
    | StageStats
    | Shutdown
    | BlockEvents
    | BlockSnapshotQuery
)
MESSAGE_TYPES = (
    Submit,
    StreamStart,
    StageOutput,
    StageOutputs,
    StageError,
    Abort,
    Hold,
    StageReady,
    StatsQuery,
    StageStats,
    Shutdown,
    BlockEvents,
    BlockSnapshotQuery,
)
