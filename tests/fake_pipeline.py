"""A pipeline of fake stages (tests/fake_stage.py) for tests that need a real server, real stage
processes and real ZMQ, but no vLLM: its config, its tokenizer, what its thinker answers, and a
server over it. Shared by the tests of the HTTP API, the realtime API, admission and the wire."""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import yaml

from omni_cache.config import load_config
from omni_cache.runtime.metrics.prometheus import parse_metrics
from omni_cache.runtime.orchestrator import Orchestrator
from omni_cache.serving.server import ServerThread

FAKE_STAGE = Path(__file__).with_name("fake_stage.py")
API_KEY = "unit-test-key"
MAX_MODEL_LEN = 512
TIMEOUT_S = 4.0
MAX_MESSAGE_BYTES = 2**21  # server.max_message_bytes
MAX_BODY_BYTES = 2**20  # server.max_body_bytes: the largest request body
TOKEN_DELAY_S = 0.02
SAMPLES_PER_TOKEN = 240  # fake decoder: 10 ms of audio per token


class ByteTokenizer:
    """Chat template "role: content\\n" per message, one token per byte."""

    chat_template = ""

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True, tools=None, **template_kwargs):
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        return {"input_ids": list(text.encode())}  # like transformers 5's BatchEncoding

    def decode(self, ids, skip_special_tokens=True):
        return bytes(i for i in ids if i < 256).decode(errors="replace")


def echo(content: str, max_tokens: int) -> str:
    """What the fake thinker answers to one user message."""
    return f"user: {content}\n".encode()[:max_tokens].decode(errors="replace")


def write_config(
    name: str,
    decoder_env: str = "{}",
    *,
    token_delay_s: float = TOKEN_DELAY_S,
    max_model_len: int = MAX_MODEL_LEN,
    timeout_s: float = TIMEOUT_S,
    server_extra: str = "",
) -> Path:
    """The fake pipeline's config; ``server_extra``: more ``server`` keys (", key: value")."""
    d = tempfile.mkdtemp(prefix="ocu")  # short: ipc paths are limited to 107 bytes
    path = Path(d) / "pipeline.yaml"
    path.write_text(f"""
name: {name}
server: {{host: 127.0.0.1, port: 0, request_timeout_s: {timeout_s}, max_message_bytes: {MAX_MESSAGE_BYTES},
          max_body_bytes: {MAX_BODY_BYTES}{server_extra}}}
stages:
  - name: thinker
    kind: autoregressive
    model: tiny:thinker
    address: ipc://{d}/thinker.sock
    final_output: text
    engine_args: {{max_model_len: {max_model_len}}}
    sampling: {{max_tokens: 16}}
    env: {{FAKE_TOKEN_DELAY: "{token_delay_s}"}}
  - name: decoder
    kind: generation
    model: tiny:decoder
    inputs: [thinker]
    handoff: omni_cache.handoff.talker_to_decoder
    address: ipc://{d}/decoder.sock
    final_output: audio
    env: {decoder_env}
""")
    return path


def make_orchestrator(path: Path, **options: Any) -> Orchestrator:
    """The fake-stage pipeline of config ``path``; ``options``: more Orchestrator arguments."""
    return Orchestrator(
        load_config(path),
        tokenizer=ByteTokenizer(),
        stage_argv=[sys.executable, str(FAKE_STAGE)],
        start_timeout_s=60,
        shutdown_grace_s=2,
        echo_stage_logs=False,
        **options,
    )


@contextlib.contextmanager
def serve_config(path: Path) -> Iterator[ServerThread]:
    """The fake-stage pipeline of config ``path`` behind a ready HTTP server (API key API_KEY),
    stopped on exit."""
    server = ServerThread(make_orchestrator(path), api_key=API_KEY).start()
    try:
        server.wait_ready(60)
        yield server
    finally:
        server.stop()


@contextlib.contextmanager
def fake_server(prefix: str, decoder_env: str = "{}") -> Iterator[ServerThread]:
    """A pipeline of fake stages behind a ready HTTP server (API key API_KEY), stopped on exit."""
    with serve_config(write_config(f"{prefix}_{uuid.uuid4().hex[:8]}", decoder_env)) as server:
        yield server


def metric(srv: ServerThread, name: str, **labels: str) -> float:
    """Sample ``name`` of the server's /metrics, summed over the samples whose labels include
    ``labels``."""
    r = httpx.get(srv.url + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30)
    return sum(
        v for n, got, v in parse_metrics(r.text) if n == name and all(got.get(k) == x for k, x in labels.items())
    )


#: The stage counters a client hold shows in (scheduler/client_hold.py; the fake thinker's tokens).
HOLDS, SENT = "omni_cache_stage_client_holds_total", "omni_cache_stage_tokens_sent"


def wait_until_held(srv: ServerThread, before: float) -> float:
    """Wait until the thinker has counted one more client hold than ``before``; the tokens it had
    sent by then."""
    end = time.monotonic() + 60
    while metric(srv, HOLDS, stage="thinker") < before + 1:
        assert time.monotonic() < end, "the paused client's request was never held"
        time.sleep(0.05)
    return metric(srv, SENT, stage="thinker")


def sse_events(lines):
    events = []
    for line in lines:
        if not line:
            continue
        assert line.startswith("data: "), line
        data = line[len("data: ") :]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


def fake_pipeline_config(directory: Path, name: str, **thinker: object) -> Path:
    """A thinker -> decoder pipeline of fake stages without any address."""
    data = {
        "name": name,
        "server": {"host": "127.0.0.1", "port": 0, "request_timeout_s": 30},
        "stages": [
            {
                "name": "thinker",
                "kind": "autoregressive",
                "model": "tiny:thinker",
                "final_output": "text",
                "engine_args": {"max_model_len": 512},
                "sampling": {"max_tokens": 8},
                **thinker,
            },
            {
                "name": "decoder",
                "kind": "generation",
                "model": "tiny:decoder",
                "inputs": ["thinker"],
                "handoff": "omni_cache.handoff.talker_to_decoder",
                "final_output": "audio",
            },
        ],
    }
    path = directory / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def open_stream_without_reading(srv: ServerThread, tokens: int) -> socket.socket:
    """A streamed spoken answer of ``tokens`` tokens asked for over a socket whose receive window
    is 4 KiB, and never read: a client that stops reading."""
    body = json.dumps(
        {
            "model": srv.orchestrator.served_model_name,
            "max_tokens": tokens,
            "stream": True,
            "modalities": ["text", "audio"],
            "audio": {"format": "pcm16", "voice": "default"},
            "messages": [{"role": "user", "content": "x" * tokens}],
        }
    ).encode()
    host, port = srv.url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: the window stays small
    sock.connect((host, int(port)))
    sock.sendall(
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {API_KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    return sock


class Records(logging.Handler):
    """The messages of the log records a logger hands it (added with ``addHandler``)."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())
