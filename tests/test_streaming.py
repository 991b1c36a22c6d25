"""Streaming as load generators and SDKs read it, against the fake stages (no vLLM; fast).

* No chunk before the first token: tools like ``vllm bench serve`` time the first chunk that has
  ``choices`` as the first token, so the role must ride on the first real chunk.
* No empty deltas, and the streamed text of an answer is exactly its non-streamed text, also
  when the answer has invalid or incomplete UTF-8 (the fake thinker decodes ``UTF8BAD_ANSWER``
  the way vLLM's incremental detokenizer does).
"""

from __future__ import annotations

import time
import uuid

import httpx
import openai
import pytest
from fake_pipeline import API_KEY, echo, fake_server, sse_events
from fake_stage import SLOW_FIRST_TOKEN_S, UTF8BAD_ANSWER

from omni_cache.runtime.metrics.prometheus import parse_metrics

TTFT = "vllm:time_to_first_token_seconds"


@pytest.fixture(scope="module")
def srv():
    with fake_server("stream") as server:
        yield server


@pytest.fixture
def http(srv):
    with httpx.Client(base_url=srv.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30) as c:
        yield c


@pytest.fixture
def oai(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=API_KEY, max_retries=0, timeout=30)


def body(srv, content: str, **extra):
    return {"model": srv.orchestrator.served_model_name, "messages": [{"role": "user", "content": content}], **extra}


def stream(http, payload) -> tuple[list, float | None]:
    """(events, seconds from sending to the first chunk with choices)."""
    events, first = [], None
    t0 = time.perf_counter()
    with http.stream("POST", "/v1/chat/completions", json=payload) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line:
                continue
            [event] = sse_events([line])
            if first is None and isinstance(event, dict) and event.get("choices"):
                first = time.perf_counter() - t0
            events.append(event)
    assert events[-1] == "[DONE]"
    return events[:-1], first


def assert_openai_shaped(chunks) -> None:
    """The role on the first chunk only; every chunk carries text, audio or the finish reason."""
    with_choices = [c for c in chunks if c["choices"]]
    assert with_choices, chunks
    for i, c in enumerate(with_choices):
        delta = c["choices"][0]["delta"]
        assert ("role" in delta) == (i == 0), (i, delta)
        if i == 0:
            assert delta["role"] == "assistant"
        assert delta.get("content") or delta.get("audio") or c["choices"][0]["finish_reason"], (i, c)
        assert delta.get("content", None) != ""


def ttft_sum(http) -> float:
    return sum(
        v for n, lab, v in parse_metrics(http.get("/metrics").text) if n == TTFT + "_sum" and lab["stage"] == "thinker"
    )


@pytest.mark.parametrize("modalities", [["text"], ["text", "audio"]])
def test_no_chunk_before_the_first_token(srv, http, modalities):
    # The first token takes SLOW_FIRST_TOKEN_S. Before the fix the role chunk came right away.
    before = ttft_sum(http)
    chunks, first = stream(
        http, body(srv, f"SLOWSTART {uuid.uuid4().hex[:6]}", max_tokens=6, stream=True, modalities=modalities)
    )
    server_ttft = ttft_sum(http) - before
    # Causality, not a time limit: the client's clock starts before the server's, so a first
    # chunk that waited for the first token cannot arrive sooner than the server's TTFT.
    assert server_ttft >= SLOW_FIRST_TOKEN_S
    assert first >= server_ttft
    assert_openai_shaped(chunks)
    if modalities == ["text"]:
        assert chunks[0]["choices"][0]["delta"]["content"] == "u"  # the echo's first byte


def test_stream_with_audio_is_openai_shaped(srv, http):
    chunks, _ = stream(
        http,
        body(
            srv,
            "audio too",
            max_tokens=8,
            stream=True,
            modalities=["text", "audio"],
            stream_options={"include_usage": True},
        ),
    )
    assert_openai_shaped(chunks)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 8


@pytest.mark.parametrize("max_tokens", [2, 9, 16])
def test_invalid_utf8_stream_equals_non_stream(srv, http, oai, max_tokens):
    content = f"UTF8BAD {uuid.uuid4().hex[:6]}"
    chunks, _ = stream(
        http, body(srv, content, max_tokens=max_tokens, stream=True, stream_options={"include_usage": True})
    )
    assert_openai_shaped(chunks)
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    whole = oai.chat.completions.create(
        model=srv.orchestrator.served_model_name, max_tokens=max_tokens, messages=[{"role": "user", "content": content}]
    )
    assert whole.choices[0].message.content == streamed
    assert whole.usage.completion_tokens == chunks[-1]["usage"]["completion_tokens"] == max_tokens
    # What vLLM's detokenizer makes of these bytes: U+FFFD for invalid ones, incomplete ones at
    # the end held back (for max_tokens=2 the whole answer: no text, no empty chunk).
    expected = {2: "", 9: "\ufffd ok \ufffd\ufffd ", 16: "\ufffd ok \ufffd\ufffd end "}[max_tokens]
    assert streamed == expected
    assert len(UTF8BAD_ANSWER) == 16


def test_openai_sdk_stream_text_equals_non_stream(srv, oai):
    name = srv.orchestrator.served_model_name
    msgs = [{"role": "user", "content": "héllo wörld"}]
    chunks = list(oai.chat.completions.create(model=name, messages=msgs, max_tokens=12, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    whole = oai.chat.completions.create(model=name, messages=msgs, max_tokens=12).choices[0].message.content
    assert streamed == whole == echo("héllo wörld", 12)
