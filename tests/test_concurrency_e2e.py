"""The tiny pipeline under more requests than every stage's batch limits (thinker and talker
`max_num_seqs: 4`, decoder `max_batch_size: 2`): real stage processes, ZMQ and HTTP.

A burst of text, audio and streaming requests, some abandoned mid-answer, one that a stage must
refuse: every request ends exactly once, each full audio answer is as long as the same prompt's
answer alone, the refused one fails alone with an error naming the stage, and afterwards no stage
holds anything. Then the stage-side ends of a request's life, driven over the stages' own sockets:
an Abort that overtakes the request, and a deadline that passes while a stage holds it.
"""

from __future__ import annotations

import base64
import io
import json
import os
import time
import wave
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
import yaml
import zmq
from served_config import without_warmup
from shared_forkers import shared_forkers

from omni_cache.config import load_config
from omni_cache.runtime.metrics.prometheus import parse_metrics
from omni_cache.runtime.orchestrator import Orchestrator
from omni_cache.serving.server import ServerThread
from omni_cache.tiny.checkpoints import THINKER_HIDDEN
from omni_cache.wire.messages import MESSAGE_TYPES, Abort, StageOutput, StreamStart
from omni_cache.wire.transport import Codec, Sender

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[1]
HEADERS = {"Authorization": "Bearer test-key"}
TALKER_MAX_MODEL_LEN = 512
TALKER_MAX_CODES = 40  # the talker's sampling.max_tokens: codes per answer, all segments together


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    data = yaml.safe_load((ROOT / "stage_configs" / "tiny_omni.yaml").read_text())
    name = "conc"
    data["name"] = name
    data["server"]["port"] = 0
    for stage in data["stages"]:
        stage["address"] = f"ipc:///tmp/omni_cache/{name}-{os.getpid()}/{stage['name']}.sock"
        if stage["kind"] == "autoregressive":
            stage["engine_args"]["max_num_seqs"] = 4
        else:
            stage["generation"]["max_batch_size"] = 2
        if stage["name"] == "talker":
            stage["engine_args"]["max_model_len"] = TALKER_MAX_MODEL_LEN
            stage["sampling"]["max_tokens"] = TALKER_MAX_CODES
    path = tmp_path_factory.mktemp("cfg") / f"{name}.yaml"
    path.write_text(yaml.safe_dump(without_warmup(data)))  # (no test of first use here)
    orch = Orchestrator(load_config(path), echo_stage_logs=False, stage_forkers=shared_forkers())
    srv = ServerThread(orch, api_key="test-key").start()
    srv.wait_ready(600)
    yield srv
    srv.stop()


def chat(server, content: str, *, max_tokens: int, audio: bool) -> httpx.Response:
    body = {"model": "conc", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens}
    if audio:
        body.update(modalities=["text", "audio"], audio={"voice": "default", "format": "wav"})
    return httpx.post(server.url + "/v1/chat/completions", json=body, headers=HEADERS, timeout=300)


def audio_samples(r: httpx.Response) -> int:
    assert r.status_code == 200, r.text
    data = base64.b64decode(r.json()["choices"][0]["message"]["audio"]["data"])
    with wave.open(io.BytesIO(data)) as w:
        return w.getnframes()


def stream(server, content: str, *, max_tokens: int, stop_after_audio: bool = False) -> dict:
    """A streamed audio answer: its pcm16 sample count and its end ("done", "error", or "left"
    when the client hung up after the first audio)."""
    body = {
        "model": "conc",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "stream": True,
        "modalities": ["text", "audio"],
        "audio": {"voice": "default", "format": "pcm16"},
    }
    samples, end = 0, None
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, headers=HEADERS, timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                end = end or "done"
                break
            event = json.loads(line[6:])
            if "error" in event:
                end = "error"
                continue
            for choice in event.get("choices", []):
                audio = choice["delta"].get("audio")
                if audio and audio.get("data"):
                    samples += len(base64.b64decode(audio["data"])) // 2
            if stop_after_audio and samples:
                return {"samples": samples, "end": "left"}
    return {"samples": samples, "end": end}


def stage_metrics(server) -> dict[tuple[str, str], float]:
    text = httpx.get(server.url + "/metrics", headers=HEADERS).text
    return {(n, lab.get("stage", "")): v for n, lab, v in parse_metrics(text)}


def wait_until_empty(server) -> dict[tuple[str, str], float]:
    """Aborts reach the stages asynchronously: wait (bounded) until nothing is held anywhere."""
    held = ("omni_cache_stage_queue_depth", "vllm:num_requests_running", "vllm:num_requests_waiting")
    deadline = time.monotonic() + 60
    while True:
        m = stage_metrics(server)
        busy = {k: v for k, v in m.items() if k[0] in held and v}
        if m[("omni_cache_requests_in_flight", "")]:
            busy["in_flight"] = m[("omni_cache_requests_in_flight", "")]
        if not busy:
            return m
        assert time.monotonic() < deadline, f"still held after the burst: {busy}"
        time.sleep(0.1)


PROMPTS = [f"question {i}: what is {i} plus {i}?" for i in range(4)]


