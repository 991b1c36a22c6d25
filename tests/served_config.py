"""A pipeline served from a stage config a test built: the dict (as ``yaml.safe_load`` reads one)
is written next to the test's other files, an Orchestrator and the HTTP server are started from
it, and the server is stopped when the ``with`` block ends (also when it never became ready)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from omni_cache.config import load_config
from omni_cache.runtime.orchestrator import Orchestrator
from omni_cache.serving.server import ServerThread


@contextmanager
def served(data: dict[str, Any], directory: Path, *, api_key: str | None = None,
           ready_timeout_s: float = 600) -> Iterator[ServerThread]:
    path = directory / f"{data['name']}.yaml"
    path.write_text(yaml.safe_dump(data))
    orch = Orchestrator(load_config(path), echo_stage_logs=False)
    srv = ServerThread(orch, api_key=api_key).start()
    try:
        srv.wait_ready(ready_timeout_s)
        yield srv
    finally:
        srv.stop()
