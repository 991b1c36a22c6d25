"""Requests end at once, whatever ends them, and nothing swallows a cancellation.

* A failure while the server handles a stage's output that is not a known bad output (a bug)
  fails that request at once with a 500 naming it, counted in /metrics, instead of leaving it to
  its deadline; the server keeps serving.
* An SSE response gives its request's place among those in flight back however its client
  leaves, also when the client is gone before the response's first byte (Starlette then never
  starts the response's generator).
* The event loop's lag is in /metrics, and a loop held by blocking work shows in it.
* A request vLLM's engine ends with finish_reason "error" fails in its stage (a 500, as
  ``vllm serve`` answers it), never as an answer of what it sampled last.
* omni_cache/tasks.py: tasks ended without swallowing the caller's own cancellation.

The server runs fake stages (tests/fake_stage.py: real processes, real ZMQ, no model)."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
import uuid

import httpx
import pytest
from fake_pipeline import API_KEY, make_orchestrator, write_config
from starlette.requests import ClientDisconnect

from omni_cache.runtime.metrics.prometheus import parse_metrics
from omni_cache.serving.server import ServerThread
from omni_cache.tasks import cancel_and_wait, finish_or_cancel, wait_ended

TOKEN_DELAY_S = 0.2  # a long answer takes tens of seconds
REQUEST_TIMEOUT_S = 120.0  # far past any wait below: an answer that comes came at once


@pytest.fixture(scope="module")
def srv():
    path = write_config(f"ends_{uuid.uuid4().hex[:8]}", token_delay_s=TOKEN_DELAY_S, timeout_s=REQUEST_TIMEOUT_S)
    server = ServerThread(make_orchestrator(path), api_key=API_KEY).start()
    try:
        server.wait_ready(60)
        yield server
    finally:
        server.stop()


def _body(srv, content: str, **extra) -> dict:
    return {
        "model": srv.orchestrator.served_model_name,
        "max_tokens": 4,
        "messages": [{"role": "user", "content": content}],
        **extra,
    }


def _post(srv, body: dict) -> httpx.Response:
    return httpx.post(
        srv.url + "/v1/chat/completions", json=body, timeout=60, headers={"Authorization": f"Bearer {API_KEY}"}
    )


def _metrics(srv) -> list[tuple[str, dict[str, str], float]]:
    r = httpx.get(srv.url + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30)
    return parse_metrics(r.text)


def _value(samples, name: str, **labels: str) -> float:
    return sum(v for n, ls, v in samples if n == name and all(ls.get(k) == x for k, x in labels.items()))


def _wait_nothing_in_flight(srv, timeout: float) -> None:
    orch = srv.orchestrator
    end = time.monotonic() + timeout
    while orch.in_flight or orch.admission.bounds.requests:
        assert time.monotonic() < end, (
            f"still in flight after {timeout:g} s: "
            f"{orch.in_flight} request(s), "
            f"{orch.admission.bounds.requests} ticket(s)"
        )
        time.sleep(0.05)


def test_a_failure_handling_a_stage_output_fails_the_request_at_once(srv, caplog):
    """A bug stands in for any: handling the thinker's output of one request raises. The client
    gets a stable message naming the stage; the exception's text is in the log only."""
    orch = srv.orchestrator
    add = orch.outputs.add

    def failing_add(req, stage, msg, tensors, now):
        if b"BUG" in bytes(t for t in req.prompt_token_ids if t < 256):
            raise RuntimeError("an injected fault")
        return add(req, stage, msg, tensors, now)

    before = _value(_metrics(srv), "omni_cache_output_errors_total", stage="thinker")
    orch.outputs.add = failing_add
    try:
        r = _post(srv, _body(srv, "BUG here"))  # answered long before request_timeout_s
    finally:
        orch.outputs.add = add
    assert r.status_code == 500, r.text
    message = r.json()["error"]["message"]
    assert message.startswith("the server failed on stage 'thinker''s output (logged for request "), message
    assert "injected fault" not in message and "RuntimeError" not in message
    assert "an injected fault" in caplog.text
    assert _value(_metrics(srv), "omni_cache_output_errors_total", stage="thinker") == before + 1
    _wait_nothing_in_flight(srv, 5.0)
    ok = _post(srv, _body(srv, "fine"))
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == "user"


