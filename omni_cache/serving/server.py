"""``omni-serve``'s HTTP API: OpenAI-compatible chat completions over the stage pipeline.

Routes (FastAPI, served by uvicorn on ``server.host:server.port``, 127.0.0.1:8091 by default):

``POST /v1/chat/completions``
    OpenAI chat completions as ``vllm serve`` takes them: the body is vLLM's
    ``ChatCompletionRequest``, every field of it supported, refused by name or ignored where vLLM
    ignores it (:mod:`omni_cache.serving.chat_fields`), plus ``modalities`` (``["text"]`` default,
    ``["text", "audio"]`` adds audio) and ``audio: {voice, format}``. With audio the message
    carries ``audio: {id, data, expires_at, transcript}``, ``data`` base64 24 kHz mono audio in
    ``audio.format``: ``wav`` (default), ``flac``, ``mp3``, ``opus`` or ``pcm16``
    (:mod:`omni_cache.serving.audio_formats`). Streamed (:mod:`omni_cache.serving.chat_stream`),
    the first chunk carries the first text or audio together with the role, and
    ``delta.audio.data`` holds base64 ``pcm16`` chunks (the only format a stream takes).
``GET /health``   200 ``{"status": "ok"}`` when every stage replica is up; 200 ``"degraded"`` naming
                  the replicas that are down while every stage has one up; else 503 naming the
                  stages that have none.
``GET /v1/models`` (vLLM's model list), ``GET /metrics`` (Prometheus text).

Errors are vLLM's bodies ``{"error": {"message", "type", "param", "code"}}``
(:mod:`omni_cache.serving.errors`): 400 bad JSON / fields / a refused parameter / an over-long
prompt, 401 missing or wrong API key (every route but /health, when a key is set), 404 unknown
model, 413 a body over ``server.max_body_bytes`` or media that can never fit, 429 (OpenAI's rate
limit body) with ``Retry-After`` past the bounds on requests and decoded media in flight
(:mod:`omni_cache.runtime.request_path.admission`), 503 a stage is down or died, 504 deadline. Streams report
errors that happen after the first byte as an SSE event ``data: {"error": {...}}`` followed by
``data: [DONE]``.

This module assembles the app (:func:`create_app`) and runs it (:func:`serve`, :class:`ServerThread`);
the routes are in :mod:`omni_cache.serving.routes`, the request checks in
:mod:`omni_cache.serving.chat_request`, the error bodies in :mod:`omni_cache.serving.errors` and
the API key check in :mod:`omni_cache.serving.auth`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI

from omni_cache.config.addresses import RunDirError
from omni_cache.runtime.metrics.prometheus import OrchestratorMetrics
from omni_cache.runtime.orchestrator import Orchestrator
from omni_cache.serving.auth import API_KEY_ENV
from omni_cache.serving.chat_output import parser_class
from omni_cache.serving.errors import add_error_handlers
from omni_cache.serving.http_protocol import HttpProtocol
from omni_cache.serving.media import DecodedCache
from omni_cache.serving.preload import preload
from omni_cache.serving.realtime.connection import SessionRegistry
from omni_cache.serving.realtime.ws_protocol import bounded_ws_protocol
from omni_cache.serving.routes import router
from omni_cache.tasks import cancel_and_wait
from omni_cache.thread_pools import ThreadPools

logger = logging.getLogger(__name__)

#: WebSocket permessage-deflate (negotiated, so a client that offers it simply goes without).
#: Off: realtime sessions send audio as base64 JSON, which deflate barely shrinks, and inflating
#: every 40 ms append was ~12% of the event loop's time under 16 streaming sessions
#: (benchmarks.realtime_load, py-spy on the loop thread).
WS_DEFLATE = False

__all__ = ["ServerThread", "create_app", "protocol_options", "serve"]


def protocol_options(config: Any, metrics: OrchestratorMetrics | None = None) -> dict[str, Any]:
    """uvicorn's protocol settings for a pipeline ``config``: HTTP whose requests see their
    connection (:mod:`omni_cache.serving.http_protocol`: streamed answers watch their client's
    TCP acknowledgements); WebSockets through the bounded protocol
    (:mod:`omni_cache.serving.realtime.ws_protocol`), its largest message and read budget
    (counted in ``metrics``), no deflate."""
    realtime = config.server.realtime
    return {
        "http": HttpProtocol,
        "ws": bounded_ws_protocol(
            realtime.max_event_bytes,
            realtime.max_read_bytes_per_s,
            on_read_held=None if metrics is None else metrics.clients.realtime_read_held,
        ),
        "ws_per_message_deflate": WS_DEFLATE,
        "ws_max_size": realtime.max_message_bytes,
    }


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
    """The FastAPI app serving ``orch``: the routes of :mod:`omni_cache.serving.routes`, the
    error handlers of :mod:`omni_cache.serving.errors`, and what the routes read on ``app.state``.

    With ``manage_lifecycle`` the app's lifespan starts the orchestrator in the background (the
    HTTP port answers at once; /health says 503 until every stage is ready) and closes it on
    shutdown. ``on_ready`` / ``on_startup_failure`` are called when start-up finished / failed.
    """
    # vLLM's metrics carry the served model name as their model_name label.
    orch.metrics.model_name = orch.served_model_name
    lifespan = _lifespan(orch, manage_lifecycle, on_ready, on_startup_failure)
    app = FastAPI(title="omni_cache", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.orchestrator = orch
    app.state.served_model_name = orch.served_model_name
    app.state.api_key = api_key
    app.state.startup_error = None
    app.state.media_cache = DecodedCache(orch.config.server.media.decoded_cache_bytes)
    app.state.threads = ThreadPools(orch.config.server.threads)  # shut down with the app (lifespan)
    try:
        app.state.tool_parser = parser_class(orch.config.server.tool_call_parser, orch.served_model_name)
    except TypeError as e:
        raise ValueError(f"server.tool_call_parser: {e}") from None
    app.state.realtime_sessions = SessionRegistry()  # /v1/realtime's open sessions
    add_error_handlers(app)
    app.include_router(router)
    return app


def _lifespan(
    orch: Orchestrator,
    manage_lifecycle: bool,
    on_ready: Callable[[], None] | None,
    on_startup_failure: Callable[[BaseException], None] | None,
) -> Callable[[FastAPI], Any]:
    """Start the orchestrator in the background when the app starts, close it when it stops."""

    async def boot(app: FastAPI) -> None:
        imports = asyncio.create_task(asyncio.to_thread(preload), name="omni-cache-preload")
        threads = asyncio.create_task(asyncio.to_thread(app.state.threads.start_threads), name="omni-cache-threads")
        try:
            await orch.start()
            await imports  # long done: the stages take seconds to start
            await threads
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001
            app.state.startup_error = e
            if on_startup_failure is not None:
                on_startup_failure(e)
            else:
                logger.error("the pipeline did not start: %s", e)
            return
        orch.heap.freeze_startup_objects()  # omni-serve's own process only
        if on_ready is not None:
            on_ready()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        task: asyncio.Task | None = None
        if manage_lifecycle:
            task = asyncio.create_task(boot(app), name="omni-cache-start")
        app.state.startup_task = task
        try:
            yield
        finally:
            await cancel_and_wait(task)  # None or done: nothing to cancel
            if manage_lifecycle:
                await orch.close()
            app.state.threads.close()

    return lifespan


# --------------------------------------------------------------------------------------------------
# Running it
# --------------------------------------------------------------------------------------------------


def _bound_port(server: Any, default: int) -> int:
    with contextlib.suppress(Exception):
        return int(server.servers[0].sockets[0].getsockname()[1])
    return default


def serve(config: Any, args: Any, stage_forkers: Any = None) -> int:
    """Run ``omni-serve`` until SIGINT/SIGTERM: start the stages, serve HTTP, stop everything.
    ``stage_forkers``: the stage forkers started for ``config`` (the caller closes them).

    Returns 0 after a clean shutdown, 1 when the pipeline did not start.
    """
    import uvicorn

    api_key = getattr(args, "api_key", None) or os.environ.get(API_KEY_ENV) or None
    try:
        orch = Orchestrator(
            config,
            manage_heap=True,  # omni-serve's process is the server's own
            checkpoint_dir=getattr(args, "checkpoint_dir", None),
            prefix_cache=not getattr(args, "no_prefix_cache", False),
            stage_forkers=stage_forkers,
        )
    except RunDirError as e:
        print(f"omni-serve: {e}", file=sys.stderr, flush=True)
        return 1
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
        print(f"omni-serve: ready: model {orch.served_model_name!r} at http://{host}:{bound}", flush=True)

    app = create_app(orch, api_key=api_key, on_ready=on_ready, on_startup_failure=on_failure)
    uv_config = uvicorn.Config(
        app,
        host=host,
        port=port,
        lifespan="on",
        log_level=getattr(args, "log_level", "info") or "info",
        timeout_graceful_shutdown=5,
        **protocol_options(config, orch.metrics),
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

    def __init__(
        self,
        orch: Orchestrator,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: str | None = None,
        log_level: str = "warning",
    ) -> None:
        import uvicorn

        self.orchestrator = orch
        self.app = create_app(orch, api_key=api_key)
        self.server = uvicorn.Server(
            uvicorn.Config(
                self.app,
                host=host,
                port=port,
                lifespan="on",
                log_level=log_level,
                timeout_graceful_shutdown=2,
                **protocol_options(orch.config, orch.metrics),
            )
        )
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
                raise TimeoutError(f"the pipeline was not ready after {timeout:g} s: {self.orchestrator.not_ready()}")
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=60)
        self.orchestrator.kill_all_sync()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
