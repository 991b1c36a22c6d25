"""The Qwen3-Omni pipeline through the HTTP API, streaming: audio reaches the client while the
thinker is still writing; a client that hangs up, an abort and a stage killed mid-answer each leave
nothing of the request in any stage (the talker's rows and codebook history included: they live on
vLLM's request objects), and the pipeline answers again afterwards. A prompt too long for the
context is refused from its length in characters, before it is tokenized."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest
from served_config import QWEN3_OMNI_SHARED

from omni_cache.runtime.metrics.prometheus import parse_metrics

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
]

ROOT = Path(__file__).resolve().parents[1]
NAME = QWEN3_OMNI_SHARED
LONG_ANSWER = 160  # thinker tokens: long enough that the first audio comes well before its end


@pytest.fixture(scope="module")
def server(qwen3_omni_server):
    """The shipped pipeline, shared with tests/test_realtime_e2e.py (tests/conftest.py)."""
    return qwen3_omni_server


def events(server, content: str, max_tokens: int):
    """The SSE events of a streamed text + audio answer, in arrival order ("[DONE]" ends it)."""
    body = {
        "model": NAME,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "stream": True,
        "modalities": ["text", "audio"],
        "audio": {"voice": "default", "format": "pcm16"},
    }
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line == "data: [DONE]":
                return
            if line.startswith("data: "):
                yield json.loads(line[6:])


def kinds(event: dict) -> set[str]:
    out = set()
    for choice in event.get("choices", []):
        delta = choice.get("delta", {})
        if delta.get("content"):
            out.add("text")
        if (delta.get("audio") or {}).get("data"):
            out.add("audio")
        if choice.get("finish_reason"):
            out.add("finish")
    return out


def test_first_audio_arrives_before_the_thinker_finishes(server):
    seen = [kinds(e) for e in events(server, "Tell me everything about lighthouses.", LONG_ANSWER)]
    text_at = [i for i, k in enumerate(seen) if "text" in k]
    audio_at = [i for i, k in enumerate(seen) if "audio" in k]
    assert len(text_at) > 20, "the thinker's answer is too short for this test"
    assert audio_at, "no audio"
    assert audio_at[0] < text_at[-1], f"first audio at event {audio_at[0]}, the thinker's last text at {text_at[-1]}"


def stage_metrics(server) -> dict[tuple[str, str], float]:
    text = httpx.get(server.url + "/metrics", timeout=30).text
    return {(name, labels.get("stage", "")): value for name, labels, value in parse_metrics(text)}


def wait_until_no_stage_holds_anything(server, why: str) -> None:
    """Every stage's table of live requests and both vLLM schedulers empty (bounded wait)."""
    deadline = time.monotonic() + 120
    while True:
        m = stage_metrics(server)
        live = {s: m.get(("omni_cache_stage_queue_depth", s), -1) for s in ("thinker", "talker", "decoder")}
        engine = {
            s: m.get(("vllm:num_requests_running", s), 0) + m.get(("vllm:num_requests_waiting", s), 0)
            for s in ("thinker", "talker")
        }
        if not any(live.values()) and not any(engine.values()):
            return
        assert time.monotonic() < deadline, f"still live after {why}: {live} {engine}"
        time.sleep(0.2)


def answers_again(server) -> None:
    deadline = time.monotonic() + 300
    while httpx.get(server.url + "/health", timeout=30).status_code != 200:
        assert time.monotonic() < deadline, "the pipeline did not come back"
        time.sleep(0.1)
    assert any("audio" in kinds(e) for e in events(server, "Hello again.", 8))


def until_first_audio(stream) -> dict:
    for event in stream:
        if "audio" in kinds(event):
            return event  # the talker is mid-answer
    raise AssertionError("the answer ended before any audio arrived")


def test_a_prompt_past_the_context_in_characters_is_refused_before_tokenizing(server):
    """2 MB of text: tokenizing it took ~4 s holding the tokenizer's lock (20 MB: ~40 s, every
    other prompt waiting), only for admission to refuse its token count."""
    body = {"model": NAME, "messages": [{"role": "user", "content": "word " * 400_000}], "max_tokens": 4}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "input_text" and "2000" in error["message"] and "characters" in error["message"]
    answers_again(server)


def test_a_client_that_hangs_up_leaves_nothing_in_the_stages(server):
    stream = events(server, "Describe the sea at night, slowly.", LONG_ANSWER)
    until_first_audio(stream)
    stream.close()  # the client hangs up
    wait_until_no_stage_holds_anything(server, "the client left")
    answers_again(server)


def test_an_abort_mid_answer_ends_the_request_and_leaves_nothing(server):
    stream = events(server, "Describe the harbour in the morning, slowly.", LONG_ANSWER)
    first = until_first_audio(stream)
    server.orchestrator.abort_threadsafe(first["id"].removeprefix("chatcmpl-"), "aborted by the test")
    rest = list(stream)
    assert rest and "aborted by the test" in rest[-1]["error"]["message"], rest[-1:]
    wait_until_no_stage_holds_anything(server, "the abort")
    answers_again(server)


@pytest.mark.parametrize("dying", ["thinker", "decoder"])
def test_a_stage_killed_mid_answer_leaves_nothing_in_the_talker(server, dying):
    """The talker holds a streaming request fed by the thinker and read by the decoder: when
    either dies mid-answer, the request fails naming it and the talker lets go of it too."""
    orch = server.orchestrator
    old_pid = orch.stage_pids()[dying]
    # The random talker decides when its speech ends, so an answer may leave the dying stage
    # before the kill and complete as it should. Kill only under an answer that cannot: the stage
    # that feeds the dying one (itself, for the thinker) is stopped, and the server has not heard
    # it finish. A stage tells the server it finished before it sends its last output downstream,
    # and a /metrics scrape (a round trip to every stage that is up) lets whatever the stopped
    # stage sent before its stop reach the server first.
    feeder = "talker" if dying == "decoder" else dying
    feeder_pid = orch.stage_pids()[feeder]
    for content in (
        "Tell me about the tides, slowly and at length.",
        "Tell me about the winds over the sea, slowly and at length.",
        "Tell me about the moon and the coast, slowly and at length.",
    ):
        stream = events(server, content, LONG_ANSWER)
        request_id = until_first_audio(stream)["id"].removeprefix("chatcmpl-")
        os.kill(feeder_pid, signal.SIGSTOP)
        stage_metrics(server)
        req = orch.requests.find(request_id)
        if req is not None and feeder not in req.finished:
            break  # its last output is still to come from the stopped feeder
        os.kill(feeder_pid, signal.SIGCONT)
        for _ in stream:  # this answer left the stage already: let it end, try another
            pass
    else:
        pytest.fail(f"the {feeder} had finished every answer by its first audio")
    os.kill(old_pid, signal.SIGKILL)
    if feeder != dying:
        os.kill(feeder_pid, signal.SIGCONT)
    rest = list(stream)
    error = rest[-1].get("error") if rest else None
    assert error and dying in error["message"], rest[-1:]
    answers_again(server)  # the killed stage restarted ...
    assert orch.stage_pids()[dying] not in (None, old_pid)
    wait_until_no_stage_holds_anything(server, f"{dying} died")  # ... and nothing was left behind
