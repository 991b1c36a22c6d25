"""The HTTP API, orchestrator and Python API against fake stage processes (no vLLM; fast).

The fake stages (tests/fake_stage.py) are real OS processes started by the orchestrator with the
stage command line, talking the stage protocol over real ZMQ sockets: an echo "thinker" (answers
with the prompt's bytes) and a "decoder" (a sine per token, 24 kHz float32).
"""

from __future__ import annotations

import base64
import io
import json
import os
import signal
import socket
import sys
import threading
import time
import uuid
import wave
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import pytest
import soundfile
from fake_pipeline import (  # noqa: F401  (re-used by this module's tests)
    API_KEY,
    FAKE_STAGE,
    MAX_BODY_BYTES,
    MAX_MESSAGE_BYTES,
    MAX_MODEL_LEN,
    SAMPLES_PER_TOKEN,
    TIMEOUT_S,
    TOKEN_DELAY_S,
    ByteTokenizer,
    echo,
    fake_server,
    make_orchestrator,
    sse_events,
    write_config,
)

from omni_cache.config import load_config
from omni_cache.config.addresses import control_address
from omni_cache.pcm import to_pcm16
from omni_cache.runtime.metrics.prometheus import parse_metrics
from omni_cache.runtime.supervision.process_runner import StageStartError
from omni_cache.serving.audio_formats import encode_audio
from omni_cache.serving.server import ServerThread


def assert_gone(pids) -> None:
    for pid in pids:
        if pid is None:
            continue
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.fixture(scope="module")
def srv():
    name = f"unit_{uuid.uuid4().hex[:8]}"
    orch = make_orchestrator(write_config(name))
    server = ServerThread(orch, api_key=API_KEY).start()
    pids = []
    try:
        server.wait_ready(60)
        pids = list(orch.stage_pids().values())
        yield server
        pids += list(orch.stage_pids().values())  # after restarts
    finally:
        server.stop()
    assert_gone(pids)  # no orphans


@pytest.fixture
def http(srv):
    with httpx.Client(base_url=srv.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30) as client:
        yield client


@pytest.fixture
def oai(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=API_KEY, max_retries=0, timeout=30)


def model(srv) -> str:
    return srv.orchestrator.served_model_name


def chat(srv, content="hello", **extra):
    return {"model": model(srv), "messages": [{"role": "user", "content": content}], **extra}


