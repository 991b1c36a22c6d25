"""Stage replicas without vLLM (fast): the routing policies on their own, the request table's load,
and a pipeline whose thinker runs as two fake stage processes (tests/fake_stage.py: real OS
processes, real ZMQ) routed by ``least_loaded``: a busy replica is passed over, and kill -9 of
one replica fails only its own request while the other keeps serving, until the dead one is back
and taken again."""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest
from sse_client import read_events

from omni_cache.config import load_config
from omni_cache.runtime.metrics.prometheus import parse_metrics
from omni_cache.runtime.orchestrator import Orchestrator
from omni_cache.runtime.request_path.requests import Request, RequestTable
from omni_cache.runtime.routing.prefix_index import PrefixIndex
from omni_cache.runtime.routing.replica_router import ReplicaRouter
from omni_cache.serving.server import ServerThread

FAKE_STAGE = Path(__file__).with_name("fake_stage.py")
API_KEY = "replica-test-key"
HEADERS = {"Authorization": f"Bearer {API_KEY}"}


# ---- the policies ----------------------------------------------------------------------------


def test_round_robin_takes_turns_and_skips_a_replica_that_is_down():
    router = ReplicaRouter("round_robin", {"thinker": 3})
    assert [router.pick("thinker", [0, 1, 2], {}) for _ in range(4)] == [0, 1, 2, 0]
    assert [router.pick("thinker", [0, 2], {}) for _ in range(3)] == [2, 0, 2]  # 1 is down
    assert router.pick("thinker", [0, 1, 2], {}) == 0  # back: the turn goes on from where it was
    assert router.pick("thinker", [0, 1, 2], {}) == 1
    assert router.decisions[("thinker", 0, "round_robin", "round_robin")] == 4
    assert router.decisions[("thinker", 2, "round_robin", "round_robin")] == 3


def test_least_loaded_takes_the_fewest_in_flight_ties_to_the_lowest_index():
    router = ReplicaRouter("least_loaded", {"thinker": 3})
    assert router.pick("thinker", [0, 1, 2], {}) == 0
    assert router.pick("thinker", [0, 1, 2], {0: 1}) == 1
    assert router.pick("thinker", [0, 1, 2], {0: 2, 1: 1, 2: 1}) == 1
    assert router.pick("thinker", [0, 2], {0: 2, 1: 0, 2: 3}) == 0  # 1 is down
    assert sum(router.decisions.values()) == 4
    assert all(key[2:] == ("least_loaded", "least_loaded") for key in router.decisions)


def test_prefix_takes_the_longest_held_prefix_else_the_least_loaded():
    router = ReplicaRouter("prefix", {"thinker": 3})
    loads = {0: 3, 1: 1, 2: 2}
    assert router.pick("thinker", [0, 1, 2], loads) == 1  # nothing known: least loaded
    assert router.pick("thinker", [0, 1, 2], loads, {0: 0, 1: 0}) == 1  # nothing held
    assert router.pick("thinker", [0, 1, 2], {0: 3, 1: 0}, {0: 5, 1: 2}) == 0  # longest, busy or not
    assert router.pick("thinker", [0, 1, 2], {0: 3, 2: 1}, {0: 5, 2: 5}) == 2  # tie: least loaded
    assert router.pick("thinker", [1, 2], {}, {0: 9, 1: 1}) == 1  # 0 holds more, but it is down
    assert router.decisions == {
        ("thinker", 1, "prefix", "least_loaded"): 2,
        ("thinker", 0, "prefix", "prefix_hit"): 1,
        ("thinker", 2, "prefix", "prefix_hit"): 1,
        ("thinker", 1, "prefix", "prefix_hit"): 1,
    }


def test_prefix_index_counts_leading_blocks_and_forgets_what_was_evicted():
    index = PrefixIndex()
    index.apply(0, stored=[11, 12, 13], removed=[], block_size=32)
    index.apply(1, stored=[11, 99], removed=[])
    assert index.block_size == {0: 32}
    assert index.matched_blocks(0, [11, 12, 13, 14]) == 3
    assert index.matched_blocks(1, [11, 12, 13]) == 1  # 12 missing: 99 does not continue it
    index.apply(0, stored=[11, 12], removed=[])  # hits report their blocks again: still held once
    assert index.matched_blocks(0, [11, 12, 13]) == 3 and index.blocks(0) == 3
    index.apply(0, stored=[], removed=[12])  # evicted
    assert index.matched_blocks(0, [11, 12, 13]) == 1 and index.blocks(0) == 2
    index.apply(0, stored=[13], removed=[], cleared=True)  # a reset, then one block
    assert index.matched_blocks(0, [11]) == 0 and index.blocks(0) == 1
    index.forget(1)
    assert index.matched_blocks(1, [11]) == 0 and index.blocks(1) == 0


