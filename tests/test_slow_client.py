"""A chat client that reads nothing of a long spoken answer it streams is disconnected once more
than ``server.max_outbox_bytes`` of the answer waits for it: its request is aborted, what waited
is freed, and ``omni_cache_slow_clients_disconnected`` counts it in /metrics. Before, the answer
waited in the server whole until ``server.request_timeout_s``. The cut is expected (and counted):
uvicorn's ERROR line for a response that ended unfinished is not logged for it.

The server runs fake stages (tests/fake_stage.py: real processes, real ZMQ, no model): the echo
thinker answers with its prompt's bytes, the fake decoder sends 240 float32 samples per token."""

from __future__ import annotations

import logging
import time
import uuid

import httpx
import pytest
from fake_pipeline import API_KEY, Records, make_orchestrator, metric, open_stream_without_reading, write_config

from omni_cache.serving.http_protocol import UNFINISHED
from omni_cache.serving.server import ServerThread

OUTBOX = 1024 * 1024  # 1092 tokens of the fake decoder's audio (2 s of its answer)
ANSWER_TOKENS = 12000  # 11.5 MB of samples, ~14 MB of SSE: far more than the sockets buffer (4 MiB here)


@pytest.fixture(scope="module")
def srv():
    path = write_config(
        f"slow_{uuid.uuid4().hex[:8]}",
        token_delay_s=0.002,
        max_model_len=2 * ANSWER_TOKENS + 200,  # the prompt is as long as the answer
        timeout_s=120,
        server_extra=f", max_outbox_bytes: {OUTBOX}",
    )
    server = ServerThread(make_orchestrator(path), api_key=API_KEY).start()
    try:
        server.wait_ready(60)
        yield server
    finally:
        server.stop()


def _slow_clients(srv) -> float:
    return metric(srv, "omni_cache_slow_clients_disconnected_total")


def test_a_client_that_stops_reading_is_disconnected_and_its_request_freed(srv):
    orch = srv.orchestrator
    before = _slow_clients(srv)
    records = Records()
    uvicorn_log = logging.getLogger("uvicorn.error")
    uvicorn_log.addHandler(records)
    sock = open_stream_without_reading(srv, ANSWER_TOKENS)
    try:
        end = time.monotonic() + 60
        while _slow_clients(srv) == before:
            assert time.monotonic() < end, "the server still holds the answer for a client that reads nothing"
            time.sleep(0.2)
        while orch.in_flight or orch.admission.bounds.requests:
            assert time.monotonic() < end, "the slow client's request is still in flight"
            time.sleep(0.05)
        # The server closed the connection: what the sockets held, then the end, no [DONE].
        received = bytearray()
        sock.settimeout(30)
        while chunk := sock.recv(65536):
            received += chunk
    finally:
        sock.close()
        uvicorn_log.removeHandler(records)
    assert b"data: [DONE]" not in received
    assert UNFINISHED not in records.messages  # an expected cut, counted: no ERROR line
    assert len(received) < ANSWER_TOKENS * 700  # far from the whole answer
    # Another client is served as before.
    r = httpx.post(
        srv.url + "/v1/chat/completions",
        json={"model": orch.served_model_name, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=60,
    )
    assert r.status_code == 200, r.text
