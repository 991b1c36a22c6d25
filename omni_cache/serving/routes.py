"""The HTTP routes, one function each, on an ``APIRouter``: /health, /v1/models, /metrics,
/v1/chat/completions and the /v1/realtime WebSocket. They find the orchestrator, the served model
name and the API key on ``request.app.state`` (set by :func:`omni_cache.serving.server.create_app`).

A chat request takes its place among the requests in flight before anything of its body is read
(429 when there is none: omni_cache/runtime/request_path/admission.py), reads its body up to
``server.max_body_bytes`` (each byte held against ``server.max_body_bytes_in_flight`` until the
request was submitted; after that it keeps neither body nor messages), and does its heavy work
off the event loop: parsing the JSON, tokenizing, reading and decoding its media (whose decoded
size is reserved from their headers before they are decoded) run in worker threads.
"""

from __future__ import annotations

import asyncio
import base64
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Depends, Request, WebSocket
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from omni_cache.runtime.metrics.prometheus import CONTENT_TYPE
from omni_cache.runtime.orchestrator import Orchestrator
from omni_cache.runtime.request_path.admission import Ticket
from omni_cache.runtime.request_path.results import RequestHandle
from omni_cache.serving.audio_formats import encode_audio
from omni_cache.serving.auth import bearer_token_problem
from omni_cache.serving.chat_output import ChoiceWriter
from omni_cache.serving.chat_prompt import rendered_prompt, tool_parser
from omni_cache.serving.chat_request import ChatRequest, drain_body, parse_chat_request, read_body
from omni_cache.serving.chat_sampling import engine_sampling
from omni_cache.serving.chat_stream import StreamOptions, collect_unless_disconnected, stream_chunks, usage
from omni_cache.serving.errors import APIError, Unauthorized
from omni_cache.serving.http_protocol import quiet_unfinished_response, transport_of
from omni_cache.serving.media import DecodedCache, MediaDecoder, MediaError, MediaItem
from omni_cache.serving.realtime.client_items import ImageSource
from omni_cache.serving.realtime.connection import CLOSE_POLICY, serve_realtime
from omni_cache.serving.realtime.protocol import EventError
from omni_cache.serving.send_watch import SendWatch
from omni_cache.tasks import cancel_and_wait
from omni_cache.thread_pools import ThreadPools

__all__ = ["AUDIO_TTL_S", "router"]

#: ``expires_at`` of an answer's audio: this long after ``created``.
AUDIO_TTL_S = 3600


async def require_api_key(request: Request) -> None:
    problem = bearer_token_problem(request.headers.get("authorization", ""), request.app.state.api_key)
    if problem is not None:
        await _drain(request)
        raise Unauthorized(problem)


async def _json_body(request: Request) -> None:
    """vLLM's check of the body's content type (its route's ``validate_json_request``)."""
    from vllm.entrypoints.serve.utils.api_utils import validate_json_request

    try:
        await validate_json_request(request)
    except Exception:
        await _drain(request)
        raise


async def _drain(request: Request) -> None:
    """A request refused before its body was read: the body is read and dropped first (bounded
    by ``server.max_body_bytes`` and ``server.body_timeout_s``), or its client, still sending,
    would see a reset connection instead of the answer."""
    if request.scope["type"] == "http":
        server = request.app.state.orchestrator.config.server
        await drain_body(request, server.max_body_bytes, server.body_timeout_s)


