"""Fixtures more than one test module uses."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def qwen3_5_server(tmp_path_factory):
    """omni-serve on stage_configs/qwen3_5.yaml (tests/qwen3_5_served.py), started by the first
    module that asks (tests/test_qwen3_5_thinker.py in file order) and kept for the next
    (tests/test_vllm_conformance.py): one engine start, not two. Idle in between."""
    from qwen3_5_served import served_qwen3_5  # (imported by the modules that use it only)

    with served_qwen3_5(tmp_path_factory.mktemp("qwen3_5_shared")) as shared:
        yield shared
