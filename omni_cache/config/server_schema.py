"""The ``server`` block of a stage config: the HTTP server, its admission bounds and timeouts,
media limits (``server.media``) and realtime sessions (``server.realtime``). Part of the stage-config
schema (:mod:`omni_cache.config.schema`)."""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta, field

from omni_cache.config.struct_base import ConfigStruct, NonNegativeInt, PositiveFloat, PositiveInt

#: How the orchestrator picks a replica of a stage for each request (omni_cache.runtime.routing.replica_router).
RoutingPolicy = Literal["prefix", "round_robin", "least_loaded"]


class MediaConfig(ConfigStruct, kw_only=True):
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


class RealtimeConfig(ConfigStruct, kw_only=True):
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
    #: Largest client event, in bytes of its JSON: a larger one is answered with an ``error``
    #: (code ``event_too_large``) and dropped, and the session goes on; its bytes are dropped as
    #: they arrive, never assembled. 4 MiB holds an ``input_audio_buffer.append`` of the whole
    #: input buffer (60 s of 24 kHz pcm16: 3.84 MB in base64) or an image of 3 MiB. Each event up
    #: to it is read on the event loop (~0.1 ms per MiB) and unmasked and parsed (holding the GIL
    #: for ``json.loads``) on a thread, a few ms per MiB on a slow core: the bound on one event's
    #: pause to everyone else.
    max_event_bytes: PositiveInt = 4 * 1024 * 1024
    #: Largest WebSocket message the server takes at all (uvicorn's ``ws_max_size``; 16 MiB, as
    #: there): a larger one ends the connection (close code 1009, message too big) from its
    #: frame's header. At least ``max_event_bytes``: a message between the two is dropped as it
    #: arrives and answered with ``event_too_large`` (an append of up to 15 MiB, which OpenAI's
    #: API accepts, gets that error, not a closed connection).
    max_message_bytes: PositiveInt = 16 * 1024 * 1024
    #: Bytes a session's connection reads per second on average, with a burst of
    #: ``max_event_bytes`` at full speed: past it the server stops reading that socket until the
    #: budget refills, and the client waits in TCP flow control. 1 MiB/s is 16 times real-time
    #: 24 kHz pcm16 audio in base64 (64 kB/s); a whole 60 s buffer in one append, or a 3 MiB
    #: image, goes at once. A client replaying a recording faster than that is slowed to it.
    max_read_bytes_per_s: PositiveInt = 1024 * 1024
    #: The thinker listens while the user speaks: each complete audio-encoder window of a turn
    #: (8 s for Qwen3-Omni) is prefilled as it arrives, so at the turn's end only the last window
    #: and the answer remain (omni_cache/serving/realtime/listening.py). Off: the turn's audio is
    #: prefilled when the turn ends (the prompt is the same either way).
    listen_while_speaking: bool = True
    #: Listening (prefill-only) requests in flight in the whole server at once; beyond it a
    #: window is left to the turn's response. Each also takes a place among
    #: ``max_requests_in_flight``, only while a quarter of them stays free.
    max_listening_requests: PositiveInt = 8


class ThreadsConfig(ConfigStruct, kw_only=True):
    """The server's worker threads, one pool per kind of work (omni_cache/thread_pools.py):
    a flood of one kind waits in its own pool's queue and never takes another's threads. None ->
    sized from the host's CPUs."""

    #: Parsing chat bodies, templating and tokenizing prompts, the tool parser, counting a
    #: realtime conversation's tokens. None -> min(32, CPUs + 4), asyncio's own default.
    request: PositiveInt | None = None
    #: Reading, inflating and decoding images, clips and videos (chat requests' parts and
    #: realtime sessions' items). None -> min(16, max(2, CPUs)).
    media: PositiveInt | None = None
    #: Encoding whole (non-streamed) answers to JSON: a spoken one carries its audio as base64.
    #: None -> min(8, max(2, CPUs // 2)).
    response: PositiveInt | None = None
    #: Parsing realtime client events larger than 64 KiB (smaller ones are parsed on the event
    #: loop in microseconds). None -> 2.
    realtime_events: PositiveInt | None = None


class ServerConfig(ConfigStruct, kw_only=True):
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
    #: (omni_cache/runtime/request_path/admission.py). Past it a new request gets 429 with Retry-After.
    max_requests_in_flight: PositiveInt = 64
    #: Decoded images and clips (pixels x 3 bytes, samples x 4 bytes) the requests in flight hold
    #: together, reserved from each item's header before it is decoded. Past it 429 with
    #: Retry-After; a request whose media alone exceed it, 413.
    max_media_bytes_in_flight: PositiveInt = 1024 * 1024 * 1024
    #: A chat request's answer (audio as float32 samples, text) waiting for its client to read it,
    #: in bytes. A streaming client that stops reading is disconnected past it, its request
    #: aborted and what waited freed (``omni_cache_slow_clients_disconnected`` in /metrics).
    #: 8 MiB: 87 s of 24 kHz audio ahead of the client.
    max_outbox_bytes: PositiveInt = 8 * 1024 * 1024
    #: Seconds a streaming client may take none of the bytes sent to it (its TCP connection
    #: acknowledges nothing while they wait) before it is disconnected the same way. Its writes
    #: stop sooner, after half a second of that: the answer then waits unencoded, within
    #: ``max_outbox_bytes``. 10 s: a client that plays as it reads takes bytes many times a second.
    max_send_stall_s: PositiveFloat = 10.0
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
    #: Accept stage and orchestrator sockets bound beyond loopback (``tcp://0.0.0.0``, a network
    #: address) without ``stage_auth_key_file``: anyone who reaches them can send the pipeline
    #: messages. Only for a network you trust; the server logs a warning at every start. False:
    #: such a config is refused with the command that makes a key.
    allow_unauthenticated_stages: bool = False
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
    #: The server's worker threads per kind of work (request, media, response, realtime_events).
    threads: ThreadsConfig = field(default_factory=ThreadsConfig)
    #: Which replica of a stage (``replicas: N``) serves a request: "round_robin" (in turn),
    #: "least_loaded" (fewest of the orchestrator's requests in flight on it, ties to the lowest
    #: index) or "prefix" (the thinker replica whose prefix cache holds the longest prefix of the
    #: prompt, as its engine reports, unless it is much busier: omni_cache/runtime/routing/replica_router.py;
    #: "least_loaded" when none holds any). A request's later messages to a stage go to the
    #: replica its first one went to.
    routing: RoutingPolicy = "prefix"
    #: A Ray cluster to place the stage replicas on (``omni_cache.runtime.supervision.ray_placement``):
    #: "auto" (the cluster this host joined with ``ray start``) or the head's "HOST:PORT". Every
    #: replica of every stage not ``external`` then runs as a process owned by a Ray actor, placed
    #: by the stage's ``ray`` resources, at its node's IP and a port its actor picks. None (the
    #: default): stages are spawned on this machine. ``omni-serve --ray-address`` overrides it.
    ray_address: str | None = None
    #: How the stages spawned on this machine start: "fork" (from a process that imported vLLM
    #: once and forks each stage process: omni_cache/runtime/supervision/stage_forker.py; a
    #: 2-core host saves 15-20 s of CPU per stage process, restarts included) or "spawn" (each a
    #: fresh ``python -m workers``). Stages started by hand or placed by Ray are not affected,
    #: nor a custom stage command.
    stage_launch: Literal["fork", "spawn"] = "fork"
