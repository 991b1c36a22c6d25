"""Admission control (omni_cache/runtime/request_path/admission.py, omni_cache/serving/routes.py): the bounds
on requests in flight and on the decoded media they hold, the 429 with Retry-After past them, the
HTTP body limit, and a flood.

The flood runs against fake stages (tests/fake_stage.py: real processes, real ZMQ, real HTTP, no
model): what is under test is the server's memory and event loop while it refuses and decodes,
which the model behind it does not change, and a fake thinker answers in a time the test sets
(the real tiny pipeline would add minutes of engine start-up and a CPU-bound thinker competing
with the server for the 2 cores, without testing anything more of admission).
"""

from __future__ import annotations

import base64
import contextlib
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import yaml
from fake_pipeline import FAKE_STAGE, ByteTokenizer, echo
from media_samples import flat_png_data_url

from omni_cache.config import load_config
from omni_cache.runtime.orchestrator import Orchestrator
from omni_cache.runtime.request_path.admission import RETRY_AFTER_S, InFlightBounds
from omni_cache.runtime.request_path.results import RequestError
from omni_cache.serving.server import ServerThread

MIB = 1 << 20
#: The flood's limits: 4 images of at most 2048 x 2048 per request (48 MiB decoded, the most one
#: request may carry), two such requests' worth of decoded media in flight, 8 requests in flight.
MAX_ITEMS, SIDE = 4, 2048
IMAGE = SIDE * SIDE * 3  # one image's decoded bytes (12 MiB)
REQUEST_MEDIA = MAX_ITEMS * IMAGE
MAX_MEDIA_IN_FLIGHT = 2 * REQUEST_MEDIA
MAX_IN_FLIGHT = 8
CLIENTS = 16
#: What the server process may grow by while 16 clients post that much at once: the two requests'
#: media it holds (96 MiB) and the copies decoding makes. Measured (Intel Xeon 6/167, shared):
#: 178 and 205 MiB; with the bounds lifted (64 in flight, 3 GiB of media) the same flood grew it
#: by 1,036 MiB, every request admitted.
RSS_GROWTH_LIMIT = 320 * MIB
TOKEN_DELAY_S = 0.05  # the fake thinker's pace: an answer of 30 tokens takes 1.5 s


# ---- the bounds on their own ---------------------------------------------------------------------


def test_places_in_flight_are_bounded_and_given_back_once():
    bounds = InFlightBounds(max_requests=2, max_media_bytes=100)
    a, b = bounds.enter(), bounds.enter()
    with pytest.raises(RequestError) as info:
        bounds.enter()
    assert info.value.status == 429 and info.value.retry_after == RETRY_AFTER_S
    assert "server.max_requests_in_flight" in info.value.message
    a.release()
    a.release()  # a second release gives nothing back twice
    assert bounds.requests == 1
    c = bounds.enter()
    assert bounds.requests == 2
    b.release(), c.release()
    assert bounds.requests == 0


def test_media_bytes_are_reserved_against_what_the_others_hold():
    bounds = InFlightBounds(max_requests=10, max_media_bytes=100)
    a, b = bounds.enter(), bounds.enter()
    a.hold_media(60)
    with pytest.raises(RequestError) as info:
        b.hold_media(50)  # 110 with a's: not now
    assert info.value.status == 429 and info.value.retry_after == RETRY_AFTER_S
    assert "server.max_media_bytes_in_flight" in info.value.message
    assert (b.media_bytes, bounds.media_bytes) == (0, 60)
    with pytest.raises(RequestError) as info:
        b.hold_media(101)  # never, whatever the others hold
    assert info.value.status == 413 and info.value.retry_after is None
    a.release()
    b.hold_media(50)
    b.hold_media(40)  # more for the same request
    assert (b.media_bytes, bounds.media_bytes) == (90, 90)
    b.release()
    assert bounds.media_bytes == 0 and bounds.requests == 0


def test_body_bytes_are_held_until_released_and_refused_past_the_bound():
    bounds = InFlightBounds(max_requests=10, max_media_bytes=100, max_body_bytes=50)
    a, b = bounds.enter(), bounds.enter()
    a.hold_body(30)
    with pytest.raises(RequestError) as info:
        b.hold_body(30)
    assert info.value.status == 429 and "server.max_body_bytes_in_flight" in info.value.message
    a.release_body()  # parsed and submitted: a keeps its place, not its body
    b.hold_body(30)
    assert (bounds.body_bytes, bounds.requests) == (30, 2)
    b.release()
    a.release()
    assert (bounds.body_bytes, bounds.requests) == (0, 0)


