"""Spoken answers streamed from a served pipeline, for the tests that disturb its stages
(tests/test_stage_hangs_e2e.py, tests/test_stage_backpressure_e2e.py): each read in a thread of
its own, with what the stages hold (/metrics) and the checks that the pipeline answers again."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from served_config import served
from sse_client import read_events

from omni_cache.runtime.metrics.prometheus import parse_metrics

#: Bound of the waits for a restart (vLLM start-up) and for an answer.
WAIT_S = 300.0
QWEN3_OMNI = Path(__file__).resolve().parents[1] / "stage_configs" / "qwen3_omni.yaml"


def qwen3_omni_server(name: str, heartbeat_timeout_s: float) -> Any:
    """A module-scoped fixture: the shipped Qwen3-Omni pipeline served under its own name, ipc
    paths and a free port, with this heartbeat timeout."""

    @pytest.fixture(scope="module")
    def server(tmp_path_factory):
        data = yaml.safe_load(QWEN3_OMNI.read_text())
        data["name"] = name
        data["server"]["port"] = 0
        data["server"]["heartbeat_timeout_s"] = heartbeat_timeout_s
        for stage in data["stages"]:
            stage["address"] = f"ipc:///tmp/omni_cache/{name}-{os.getpid()}/{stage['name']}.sock"
        with served(data, tmp_path_factory.mktemp("cfg")) as srv:
            yield srv

    return server


def spoken(server, content: str, max_tokens: int) -> dict:
    """A streamed text + audio chat request for ``server``'s model."""
    return {
        "model": server.orchestrator.served_model_name,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "stream": True,
        "modalities": ["text", "audio"],
        "audio": {"voice": "default", "format": "pcm16"},
    }


def has_audio(event) -> bool:
    return isinstance(event, dict) and any(
        (c.get("delta", {}).get("audio") or {}).get("data") for c in event.get("choices", [])
    )


class Stream:
    """One spoken answer read in a thread: its events, when its first audio came, when it ended."""

    def __init__(self, server, content: str, max_tokens: int) -> None:
        self.events: list = []
        self.ended_at: float | None = None
        self.audio = threading.Event()  # first audio, or the end
        self.thread = threading.Thread(target=self._read, args=(server, content, max_tokens), daemon=True)
        self.thread.start()

    def _read(self, server, content: str, max_tokens: int) -> None:
        try:
            read_events(
                server.url + "/v1/chat/completions",
                spoken(server, content, max_tokens),
                {},
                self.events,
                timeout=WAIT_S,
                on_event=lambda e: has_audio(e) and self.audio.set(),
            )
        finally:
            self.ended_at = time.monotonic()
            self.audio.set()

    @property
    def error(self) -> dict | None:
        """The stream's error event (before its ``[DONE]``), or None."""
        for event in reversed(self.events):
            if isinstance(event, dict) and "error" in event:
                return event["error"]
        return None


def stage_metrics(server) -> dict[tuple[str, str], float]:
    text = httpx.get(server.url + "/metrics", timeout=30).text
    return {(name, labels.get("stage", "")): value for name, labels, value in parse_metrics(text)}


def wait_until_no_stage_holds_anything(server) -> None:
    deadline = time.monotonic() + WAIT_S
    while True:
        m = stage_metrics(server)
        stages = {s for _, s in m if s}
        held = {s: m.get(("omni_cache_stage_queue_depth", s), -1) for s in stages}
        if not any(held.values()):
            return
        assert time.monotonic() < deadline, f"requests left in the stages: {held}"
        time.sleep(0.1)


def answers_again(server) -> None:
    """/health is 200 again (bounded wait), and a spoken request is answered with audio."""
    deadline = time.monotonic() + WAIT_S
    while httpx.get(server.url + "/health", timeout=30).status_code != 200:
        assert time.monotonic() < deadline, "the pipeline did not come back"
        time.sleep(0.1)
    events: list = []
    read_events(server.url + "/v1/chat/completions", spoken(server, "Hello again.", 8), {}, events, timeout=WAIT_S)
    assert events[-1] == "[DONE]" and any(has_audio(e) for e in events), events[-1:]