def test_a_one_replica_stage_is_no_decision_and_nothing_is_picked_from_none():
    router = ReplicaRouter("round_robin", {"thinker": 2, "talker": 1})
    assert router.pick("talker", [0], {}) == 0
    assert not router.decisions
    with pytest.raises(ValueError, match="no replica of stage 'thinker' is up"):
        router.pick("thinker", [], {})
    with pytest.raises(ValueError, match="unknown routing policy 'random'"):
        ReplicaRouter("random", {})


def test_request_table_load_counts_what_each_replica_has_not_finished():
    table = RequestTable()

    def req(rid: str, thinker: int, talker: int) -> Request:
        r = Request(
            request_id=rid,
            prompt_token_ids=[1],
            modalities=("text", "audio"),
            participants=("thinker", "talker"),
            t0=0.0,
            deadline=1e9,
            timeout_s=1.0,
            return_latents=False,
            route={"thinker": thinker, "talker": talker},
        )
        table.add(r)
        return r

    a, b, _ = req("a", 0, 1), req("b", 1, 1), req("c", 1, 0)
    a.finished["thinker"] = None  # type: ignore[assignment]  # done at the thinker, still talking
    assert table.load("thinker") == {1: 2}
    assert table.load("talker") == {1: 2, 0: 1}
    assert [r.request_id for r in table.served_by("talker", 1)] == ["a", "b"]
    table.answered(b)
    assert table.load("thinker") == {1: 1}


# ---- two fake thinker replicas behind the HTTP server ------------------------------------------


class ByteTokenizer:
    chat_template = ""

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True, tools=None, **template_kwargs):
        return list("".join(f"{m['role']}: {m['content']}\n" for m in messages).encode())

    def decode(self, ids, skip_special_tokens=True):
        return bytes(i for i in ids if i < 256).decode(errors="replace")


@pytest.fixture(scope="module")
def srv():
    d = tempfile.mkdtemp(prefix="ocr")  # short: ipc paths are limited to 107 bytes
    path = Path(d) / "pipeline.yaml"
    path.write_text(f"""
name: replicas_{uuid.uuid4().hex[:8]}
server: {{host: 127.0.0.1, port: 0, request_timeout_s: 60, routing: least_loaded}}
stages:
  - name: thinker
    kind: autoregressive
    model: tiny:thinker
    address: ipc://{d}/thinker.sock
    replicas: 2
    final_output: text
    engine_args: {{max_model_len: 512}}
    sampling: {{max_tokens: 16}}
    env: {{FAKE_TOKEN_DELAY: "0.01"}}
  - name: decoder
    kind: generation
    model: tiny:decoder
    inputs: [thinker]
    handoff: omni_cache.handoff.talker_to_decoder
    address: ipc://{d}/decoder.sock
    final_output: audio
""")
    orch = Orchestrator(
        load_config(path),
        tokenizer=ByteTokenizer(),
        stage_argv=[sys.executable, str(FAKE_STAGE)],
        start_timeout_s=60,
        shutdown_grace_s=2,
        echo_stage_logs=False,
    )
    server = ServerThread(orch, api_key=API_KEY).start()
    try:
        server.wait_ready(60)
        yield server
    finally:
        server.stop()


def metric(srv, name: str, **labels: str) -> float:
    text = httpx.get(srv.url + "/metrics", headers=HEADERS, timeout=10).text
    return sum(
        v for n, lab, v in parse_metrics(text) if n == name and all(lab.get(k) == want for k, want in labels.items())
    )


def routed(srv, replica: int) -> float:
    return metric(
        srv,
        "omni_cache_routing_decisions_total",
        stage="thinker",
        replica=str(replica),
        policy="least_loaded",
        decision="least_loaded",
    )