router = APIRouter()
_auth = [Depends(require_api_key)]


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    state = request.app.state
    if state.startup_error is not None:
        return JSONResponse(
            {"status": "failed", "message": f"the pipeline did not start: {state.startup_error}"}, status_code=503
        )
    orch: Orchestrator = state.orchestrator
    not_ready = orch.not_ready()
    replicas = orch.replicas_not_ready()
    # Replicas up but inside one long step (heartbeats coming): busy, not down
    # (omni_cache/runtime/supervision/hang_watch.py); named whatever the status.
    long_steps = orch.supervisor.long_steps()
    busy = (
        {
            "busy": {
                name: {
                    "stage": sp.stage,
                    "replica": sp.index,
                    "step_s": round(step, 1),
                    "step_timeout_s": sp.step_timeout_s,
                }
                for name, step in long_steps.items()
                for sp in [orch.supervisor.stages[name]]
            }
        }
        if long_steps
        else {}
    )
    if not not_ready and not replicas:
        return JSONResponse({"status": "ok", **busy})
    # Each replica that is down, by name, with its stage and index beside it.
    down = {
        name: {"stage": sp.stage, "replica": sp.index, "why": why}
        for name, why in replicas.items()
        for sp in [orch.supervisor.stages[name]]
    }
    if not not_ready:
        # Every stage has a replica serving: requests are taken (200), with less capacity.
        message = "replica(s) not ready: " + ", ".join(f"{n} ({why})" for n, why in replicas.items())
        return JSONResponse({"status": "degraded", "message": message, "replicas": down, **busy})
    message = "stage(s) not ready: " + ", ".join(f"{n} ({why})" for n, why in not_ready.items())
    return JSONResponse(
        {"status": "unavailable", "message": message, "stages": not_ready, "replicas": down, **busy}, status_code=503
    )


@router.get("/v1/models", dependencies=_auth)
async def models(request: Request) -> JSONResponse:
    """vLLM's model list: the one model served, its folder as ``root``, the thinker's context."""
    from vllm.entrypoints.serve.engine.protocol import ModelCard, ModelList, ModelPermission

    orch: Orchestrator = request.app.state.orchestrator
    card = ModelCard(
        id=request.app.state.served_model_name,
        root=orch.codec.model_path or None,
        max_model_len=orch.admission.max_model_len,
        permission=[ModelPermission()],
    )
    return JSONResponse(ModelList(data=[card]).model_dump())


@router.get("/metrics", dependencies=_auth)
async def metrics(request: Request) -> PlainTextResponse:
    return PlainTextResponse(await request.app.state.orchestrator.render_metrics(), media_type=CONTENT_TYPE)


@router.post("/v1/chat/completions", dependencies=[*_auth, Depends(_json_body)])
async def chat_completions(request: Request):
    received_at = time.monotonic()
    orch: Orchestrator = request.app.state.orchestrator
    try:
        ticket = orch.admission.enter()  # 429 before anything of the body is read
    except Exception:
        await _drain(request)
        raise
    try:
        a = await _accept(request, orch, ticket, received_at)
    except BaseException:
        ticket.release()  # refused (or the client went away) before it was accepted
        raise
    if a.chat.body.stream:
        return _stream(a.handle, a.chat, orch, a.writer, a.answer_id, request.app.state.threads)
    return await _complete(a.handle, a.chat, orch, request, a.writer, a.answer_id)


@dataclass
class _Accepted:
    """A submitted chat request and what answering it reads (without its messages and media)."""

    handle: RequestHandle
    chat: ChatRequest
    writer: ChoiceWriter
    answer_id: str


async def _accept(request: Request, orch: Orchestrator, ticket: Ticket, received_at: float) -> _Accepted:
    """Read, check and submit one chat request holding ``ticket``; its body's bytes are held on
    the ticket until it was submitted (``server.max_body_bytes_in_flight``)."""
    try:
        return await _read_and_submit(request, orch, ticket, received_at)
    finally:
        ticket.release_body()


