"""``omni-serve``'s HTTP API: OpenAI-compatible chat completions over the stage pipeline.

Routes (FastAPI, served by uvicorn on ``server.host:server.port``, 127.0.0.1:8091 by default):

``POST /v1/chat/completions``
    OpenAI chat completions: ``model`` (the served model name), ``messages``, ``max_tokens`` /
    ``max_completion_tokens``, ``temperature``, ``top_p``, ``seed``, ``stream``
    (+ ``stream_options.include_usage``), ``modalities`` (``["text"]`` default, ``["text",
    "audio"]`` adds audio), ``audio: {voice, format}``. With audio the message carries
    ``audio: {id, data, expires_at, transcript}``, ``data`` base64 24 kHz mono audio in
    ``audio.format``: ``wav`` (default), ``flac``, ``mp3``, ``opus`` or ``pcm16``
    (:mod:`omni_cache.serving.audio_formats`). Streamed (:mod:`omni_cache.serving.chat_stream`), the first chunk
    carries the first text or audio together with the role, and ``delta.audio.data`` holds base64
    ``pcm16`` chunks (the only format a stream takes). Unknown fields are ignored.
``GET /health``   200 ``{"status": "ok"}`` when every stage is up, else 503 naming the others.
``GET /v1/models``, ``GET /metrics`` (Prometheus text).

Errors are OpenAI-style JSON ``{"error": {"message", "type", "param", "code"}}``: 400 bad JSON /
fields / over-long prompt, 401 missing or wrong API key (every route but /health, when a key is
set), 404 unknown model, 503 a stage is down or died, 504 deadline. Streams report errors that
happen after the first byte as an SSE event ``data: {"error": {...}}`` followed by ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hmac
import logging
import os
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, Literal

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from omni_cache.serving.audio_formats import STREAM_FORMAT, UnsupportedFormat, check_format, encode_audio
from omni_cache.serving.chat_stream import collect_unless_disconnected, stream_chunks, usage
from omni_cache.serving.metrics import CONTENT_TYPE
from omni_cache.runtime.orchestrator import Orchestrator, RequestError

logger = logging.getLogger("omni_cache.serving.server")

__all__ = ["API_KEY_ENV", "APIError", "ChatCompletionRequest", "ServerThread", "create_app", "serve"]

API_KEY_ENV = "OMNI_CACHE_API_KEY"
AUDIO_TTL_S = 3600

_INT64 = 2**63 - 1


# --------------------------------------------------------------------------------------------------
# Request schema
# --------------------------------------------------------------------------------------------------


class _Model(BaseModel):
    # strict: "5" is not an int, 1 is not a bool (OpenAI rejects both); unknown fields are ignored.
    model_config = ConfigDict(extra="ignore", strict=True)


class ContentPart(_Model):
    type: str
    text: str | None = None


class ChatMessage(_Model):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None


class AudioOptions(_Model):
    voice: str | None = None
    # Default: "wav", or "pcm16" when streaming (the only format a stream can carry).
    format: str | None = None


class StreamOptions(_Model):
    include_usage: bool = False


class ChatCompletionRequest(_Model):
    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1, le=2**31)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=2**31)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    seed: int | None = Field(default=None, ge=-_INT64 - 1, le=_INT64)
    stream: bool = False
    stream_options: StreamOptions | None = None
    modalities: list[Literal["text", "audio"]] | None = None
    audio: AudioOptions | None = None
    n: int | None = Field(default=None, ge=1)


# --------------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------------

_ERROR_TYPES = {
    400: ("invalid_request_error", None),
    401: ("authentication_error", "invalid_api_key"),
    404: ("invalid_request_error", "not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    499: ("client_closed_request", None),
    500: ("server_error", None),
    503: ("service_unavailable", "stage_unavailable"),
    504: ("timeout", "request_timeout"),
}


class APIError(Exception):
    """An error answered as OpenAI-style JSON."""

    def __init__(self, status: int, message: str, *, type: str | None = None,
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        default_type, default_code = _ERROR_TYPES.get(status, ("server_error", None))
        self.status = status
        self.message = message
        self.type = type or default_type
        self.param = param
        self.code = code if code is not None else default_code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)

    @classmethod
    def from_request_error(cls, e: RequestError) -> APIError:
        return cls(e.status, e.message)


def _validation_error(exc: ValidationError) -> APIError:
    errors = exc.errors()
    first = errors[0] if errors else {"type": "", "loc": (), "msg": str(exc)}
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error") or first.get("msg")
        return APIError(400, f"invalid JSON body: {detail}", code="invalid_json")
    parts = []
    for err in errors[:3]:
        loc = ".".join(str(p) for p in err.get("loc", ())) or "request body"
        parts.append(f"{loc}: {err.get('msg')}")
    if len(errors) > 3:
        parts.append(f"({len(errors) - 3} more)")
    param = ".".join(str(p) for p in first.get("loc", ())) or None
    return APIError(400, "invalid request: " + "; ".join(parts), param=param)


# --------------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------------


def _message_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    out = []
    for i, m in enumerate(messages):
        if m.content is None:
            content = ""
        elif isinstance(m.content, str):
            content = m.content
        else:
            texts = []
            for j, part in enumerate(m.content):
                if part.type != "text":
                    raise APIError(400, f"content part type {part.type!r} is not supported (text only)",
                                   param=f"messages.{i}.content.{j}.type")
                if part.text is None:
                    raise APIError(400, "a text content part needs 'text'", param=f"messages.{i}.content.{j}.text")
                texts.append(part.text)
            content = "".join(texts)
        d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": content}
        if m.name:
            d["name"] = m.name
        out.append(d)
    return out


# --------------------------------------------------------------------------------------------------
# The app
# --------------------------------------------------------------------------------------------------


def create_app(
    orch: Orchestrator,
    *,
    api_key: str | None = None,
    manage_lifecycle: bool = True,
    on_ready: Callable[[], None] | None = None,
    on_startup_failure: Callable[[BaseException], None] | None = None,
) -> FastAPI:
    """The FastAPI app serving ``orch``.

    With ``manage_lifecycle`` the app's lifespan starts the orchestrator in the background (the
    HTTP port answers at once; /health says 503 until every stage is ready) and closes it on
    shutdown. ``on_ready`` / ``on_startup_failure`` are called when start-up finished / failed.
    """
    served = orch.served_model_name
    entry = orch.entry.name
    # vLLM's metrics carry the served model name as their model_name label.
    orch.metrics.model_name = served

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        task: asyncio.Task | None = None
        if manage_lifecycle:
            async def boot() -> None:
                try:
                    await orch.start()
                except asyncio.CancelledError:
                    raise
                except BaseException as e:  # noqa: BLE001
                    app.state.startup_error = e
                    if on_startup_failure is not None:
                        on_startup_failure(e)
                    else:
                        logger.error("the pipeline did not start: %s", e)
                    return
                if on_ready is not None:
                    on_ready()

            task = asyncio.create_task(boot(), name="omni-cache-start")
        app.state.startup_task = task
        try:
            yield
        finally:
            if task is not None and not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
            if manage_lifecycle:
                await orch.close()

    app = FastAPI(title="omni_cache", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.orchestrator = orch
    app.state.startup_error = None

    async def check_key(request: Request) -> None:
        if not api_key:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise APIError(401, "missing API key: send 'Authorization: Bearer <key>'")
        if not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError(401, "incorrect API key provided")

    auth = [Depends(check_key)]

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestError)
    async def _request_error(_: Request, exc: RequestError) -> JSONResponse:
        return APIError.from_request_error(exc).response()

    @app.exception_handler(RequestValidationError)
    async def _fastapi_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return APIError(400, f"invalid request: {exc.errors()}").response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return APIError(exc.status_code, str(exc.detail)).response()

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error")
        return APIError(500, f"internal error: {type(exc).__name__}: {exc}").response()

    @app.get("/health")
    async def health() -> JSONResponse:
        if app.state.startup_error is not None:
            return JSONResponse({"status": "failed", "message": f"the pipeline did not start: "
                                 f"{app.state.startup_error}"}, status_code=503)
        not_ready = orch.not_ready()
        if not not_ready:
            return JSONResponse({"status": "ok"})
        message = "stage(s) not ready: " + ", ".join(f"{n} ({why})" for n, why in not_ready.items())
        return JSONResponse({"status": "unavailable", "message": message, "stages": not_ready},
                            status_code=503)

    @app.get("/v1/models", dependencies=auth)
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [
            {"id": served, "object": "model", "created": 0, "owned_by": "omni_cache"}]}

    @app.get("/metrics", dependencies=auth)
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(await orch.render_metrics(), media_type=CONTENT_TYPE)

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat_completions(request: Request):
        received_at = time.monotonic()
        body = await request.body()
        try:
            req = ChatCompletionRequest.model_validate_json(body)
        except ValidationError as e:
            raise _validation_error(e) from None
        if req.model != served:
            raise APIError(404, f"the model {req.model!r} does not exist; this server serves {served!r}",
                           param="model", code="model_not_found")
        if req.n not in (None, 1):
            raise APIError(400, "only n=1 is supported", param="n")
        modalities = tuple(dict.fromkeys(req.modalities or ["text"]))
        wants_audio = "audio" in modalities
        audio_format = (req.audio.format if req.audio else None) or (STREAM_FORMAT if req.stream else "wav")
        if wants_audio:
            try:
                check_format(audio_format, stream=req.stream)
            except UnsupportedFormat as e:
                raise APIError(400, str(e), param="audio.format") from None
        messages = _message_dicts(req.messages)
        if orch.tokenizer is None:
            raise APIError(503, "the pipeline is still starting: "
                           + ", ".join(f"{n} ({why})" for n, why in orch.not_ready().items()))
        try:
            prompt = await asyncio.to_thread(orch.tokenize_messages, messages)
        except Exception as e:  # noqa: BLE001 -- a chat template may raise on odd conversations
            raise APIError(400, f"could not apply the chat template: {e}", param="messages") from None
        handle = await orch.submit(
            prompt,
            max_tokens=req.max_completion_tokens or req.max_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            seed=req.seed,
            modalities=modalities,
            received_at=received_at,
        )
        chat_id = f"chatcmpl-{handle.request_id}"
        created = int(time.time())
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            base = {"id": chat_id, "object": "chat.completion.chunk", "created": created, "model": served}
            return StreamingResponse(
                stream_chunks(handle, base, entry_stage=entry, include_usage=include_usage,
                              error_body=lambda e: APIError.from_request_error(e).body()),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        answer = await collect_unless_disconnected(handle, request)
        done = answer.completed
        message: dict[str, Any] = {"role": "assistant", "content": answer.text}
        if wants_audio:
            data = await asyncio.to_thread(encode_audio, answer.samples(),
                                           answer.sample_rate or orch.audio_sample_rate, audio_format)
            message["audio"] = {
                "id": f"audio_{handle.request_id}",
                "data": base64.b64encode(data).decode("ascii"),
                "expires_at": created + AUDIO_TTL_S,
                "transcript": answer.text,
            }
        return JSONResponse({
            "id": chat_id,
            "object": "chat.completion",
            "created": created,
            "model": served,
            "choices": [{"index": 0, "message": message, "finish_reason": done.finish_reason,
                         "logprobs": None}],
            "usage": usage(done.num_prompt_tokens, answer.num_tokens, done.cached_tokens.get(entry, 0)),
        })

    return app


# --------------------------------------------------------------------------------------------------
# Running it
# --------------------------------------------------------------------------------------------------


def _bound_port(server: Any, default: int) -> int:
    with contextlib.suppress(Exception):
        return int(server.servers[0].sockets[0].getsockname()[1])
    return default


def serve(config: Any, args: Any) -> int:
    """Run ``omni-serve`` until SIGINT/SIGTERM: start the stages, serve HTTP, stop everything.

    Returns 0 after a clean shutdown, 1 when the pipeline did not start.
    """
    import uvicorn

    api_key = getattr(args, "api_key", None) or os.environ.get(API_KEY_ENV) or None
    orch = Orchestrator(
        config,
        config_path=getattr(args, "stage_config", None),
        checkpoint_dir=getattr(args, "checkpoint_dir", None),
        prefix_cache=not getattr(args, "no_prefix_cache", False),
    )
    host, port = config.server.host, config.server.port
    holder: dict[str, Any] = {}
    failures: list[BaseException] = []

    def on_failure(exc: BaseException) -> None:
        failures.append(exc)
        print(f"omni-serve: the pipeline did not start: {exc}", file=sys.stderr, flush=True)
        if "server" in holder:
            holder["server"].should_exit = True

    def on_ready() -> None:
        bound = _bound_port(holder.get("server"), port)
        print(f"omni-serve: ready: model {orch.served_model_name!r} at http://{host}:{bound}",
              flush=True)

    app = create_app(orch, api_key=api_key, on_ready=on_ready, on_startup_failure=on_failure)
    uv_config = uvicorn.Config(
        app, host=host, port=port, lifespan="on",
        log_level=getattr(args, "log_level", "info") or "info",
        timeout_graceful_shutdown=5,
    )
    server = uvicorn.Server(uv_config)
    holder["server"] = server
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    finally:
        orch.kill_all_sync()  # a no-op after a clean close
    return 1 if failures else 0


class ServerThread:
    """The HTTP server with its orchestrator in a background thread (tests, notebooks)::

        with ServerThread(Orchestrator(config, ...), api_key="k") as srv:
            srv.wait_ready(60)
            httpx.get(srv.url + "/health")
    """

    def __init__(self, orch: Orchestrator, *, host: str = "127.0.0.1", port: int = 0,
                 api_key: str | None = None, log_level: str = "warning") -> None:
        import uvicorn

        self.orchestrator = orch
        self.app = create_app(orch, api_key=api_key)
        self.server = uvicorn.Server(uvicorn.Config(
            self.app, host=host, port=port, lifespan="on", log_level=log_level,
            timeout_graceful_shutdown=2,
        ))
        self._host = host
        self._thread = threading.Thread(target=self.server.run, name="omni-cache-http", daemon=True)
        self.url = ""

    def start(self, timeout: float = 30.0) -> ServerThread:
        self._thread.start()
        end = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > end:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.02)
        self.url = f"http://{self._host}:{_bound_port(self.server, 0)}"
        return self

    def wait_ready(self, timeout: float = 600.0) -> None:
        """Block until every stage is ready; raises the start-up error if there was one."""
        end = time.monotonic() + timeout
        while not self.orchestrator.started:
            error = self.app.state.startup_error
            if error is not None:
                raise error
            if time.monotonic() > end:
                raise TimeoutError(f"the pipeline was not ready after {timeout:g} s: "
                                   f"{self.orchestrator.not_ready()}")
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=60)
        self.orchestrator.kill_all_sync()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