def ask(srv, content: str) -> httpx.Response:
    body = {
        "model": srv.orchestrator.served_model_name,
        "max_tokens": 8,
        "messages": [{"role": "user", "content": content}],
    }
    return httpx.post(srv.url + "/v1/chat/completions", json=body, headers=HEADERS, timeout=30)


def wait_until(check, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.05)


def stream_in_background(srv, content: str) -> tuple[threading.Thread, list]:
    """A streamed request read by a thread: its SSE events land in the returned list."""
    events: list = []
    body = {
        "model": srv.orchestrator.served_model_name,
        "stream": True,
        "max_tokens": 8,
        "messages": [{"role": "user", "content": content}],
    }

    thread = threading.Thread(
        target=read_events,
        daemon=True,
        args=(srv.url + "/v1/chat/completions", body, HEADERS, events),
        kwargs={"timeout": 60},
    )
    thread.start()
    return thread, events


def text_of(events: list) -> str:
    return "".join(
        c["delta"].get("content") or "" for e in list(events) if isinstance(e, dict) for c in e.get("choices", [])
    )


def test_least_loaded_passes_a_busy_replica_and_a_dead_one_s_request_goes_on_elsewhere(srv):
    orch = srv.orchestrator
    assert sorted(orch.stage_pids()) == ["decoder", "thinker#0", "thinker#1"]
    # A request the fake thinker stalls on after 2 tokens makes replica 0 busy: both are idle,
    # so the tie goes to the lowest index.
    before = routed(srv, 0), routed(srv, 1)
    hung, events = stream_in_background(srv, "STALL")
    wait_until(lambda: routed(srv, 0) == before[0] + 1, "the stalling request is routed")
    wait_until(lambda: text_of(events) == "us", "the stalling request's 2 tokens are streamed")
    for i in range(3):
        r = ask(srv, f"quick {i}")
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == "user: qu"  # the echo, 8 tokens
    assert (routed(srv, 0), routed(srv, 1)) == (before[0] + 1, before[1] + 3)
    assert metric(srv, "omni_cache_stage_queue_depth", stage="thinker", replica="0") == 1
    assert metric(srv, "omni_cache_replica_requests_in_flight", stage="thinker", replica="0") == 1
    assert metric(srv, "omni_cache_replica_requests_in_flight", stage="thinker", replica="1") == 0

    # kill -9 of replica 0: its request goes on on replica 1 after the 2 tokens its client has
    # (no token repeated or skipped: the echo the other requests got).
    old_pid = orch.stage_pids()["thinker#0"]
    os.kill(old_pid, signal.SIGKILL)
    hung.join(timeout=30)
    assert not hung.is_alive(), "the request on the killed replica hangs"
    assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1]), events
    assert text_of(events) == "user: ST"
    assert routed(srv, 1) == before[1] + 4  # 3 quick ones, then the resumed one
    assert metric(srv, "omni_cache_requests_resumed_total", stage="thinker", replica="0") == 1
    # Its restart takes seconds (a fresh process imports torch before it announces itself):
    # meanwhile the server is degraded, not down, and replica 1 takes everything.
    health = httpx.get(srv.url + "/health", timeout=10)
    assert health.status_code == 200 and health.json()["status"] == "degraded", health.text
    assert {k: v for k, v in health.json()["replicas"]["thinker#0"].items() if k != "why"} == {
        "stage": "thinker",
        "replica": 0,
    }
    busy = routed(srv, 1)
    assert ask(srv, "still here").status_code == 200
    assert routed(srv, 1) == busy + 1

    # The dead replica comes back and is routed to again (it is the idle one with the lower index).
    wait_until(lambda: httpx.get(srv.url + "/health").json() == {"status": "ok"}, "thinker#0 is back")
    assert orch.stage_pids()["thinker#0"] not in (None, old_pid)
    assert metric(srv, "omni_cache_stage_restarts_total", stage="thinker", replica="0") == 1
    assert metric(srv, "omni_cache_stage_restarts_total", stage="thinker", replica="1") == 0
    taken = routed(srv, 0)
    assert ask(srv, "welcome back").status_code == 200
    assert routed(srv, 0) == taken + 1
    assert metric(srv, "omni_cache_stage_requests_total", stage="thinker", replica="0") == 1
