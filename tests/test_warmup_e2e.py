"""The vLLM stages' start-up warm-up (workers/warmup.py), on the tiny Qwen3-Omni thinker pipeline
(stage_configs/qwen3_omni_thinker.yaml: a real stage process, real vLLM engine, ZMQ and HTTP).

A fresh server whose thinker warmed up reports each path it warmed (``warmup_<path>_s``), starts
with its counters at zero, and serves its first logprobs, json_schema and named-tool requests
without compiling anything (``compiles_while_serving`` stays 0). The same pipeline with
``warmup: false`` compiles on its first logprobs request (the counter can tell), and answers a
fixed set of greedy requests exactly as the warmed one does (the warm-up changes no answer).
Timings are measured by benchmarks/first_request.py, not here.
"""

from __future__ import annotations

import httpx
import pytest
import yaml
from media_samples import clip_b64, png_data_url
from served_config import served, write_pipeline_config

from omni_cache.runtime.metrics.prometheus import parse_metrics

pytestmark = pytest.mark.vllm

#: Requests whose answers must not depend on the warm-up (greedy; one with logprobs, media).
FIXED = [
    {"messages": [{"role": "user", "content": "Say something about the sea."}]},
    {"messages": [{"role": "user", "content": "omni_cache warm-up: a few tokens of text."}]},
    {"messages": [{"role": "user", "content": "Rank your words."}], "logprobs": True, "top_logprobs": 2},
    {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is in the image?"},
                    {"type": "image_url", "image_url": {"url": png_data_url(64, 64, 3)}},
                ],
            }
        ]
    },
    {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What do you hear?"},
                    {"type": "input_audio", "input_audio": {"data": clip_b64(1.0, 16000), "format": "wav"}},
                ],
            }
        ]
    },
]
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def pipeline(tmp_path_factory, name: str, warmup: bool) -> dict:
    path = write_pipeline_config(tmp_path_factory.mktemp(name), name, "qwen3_omni_thinker.yaml")
    data = yaml.safe_load(path.read_text())
    data["stages"][0]["warmup"] = warmup
    return data


def thinker_counters(url: str) -> dict[str, float]:
    """The thinker's ``omni_cache_stage_*`` and vLLM counters from /metrics, by sample name."""
    out = {}
    for name, labels, value in parse_metrics(httpx.get(url + "/metrics", timeout=30).text):
        if labels.get("stage") == "thinker":
            out[name] = value
    return out


def chat(url: str, model: str, body: dict) -> dict:
    r = httpx.post(
        url + "/v1/chat/completions", timeout=300, json={"model": model, "max_tokens": 6, "temperature": 0.0, **body}
    )
    assert r.status_code == 200, r.text
    return r.json()


def answers(url: str, model: str) -> list:
    out = []
    for body in FIXED:
        choice = chat(url, model, body)["choices"][0]
        logprobs = choice.get("logprobs") or {}
        out.append(
            (
                choice["message"]["content"],
                [(t["token"], [a["token"] for a in t["top_logprobs"]]) for t in logprobs.get("content") or []],
            )
        )
    return out


@pytest.fixture(scope="module")
def warmed(tmp_path_factory):
    """A fresh warmed-up server, its counters before any request, and its answers to FIXED."""
    data = pipeline(tmp_path_factory, "warm", True)
    with served(data, tmp_path_factory.mktemp("warm-run")) as srv:
        yield srv, data["name"], thinker_counters(srv.url)


def test_the_warmup_reports_each_path_it_ran(warmed):
    _, _, counters = warmed
    for path in (
        "greedy",
        "logprobs",
        "penalties",
        "seed",
        "random_sampling",
        "structured_output",
        "image",
        "audio",
        "video",
    ):
        assert counters.get(f"omni_cache_stage_warmup_{path}_s", 0) > 0, path
    # The logprobs path is the one vLLM compiles; the others are not, but all ran.
    assert counters["omni_cache_stage_warmup_s"] >= counters["omni_cache_stage_warmup_logprobs_s"]


def test_the_warmup_counts_in_no_client_figure(warmed):
    _, _, counters = warmed
    assert counters["omni_cache_stage_requests_total"] == 0
    assert counters["vllm:prefix_cache_queries_total"] == 0
    assert counters["vllm:prompt_tokens_total"] == 0
    assert counters["omni_cache_stage_encoder_runs"] == 0
    assert counters["omni_cache_latent_rows_computed_total"] == 0


def test_first_logprobs_json_schema_and_tool_requests_compile_nothing(warmed):
    srv, model, _ = warmed
    chat(srv.url, model, {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 2})
    chat(
        srv.url,
        model,
        {
            "messages": [{"role": "user", "content": "json please"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "reply", "schema": SCHEMA}},
        },
    )
    chat(
        srv.url,
        model,
        {
            "messages": [{"role": "user", "content": "weather?"}],
            "tools": [TOOL],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        },
    )
    counters = thinker_counters(srv.url)
    assert counters["omni_cache_stage_requests_total"] == 3
    assert counters["omni_cache_stage_compiles_while_serving"] == 0


def test_without_warmup_the_first_logprobs_request_compiles_and_answers_are_unchanged(warmed, tmp_path_factory):
    warm_srv, warm_model, _ = warmed
    expected = answers(warm_srv.url, warm_model)
    data = pipeline(tmp_path_factory, "cold", False)
    with served(data, tmp_path_factory.mktemp("cold-run")) as srv:
        counters = thinker_counters(srv.url)
        assert counters["omni_cache_stage_warmup_s"] == 0
        assert counters["omni_cache_stage_compiles_while_serving"] == 0
        got = answers(srv.url, data["name"])
        assert thinker_counters(srv.url)["omni_cache_stage_compiles_while_serving"] >= 1
    assert got == expected