def test_an_answered_request_lets_go_of_its_media_with_its_ticket():
    """The bytes go back to the bound when the request is answered, and so do the arrays: the
    client's handle keeps the request a while longer (its answer is still being sent)."""
    import weakref

    import torch

    from omni_cache.runtime.request_path.requests import Request, RequestTable

    bounds = InFlightBounds(max_requests=2, max_media_bytes=100)
    ticket = bounds.enter()
    ticket.hold_media(60)
    req = Request("r", [1], ("text",), ("thinker",), 0.0, 1e9, 10.0, False)
    req.ticket, req.media = ticket, {"media.0": torch.zeros(60, dtype=torch.uint8)}
    frames = weakref.ref(req.media["media.0"])
    table = RequestTable()
    table.add(req)
    table.answered(req)
    assert bounds.media_bytes == 0 and frames() is None  # req itself is still held here


# ---- a server of fake stages -------------------------------------------------------------------


def write_config(directory: Path, **server: object) -> Path:
    data = {
        "name": f"adm_{uuid.uuid4().hex[:8]}",
        "server": {
            "host": "127.0.0.1",
            "port": 0,
            "request_timeout_s": 30,
            "max_message_bytes": 64 * MIB,
            "max_body_bytes": 4 * MIB,
            "max_requests_in_flight": MAX_IN_FLIGHT,
            "max_media_bytes_in_flight": MAX_MEDIA_IN_FLIGHT,
            "media": {"max_items": MAX_ITEMS, "max_image_pixels": SIDE * SIDE, "decoded_cache_bytes": 0},
            **server,
        },
        "stages": [
            {
                "name": "thinker",
                "kind": "autoregressive",
                "model": "tiny:thinker",
                "final_output": "text",
                "engine_args": {"max_model_len": 4096},
                "sampling": {"max_tokens": 30},
                "env": {"FAKE_TOKEN_DELAY": str(TOKEN_DELAY_S)},
            }
        ],
    }
    path = directory / "pipeline.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


#: The flood's server (the limits above) with server.max_body_bytes_in_flight at 4 MiB: shared by
#: the flood (its 16 bodies of ~90 KiB never come near it) and the test of that bound.
FLOOD_SERVER = {"max_body_bytes_in_flight": 4 * MIB}
#: One server for the count bound (two places; a 3 s deadline ends the requests that hang) and
#: for media that can never fit: two images (24 MiB) pass server.max_message_bytes but not
#: server.max_media_bytes_in_flight, three pass neither and the message bound is checked first,
#: one fits both.
BOUNDED_SERVER = {
    "max_requests_in_flight": 2,
    "request_timeout_s": 3,
    "max_media_bytes_in_flight": 2 * IMAGE - 1,
    "max_message_bytes": 3 * IMAGE - 1,
}


@pytest.fixture(scope="module")
def flood_srv() -> Iterator[ServerThread]:
    with fake_server(**FLOOD_SERVER) as srv:
        yield srv


@pytest.fixture(scope="module")
def bounded_srv() -> Iterator[ServerThread]:
    with fake_server(**BOUNDED_SERVER) as srv:
        yield srv


@contextlib.contextmanager
def fake_server(**server: object) -> Iterator[ServerThread]:
    path = write_config(Path(tempfile.mkdtemp(prefix="oca")), **server)
    orch = Orchestrator(
        load_config(path),
        tokenizer=ByteTokenizer(),
        stage_argv=[sys.executable, str(FAKE_STAGE)],
        start_timeout_s=60,
        shutdown_grace_s=2,
        echo_stage_logs=False,
    )
    srv = ServerThread(orch).start()
    try:
        srv.wait_ready(60)
        yield srv
    finally:
        srv.stop()


def media_body(srv: ServerThread, colour: int, items: int = MAX_ITEMS) -> dict:
    """A chat request with ``items`` images of SIDE x SIDE pixels, one colour each: the most
    decoded media a request may carry, in about 90 KiB of JSON."""
    parts = [{"type": "text", "text": "what is this?"}]
    parts += [
        {"type": "image_url", "image_url": {"url": flat_png_data_url(SIDE, SIDE, (colour, i, 7))}} for i in range(items)
    ]
    return {
        "model": srv.orchestrator.served_model_name,
        "max_tokens": 30,
        "messages": [{"role": "user", "content": parts}],
    }


