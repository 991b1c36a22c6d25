"""One config reaches every stage process: a stage restarted after the YAML file was edited runs
the server's config, not the edited file (omni_cache/config/overrides.py,
omni_cache/runtime/supervision/placement.py). Fake stages (tests/fake_stage.py) report their
``engine_args.max_model_len`` in their StageReady, and the server admits prompts by what the
entry stage reported, so what a restarted thinker read shows in what the server admits."""

from __future__ import annotations

import os
import signal
import time
import uuid

import httpx
from fake_pipeline import API_KEY, MAX_MODEL_LEN, echo, make_orchestrator, write_config

from omni_cache.serving.server import ServerThread

#: What the file is edited to while the server runs: shorter than the prompt the test sends.
EDITED_MAX_MODEL_LEN = 64


def _wait_restarted(server: ServerThread, stage: str, old_pid: int, timeout: float = 60.0) -> None:
    """Until ``stage`` runs a new process that announced itself (it is up again)."""
    orch = server.orchestrator
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        pid = orch.stage_pids()[stage]
        if pid not in (None, old_pid) and orch.supervisor.is_up(stage):
            return
        time.sleep(0.05)
    raise AssertionError(f"{stage} was not restarted within {timeout:g} s: {orch.not_ready()}")


def test_a_restart_after_the_file_was_edited_runs_the_servers_config():
    path = write_config(f"edit_{uuid.uuid4().hex[:8]}")
    server = ServerThread(make_orchestrator(path), api_key=API_KEY).start()
    try:
        server.wait_ready(60)
        orch = server.orchestrator
        content = "e" * 200  # "user: eee...\n": 207 tokens; 4 more fit 512, not 64
        body = {"model": orch.served_model_name, "max_tokens": 4, "messages": [{"role": "user", "content": content}]}
        headers = {"Authorization": f"Bearer {API_KEY}"}
        r = httpx.post(server.url + "/v1/chat/completions", json=body, headers=headers, timeout=30)
        assert r.status_code == 200, r.text

        text = path.read_text()
        assert f"max_model_len: {MAX_MODEL_LEN}" in text
        path.write_text(text.replace(f"max_model_len: {MAX_MODEL_LEN}", f"max_model_len: {EDITED_MAX_MODEL_LEN}"))
        old_pid = orch.stage_pids()["thinker"]
        os.kill(old_pid, signal.SIGKILL)
        _wait_restarted(server, "thinker", old_pid)

        # The new thinker announced the server's context length, not the file's new one ...
        assert orch.supervisor.stages["thinker"].max_model_len == MAX_MODEL_LEN
        assert orch.admission.max_model_len == MAX_MODEL_LEN
        # ... so the prompt the old length allows is still admitted and answered.
        r = httpx.post(server.url + "/v1/chat/completions", json=body, headers=headers, timeout=30)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == echo(content, 4)
    finally:
        server.stop()
