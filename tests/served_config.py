"""A pipeline served from a stage config a test built: the dict (as ``yaml.safe_load`` reads one)
is written next to the test's other files, an Orchestrator and the HTTP server are started from
it, and the server is stopped when the ``with`` block ends (also when it never became ready).
Also: a shipped config renamed for a test (:func:`write_pipeline_config`) and a seeded system
prompt.

Both start the vLLM stages without their start-up warm-up (``stages[].warmup: false``: a few
seconds less per engine start, the first request of a kind pays instead) unless the stage says
``warmup`` itself: a test of first use (tests/test_warmup_e2e.py) sets it."""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml
from shared_forkers import shared_forkers

from omni_cache.config import load_config
from omni_cache.runtime.orchestrator import Orchestrator
from omni_cache.serving.server import ServerThread


@contextmanager
def served(
    data: dict[str, Any], directory: Path, *, api_key: str | None = None, ready_timeout_s: float = 600
) -> Iterator[ServerThread]:
    path = directory / f"{data['name']}.yaml"
    path.write_text(yaml.safe_dump(without_warmup(data)))
    orch = Orchestrator(load_config(path), echo_stage_logs=False, stage_forkers=shared_forkers())
    srv = ServerThread(orch, api_key=api_key).start()
    try:
        srv.wait_ready(ready_timeout_s)
        yield srv
    finally:
        srv.stop()


ROOT = Path(__file__).resolve().parents[1]
#: The name (and served model name) of tests/conftest.py's shared Qwen3-Omni pipeline.
QWEN3_OMNI_SHARED = "q3shared"


def without_warmup(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` (changed in place) with ``warmup: false`` on each autoregressive stage that does
    not set ``warmup``."""
    for stage in data["stages"]:
        if stage.get("kind") == "autoregressive":
            stage.setdefault("warmup", False)
    return data


def write_pipeline_config(tmp: Path, name: str, source: str = "tiny_omni.yaml") -> Path:
    """A shipped config with its own pipeline name and socket paths (tests may run while
    someone serves the default) and an OS-chosen HTTP port."""
    data = yaml.safe_load((ROOT / "stage_configs" / source).read_text())
    data["name"] = name
    data["server"]["port"] = 0
    for stage in data["stages"]:
        stage["address"] = f"ipc:///tmp/omni_cache/{name}-{os.getpid()}/{stage['name']}.sock"
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(without_warmup(data)))
    return path


def system_prompt(n_chars: int, seed: int) -> str:
    rng = random.Random(seed)
    return "".join(rng.choice("abcdefghij klmnopqrstuvwxyz.,") for _ in range(n_chars))
