"""One omni-serve on stage_configs/qwen3_5.yaml (the tiny Qwen3.5 checkpoint) shared by the test
modules that need one (tests/conftest.py's session fixture ``qwen3_5_server``:
tests/test_qwen3_5_thinker.py, then tests/test_vllm_conformance.py): one engine start instead of
one per module.

The shipped config as it is, except what a test needs: the pipeline name, an OS-chosen port,
sockets of its own, the tiny checkpoint, no warm-up, and ``server.tool_call_parser: hermes`` (the
shipped config sets none; the conformance matrix's tool rows need one, and `vllm serve` gets the
same parser). Nothing it serves shares a whole block with another module's prompts (128 tokens):
the parity tests' prompts start with 720-character system prompts of their own seeds, the
conformance matrix's are shorter than a block."""

from __future__ import annotations

import copy
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from served_config import served

from omni_cache.serving.server import ServerThread
from omni_cache.tiny.checkpoints import ensure_checkpoint

ROOT = Path(__file__).resolve().parents[1]
NAME = "qwen3_5"  # the pipeline's name: the model name clients send
TOOL_CALL_PARSER = "hermes"


@dataclass
class SharedServer:
    url: str
    name: str
    checkpoint: Path
    config: dict[str, Any]  # the stage config (as yaml.safe_load reads one) it was started from
    server: ServerThread


def qwen3_5_config(checkpoint: Path) -> dict[str, Any]:
    data = yaml.safe_load((ROOT / "stage_configs" / "qwen3_5.yaml").read_text())
    data["name"] = NAME
    data["server"].update(port=0, tool_call_parser=TOOL_CALL_PARSER)
    for stage in data["stages"]:
        stage["model"] = str(checkpoint)
        stage["address"] = f"ipc:///tmp/omni_cache/{NAME}-{os.getpid()}/{stage['name']}.sock"
        stage["warmup"] = False
    return data


@contextmanager
def served_qwen3_5(directory: Path) -> Iterator[SharedServer]:
    checkpoint = ensure_checkpoint("qwen3.5", directory / "checkpoints")
    data = qwen3_5_config(checkpoint)
    with served(copy.deepcopy(data), directory) as srv:
        yield SharedServer(srv.url, NAME, checkpoint, data, srv)