def test_burst_over_every_batch_limit(server):
    alone = {p: audio_samples(chat(server, p, max_tokens=12, audio=True)) for p in PROMPTS}
    assert all(alone.values())
    long_prompt = "tell me everything " * 40  # over the talker's 512-token context
    with ThreadPoolExecutor(16) as pool:
        audio = {p: pool.submit(lambda p=p: audio_samples(chat(server, p, max_tokens=12, audio=True))) for p in PROMPTS}
        streamed = {p: pool.submit(stream, server, p, max_tokens=12) for p in PROMPTS}
        texts = [pool.submit(chat, server, f"just text {i}", max_tokens=8, audio=False) for i in range(3)]
        left = [
            pool.submit(stream, server, f"a long story {i}", max_tokens=400, stop_after_audio=True) for i in range(2)
        ]
        refused = pool.submit(chat, server, long_prompt, max_tokens=8, audio=True)
        # Every request ended (the pool's futures return), each with what it should have.
        for p in PROMPTS:
            assert audio[p].result() == alone[p], p
            got = streamed[p].result()
            assert got == {"samples": alone[p], "end": "done"}, p
        for t in texts:
            assert t.result().status_code == 200
            assert t.result().json()["usage"]["completion_tokens"] == 8
        assert all(f.result()["end"] == "left" for f in left)
        r = refused.result()
    assert r.status_code == 400, r.text
    assert "talker" in r.text and str(TALKER_MAX_MODEL_LEN) in r.text
    m = wait_until_empty(server)
    assert m[("omni_cache_stage_errors_total", "talker")] >= 1


def raw_sender(server, ctx: zmq.Context, stage: str) -> Sender:
    """A peer writing straight into a stage's inbox, as its upstream stage does."""
    config = server.orchestrator.config
    codec = Codec(MESSAGE_TYPES, config.server.max_message_bytes)
    # Linger: closing waits until the messages are out (the default, 0, would drop them).
    return Sender(ctx, config.stage(stage).address, codec, linger_ms=30_000)


def thinker_output(
    rid: str, seq: int, rows: int, *, start: int = 0, prompt: int = 0, time_left_s: float | None = None
) -> tuple[StageOutput, dict[str, torch.Tensor]]:
    """What the thinker sends the talker: `rows` hidden rows from position `start`, for a
    request of `prompt` prompt tokens."""
    msg = StageOutput(
        request_id=rid, stage="thinker", seq=seq, token_ids=[65], latent_start=start, num_prompt_tokens=prompt
    )
    if seq == 0:  # a stream opens with its StreamStart
        msg = StreamStart.opening(msg, modalities=["text", "audio"], time_left_s=time_left_s)
    return msg, {"hidden": torch.randn(rows, THINKER_HIDDEN).to(torch.bfloat16)}


def counter(server, name: str, stage: str) -> float:
    return stage_metrics(server).get((name, stage), 0.0)


def test_abort_before_the_first_message_leaves_nothing_in_the_stage(server):
    before = counter(server, "omni_cache_stage_requests_total", "talker")
    ctx = zmq.Context()
    sender = raw_sender(server, ctx, "talker")
    try:
        sender.send(Abort(request_id="overtaken"))
        # Arrives after the Abort: dropped, and so is the rest of its stream.
        sender.send(*thinker_output("overtaken", 0, 20, prompt=16))
        sender.send(*thinker_output("overtaken", 1, 8, start=20, prompt=16))
        # A second request on the same socket: once the talker took it, it had read the first.
        sender.send(*thinker_output("marker", 0, 2, prompt=2))  # too few rows for a talker job
        sender.send(Abort(request_id="marker"))
    finally:
        sender.close()
        ctx.term()
    deadline = time.monotonic() + 30
    while counter(server, "omni_cache_stage_requests_total", "talker") < before + 1:
        assert time.monotonic() < deadline, "the talker never took the marker request"
        time.sleep(0.2)
    m = wait_until_empty(server)
    assert m[("omni_cache_stage_requests_total", "talker")] == before + 1  # "overtaken" never started


def test_deadline_passes_in_the_stages(server):
    """Requests whose deadline passes while a stage holds them, waiting for upstream input that
    never comes (the orchestrator never heard of them, so no Abort comes either): the talker
    (with a finished vLLM job behind it) and the decoder (too few codes for audio yet) drop them."""
    expired = {s: counter(server, "omni_cache_stage_expired", s) for s in ("talker", "decoder")}
    soon = 2.0  # seconds left
    ctx = zmq.Context()
    talker, decoder = raw_sender(server, ctx, "talker"), raw_sender(server, ctx, "decoder")
    try:
        talker.send(*thinker_output("late", 0, 24, prompt=16, time_left_s=soon))  # a talker segment
        # One code: fewer than the first decode chunk (FIRST_CHUNK_CODES) plus its lookahead.
        decoder.send(
            StreamStart(
                request_id="late-codes",
                stage="talker",
                seq=0,
                token_ids=[1],
                modalities=["text", "audio"],
                time_left_s=soon,
            )
        )
    finally:
        talker.close()
        decoder.close()
        ctx.term()
    deadline = time.monotonic() + 60
    while any(counter(server, "omni_cache_stage_expired", s) < expired[s] + 1 for s in expired):
        assert time.monotonic() < deadline, {
            k: v for k, v in stage_metrics(server).items() if "expired" in k[0] or "queue_depth" in k[0]
        }
        time.sleep(0.3)
    wait_until_empty(server)


def test_the_talkers_max_tokens_caps_the_answer(server):
    """An answer whose thinker text asks for more codes than the talker's sampling.max_tokens:
    its audio stops at the cap (the talker skips its remaining segments), and the request ends
    normally."""
    from omni_cache.models.codec_decoder import decoder_config

    long = chat(server, "a long answer, please", max_tokens=60, audio=True)
    short = chat(server, "a long answer, please", max_tokens=12, audio=True)
    per_code = decoder_config()["samples_per_code"]
    assert 0 < audio_samples(short) < TALKER_MAX_CODES * per_code  # under the cap: untouched
    assert audio_samples(short) < audio_samples(long) <= TALKER_MAX_CODES * per_code
    assert long.json()["usage"]["completion_tokens"] == 60
    wait_until_empty(server)