def rss_bytes(field: str) -> int:
    """VmRSS (now) or VmHWM (the peak since the last reset) of this process, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} in /proc/self/status")


def reset_peak_rss() -> None:
    """Start VmHWM again from the current RSS (Linux: 5 to clear_refs)."""
    Path("/proc/self/clear_refs").write_text("5")


def wait_idle(srv: ServerThread, timeout: float = 60.0) -> None:
    bounds = srv.orchestrator.admission.bounds
    end = time.monotonic() + timeout
    while bounds.requests or bounds.media_bytes:
        assert time.monotonic() < end, (bounds.requests, bounds.media_bytes)
        time.sleep(0.05)


def post_at_once(srv, bodies: list[dict], sample, every_s: float) -> list[httpx.Response]:
    """Every body posted to the chat API at the same moment, each from a thread of its own, while
    ``sample()`` runs every ``every_s`` in another thread; the responses, in order."""
    done = threading.Event()
    failed: list[BaseException] = []

    def watch() -> None:
        try:
            while not done.is_set():
                sample()
                time.sleep(every_s)
        except BaseException as exc:  # re-raised below: a thread's exception alone fails no test
            failed.append(exc)

    start = threading.Barrier(len(bodies))

    def post(body: dict) -> httpx.Response:
        start.wait()
        return httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=120)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with ThreadPoolExecutor(len(bodies)) as pool:
            responses = list(pool.map(post, bodies))
    finally:
        done.set()
        watcher.join()
    if failed:  # e.g. a /health that timed out: the samples taken before it would pass the test
        raise failed[0]
    return responses


def test_a_flood_of_maximal_media_gets_429s_past_the_bounds_in_bounded_memory(flood_srv):
    """16 clients post the most decoded media a request may carry, at once: the server takes what
    its bounds allow, refuses the rest with 429 + Retry-After + an OpenAI error body, keeps its
    RSS within RSS_GROWTH_LIMIT and answers /health throughout; then it is idle again and
    serves."""
    srv = flood_srv
    # One body for every client: the decoded-item cache is off (decoded_cache_bytes: 0), so
    # each request decodes its own 48 MiB all the same, and the client encodes 4 PNGs, not 64.
    bodies = [media_body(srv, colour=0)] * CLIENTS
    # warm up: the path the flood takes, once (thread pools, PIL, the decoder's first call);
    # one token: how long it is answered does not change that path
    warm = {**bodies[0], "max_tokens": 1}
    assert httpx.post(srv.url + "/v1/chat/completions", json=warm, timeout=60).status_code == 200
    wait_idle(srv)
    health: list[int] = []
    reset_peak_rss()
    before = rss_bytes("VmRSS")
    responses = post_at_once(
        srv, bodies, lambda: health.append(httpx.get(srv.url + "/health", timeout=30).status_code), every_s=0.05
    )
    growth = rss_bytes("VmHWM") - before

    codes = sorted(r.status_code for r in responses)
    assert set(codes) <= {200, 429}, [(r.status_code, r.text[:200]) for r in responses]
    refused = [r for r in responses if r.status_code == 429]
    assert len(refused) >= CLIENTS - MAX_IN_FLIGHT, codes  # the count bound alone refuses these
    assert codes.count(200) >= 1
    for r in refused:
        assert r.headers["retry-after"] == str(RETRY_AFTER_S)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert err["code"] == "rate_limit_exceeded" and err["type"] == "requests"
        assert (
            "server.max_requests_in_flight" in err["message"] or "server.max_media_bytes_in_flight" in err["message"]
        ), err
    assert any(
        "server.max_media_bytes_in_flight" in r.json()["error"]["message"] for r in refused
    )  # places were free, media room was not
    assert growth < RSS_GROWTH_LIMIT, f"RSS grew by {growth / MIB:.0f} MiB"
    assert health and set(health) == {200}, health
    wait_idle(srv)  # every place and byte given back
    r = httpx.post(srv.url + "/v1/chat/completions", json=warm, timeout=60)
    assert r.status_code == 200, r.text


#: The video flood: 6 clients, a 640 x 360 video each (2 s at 8 fps: 4 frames sampled at 2 fps,
#: 2.6 MiB decoded), a media bound of two such requests (benchmarks/admission_flood.py --kind
#: video floods with larger ones and reads the server's RSS).
VIDEO_W, VIDEO_H, VIDEO_FRAMES, VIDEO_CLIENTS = 640, 360, 16, 6
VIDEO_MEDIA = 4 * VIDEO_W * VIDEO_H * 3


def test_a_flood_of_videos_is_held_to_the_media_bound_before_decoding():
    """Each video's decoded size is reserved from its header before it is decoded and given back
    after its answer: what the requests hold never passes server.max_media_bytes_in_flight, the
    refused ones (429) were never decoded (the decoded-item cache holds only the answered
    ones' videos), and everything is given back."""
    from media_samples import video_bytes

    media = {
        "max_items": 1,
        "max_video_frame_pixels": VIDEO_W * VIDEO_H,
        "decoded_cache_bytes": VIDEO_CLIENTS * VIDEO_MEDIA,
    }
    with fake_server(max_media_bytes_in_flight=2 * VIDEO_MEDIA, media=media) as srv:
        bounds, cache = srv.orchestrator.admission.bounds, srv.app.state.media_cache
        bodies = [
            {
                "model": srv.orchestrator.served_model_name,
                "max_tokens": 30,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "what happens?"},
                            {
                                "type": "video_url",
                                "video_url": {
                                    "url": "data:video/mp4;base64,"
                                    + base64.b64encode(
                                        video_bytes(VIDEO_FRAMES, VIDEO_W, VIDEO_H, 8, seed=c, noise=False)
                                    ).decode()
                                },
                            },
                        ],
                    }
                ],
            }
            for c in range(VIDEO_CLIENTS)
        ]
        held: list[int] = []
        responses = post_at_once(srv, bodies, lambda: held.append(bounds.media_bytes), every_s=0.002)
        codes = [r.status_code for r in responses]
        assert set(codes) <= {200, 429} and codes.count(200) >= 1 and codes.count(429) >= 1, codes
        assert all(
            "server.max_media_bytes_in_flight" in r.json()["error"]["message"]
            for r in responses
            if r.status_code == 429
        )
        assert VIDEO_MEDIA <= max(held) <= 2 * VIDEO_MEDIA
        assert len(cache) == codes.count(200)  # a refused video was never decoded
        wait_idle(srv)  # and every reserved byte was given back


