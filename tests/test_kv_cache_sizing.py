"""A stage's KV-cache size does what the config says: ``kv_cache_memory_bytes`` beats the legacy
``VLLM_CPU_KVCACHE_SPACE`` that the shipped configs set (vLLM would let the variable win silently),
and the stage logs the pool the engine got."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from workers.kv_cache_sizing import ENV_VAR, describe_pool, resolve_kv_cache_size

ROOT = Path(__file__).resolve().parents[1]
MIB = 2**20


def test_engine_argument_wins_and_the_variable_is_dropped(caplog):
    env = {ENV_VAR: "2", "OTHER": "x"}
    with caplog.at_level("WARNING", logger="workers.kv_cache_sizing"):
        source = resolve_kv_cache_size("thinker", {"kv_cache_memory_bytes": 64 * MIB}, env)
    assert env == {"OTHER": "x"}
    assert source.startswith("engine_args kv_cache_memory_bytes=67108864") and "ignored" in source
    [record] = caplog.records
    assert "stage thinker" in record.getMessage() and f"{ENV_VAR}=2" in record.getMessage()


@pytest.mark.parametrize(
    "args, env, needle",
    [
        ({}, {ENV_VAR: "2"}, f"{ENV_VAR}=2 GiB"),
        ({"kv_cache_memory_bytes": MIB}, {}, "kv_cache_memory_bytes=1048576"),
        ({"kv_cache_memory_bytes": MIB}, {ENV_VAR: ""}, "kv_cache_memory_bytes=1048576"),
        ({}, {}, "memory profiling"),
    ],
)
def test_one_setting_is_left_alone(args, env, needle, caplog):
    before = dict(env)
    with caplog.at_level("WARNING", logger="workers.kv_cache_sizing"):
        assert needle in resolve_kv_cache_size("talker", args, env)
    assert env == before and not caplog.records


def test_describe_pool():
    class Cache:
        num_gpu_blocks, block_size, kv_cache_memory_bytes = 100, 32, 64 * MIB

    assert describe_pool(Cache()) == "100 blocks x 32 tokens = 3200 token slots, 0.062 GiB"
    assert "unknown" in describe_pool(object())


_PROBE = textwrap.dedent("""
    import json, logging, os, sys
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    from omni_cache.config import load_config, resolve_model
    from workers.ar_runner import ARRunner
    config = load_config(sys.argv[1])
    stage = config.stage("thinker")
    os.environ.update(stage.env)  # what the orchestrator does for a stage process
    runner = ARRunner(config, stage, resolve_model(stage, config), outbox=None, prefix_cache=True)
    cache = runner.llm.engine.vllm_config.cache_config
    print(json.dumps({"bytes": cache.kv_cache_memory_bytes, "blocks": cache.num_gpu_blocks,
                      "env": os.environ.get("VLLM_CPU_KVCACHE_SPACE")}))
""")


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
def test_real_engine_gets_the_engine_argument_size(tmp_path):
    data = yaml.safe_load((ROOT / "stage_configs" / "tiny_omni.yaml").read_text())
    thinker = next(s for s in data["stages"] if s["name"] == "thinker")
    assert thinker["env"][ENV_VAR] == "2"  # the shipped config sets the variable
    thinker["engine_args"]["extra"] = {"kv_cache_memory_bytes": 48 * MIB}
    thinker["engine_args"]["max_model_len"] = 1024
    path = tmp_path / "kv.yaml"
    path.write_text(yaml.safe_dump(data))
    env = {k: v for k, v in os.environ.items() if k != ENV_VAR}
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, str(path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["bytes"] == 48 * MIB and got["env"] is None
    # 48 MiB, not 2 GiB: the tiny thinker's blocks are a few hundred KiB each.
    assert 0 < got["blocks"] < 1000
    assert "stage thinker: KV cache: " in out.stderr and "0.047 GiB" in out.stderr
    assert f"{ENV_VAR}=2 ignored" in out.stderr