async def _read_and_submit(request: Request, orch: Orchestrator, ticket: Ticket, received_at: float) -> _Accepted:
    state = request.app.state
    server = orch.config.server
    body = await read_body(request, server.max_body_bytes, reserve=ticket.hold_body, timeout=server.body_timeout_s)
    # Parsing, templating and tokenizing run on the request threads, media on the media threads
    # (thread_pools.py): slow decodes do not hold up the parsing of other requests. Within a
    # pool, arrival order: the smallest request first was measured against it and changed nothing
    # (benchmarks/results/hostile.md, 2026-11-30).
    threads: ThreadPools = state.threads
    chat = await threads.request(parse_chat_request, body, state.served_model_name, orch.voices)
    del body  # parsed: what is left of it lives in `chat`
    if orch.codec.tokenizer is None:
        raise APIError(
            503, "the pipeline is still starting: " + ", ".join(f"{n} ({why})" for n, why in orch.not_ready().items())
        )
    prompt = await threads.request(rendered_prompt, orch, chat, state.tool_parser)
    parser, sampling = await threads.request(_parser_and_sampling, orch, chat, state.tool_parser, len(prompt))
    req = chat.body
    media = await _decoded_media(chat, orch, ticket, state.media_cache, threads)
    handle = await orch.submit(
        prompt,
        sampling=sampling,
        modalities=chat.modalities,
        media=media,
        received_at=received_at,
        session_id=req.session_id,
        ticket=ticket,
        stream=bool(req.stream),
        voice=chat.voice,
    )
    chat = chat.without_content()
    # vLLM names the answer after the request's id (default: a random one).
    answer_id = (
        f"chatcmpl-{req.request_id}" if "request_id" in req.model_fields_set else f"chatcmpl-{handle.request_id}"
    )
    writer = ChoiceWriter(chat.body, parser, orch.codec.decode_token, prompt)
    return _Accepted(handle, chat, writer, answer_id)


#: The context length used before the entry stage reported one (vLLM then still checks its own).
_UNBOUNDED = 2**31


def _parser_and_sampling(orch: Orchestrator, chat: ChatRequest, parser_class: Any, prompt_len: int) -> tuple[Any, Any]:
    """The request's tool parser and its sampling for the thinker (on a request thread). vLLM's
    tool parser reads the tokenizer's vocabulary (tens of ms for a real one): behind the
    tokenizer's lock; it adjusts ``chat.body``, so it comes first. The sampling (vLLM's checks and
    ``to_sampling_params``: ~0.4 ms) is done here too rather than on the event loop."""
    parser = orch.codec.call_locked(tool_parser, orch, chat, parser_class)
    sampling = engine_sampling(
        chat.body,
        prompt_len=prompt_len,
        max_model_len=orch.admission.max_model_len or _UNBOUNDED,
        defaults=orch.admission.default_sampling(),
    )
    return parser, sampling


@router.websocket("/v1/realtime")
async def realtime(websocket: WebSocket) -> None:
    """A voice session speaking OpenAI's Realtime API (omni_cache/serving/realtime/, docs/realtime.md)."""
    state = websocket.app.state
    problem = bearer_token_problem(websocket.headers.get("authorization", ""), state.api_key)
    if problem is not None:
        await websocket.close(code=CLOSE_POLICY, reason=problem)  # before accept: HTTP 403
        return
    orch: Orchestrator = state.orchestrator
    await serve_realtime(
        websocket,
        orch,
        orch.config.server.realtime,
        state.realtime_sessions,
        served_model=state.served_model_name,
        threads=state.threads,
        images=_realtime_images(orch, state),
        # The connection is watched while a response streams: a client that takes none of it
        # has the response held at its stages (scheduler/client_hold.py), as a chat stream's is.
        # No stall cut here: server.realtime.max_outbox_bytes bounds what waits.
        watch=lambda on_pause, on_resume: SendWatch(transport_of(websocket.scope), math.inf, on_pause, on_resume),
    )


