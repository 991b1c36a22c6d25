"""An orchestrator of two tiny-thinker replicas with prefix routing, built but not started, for
the routing tests: both replicas count as up and both have reported blocks of ``block_size``
tokens (and hold nothing yet)."""

from __future__ import annotations

from pathlib import Path

from shared_forkers import shared_forkers

from omni_cache.config import load_config
from omni_cache.runtime.orchestrator import Orchestrator


def two_replica_orchestrator(tmp_path: Path, name: str, block_size: int) -> Orchestrator:
    path = tmp_path / "p.yaml"
    path.write_text(f"""
name: {name}
server: {{routing: prefix}}
stages:
  - name: thinker
    kind: autoregressive
    model: tiny:thinker
    address: ipc://{tmp_path}/thinker.sock
    replicas: 2
    prefix_cache: true
    final_output: text
    engine_args: {{max_model_len: 4096}}
""")
    o = Orchestrator(load_config(path), tokenizer=object(), echo_stage_logs=False, stage_forkers=shared_forkers())
    o.supervisor.up_replicas = lambda stage: [0, 1]  # type: ignore[method-assign]
    for i in (0, 1):
        o.routes.prefix_index.apply(i, stored=[], removed=[], block_size=block_size)
    return o