def test_an_sse_client_gone_before_the_first_byte_frees_its_place_at_once(srv):
    """The client sends a long streamed request and closes its socket at once: the answer
    would take over a minute (a token per 0.2 s), its place is back within seconds. Each
    request is seen admitted first (else an empty server proves nothing) and ended as its
    client's leaving (499), not answered or timed out."""
    orch = srv.orchestrator
    submit, fail = orch.submit, orch.ends.fail
    admitted: list[str] = []
    ended: dict[str, tuple[int, str]] = {}

    async def recording_submit(*args, **kwargs):
        handle = await submit(*args, **kwargs)
        admitted.append(handle.request_id)
        return handle

    def recording_fail(req, status, message, **kwargs):
        if not req.done:
            ended[req.request_id] = (status, message)
        return fail(req, status, message, **kwargs)

    content = "x" * 300
    raw = json.dumps(_body(srv, content, max_tokens=400, stream=True)).encode()
    host, port = srv.url.removeprefix("http://").split(":")
    orch.submit, orch.ends.fail = recording_submit, recording_fail
    try:
        for i in range(3):
            with socket.create_connection((host, int(port)), timeout=10) as s:
                s.sendall(
                    f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\n"
                    f"Authorization: Bearer {API_KEY}\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {len(raw)}\r\n\r\n".encode()
                    + raw
                )
            end = time.monotonic() + 30
            while len(admitted) < i + 1:  # the server read the whole body: it takes the request
                assert time.monotonic() < end, f"request {i + 1} was never admitted"
                time.sleep(0.02)
            # admitted and then seen gone; nothing may stay for the answer's minute
            _wait_nothing_in_flight(srv, 10.0)
            assert ended.get(admitted[i]) == (499, "the client disconnected from the stream"), ended
    finally:
        del orch.submit, orch.ends.fail
    ok = _post(srv, _body(srv, "after"))
    assert ok.status_code == 200, ok.text


def test_an_sse_response_that_never_starts_frees_its_place(srv):
    """An ASGI server of spec 2.4 reports a client that is gone by failing ``send`` with an
    OSError: Starlette's response then fails on its first message, before it iterates the
    stream's generator at all, so the generator's own cleanup never runs (uvicorn, spec 2.3,
    starts the generator first). The answer would take over a minute; its place is back within
    seconds."""
    raw = json.dumps(_body(srv, "y" * 300, max_tokens=400, stream=True)).encode()
    incoming = [{"type": "http.request", "body": raw, "more_body": False}]
    sent: list[dict] = []

    async def receive() -> dict:
        return incoming.pop(0) if incoming else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)
        raise OSError("the client is gone")

    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.4"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/chat/completions",
        "raw_path": b"/v1/chat/completions",
        "query_string": b"",
        "root_path": "",
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
        "state": {},
        "headers": [
            (b"content-type", b"application/json"),
            (b"authorization", f"Bearer {API_KEY}".encode()),
            (b"content-length", str(len(raw)).encode()),
        ],
    }
    loop = srv.server.servers[0].get_loop()  # the server's event loop, where its app runs
    with pytest.raises((OSError, ClientDisconnect)):
        asyncio.run_coroutine_threadsafe(srv.app(scope, receive, send), loop).result(30)
    assert sent and sent[0]["type"] == "http.response.start"  # the answer was accepted
    _wait_nothing_in_flight(srv, 10.0)


