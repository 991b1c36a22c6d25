"""A streaming chat client that takes none of its answer is cut by ``server.max_send_stall_s``,
long before ``server.max_outbox_bytes`` could count it: its TCP connection acknowledges nothing
while bytes wait (omni_cache/serving/send_watch.py). Its writes stop first (the answer waits
unencoded), its request is aborted in every stage, the cut is counted in /metrics by bound, and
uvicorn logs no ERROR for the response given up. Before, such a client was written to until the
kernel's send buffer (megabytes) was full, and only the byte bound cut it; here, with a byte bound
larger than the whole answer, it was not cut at all and read ``[DONE]`` at the end.

The server runs fake stages (tests/fake_stage.py: real processes, real ZMQ, no model): the echo
thinker answers with its prompt's bytes, the fake decoder sends 240 float32 samples per token."""

from __future__ import annotations

import json
import logging
import time
import uuid

import httpx
import pytest
from fake_pipeline import (
    API_KEY,
    HOLDS,
    SENT,
    Records,
    metric,
    open_stream_without_reading,
    serve_config,
    wait_until_held,
    write_config,
)

from omni_cache.runtime.request_path import request_ends
from omni_cache.serving.http_protocol import UNFINISHED, UnfinishedResponseFilter

ANSWER_TOKENS = 20000  # 40 s at 2 ms a token: the stall bound (1 s) comes long before its end
OUTBOX = 1 << 30  # more than the whole answer: only the stall bound can cut it
HELD_TOKENS = 3000  # 6 s at 2 ms a token; its writes wait within the first second


def stall_server(max_send_stall_s: float, answer_tokens: int):
    """A fake pipeline writing a token every 2 ms, cutting silent clients past ``max_send_stall_s``."""
    return serve_config(
        write_config(
            f"stall_{uuid.uuid4().hex[:8]}",
            token_delay_s=0.002,
            max_model_len=2 * answer_tokens + 200,  # the prompt is as long as the answer
            timeout_s=120,
            server_extra=f", max_outbox_bytes: {OUTBOX}, max_send_stall_s: {max_send_stall_s}",
        )
    )


@pytest.fixture(scope="module")
def srv():
    with stall_server(1, ANSWER_TOKENS) as server:
        yield server


def test_a_client_that_takes_nothing_is_cut_by_the_stall_bound(srv):
    orch = srv.orchestrator
    stalled = "omni_cache_slow_clients_disconnected_total"
    cuts, pauses = metric(srv, stalled, bound="max_send_stall_s"), metric(srv, "omni_cache_stream_write_pauses_total")
    records = Records()
    logging.getLogger("uvicorn.error").addHandler(records)
    sock = open_stream_without_reading(srv, ANSWER_TOKENS)
    try:
        # The request ends one way or the other: cut (the fix) or answered whole (before it).
        end = time.monotonic() + 120
        while not orch.in_flight:
            assert time.monotonic() < end, "the request was never in flight"
            time.sleep(0.05)
        while orch.in_flight or orch.admission.bounds.requests:
            assert time.monotonic() < end, "the silent client's request is still in flight"
            time.sleep(0.05)
        received = bytearray()
        sock.settimeout(30)
        while chunk := sock.recv(65536):
            received += chunk
    finally:
        sock.close()
        logging.getLogger("uvicorn.error").removeHandler(records)
    assert b"data: [DONE]" not in received, "the client that took nothing was kept to the end of its answer"
    assert metric(srv, stalled, bound="max_send_stall_s") == cuts + 1
    assert metric(srv, "omni_cache_stream_write_pauses_total") >= pauses + 1  # its writes waited first
    assert UNFINISHED not in records.messages  # the cut is expected: no ERROR line for it
    # Another client, reading, is served to the end.
    r = httpx.post(
        srv.url + "/v1/chat/completions",
        json={
            "model": orch.served_model_name,
            "max_tokens": 400,
            "stream": True,
            "modalities": ["text", "audio"],
            "messages": [{"role": "user", "content": "y" * 400}],
        },
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=60,
    )
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n"), r.text[-300:]


@pytest.fixture(scope="module")
def patient():
    """A server whose stall bound (60 s) leaves a paused client time to read again."""
    with stall_server(60, HELD_TOKENS) as server:
        yield server


def test_a_client_that_stops_reading_holds_its_answer_and_gets_all_of_it_when_it_reads_again(patient):
    """While a streaming client takes nothing, the stages hold its request (wire Hold,
    scheduler/client_hold.py): the thinker writes no token for it, where before it wrote the
    whole answer into the server's queue. When the client reads again the answer goes on from
    where it stopped, to its end: every token, then ``[DONE]``."""
    before = metric(patient, HOLDS, stage="thinker")
    sock = open_stream_without_reading(patient, HELD_TOKENS)
    try:
        # Held: two scrapes of the thinker's counter 0.5 s apart (250 tokens' time) see the same.
        first = wait_until_held(patient, before)
        time.sleep(0.5)
        assert metric(patient, SENT, stage="thinker") == first, "the thinker wrote tokens for a held request"
        received = read_to_the_end(sock)
    finally:
        sock.close()
    text = "".join(
        event["choices"][0]["delta"].get("content") or ""
        for line in received.split(b"\n")
        if line.startswith(b"data: {") and b'"choices":[{' in line
        for event in [json.loads(line[6:])]
        if event.get("choices")
    )
    # The echo thinker's answer: its templated prompt's first max_tokens bytes, one token each.
    assert b"data: [DONE]" in received and len(text) == HELD_TOKENS and text.endswith("x" * 100)


def read_to_the_end(sock) -> bytearray:
    received = bytearray()
    sock.settimeout(60)
    while chunk := sock.recv(1 << 20):
        received += chunk
        if received.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"):  # the last chunk (chunked encoding)
            break
    return received


def test_a_hold_lasts_while_it_is_renewed_and_a_lost_go_on_lapses(patient, monkeypatch):
    """A hold is a lease the orchestrator renews while its client takes nothing: the request stays
    held past the lease. When the client reads again and the "go on" is lost on the way (here
    dropped on purpose), the hold lapses at the stage within the lease and the client gets its
    whole answer, where before the request stayed held until its deadline."""
    monkeypatch.setattr(request_ends, "HOLD_LEASE_S", 1.0)
    monkeypatch.setattr(request_ends, "HOLD_RENEW_S", 0.3)
    ends = patient.orchestrator.ends
    tell = ends.hold_on_stages

    def lose_go_on(req, held, now=None):
        if held:
            return tell(req, held, now)
        req.client_held = False  # the orchestrator knows; its message to the stages is lost

    monkeypatch.setattr(ends, "hold_on_stages", lose_go_on)
    lapses = "omni_cache_stage_client_hold_lapses_total"
    before, lapsed = metric(patient, HOLDS, stage="thinker"), metric(patient, lapses, stage="thinker")
    sock = open_stream_without_reading(patient, HELD_TOKENS)
    try:
        first = wait_until_held(patient, before)
        time.sleep(2.0)  # twice the lease: only renewals keep it held
        assert metric(patient, SENT, stage="thinker") == first, "the hold lapsed while its client took nothing"
        received = read_to_the_end(sock)
    finally:
        sock.close()
    assert b"data: [DONE]" in received, received[-300:]
    assert metric(patient, lapses, stage="thinker") == lapsed + 1


def test_the_filter_keeps_other_unfinished_responses():
    """Only a response marked as given up loses its line; any other unfinished one is logged."""
    record = logging.LogRecord("uvicorn.error", logging.ERROR, __file__, 1, UNFINISHED, None, None)
    assert UnfinishedResponseFilter().filter(record)