def test_the_count_bound_refuses_before_reading_and_the_sdk_sees_a_rate_limit(bounded_srv):
    """With every place taken by requests that do not end, a new one is refused at once, body
    unread (even one over the body limit), and the openai SDK raises its RateLimitError with the
    server's message and Retry-After; a request refused for what it asks gives its place back."""
    srv = bounded_srv
    model = srv.orchestrator.served_model_name
    bounds = srv.orchestrator.admission.bounds
    # refused with 400 after it took its place: the place is given back
    bad = {"model": model, "messages": [{"role": "user", "content": "x"}], "max_tokens": 5000}
    assert httpx.post(srv.url + "/v1/chat/completions", json=bad, timeout=30).status_code == 400
    assert bounds.requests == 0
    hang = {"model": model, "messages": [{"role": "user", "content": "HANG"}]}
    with ThreadPoolExecutor(2) as pool:
        hung = [pool.submit(httpx.post, srv.url + "/v1/chat/completions", json=hang, timeout=60) for _ in range(2)]
        end = time.monotonic() + 30
        while srv.orchestrator.in_flight < 2:
            assert time.monotonic() < end
            time.sleep(0.02)
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.RateLimitError) as info:
            client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}])
        assert info.value.status_code == 429
        assert info.value.response.headers["retry-after"] == str(RETRY_AFTER_S)
        assert "server.max_requests_in_flight" in info.value.message
        # over the body limit too: still the 429, the body was never read
        huge = b'{"model": "' + model.encode() + b'", "messages": [' + b" " * (8 * MIB) + b"]}"
        r = httpx.post(
            srv.url + "/v1/chat/completions", content=huge, timeout=30, headers={"Content-Type": "application/json"}
        )
        assert r.status_code == 429, r.text
        assert [f.result().status_code for f in hung] == [504, 504]  # their deadline
    assert bounds.requests == 0
    ok = {"model": model, "messages": [{"role": "user", "content": "after"}], "max_tokens": 3}
    assert httpx.post(srv.url + "/v1/chat/completions", json=ok, timeout=30).status_code == 200


