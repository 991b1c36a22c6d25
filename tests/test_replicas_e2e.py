"""Two thinker replicas on the tiny pipeline (real vLLM engines, ZMQ, HTTP, the `openai` client),
routed ``round_robin``: consecutive requests alternate between the replicas (counted from each
replica's own ``omni_cache_stage_requests_total`` in /metrics), both replicas answer a prompt
alike (same checkpoint, greedy), an audio answer passes the one talker and decoder, and kill -9
of one replica fails only the request it was serving while the other keeps answering; the dead
one restarts and is routed to again.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from omni_cache.serving.metrics import parse_metrics
from served_config import served

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[1]
API_KEY = "test-key"
HEADERS = {"Authorization": f"Bearer {API_KEY}"}
NAME = "replicas"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    data = yaml.safe_load((ROOT / "stage_configs" / "tiny_omni.yaml").read_text())
    data["name"] = NAME
    data["server"]["port"] = 0
    data["server"]["routing"] = "round_robin"
    for stage in data["stages"]:
        stage["address"] = f"ipc:///tmp/omni_cache/{NAME}-{os.getpid()}/{stage['name']}.sock"
        if stage["name"] == "thinker":
            stage["replicas"] = 2
            stage["env"]["VLLM_CPU_KVCACHE_SPACE"] = "1"  # two engines' pools
    with served(data, tmp_path_factory.mktemp("cfg"), api_key=API_KEY) as srv:
        yield srv


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def thinker_requests(server) -> tuple[float, float]:
    """Requests each thinker replica accepted since its last start (its own counter)."""
    text = httpx.get(server.url + "/metrics", headers=HEADERS, timeout=30).text
    got = {lab["replica"]: v for n, lab, v in parse_metrics(text)
           if n == "omni_cache_stage_requests_total" and lab["stage"] == "thinker"}
    return got["0"], got["1"]


def which_replica(server, send) -> int:
    """Send one request (``send()``) and say which thinker replica took it."""
    before = thinker_requests(server)
    send()
    after = thinker_requests(server)
    moved = [i for i in (0, 1) if after[i] != before[i]]
    assert len(moved) == 1 and after[moved[0]] == before[moved[0]] + 1, (before, after)
    return moved[0]


def test_requests_alternate_between_the_replicas_and_both_answer_alike(server, client):
    answers: list[str] = []

    def ask() -> None:
        r = client.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": "the same question"}], max_tokens=12)
        answers.append(r.choices[0].message.content)

    first = which_replica(server, ask)
    assert [which_replica(server, ask) for _ in range(3)] == [1 - first, first, 1 - first]
    assert len(set(answers)) == 1, answers  # one checkpoint, greedy: the replica does not matter
    text = httpx.get(server.url + "/metrics", headers=HEADERS, timeout=30).text
    routed = {lab["replica"]: v for n, lab, v in parse_metrics(text)
              if n == "omni_cache_routing_decisions_total" and lab["stage"] == "thinker"
              and lab["policy"] == lab["decision"] == "round_robin"}
    assert routed["0"] >= 2 and routed["1"] >= 2 and abs(routed["0"] - routed["1"]) <= 1, routed
    # an audio answer: the route travels with the request through the one talker and decoder
    r = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "say it"}], max_tokens=6,
        modalities=["text", "audio"], audio={"voice": "default", "format": "wav"})
    assert r.choices[0].message.audio.data


def stream(server, content: str, out: list, first_token: threading.Event) -> None:
    body = {"model": NAME, "messages": [{"role": "user", "content": content}], "max_tokens": 800,
            "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, headers=HEADERS,
                      timeout=300) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line[len("data: "):]
                out.append(data if data == "[DONE]" else json.loads(data))
                if any(isinstance(e, dict) and e.get("choices") for e in out):
                    first_token.set()
    first_token.set()


def test_a_killed_replica_fails_only_its_request_and_is_routed_to_again(server, client):
    orch = server.orchestrator
    old_pid = orch.stage_pids()["thinker#1"]
    # Two long answers at once: round robin puts them on different replicas.
    runs = []
    for content in ("first long answer", "second long answer"):
        events: list = []
        started = threading.Event()
        thread = threading.Thread(target=stream, args=(server, content, events, started), daemon=True)
        thread.start()
        runs.append((thread, events, started))
    for _, events, started in runs:
        assert started.wait(120), "no first token"
    for _, events, _ in runs:
        assert events[-1] != "[DONE]", "an answer ended before the kill: make it longer"
    os.kill(old_pid, signal.SIGKILL)

    def failed() -> list[str]:
        return [e["error"]["message"] for _, events, _ in runs for e in list(events)
                if isinstance(e, dict) and "error" in e]

    deadline = time.monotonic() + 60
    while not failed():
        assert time.monotonic() < deadline, "no stream got the replica's death"
        time.sleep(0.05)
    # The other replica keeps answering while the dead one restarts (a vLLM engine: seconds).
    health = httpx.get(server.url + "/health", timeout=30)
    assert health.status_code == 200 and health.json()["status"] == "degraded", health.text
    assert set(health.json()["replicas"]) == {"thinker#1"}
    r = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "still?"}],
                                       max_tokens=4)
    assert r.choices[0].finish_reason in ("stop", "length")
    for thread, _, _ in runs:
        thread.join(timeout=300)
        assert not thread.is_alive(), "a stream hangs"
    errors = failed()
    assert len(errors) == 1, [e[-2] for _, e, _ in runs]
    assert "stage 'thinker#1' died (killed by signal SIGKILL)" in errors[0]
    assert all(e[-1] == "[DONE]" for _, e, _ in runs)

    deadline = time.monotonic() + 300
    while httpx.get(server.url + "/health", timeout=30).json() != {"status": "ok"}:
        assert time.monotonic() < deadline, "thinker#1 did not come back"
        time.sleep(0.5)
    assert orch.stage_pids()["thinker#1"] not in (None, old_pid)

    def ask() -> None:
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "back?"}],
                                       max_tokens=4)

    assert sorted(which_replica(server, ask) for _ in range(2)) == [0, 1]
    text = httpx.get(server.url + "/metrics", headers=HEADERS, timeout=30).text
    restarts = {lab["replica"]: v for n, lab, v in parse_metrics(text)
                if n == "omni_cache_stage_restarts_total" and lab["stage"] == "thinker"}
    assert restarts == {"0": 0, "1": 1}