def wait_healthy(srv, timeout=30.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if httpx.get(srv.url + "/health").status_code == 200:
            return
        time.sleep(0.1)
    raise AssertionError(f"not healthy after {timeout} s: {httpx.get(srv.url + '/health').json()}")


# --------------------------------------------------------------------------------------------------


def test_control_address_default():
    config = load_config(write_config("addr_test"))
    assert control_address(config) is None  # the server chooses it (tests/test_default_addresses.py)


def test_wav_roundtrip():
    t = np.arange(2400) / 24000
    x = (0.5 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    data = encode_audio(x, 24000, "wav")
    with wave.open(io.BytesIO(data)) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth(), w.getnframes()) == (24000, 1, 2, 2400)
    y, rate = soundfile.read(io.BytesIO(data), dtype="float32")
    assert rate == 24000 and np.max(np.abs(x - y)) < 1e-4
    assert len(to_pcm16(x[:1200], 12000)) == 2 * 2400  # resampled to 24 kHz


def test_health_is_open_and_api_key_protects_the_rest(srv):
    r = httpx.get(srv.url + "/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        r = httpx.get(srv.url + "/v1/models", headers=headers)
        assert r.status_code == 401, headers
        assert r.json() == {"error": "Unauthorized"}  # vllm serve's body
        assert httpx.get(srv.url + "/metrics", headers=headers).status_code == 401
        assert httpx.post(srv.url + "/v1/chat/completions", json=chat(srv), headers=headers).status_code == 401
    r = httpx.get(srv.url + "/v1/models", headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 200 and r.json()["data"][0]["id"] == model(srv)


def test_text_answer_with_openai_client(srv, oai):
    content = f"text {uuid.uuid4().hex[:6]}"
    r = oai.chat.completions.create(model=model(srv), messages=[{"role": "user", "content": content}], max_tokens=8)
    assert r.choices[0].message.content == echo(content, 8)
    assert r.choices[0].finish_reason == "length"
    assert r.choices[0].message.audio is None
    assert r.usage.prompt_tokens == len(f"user: {content}\n")
    assert r.usage.completion_tokens == 8


def test_shared_prefix_reports_cached_tokens(srv, oai):
    prefix = "a long shared system prompt " * 3 + uuid.uuid4().hex
    cached = []
    for q in ("first question", "second question"):
        r = oai.chat.completions.create(
            model=model(srv),
            max_tokens=4,
            messages=[{"role": "system", "content": prefix}, {"role": "user", "content": q}],
        )
        cached.append(r.usage.prompt_tokens_details.cached_tokens)
    assert cached[0] == 0 and cached[1] >= len(prefix) // 4 * 4


def test_audio_answer_is_a_24khz_mono_16bit_wav(srv, oai):
    r = oai.chat.completions.create(
        model=model(srv),
        messages=[{"role": "user", "content": "sing"}],
        max_tokens=6,
        modalities=["text", "audio"],
        audio={"voice": "default", "format": "wav"},
    )
    msg = r.choices[0].message
    assert msg.content == echo("sing", 6)
    assert msg.audio.transcript == msg.content and msg.audio.id and msg.audio.expires_at > time.time()
    with wave.open(io.BytesIO(base64.b64decode(msg.audio.data))) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (24000, 1, 2)
        assert w.getnframes() == 6 * SAMPLES_PER_TOKEN


def test_stream_text_and_audio_ends_with_done(srv, http):
    body = chat(
        srv,
        "stream me",
        max_tokens=10,
        stream=True,
        modalities=["text", "audio"],
        stream_options={"include_usage": True},
    )
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == echo("stream me", 10)
    pcm = b"".join(
        base64.b64decode(c["choices"][0]["delta"]["audio"]["data"])
        for c in chunks
        if c["choices"] and "audio" in c["choices"][0]["delta"]
    )
    assert len(pcm) == 2 * 10 * SAMPLES_PER_TOKEN
    finish = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finish) == 1 and finish[0]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 10


def test_stream_with_openai_client(srv, oai):
    stream = oai.chat.completions.create(
        model=model(srv), messages=[{"role": "user", "content": "hey"}], max_tokens=5, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == echo("hey", 5)


@pytest.mark.parametrize(
    "body, status, needle",
    [
        (b"{not json", 400, "JSON decode error"),
        (b"", 400, "JSON decode error"),
        (b"[1, 2]", 400, "validation error"),
        (json.dumps({"model": "M", "messages": "hello"}).encode(), 400, "messages"),
        (json.dumps({"model": "M", "messages": [{"role": "user", "content": 5}]}).encode(), 400, "content"),
        (
            json.dumps({"model": "M", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}).encode(),
            400,
            "max_tokens",
        ),
        (
            json.dumps({"model": "M", "messages": [{"role": "user", "content": "x"}], "temperature": "hot"}).encode(),
            400,
            "temperature",
        ),
        (
            json.dumps({"model": "M", "messages": [{"role": "user", "content": "x"}], "temprature": 0.5}).encode(),
            400,
            "temprature",
        ),
        (
            json.dumps({"model": "M", "messages": [{"role": "user", "content": "x"}], "echo": True}).encode(),
            400,
            "echo",
        ),
        (
            json.dumps(
                {"model": "M", "messages": [{"role": "user", "content": "x"}], "modalities": ["video"]}
            ).encode(),
            400,
            "modalities",
        ),
        (
            json.dumps(
                {
                    "model": "M",
                    "messages": [{"role": "user", "content": "x"}],
                    "modalities": ["text", "audio"],
                    "audio": {"voice": "default", "format": "aac"},
                }
            ).encode(),
            400,
            "'wav', 'flac', 'mp3', 'opus', 'pcm16'",
        ),
        (
            json.dumps(
                {
                    "model": "M",
                    "messages": [{"role": "user", "content": "x"}],
                    "modalities": ["text", "audio"],
                    "stream": True,
                    "audio": {"voice": "default", "format": "wav"},
                }
            ).encode(),
            400,
            "'pcm16'",
        ),
        (
            json.dumps(
                {
                    "model": "M",
                    "messages": [
                        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}
                    ],
                }
            ).encode(),
            400,
            "image_url",
        ),
        (
            json.dumps({"model": "M", "messages": [{"role": "user", "content": "x" * MAX_MODEL_LEN}]}).encode(),
            400,
            str(MAX_MODEL_LEN),
        ),
        (
            json.dumps({"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]}).encode(),
            404,
            "no-such-model",
        ),
        (
            json.dumps(
                {
                    "model": "M",
                    "messages": [{"role": "user", "content": "x"}],
                    "modalities": ["text", "audio"],
                    "audio": {"voice": "alloy", "format": "wav"},
                }
            ).encode(),
            400,
            "voice 'alloy' is not available",
        ),
        (
            json.dumps({"model": "M", "messages": [{"role": "user", "content": "x" * MAX_BODY_BYTES}]}).encode(),
            413,
            f"over {MAX_BODY_BYTES} bytes (server.max_body_bytes)",
        ),
    ],
)
def test_bad_requests_get_clear_errors(srv, http, body, status, needle):
    body = body.replace(b'"M"', json.dumps(model(srv)).encode())
    r = http.post("/v1/chat/completions", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert needle in err["message"], err
    assert err["code"] == status  # vLLM's body: the status as the code
    if status == 404:
        assert (err["type"], err["param"]) == ("NotFoundError", "model")


def test_over_long_prompt_message_names_the_lengths(srv, http):
    content = "y" * MAX_MODEL_LEN
    r = http.post("/v1/chat/completions", json=chat(srv, content, max_tokens=2))
    assert r.status_code == 400
    msg = r.json()["error"]["message"]
    prompt_len = len(f"user: {content}\n")
    assert str(MAX_MODEL_LEN) in msg and str(prompt_len) in msg


def test_max_tokens_past_the_context_is_clamped_as_vllm_does(srv, http):
    """A prompt that fits with max_tokens that do not: vLLM lowers max_tokens to what is left
    (25 tokens here: the fake thinker answers one per TOKEN_DELAY_S)."""
    content = "y" * 480
    r = http.post("/v1/chat/completions", json=chat(srv, content, max_tokens=200))
    assert r.status_code == 200, r.text
    prompt_len = len(f"user: {content}\n")
    assert r.json()["usage"]["completion_tokens"] == MAX_MODEL_LEN - prompt_len


def test_oversized_body_without_a_length_is_refused_while_read(srv, http):
    """Chunked upload (no Content-Length): refused once the limit is passed, not after reading
    it all; the server keeps serving."""

    def chunks():
        yield b'{"model": "' + model(srv).encode() + b'", "messages": [{"role": "user", "content": "'
        for _ in range(4 * MAX_BODY_BYTES // 65536):
            yield b"x" * 65536
        yield b'"}]}'

    r = http.post("/v1/chat/completions", content=chunks(), headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == 413, r.text
    assert http.post("/v1/chat/completions", json=chat(srv, "still here")).status_code == 200


def test_still_serves_after_bad_input(srv, http):
    assert http.post("/v1/chat/completions", content=b"\xff\xfe garbage").status_code == 400
    r = http.post("/v1/chat/completions", json=chat(srv, "after", max_tokens=3))
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == echo("after", 3)


def test_stage_error_is_reported(srv, http):
    r = http.post("/v1/chat/completions", json=chat(srv, "please FAIL"))
    assert r.status_code == 500
    assert "thinker" in r.json()["error"]["message"] and "fake failure" in r.json()["error"]["message"]


def test_a_stage_refusal_names_the_field_vllm_named(srv, http):
    """A check in the stage that names its field (vLLM's VLLMValidationError.parameter, e.g.
    ``allowed_token_ids`` out of the vocabulary) reached the client with ``param`` null, where
    `vllm serve` names it."""
    r = http.post("/v1/chat/completions", json=chat(srv, "please REFUSE"))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"], err["type"]) == ("top_logprobs", "BadRequestError") and "fake refusal" in err["message"]


def test_deadline_gives_504(srv, http):
    t0 = time.monotonic()
    r = http.post("/v1/chat/completions", json=chat(srv, "HANG forever"))
    assert r.status_code == 504, r.text
    assert "timed out" in r.json()["error"]["message"]
    # Causality, not a speed limit: the deadline cannot fire before it is due.
    assert time.monotonic() - t0 >= TIMEOUT_S - 0.1


def test_metrics_text_format(srv, http):
    http.post("/v1/chat/completions", json=chat(srv, "metrics", max_tokens=3, modalities=["text", "audio"]))
    r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    samples = parse_metrics(r.text)  # prometheus_client's parser
    by = {(n, lab.get("stage"), lab.get("le")): v for n, lab, v in samples}
    for stage in ("thinker", "decoder"):
        for metric in (
            "omni_cache_stage_requests_total",
            "omni_cache_stage_errors_total",
            "omni_cache_stage_queue_depth",
            "omni_cache_latent_rows_served_total",
            "omni_cache_stage_up",
            "omni_cache_stage_restarts_total",
        ):
            assert (metric, stage, None) in by, (metric, stage)
    # vLLM's names, per stage, with vLLM's model_name label, for what means the same thing.
    for name, lab, _ in samples:
        if name.startswith("vllm:"):
            assert lab["model_name"] == model(srv) and lab["stage"] in ("thinker", "decoder"), (name, lab)
    assert by[("omni_cache_stage_requests_total", "thinker", None)] >= 1
    assert by[("vllm:prefix_cache_queries_total", "thinker", None)] > 0
    assert ("vllm:prefix_cache_hits_total", "thinker", None) in by
    assert by[("vllm:time_to_first_token_seconds_count", "thinker", None)] >= 1
    assert by[("vllm:time_to_first_token_seconds_bucket", "thinker", "+Inf")] >= 1
    assert by[("vllm:e2e_request_latency_seconds_count", "decoder", None)] >= 1
    assert by[("omni_cache_time_to_first_audio_seconds_count", "decoder", None)] >= 1
    assert not any(n.startswith("omni_cache_") and "prefix_cache" in n for n, _, _ in samples)


def _first_output_event(orch, stage: str) -> tuple[threading.Event, object]:
    """An event set once ``stage``'s first output of any request reached the orchestrator, and
    the ``outputs.add`` it wraps (put it back with ``orch.outputs.add = original``)."""
    seen = threading.Event()
    add = orch.outputs.add

    def recording_add(req, st, msg, tensors, now):
        if st.name == stage and msg.token_ids:
            seen.set()
        return add(req, st, msg, tensors, now)

    orch.outputs.add = recording_add
    return seen, add


def _hold_restarts(sp):
    """Keep the supervisor from restarting replica ``sp`` until the returned event is set: its
    launch, when due, is put off by one poll (the restart counted once, when it happens)."""
    release = threading.Event()
    launch = sp.launch

    def held_launch():
        if release.is_set():
            del sp.launch  # the class's again
            return launch()
        sp.restarts -= 1  # poll() counted this attempt; the real one counts itself
        sp.tail.pop()  # its "--- restart N ---" line
        sp.restart_at = time.monotonic() + 0.05
        return None

    sp.launch = held_launch
    return release


def test_killed_stage_fails_in_flight_request_fast_and_comes_back(srv, http):
    orch = srv.orchestrator
    old_pid = orch.stage_pids()["thinker"]
    replica = orch.supervisor.replica("thinker", 0)
    # STALL: two tokens, then nothing until the stage is told to abort: the request is in flight
    # whenever the kill comes.
    content = "STALL " + "k" * 120
    first_token, add = _first_output_event(orch, "thinker")
    release = _hold_restarts(replica)
    try:
        with ThreadPoolExecutor(1) as pool:
            fut = pool.submit(http.post, "/v1/chat/completions", json=chat(srv, content, max_tokens=100))
            assert first_token.wait(30), "the thinker never answered a token"  # a few tokens in
            os.kill(old_pid, signal.SIGKILL)
            r = fut.result(timeout=120)  # bounds a hang; how fast it fails is benchmarks.stage_failure's
        # 503, not the 504 the TIMEOUT_S deadline would give: the death itself failed the request.
        assert r.status_code == 503, r.text
        assert "thinker" in r.json()["error"]["message"]
        # The restart is held: /health says the thinker is down, and why.
        health = httpx.get(srv.url + "/health")
        assert health.status_code == 503, health.text
        assert "thinker" in health.json()["message"], health.text
    finally:
        orch.outputs.add = add
        release.set()
    wait_healthy(srv)
    assert orch.stage_pids()["thinker"] not in (None, old_pid)
    r = http.post("/v1/chat/completions", json=chat(srv, "back again", max_tokens=4))
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == echo("back again", 4)
    metrics = {(n, lab.get("stage")): v for n, lab, v in parse_metrics(http.get("/metrics").text)}
    assert metrics[("omni_cache_stage_restarts_total", "thinker")] >= 1


def test_killed_stage_mid_stream_gives_sse_error_event(srv, http):
    orch = srv.orchestrator
    old_pid = orch.stage_pids()["decoder"]
    body = chat(srv, "d" * 120, max_tokens=100, stream=True, modalities=["text", "audio"])
    events, killed = [], False
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line:
                continue
            data = line[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
            if (
                not killed
                and isinstance(events[-1], dict)
                and events[-1].get("choices")
                and "audio" in events[-1]["choices"][0]["delta"]
            ):
                killed = True
                os.kill(old_pid, signal.SIGKILL)
    assert killed, "no audio chunk arrived before the stream ended"
    assert events[-1] == "[DONE]"
    err = events[-2]["error"]
    # stage_unavailable, not a deadline error: the death itself ended the stream.
    assert err["code"] == 503 and "decoder" in err["message"]
    # Text-only requests never needed the decoder; audio ones work again after the restart.
    wait_healthy(srv)
    r = http.post("/v1/chat/completions", json=chat(srv, "audio again", max_tokens=3, modalities=["text", "audio"]))
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["audio"]["data"]


def _thinker_queue_depth(http) -> float:
    samples = parse_metrics(http.get("/metrics").text)
    return next(v for n, lab, v in samples if n == "omni_cache_stage_queue_depth" and lab["stage"] == "thinker")


def _wait_idle(srv, http, timeout=3.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if srv.orchestrator.in_flight == 0 and _thinker_queue_depth(http) == 0:
            return
        time.sleep(0.1)
    raise AssertionError(
        f"still busy: in_flight={srv.orchestrator.in_flight}, thinker queue depth={_thinker_queue_depth(http)}"
    )


def _recording_ends(orch) -> tuple[list, threading.Event, object]:
    """Every request failed from now on, as (status, message), an event set at each, and the
    ``ends.fail`` it wraps (put it back with ``orch.ends.fail = original``)."""
    ended: list[tuple[int, str]] = []
    each = threading.Event()
    fail = orch.ends.fail

    def recording_fail(req, status, message, **kw):
        if not req.done:
            ended.append((status, message))
            each.set()
        return fail(req, status, message, **kw)

    orch.ends.fail = recording_fail
    return ended, each, fail


def _wait_ended(ended: list, each: threading.Event, n: int, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while len(ended) < n:
        assert time.monotonic() < end, f"{len(ended)} request(s) ended, not {n}: {ended}"
        each.wait(0.1)
        each.clear()


def test_client_that_goes_away_aborts_its_request(srv, http):
    """STALL answers two tokens and then nothing until the thinker is told to abort (or the
    TIMEOUT_S deadline fails it, 504): a request ended 499 by its client's leaving, and a thinker
    idle after it, show the request was aborted and dropped, with no wall-clock window."""
    wait_healthy(srv)  # (a stage an earlier test killed is back)
    _wait_idle(srv, http, timeout=30.0)
    orch = srv.orchestrator
    ended, each, fail = _recording_ends(orch)
    try:
        body = chat(srv, "STALL g" + "g" * 120, max_tokens=100, stream=True)
        with http.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200, r.read()
            next(r.iter_lines())  # the first chunk, then hang up
        _wait_ended(ended, each, 1)
        assert ended[0] == (499, "the client disconnected from the stream"), ended
        _wait_idle(srv, http, timeout=30.0)  # the thinker dropped it (else it holds it an hour)
        # A non-streamed request whose client hangs up once the request is in flight (disconnects
        # are polled every 0.5 s). By hand on a socket: a client-side timeout could fire before the
        # server had the request, on a busy CPU.
        data = json.dumps(chat(srv, "STALL h" + "h" * 120, max_tokens=100)).encode()
        host, port = srv.url.split("//")[1].split(":")
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            sock.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                + f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(data)}\r\n\r\n".encode()
                + data
            )
            end = time.monotonic() + 30
            while orch.in_flight == 0:
                assert time.monotonic() < end, "the request never reached the pipeline"
                time.sleep(0.02)
        _wait_ended(ended, each, 2)
        assert ended[1] == (499, "the client disconnected"), ended
        _wait_idle(srv, http, timeout=30.0)
    finally:
        orch.ends.fail = fail


def test_python_pipeline_api():
    from omni_cache import Pipeline

    path = write_config(f"pipe_{uuid.uuid4().hex[:8]}")
    with Pipeline.from_config(
        path,
        tokenizer=ByteTokenizer(),
        stage_argv=[sys.executable, str(FAKE_STAGE)],
        start_timeout_s=60,
        shutdown_grace_s=2,
        echo_stage_logs=False,
    ) as pipe:
        pids = list(pipe.orchestrator.stage_pids().values())
        prompts = ["hello there", [{"role": "user", "content": "chat form"}], list(b"raw ids")]
        results = pipe.generate(prompts, max_tokens=6, return_latents=True)
        assert [r.text for r in results] == [echo("hello there", 6), echo("chat form", 6), "raw id"]
        for r, n_prompt in zip(results, (len("user: hello there\n"), len("user: chat form\n"), 7)):
            assert r.audio.dtype == np.float32 and r.audio.shape == (6 * SAMPLES_PER_TOKEN,)
            assert r.sample_rate == 24000
            assert set(r.cached_tokens) == {"thinker", "decoder"}
            assert r.latents["hidden"].shape == (n_prompt + 6, 4)
        again = pipe.generate("hello there", max_tokens=2, modalities=("text",))
        assert again[0].audio is None and again[0].latents == {}
        assert again[0].cached_tokens["thinker"] > 0
        stats = pipe.stats(timeout=30)
        assert stats["thinker"]["requests"] == 4 and stats["thinker"]["prefix_cache_hit_tokens"] > 0
    assert_gone(pids)


@pytest.mark.parametrize(
    "env, timeout, needle",
    [
        # fails fast: start() does not wait for the 60 s timeout when a stage exits
        ('{FAKE_EXIT_AT_START: "3"}', 60, "exited before it was ready (exit code 3)"),
        ('{FAKE_START_DELAY: "60"}', 2, "not ready after 2 s"),
    ],
)
def test_stage_that_does_not_come_up_is_named(env, timeout, needle):
    from omni_cache import Pipeline

    path = write_config(f"bad_{uuid.uuid4().hex[:8]}", decoder_env=env)
    with pytest.raises(StageStartError) as info:
        Pipeline.from_config(
            path,
            tokenizer=ByteTokenizer(),
            stage_argv=[sys.executable, str(FAKE_STAGE)],
            start_timeout_s=timeout,
            shutdown_grace_s=1,
            echo_stage_logs=False,
        )
    msg = str(info.value)
    assert "stage 'decoder'" in msg and needle in msg
    if "exit code" in needle:
        assert "fake stage: cannot load the model" in msg  # the end of its output
        assert "'thinker'" not in msg


def test_second_pipeline_on_the_same_addresses_is_refused_and_the_first_keeps_serving():
    from omni_cache import Pipeline
    from omni_cache.wire.ipc_claims import AddressInUseError

    path = write_config(f"dup_{uuid.uuid4().hex[:8]}")
    kw = dict(
        tokenizer=ByteTokenizer(),
        stage_argv=[sys.executable, str(FAKE_STAGE)],
        start_timeout_s=60,
        shutdown_grace_s=2,
        echo_stage_logs=False,
    )
    with Pipeline.from_config(path, **kw) as first:
        with pytest.raises(AddressInUseError) as info:
            Pipeline.from_config(path, **kw)
        assert f"(pid {os.getpid()})" in str(info.value) and ".sock" in str(info.value)
        [r] = first.generate("still mine", max_tokens=4)
        assert r.text == echo("still mine", 4)
    with Pipeline.from_config(path, **kw) as again:  # released at close
        assert again.generate("next", max_tokens=2)[0].text == echo("next", 2)


def test_a_stage_claiming_an_absurd_sample_rate_fails_the_request_only():
    """A decoder that reports 1 Hz: resampling that to 24 kHz would allocate 24,000 samples per
    sample. The request fails naming the stage and the rate; the pipeline's rate is unchanged and
    text answers go on."""
    with fake_server("rate", decoder_env='{FAKE_SAMPLE_RATE: "1"}') as server:
        h = {"Authorization": f"Bearer {API_KEY}"}
        body = {
            "model": server.orchestrator.served_model_name,
            "messages": [{"role": "user", "content": "hi"}],
            "modalities": ["text", "audio"],
        }
        r = httpx.post(server.url + "/v1/chat/completions", json=body, headers=h, timeout=30)
        assert r.status_code == 500 and "'decoder' sent audio at 1 Hz" in r.text, r.text
        assert server.orchestrator.audio_sample_rate == 24000
        r = httpx.post(
            server.url + "/v1/chat/completions", json={**body, "modalities": ["text"]}, headers=h, timeout=30
        )
        assert r.status_code == 200, r.text