def _realtime_images(orch: Orchestrator, state: Any) -> ImageSource:
    """A session's input_image parts read with the chat API's limits and decoded-item cache:
    checked from the header first, decoded once the session made room (realtime/client_items.py)."""
    decoder = MediaDecoder(
        orch.config.server.media,
        audio_sample_rate=orch.audio_input_rate,
        cache=state.media_cache,
        off_loop=state.threads.media,
    )

    def event_error(e: MediaError, param: str) -> EventError:
        return EventError(str(e), param=e.param or param, code="invalid_value")

    def read(url: str, param: str) -> Any:
        try:
            return decoder.read_image(url, param)
        except MediaError as e:
            raise event_error(e, param) from None

    async def fetch(urls: list[tuple[str, str]]) -> None:
        try:
            await decoder.fetch_urls({url: (param, "image_url", decoder.limits.max_item_bytes) for url, param in urls})
        except MediaError as e:
            raise event_error(e, e.param or "item") from None

    def decode(item: Any) -> MediaItem:
        try:
            return decoder.decode_all([item])[0]
        except MediaError as e:
            raise event_error(e, item.param) from None

    return ImageSource(read, decode, decoder.limits.max_items, fetch, decoder.fetched.clear)


async def _decoded_media(
    chat: ChatRequest, orch: Orchestrator, ticket: Ticket, cache: DecodedCache, threads: ThreadPools
) -> list[MediaItem]:
    """The request's images and clips, each checked against ``server.media`` from its header,
    their decoded size reserved on ``ticket`` (413 / 429, omni_cache/runtime/request_path/admission.py), then
    decoded; reading, inflating and decoding run on the media threads (milliseconds to seconds).
    A bad item is a 400 naming its part."""
    if not chat.media:
        return []
    decoder = MediaDecoder(
        orch.config.server.media,
        audio_sample_rate=orch.audio_input_rate,
        cache=cache,
        use_audio_in_video=_use_audio_in_video(chat),
        video_sampler=orch.video_sampler,
        off_loop=threads.media,
    )
    try:
        await decoder.fetch_all(chat.media)  # http(s) URLs, awaited here: no thread waits on a download
        encoded = await threads.media(decoder.read_all, chat.media)
        orch.admission.hold_media(ticket, [item.decoded_bytes for item in encoded])
        return await threads.media(decoder.decode_all, encoded)
    except MediaError as e:
        raise APIError(400, str(e), param=e.param) from None


async def parse_locked(
    threads: ThreadPools, orch: Orchestrator, writer: ChoiceWriter, fn: Callable[..., Any], *args: Any
) -> Any:
    """``fn(*args)``, a ChoiceWriter call: with a tool parser (it reads the tokenizer) under the
    tokenizer's lock on a request thread; without one, here (nothing else reads the tokenizer)."""
    if writer.parser is None:
        return fn(*args)
    return await threads.request(orch.codec.call_locked, fn, *args)


def _use_audio_in_video(chat: ChatRequest) -> bool | None:
    """The request's ``mm_processor_kwargs.use_audio_in_video``; None: the server's default."""
    return (chat.body.mm_processor_kwargs or {}).get("use_audio_in_video")