def test_media_that_can_never_fit_are_a_413_and_the_body_limit_holds_while_reading(bounded_srv):
    """BOUNDED_SERVER: two images never fit server.max_media_bytes_in_flight (413, not 429), one
    is answered, three never fit server.max_message_bytes; a body past server.max_body_bytes is
    refused while it is read."""
    srv = bounded_srv
    r = httpx.post(srv.url + "/v1/chat/completions", json=media_body(srv, 1, items=2), timeout=60)
    assert r.status_code == 413, r.text
    assert "server.max_media_bytes_in_flight" in r.json()["error"]["message"]
    one = {**media_body(srv, 2, items=1), "max_tokens": 1}  # fits
    assert httpx.post(srv.url + "/v1/chat/completions", json=one, timeout=60).status_code == 200

    def chunks():  # no Content-Length: refused once past the limit, not after all of it
        yield b'{"model": "m", "messages": [{"role": "user", "content": "'
        for _ in range(64):
            yield b"x" * MIB
        yield b'"}]}'

    r = httpx.post(
        srv.url + "/v1/chat/completions", content=chunks(), timeout=60, headers={"Content-Type": "application/json"}
    )
    assert r.status_code == 413 and "server.max_body_bytes" in r.json()["error"]["message"]
    wait_idle(srv)
    r = httpx.post(srv.url + "/v1/chat/completions", json=media_body(srv, 3, items=3), timeout=60)
    assert r.status_code == 413 and "server.max_message_bytes" in r.json()["error"]["message"]
    wait_idle(srv)


def test_the_python_api_waits_for_room_instead_of_failing(tmp_path: Path):
    """Pipeline.generate with more prompts than server.max_requests_in_flight: the extra ones
    wait until one of its own requests ended, and all are answered, each with its own answer.
    The answers differ (the fake thinker echoes its prompt) and end in another order than they
    were sent (longer first: a token per TOKEN_DELAY_S), so an answer handed to the wrong
    caller, or the results put in the order they ended, fails."""
    from omni_cache import Pipeline

    path = write_config(tmp_path, max_requests_in_flight=2)
    with Pipeline.from_config(
        path,
        tokenizer=ByteTokenizer(),
        stage_argv=[sys.executable, str(FAKE_STAGE)],
        start_timeout_s=60,
        shutdown_grace_s=2,
        echo_stage_logs=False,
    ) as pipe:
        prompts = [f"prompt {i} " + "." * (12 - 3 * i) for i in range(5)]
        results = pipe.generate(prompts, max_tokens=40)
        answers = [r.text for r in results]
        assert answers == [echo(p, 40) for p in prompts]
        assert len(set(answers)) == len(prompts)
        assert pipe.orchestrator.admission.bounds.requests == 0


def test_bodies_being_read_are_bounded_and_their_bytes_given_back_once_submitted(flood_srv):
    """server.max_body_bytes_in_flight: while one body of 3 MiB is being read (its client has not
    sent the rest), another declaring 2 MiB does not fit in 4 MiB and gets 429 before it is read;
    once the first was submitted its bytes are free (it keeps no body while it is answered)."""
    srv = flood_srv  # (server.max_body_bytes: 4 MiB, write_config's)
    model = srv.orchestrator.served_model_name
    bounds = srv.orchestrator.admission.bounds
    go_on = threading.Event()
    head = b'{"model": "' + model.encode() + b'", "max_tokens": 3, "messages": [{"role": '
    padding = b" " * (3 * MIB)

    def slow_body():
        yield head + padding  # JSON allows whitespace between tokens
        go_on.wait(60)
        yield b'"user", "content": "slow"}]}'

    with ThreadPoolExecutor(1) as pool:
        slow = pool.submit(
            httpx.post,
            srv.url + "/v1/chat/completions",
            content=slow_body(),
            headers={"Content-Type": "application/json"},
            timeout=60,
        )
        end = time.monotonic() + 30
        while bounds.body_bytes < 3 * MIB:
            assert time.monotonic() < end, bounds.body_bytes
            time.sleep(0.02)
        other = {"model": model, "max_tokens": 3, "messages": [{"role": "user", "content": "x" * (2 * MIB)}]}
        r = httpx.post(srv.url + "/v1/chat/completions", json=other, timeout=30)
        assert r.status_code == 429 and r.headers["retry-after"] == str(RETRY_AFTER_S), r.text
        assert "server.max_body_bytes_in_flight" in r.json()["error"]["message"]
        go_on.set()
        assert slow.result().status_code == 200
    wait_idle(srv)
    assert bounds.body_bytes == 0
    r = httpx.post(srv.url + "/v1/chat/completions", json=other, timeout=30)
    assert r.status_code == 400, r.text  # fits now; only too long for the context (4096)