def test_the_event_loop_lag_is_measured(srv):
    """A probe's lateness is a histogram in /metrics; 0.6 s of blocking work run on the loop (an
    abort that sleeps, standing in for any blocking call) shows as a sample past 0.5 s."""

    def late(samples) -> float:
        count = _value(samples, "omni_cache_event_loop_lag_seconds_count")
        return count - _value(samples, "omni_cache_event_loop_lag_seconds_bucket", le="0.5")

    before = _metrics(srv)
    assert _value(before, "omni_cache_event_loop_lag_seconds_count") > 0
    orch = srv.orchestrator
    orch.abort = lambda request_id, reason="": time.sleep(0.6)  # runs on the loop
    try:
        orch.abort_threadsafe("no-such-request")
        end = time.monotonic() + 10
        while late(_metrics(srv)) < late(before) + 1:
            assert time.monotonic() < end, "the blocked loop did not show in the lag histogram"
            time.sleep(0.1)
    finally:
        del orch.abort


# ---- omni_cache/tasks.py -----------------------------------------------------------------------


def test_cancel_and_wait_ends_the_tasks_and_logs_a_failure(caplog):
    async def main():
        async def forever():
            await asyncio.Event().wait()

        async def fails():
            raise ValueError("boom")

        a = asyncio.create_task(forever())
        b = asyncio.create_task(fails())
        await asyncio.sleep(0)
        with caplog.at_level(logging.ERROR, logger="omni_cache.tasks"):
            await cancel_and_wait(a, b, None)
        assert a.cancelled() and b.done()
        assert "boom" in caplog.text  # logged, not raised, not lost

        slow = asyncio.create_task(asyncio.sleep(10))
        assert not await finish_or_cancel(slow, 0.05) and slow.cancelled()
        quick = asyncio.create_task(asyncio.sleep(0))
        assert await finish_or_cancel(quick, 5.0) and not quick.cancelled()

    asyncio.run(main())


def test_waiting_for_tasks_does_not_swallow_the_callers_cancellation():
    """The caller is cancelled while it waits for a task that ignores its own cancellation for
    a while: the caller's CancelledError comes through (suppress(BaseException) swallowed it)."""

    async def main():
        release, cleaning = asyncio.Event(), asyncio.Event()

        async def stubborn():
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                cleaning.set()
                await release.wait()  # cleans up for a while before it ends
                raise

        inner = asyncio.create_task(stubborn())
        await asyncio.sleep(0)
        closer = asyncio.create_task(cancel_and_wait(inner))
        # The closer cancelled the task and waits for its cleanup (not a guess that it got there).
        await asyncio.wait_for(cleaning.wait(), 5.0)
        assert not closer.done()
        closer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await closer
        assert not inner.done()  # the caller left; the task goes on ending by itself
        release.set()
        assert await wait_ended([inner], 5.0) and inner.cancelled()

    asyncio.run(main())


def test_the_tool_parser_reads_the_tokenizer_under_its_lock_off_the_loop():
    """Before: a request with tools parsed its answer on the event loop without the tokenizer's
    lock, while worker threads tokenized other requests with the same tokenizer."""
    import threading
    from types import SimpleNamespace

    from omni_cache.config.server_schema import ThreadsConfig
    from omni_cache.runtime.request_path.text_codec import TextCodec
    from omni_cache.serving.routes import parse_locked
    from omni_cache.thread_pools import ThreadPools

    codec = TextCodec.__new__(TextCodec)
    codec._lock = threading.Lock()
    orch = SimpleNamespace(codec=codec)
    threads = ThreadPools(ThreadsConfig())
    seen = []

    def parse(x):
        seen.append((threading.current_thread().name, codec._lock.locked()))
        return x

    try:
        assert asyncio.run(parse_locked(threads, orch, SimpleNamespace(parser=object()), parse, 7)) == 7
        assert asyncio.run(parse_locked(threads, orch, SimpleNamespace(parser=None), parse, 8)) == 8
    finally:
        threads.close()
    # A request thread, holding the tokenizer's lock; then, without a tool parser, nothing reads
    # the tokenizer: no hop off the loop.
    assert seen[0][0].startswith("omni-request_") and seen[0][1]
    assert seen[1] == (threading.main_thread().name, False)


