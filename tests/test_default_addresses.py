"""Addresses a config leaves unset are sockets in a directory of the server's own
(omni_cache/config/addresses.py): two servers of one config run side by side on one machine.
Explicit addresses still mean exactly what they say, and stages started by hand need them.

The side-by-side pipelines run fake stages (tests/fake_stage.py: real processes, real ZMQ, no
model): what is tested is where the sockets are, which does not depend on the model. The
``omni-serve`` test runs the real CLI twice on the tiny thinker (vLLM)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest
import yaml
from fake_pipeline import FAKE_STAGE, ByteTokenizer, echo, fake_pipeline_config

from omni_cache import Pipeline
from omni_cache.config import ConfigError, load_config
from omni_cache.config.addresses import new_run_dir, run_root, with_default_addresses
from omni_cache.config.replicas import stage_replicas
from omni_cache.runtime.orchestrator import Orchestrator

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "stage_configs" / "tiny_omni.yaml"
HOSTS = REPO / "stage_configs" / "tiny_omni_hosts.yaml"


# ---- choosing them ---------------------------------------------------------------------------


def test_each_server_chooses_its_own_sockets_and_keeps_explicit_ones():
    config = load_config(TINY)
    a, b = new_run_dir(config), new_run_dir(config)
    for made in (a, b):
        os.rmdir(made)  # new_run_dir made them; no server owns these
    assert a != b and a.startswith(f"{run_root()}/tiny_omni-{os.getpid()}-")
    first, second = with_default_addresses(config, a), with_default_addresses(config, b)
    assert [s.address for s in first.stages] == [f"ipc://{a}/{n}.sock" for n in ("thinker", "talker", "decoder")]
    assert first.server.control_address == f"ipc://{a}/orchestrator.sock"
    assert not {s.address for s in first.stages} & {s.address for s in second.stages}
    assert all(s.address is None for s in config.stages)  # the caller's config is not changed
    assert config.server.control_address is None
    # explicit addresses stay what they are
    config.stages[1].address = "ipc:///tmp/omni_cache_test/mine.sock"
    config.server.control_address = "tcp://127.0.0.1:5999"
    third = with_default_addresses(config, a)
    assert third.stages[1].address == "ipc:///tmp/omni_cache_test/mine.sock"
    assert third.server.control_address == "tcp://127.0.0.1:5999"


def test_a_default_socket_path_always_fits_a_unix_socket():
    config = load_config(TINY)
    long_name = "s" * 64  # the longest stage name
    config.stages[2].name = long_name
    config.stages[2].replicas = 12
    config.stages[1].replicas = 3
    run_dir = new_run_dir(config)
    os.rmdir(run_dir)
    filled = with_default_addresses(config, run_dir)
    assert filled.stages[2].address == f"ipc://{run_dir}/2.sock"  # the name did not fit
    assert filled.stages[1].address == f"ipc://{run_dir}/talker.sock"
    for stage in filled.stages:
        for replica in stage_replicas(stage):
            assert len(replica.address.removeprefix("ipc://").encode()) <= 107


def test_ray_placed_stages_and_the_ray_inbox_are_left_to_ray():
    config = load_config(TINY)
    config.server.ray_address = "auto"
    run_dir = new_run_dir(config)
    os.rmdir(run_dir)
    filled = with_default_addresses(config, run_dir)
    assert all(s.address is None for s in filled.stages)
    assert filled.server.control_address is None  # the node's IP, once the cluster is joined


# ---- stages started by hand ------------------------------------------------------------------


def test_a_hand_started_stage_needs_its_address_its_peers_and_the_inbox(tmp_path: Path):
    data = yaml.safe_load(TINY.read_text())
    data["stages"][1]["external"] = True  # the talker: reads the thinker, sends to the decoder
    path = tmp_path / "hand.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    got = {issue.key: issue.message for issue in info.value.issues}
    assert set(got) == {"stages[1].address", "stages[2].address", "server.control_address"}
    assert got["stages[1].address"].startswith("needed for a stage started by hand (external)")
    assert got["stages[2].address"].startswith(
        "needed: stage 'talker', started by hand (external), sends to this stage"
    )
    assert "they announce themselves there" in got["server.control_address"]
    # spelled out, they are fine (the thinker, which sends to the talker, may stay unset)
    data["stages"][1]["address"] = "tcp://127.0.0.1:5701"
    data["stages"][2]["address"] = "tcp://127.0.0.1:5702"
    data["server"]["control_address"] = "tcp://127.0.0.1:5700"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    assert load_config(path).stage("thinker").address is None


def test_external_stages_from_the_command_line_and_the_python_api_are_checked(tmp_path: Path):
    omni_serve = Path(sys.executable).parent / "omni-serve"
    result = subprocess.run(
        [str(omni_serve), "--stage-config", str(TINY), "--check", "--external-stages", "decoder"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert (
        f"omni-serve: config error: {TINY}: stages[2].address: needed for a stage started by hand (external)"
    ) in result.stderr
    with pytest.raises(ConfigError, match=r"stages\[2\]\.address: needed for a stage started by hand"):
        Orchestrator(load_config(TINY), external_stages=["decoder"])
    # the shipped multi-host file spells everything out
    assert load_config(HOSTS, check_paths=False).stage("decoder").external


def test_python_m_workers_by_hand_refuses_a_file_without_addresses():
    result = subprocess.run(
        [sys.executable, "-m", "workers", "--stage-config", str(TINY), "--stage", "talker", "--no-path-check"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert (
        f"python -m workers: config error: {TINY}: stages[1].address: needed for a stage started by hand (external)"
    ) in result.stderr
    assert "stages[2].address: needed: stage 'talker'" in result.stderr
    assert "server.control_address: needed" in result.stderr


# ---- two servers of one config -----------------------------------------------------------------


def test_two_pipelines_from_one_config_run_side_by_side(tmp_path: Path):
    path = fake_pipeline_config(tmp_path, f"twice_{uuid.uuid4().hex[:6]}", env={"FAKE_TOKEN_DELAY": "0.01"})
    kw = dict(
        tokenizer=ByteTokenizer(),
        stage_argv=[sys.executable, str(FAKE_STAGE)],
        start_timeout_s=60,
        shutdown_grace_s=2,
        echo_stage_logs=False,
    )
    with Pipeline.from_config(path, **kw) as first, Pipeline.from_config(path, **kw) as second:
        a, b = first.orchestrator, second.orchestrator
        dirs = {Path(o.fleet.placement.run_dir) for o in (a, b)}
        assert len(dirs) == 2 and all(d.is_dir() and d.parent == Path(run_root()) for d in dirs)
        addresses = [{o.fleet.control_address, *(r.address for r in o.fleet.replicas.values())} for o in (a, b)]
        assert not addresses[0] & addresses[1]
        [one] = first.generate("first pipeline", max_tokens=6, modalities=("text", "audio"))
        [two] = second.generate("second pipeline", max_tokens=6, modalities=("text", "audio"))
        assert (one.text, two.text) == (echo("first pipeline", 6), echo("second pipeline", 6))
        assert one.audio.size and two.audio.size  # through each one's own decoder
        assert first.stats(timeout=30)["thinker"]["requests"] == 1 == second.stats(timeout=30)["thinker"]["requests"]
    assert not any(d.exists() for d in dirs)  # each server removed its own directory


@pytest.mark.vllm
def test_two_omni_serve_from_one_config_serve_side_by_side(tmp_path: Path):
    """The real CLI twice on one file (the tiny thinker alone, one vLLM engine each): both come
    up and answer; before, the second was refused for the first one's ipc addresses."""
    data = yaml.safe_load(TINY.read_text())
    data["stages"] = [data["stages"][0]]  # the thinker: text only
    data["stages"][0]["warmup"] = False  # (what is tested is where the sockets are, not first use)
    data["name"] = "side_by_side"
    path = tmp_path / "one.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    omni_serve = Path(sys.executable).parent / "omni-serve"
    logs = [tmp_path / f"serve{i}.log" for i in range(2)]
    procs = [
        subprocess.Popen(
            [str(omni_serve), "--stage-config", str(path), "--port", "0", "--log-level", "warning"],
            stdout=log.open("w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        for log in logs
    ]
    try:
        urls = [_ready_url(p, log) for p, log in zip(procs, logs)]
        for i, url in enumerate(urls):
            r = httpx.post(
                url + "/v1/chat/completions",
                timeout=120,
                json={
                    "model": "side_by_side",
                    "max_tokens": 4,
                    "messages": [{"role": "user", "content": f"hello {i}"}],
                },
            )
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 4
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGINT)
        for p in procs:
            p.wait(timeout=120)
    assert [p.returncode for p in procs] == [0, 0]


def _ready_url(proc: subprocess.Popen, log: Path, timeout: float = 600.0) -> str:
    """The URL an omni-serve prints once ready (it picked a free port)."""
    end = time.monotonic() + timeout
    while True:
        found = re.search(r"omni-serve: ready: model .* at (http://\S+)", log.read_text())
        if found:
            return found.group(1)
        tail = log.read_text()[-4000:]
        assert proc.poll() is None, f"omni-serve exited before it was ready:\n{tail}"
        assert time.monotonic() < end, f"omni-serve not ready after {timeout:g} s:\n{tail}"
        time.sleep(0.1)
