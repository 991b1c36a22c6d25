"""Malformed chat bodies against a real server: every one answered with a 4xx and a message, none
with a 5xx, a reset connection or no answer, and the server serving afterwards with nothing left
held (tests/body_fuzz.py makes the bodies; the server runs fake stages: a body refused before
submission needs no stage work). Then the parts one at a time: the depth scan, the body's
timeout, an over-long body read on so its client reads the 413."""

from __future__ import annotations

import json
import random
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import yaml
from body_fuzz import Case, cases, send
from fake_pipeline import API_KEY, make_orchestrator, write_config

from omni_cache import json_body
from omni_cache.json_body import MAX_JSON_DEPTH, BodyError, json_depth, json_shape, parse_json
from omni_cache.serving.chat_request import parse_chat_request
from omni_cache.serving.server import ServerThread

MAX_BODY_BYTES = 64 * 1024  # small: the over-long bodies stay quick to send
BODY_TIMEOUT_S = 0.5
FUZZ_CASES = 1500
SEED = 41


@pytest.fixture(scope="module")
def srv():
    path = write_config(f"fuzz_{uuid.uuid4().hex[:8]}")
    data = yaml.safe_load(path.read_text())
    data["server"].update(
        max_body_bytes=MAX_BODY_BYTES, max_body_bytes_in_flight=64 * MAX_BODY_BYTES, body_timeout_s=BODY_TIMEOUT_S
    )
    path.write_text(yaml.safe_dump(data))
    server = ServerThread(make_orchestrator(Path(path)), api_key=API_KEY).start()
    try:
        server.wait_ready(60)
        yield server
    finally:
        server.stop()


def _address(srv) -> tuple[str, int]:
    host, port = srv.url.removeprefix("http://").split(":")
    return host, int(port)


def _chat(srv, content: str) -> httpx.Response:
    return httpx.post(
        srv.url + "/v1/chat/completions",
        timeout=30,
        headers={"Authorization": f"Bearer {API_KEY}"},
        json={
            "model": srv.orchestrator.served_model_name,
            "max_tokens": 4,
            "messages": [{"role": "user", "content": content}],
        },
    )


def _wait_idle(srv, timeout: float = 10.0) -> None:
    """Every request answered and every byte given back to the server's bounds."""
    orch = srv.orchestrator
    end = time.monotonic() + timeout
    while (
        orch.in_flight
        or orch.admission.bounds.requests
        or orch.admission.bounds.body_bytes
        or orch.admission.bounds.media_bytes
    ):
        assert time.monotonic() < end, (
            orch.in_flight,
            orch.admission.bounds.requests,
            orch.admission.bounds.body_bytes,
        )
        time.sleep(0.05)


def test_every_malformed_body_is_a_4xx_with_a_message(srv):
    host, port = _address(srv)
    model = srv.orchestrator.served_model_name
    made = list(cases(model, FUZZ_CASES, SEED, MAX_BODY_BYTES))
    assert len({c.kind for c in made}) == 9
    with ThreadPoolExecutor(4) as pool:
        outcomes = list(pool.map(lambda c: send(host, port, c, api_key=API_KEY, timeout=20), made))
    wrong = [
        (c.kind, o.status or o.error, c.body[:120], o.body[:200])
        for c, o in zip(made, outcomes)
        if o.status is None or not 400 <= o.status < 500
    ]
    assert not wrong, f"{len(wrong)} of {len(made)} not a 4xx: {wrong[:10]}"
    for c, o in zip(made, outcomes):
        error = json.loads(o.body)["error"]
        assert error["message"] and error["code"] == o.status, (c.kind, o.body[:300])
    statuses = Counter(o.status for o in outcomes)
    assert statuses[408] and statuses[413] and statuses[400]  # each way of refusing was met
    _wait_idle(srv)
    r = _chat(srv, "after the fuzz")
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "user"
    assert httpx.get(srv.url + "/health", timeout=10).json()["status"] == "ok"


def test_a_body_deeper_than_the_limit_is_refused_by_name(srv):
    host, port = _address(srv)
    deep = b'{"model": "m", "messages": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    outcome = send(host, port, Case("deep", deep), api_key=API_KEY, timeout=10)
    assert outcome.status == 400
    assert f"nests 5001 levels deep; at most {MAX_JSON_DEPTH}" in json.loads(outcome.body)["error"]["message"]


def test_a_body_that_never_all_arrives_gets_408(srv):
    host, port = _address(srv)
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}]}).encode()
    outcome = send(host, port, Case("lying", body, declared_length=len(body) + 10), api_key=API_KEY, timeout=10)
    assert outcome.status == 408
    assert "server.body_timeout_s" in json.loads(outcome.body)["error"]["message"]
    _wait_idle(srv)