class _Fleet:
    """What RequestEnds reads of the stage fleet: replica names, which are up, and the sends
    (recorded, not made)."""

    def __init__(self, down: set[str] = frozenset()) -> None:
        from types import SimpleNamespace

        self.sent: list[tuple[str, object]] = []
        self.names = {(s, i): f"{s}.{i}" for s in ("thinker", "talker") for i in (0, 1)}
        replicas = {n: SimpleNamespace(name=n, up=n not in down) for n in self.names.values()}
        self.supervisor = SimpleNamespace(stages=replicas)

    def name_of(self, stage: str, index: int) -> str | None:
        return self.names.get((stage, index))

    async def send(self, name: str, msg: object, timeout: float) -> None:
        self.sent.append((name, msg))


def test_a_hold_is_said_again_to_the_replicas_now_serving_the_request():
    """While its client takes nothing a hold is renewed every HOLD_RENEW_S, to the replicas the
    request's current attempt runs on, by its current wire id: a request resumed on another
    replica (its first died) is held there too. Once let go, it is not renewed."""
    from omni_cache.runtime.request_path.request_ends import HOLD_LEASE_S, HOLD_RENEW_S, RequestEnds
    from omni_cache.runtime.request_path.requests import RequestTable, new_request
    from omni_cache.wire.messages import Hold

    table, fleet, spawned = RequestTable(), _Fleet(down={"thinker.0"}), []
    ends = RequestEnds(table, fleet=fleet, admission=None, outputs=None, metrics=None, spawn=spawned.append)
    req = new_request(
        [1, 2, 3], ("text",), ("thinker", "talker"), received_at=None, timeout=60, return_latents=False, ticket=None
    )
    table.add(req)

    def said() -> list[tuple[str, Hold]]:
        for coro in spawned:
            asyncio.run(coro)
        spawned.clear()
        out, fleet.sent[:] = list(fleet.sent), []
        return out

    ends.hold_on_stages(req, True, now=100.0)
    assert said() == [("talker.0", Hold(request_id=req.request_id, held=True, lease_s=HOLD_LEASE_S))]
    ends.renew_holds(100.0 + HOLD_RENEW_S / 2)
    assert said() == []  # not due yet
    req.attempt, req.route = 1, {"thinker": 1, "talker": 1}  # resumed: thinker.0 died
    table.rekey(req, req.request_id)
    ends.renew_holds(100.0 + HOLD_RENEW_S)
    renewal = Hold(request_id=f"{req.request_id}.r1", held=True, lease_s=HOLD_LEASE_S)
    assert said() == [("thinker.1", renewal), ("talker.1", renewal)]
    ends.hold_on_stages(req, False, now=102.0)
    assert [m.held for _, m in said()] == [False, False]
    ends.renew_holds(200.0)
    assert said() == []


def test_a_request_the_engine_ends_with_an_error_fails_alone():
    """A response_format schema xgrammar compiles but then rejects its own token (``{"$ref":
    "#"}``) made vLLM end the request with finish_reason "error": the client got a 200 whose
    content was that token ("\\u0000") with finish_reason "error" (``vllm serve``: a 500)."""
    from types import SimpleNamespace

    from vllm.exceptions import GenerationError

    from workers.llm_stage import ENGINE_ERROR, LLMStage

    def output(rid: str, reason: str) -> SimpleNamespace:
        completion = SimpleNamespace(finish_reason=reason, token_ids=[0], text="\0", stop_reason=None, logprobs=None)
        return SimpleNamespace(request_id=rid, outputs=[completion], finished=True)

    stage = LLMStage.__new__(LLMStage)  # the engine's outputs are all step() reads here
    stage.engine = SimpleNamespace(step=lambda: [output("bad", "error")])
    stage._tracked = {"bad": SimpleNamespace(num_prompt_tokens=10)}
    [out] = stage.step()
    assert isinstance(out.error, GenerationError) and str(out.error) == ENGINE_ERROR
    assert not out.finished and out.token_ids == [] and out.text == ""