def _stream(
    handle: RequestHandle,
    chat: ChatRequest,
    orch: Orchestrator,
    writer: ChoiceWriter,
    answer_id: str,
    threads: ThreadPools,
) -> StreamingResponse:
    """The answer as SSE chunks (:mod:`omni_cache.serving.chat_stream`)."""
    req = chat.body
    base = {
        "id": answer_id,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": orch.served_model_name,
    }
    so = req.stream_options
    options = StreamOptions(
        include_usage=bool(so and so.include_usage),
        continuous_usage=bool(so and so.include_usage and so.continuous_usage_stats),
        return_token_ids=bool(req.return_token_ids),
    )
    return _RequestStream(
        handle,
        orch,
        stream_chunks(
            handle,
            base,
            writer,
            entry_stage=orch.topology.entry.name,
            options=options,
            error_body=lambda e: APIError.from_request_error(e).body(),
            parse=lambda fn, *args: parse_locked(threads, orch, writer, fn, *args),
        ),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


class _RequestStream(StreamingResponse):
    """An SSE response that ends its request however the response ends. The generator's own
    ``finally`` aborts an unanswered request only once the generator started: Starlette cancels
    a response whose client is already gone before it iterates the generator at all, and the
    request (with its place among those in flight) would then live until its stages finished.

    Its client's connection is watched (:mod:`omni_cache.serving.send_watch`): the writes wait
    (and its stages hold its work) while the client takes nothing, and past
    ``server.max_send_stall_s`` of that it is dropped as a slow client, as past
    ``server.max_outbox_bytes``."""

    def __init__(self, handle: RequestHandle, orch: Orchestrator, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._handle = handle
        self._max_stall_s = orch.config.server.max_send_stall_s
        self._metrics = orch.metrics

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        watch = SendWatch(transport_of(scope), self._max_stall_s, self._paused, lambda: self._handle.hold(False))
        response = asyncio.ensure_future(super().__call__(scope, receive, watch.send(send)))
        overflowed = asyncio.ensure_future(self._handle.overflowed.wait())
        stalled = asyncio.ensure_future(watch.stalled())
        try:
            await asyncio.wait({response, overflowed, stalled}, return_when=asyncio.FIRST_COMPLETED)
            if response.done():
                response.result()
            else:
                if stalled.done():
                    self._handle.drop_slow_client(
                        "max_send_stall_s",
                        f"the client took none of the answer for {self._max_stall_s:g} s "
                        "(server.max_send_stall_s): the connection was closed",
                    )
                # Its client stopped reading (server.max_outbox_bytes or max_send_stall_s): the
                # response is given up unfinished, which makes uvicorn close the connection.
                quiet_unfinished_response()
        finally:
            await cancel_and_wait(response, overflowed, stalled)
            if not self._handle.done:
                self._handle.abort("the client disconnected from the stream")

    def _paused(self) -> None:
        """Its client took nothing for a while: the writes wait, and so does the answer's work at
        the stages (scheduler/client_hold.py) until it takes again or is cut."""
        self._metrics.clients.stream_write_paused()
        self._handle.hold(True)


async def _complete(
    handle: RequestHandle, chat: ChatRequest, orch: Orchestrator, request: Request, writer: ChoiceWriter, answer_id: str
) -> Response:
    """The whole answer as one chat.completion (audio encoded in the requested format)."""
    from openai.types.chat.chat_completion_audio import ChatCompletionAudio
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionResponse

    created = int(time.time())
    answer = await collect_unless_disconnected(handle, request)
    done = answer.completed
    # The tool parser reads the tokenizer the worker threads tokenize with: under its lock, in a
    # thread (the lock may be held for a long prompt's tokenizing; the loop does not wait for it).
    threads: ThreadPools = request.app.state.threads
    choice = await parse_locked(
        threads,
        orch,
        writer,
        writer.choice,
        answer.text,
        answer.token_ids,
        answer.logprobs,
        done.finish_reason,
        done.stop_reason,
    )

    def body() -> bytes:
        """The response's JSON; on a response thread: encoding, base64 and rendering a whole
        answer's audio take milliseconds per second of it."""
        if chat.wants_audio:
            data = encode_audio(answer.samples(), answer.sample_rate or orch.audio_sample_rate, chat.audio_format)
            choice.message.audio = ChatCompletionAudio(
                id=f"audio_{handle.request_id}",
                data=base64.b64encode(data).decode("ascii"),
                expires_at=created + AUDIO_TTL_S,
                transcript=done.transcript or "",
            )
        response = ChatCompletionResponse(
            id=answer_id,
            created=created,
            model=orch.served_model_name,
            choices=[choice],
            usage=usage(done.num_prompt_tokens, answer.num_tokens, done.cached_tokens.get(orch.topology.entry.name, 0)),
            # vLLM's prompt_token_ids: media placeholders expanded, as its engine saw them.
            prompt_token_ids=handle.engine_prompt_token_ids if chat.body.return_token_ids else None,
        )
        return JSONResponse(response.model_dump()).body

    return Response(await threads.response(body), media_type="application/json")