def test_an_over_long_body_is_read_on_so_its_client_reads_the_413(srv):
    """Before, the 413 went out and the socket closed with the body unread: the client, still
    sending, saw a reset connection. Up to twice server.max_body_bytes is now read and dropped;
    also for a request refused before its body is read (here: no API key)."""
    host, port = _address(srv)
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * (MAX_BODY_BYTES * 3 // 2)}]})
    outcome = send(host, port, Case("long", body.encode()), api_key=API_KEY, timeout=10)
    assert outcome.status == 413, outcome
    assert "server.max_body_bytes" in json.loads(outcome.body)["error"]["message"]
    refused = send(host, port, Case("long", body.encode()), api_key=None, timeout=10)
    assert refused.status == 401, refused
    wrong_type = send(host, port, Case("long", body.encode(), content_type="text/plain"), api_key=API_KEY, timeout=10)
    assert wrong_type.status == 400, wrong_type
    _wait_idle(srv)


# ---- the parts -------------------------------------------------------------------------------


def test_json_depth_counts_brackets_outside_strings_only():
    assert json_depth(b'{"a": [1, {"b": "[[[\\"[["}]}') == 3
    assert json_depth(b"[]") == 1 and json_depth(b"7") == 0 and json_depth(b"") == 0
    assert json_depth(b'["]]]]]", [[]]]') == 3
    assert json_depth(b"[" * 100) == 100  # unclosed: as deep as its brackets reach
    assert json_depth(b'"' + b'\\"' * 1000 + b"[[") == 0  # one unterminated string


def test_parse_json_names_what_is_wrong():
    assert parse_json(b'{"a": [[1]]}') == {"a": [[1]]}
    for raw, needle in [
        (b"[" * 65 + b"]" * 65, "nests 65 levels deep; at most 64"),
        (b'{"a": 1', "not valid JSON: Expecting"),
        (b'{"a": "\xff"}', "not valid UTF-8"),
        (b'{"a": ' + b"9" * 5000 + b"}", "not valid JSON: Exceeds the limit"),
    ]:
        with pytest.raises(BodyError, match=needle):
            parse_json(raw)


def test_a_deep_tool_call_argument_string_reads_as_no_arguments():
    """An assistant's earlier tool call whose arguments string nests deeper than the limit reads
    as ``{}``, as an unparsable one does (before, json.loads raised RecursionError: a 500)."""
    args = "[" * 5000 + "]" * 5000
    body = json.dumps(
        {
            "model": "m",
            "messages": [
                {"role": "user", "content": "x"},
                {
                    "role": "assistant",
                    "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": args}}],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "y"},
            ],
        }
    ).encode()
    chat = parse_chat_request(body, "m")
    assert chat.messages[1]["tool_calls"][0]["function"]["arguments"] == {}


def test_json_shape_is_the_same_in_any_chunks(monkeypatch):
    """The scan carries its state (in a string, a run of backslashes, the depth) from one chunk to
    the next: cut anywhere, the same shape as read whole."""
    rng = random.Random(5)
    alphabet = [b"[", b"]", b"{", b"}", b'"', b"\\", b",", b"a", b":", b"\\\\", b'\\"']
    texts = [b"".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 200))) for _ in range(300)]
    whole = [json_shape(t) for t in texts]
    for chunk in (1, 2, 3, 7):
        monkeypatch.setattr(json_body, "_CHUNK", chunk)
        assert [json_shape(t) for t in texts] == whole
    monkeypatch.setattr(json_body, "_FIRST_CHUNK", 1)  # chunks of 1, 2, 4, 8, 8, ... bytes
    monkeypatch.setattr(json_body, "_CHUNK", 8)
    assert [json_shape(t) for t in texts] == whole


def test_a_bounded_scan_stops_past_its_bound():
    """Past a bound the scan stops after its chunk: 4 MiB of ``[`` is refused from its first
    64 KiB, its depth reported as a lower bound; a text within the bounds is read to its end."""
    deep = json_shape(b"[" * (4 << 20), max_depth=MAX_JSON_DEPTH)
    assert not deep.complete and deep.depth == 64 * 1024
    many = json_shape(b"[" + b"1," * (1 << 20) + b"1]", max_values=1000)
    assert not many.complete and 1000 < many.values < 1 << 20
    within = b'{"a": [' + b"1," * 100_000 + b'1], "b": "' + b"[" * 100_000 + b'"}'
    assert json_shape(within, max_depth=MAX_JSON_DEPTH, max_values=200_002) == json_shape(within)
    assert json_shape(within).complete
    with pytest.raises(BodyError, match="the JSON event nests at least 65536 levels deep; at most 64 are read"):
        parse_json(b"[" * (2 << 20), what="event")


def test_json_shape_by_runs_outside_strings_is_the_scan_of_every_byte(monkeypatch):
    """Chunks with few quotes are counted by their runs outside strings (a 2 MiB nesting attack
    or a base64 string: a few passes): the same shapes as the scan of every byte, in any chunks,
    escaped quotes and backslash runs across chunk edges included."""
    rng = random.Random(7)
    alphabet = [b"[", b"]", b"{", b"}", b'"', b"\\", b",", b"a", b"a" * 50, b"[" * 30, b"\\\\", b'\\"']
    texts = [b"".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 120))) for _ in range(400)]
    texts += [b"[" * 5000, b'{"audio": "' + b"QUFB" * 4000 + b'"}', b'"' + b"\\" * 9 + b'"[[', b"\\" * 7 + b'"]']
    monkeypatch.setattr(json_body, "_FEW_QUOTES", -1)  # every chunk scanned byte by byte
    expected = [json_shape(t) for t in texts]
    monkeypatch.setattr(json_body, "_FEW_QUOTES", 64)
    for chunk in (1, 3, 64, 1 << 20):
        monkeypatch.setattr(json_body, "_CHUNK", chunk)
        assert [json_shape(t) for t in texts] == expected, chunk


def test_json_shape_counts_values_outside_strings():
    assert json_shape(b'{"a": [1, 2, {"b": ",,[{"}], "c": "\\\\"}').values == 6
    assert json_shape(b"[]").values == 1 and json_shape(b"7").values == 0
    with pytest.raises(BodyError, match="the JSON event holds 4 values; at most 3 are read"):
        parse_json(b"[1, 2, 3, 4]", max_values=3, what="event")
    assert parse_json(b"[1, 2]", max_values=3) == [1, 2]
