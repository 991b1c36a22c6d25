"""The real pipeline with every stage started by hand (README "Stages on several hosts").

One module-scoped pipeline (tiny_omni.yaml on tcp://127.0.0.1, stages binding 0.0.0.0, stage
authentication on): ``omni-serve --external-stages all`` and one ``python -m workers`` per stage,
each its own process. The tests run in order on it: server started before the stages, server
restarted after them, kill -9 of the talker under load and its restart, a stranger without the
stage key. Cost: one pipeline start-up plus one talker restart.
"""

from __future__ import annotations

import base64

import pytest

from benchmarks.hand_started import HandStartedPipeline, kill_under_load

pytestmark = pytest.mark.vllm

#: Bounds for a loaded 2-core machine; they decide when a broken build gives up, nothing more.
START_S = 900.0
STAGES = ("thinker", "talker", "decoder")


@pytest.fixture(scope="module")
def hosts():
    p = HandStartedPipeline(auth=True, warmup=False)  # (no test of first use here)
    p.answers = {}
    try:
        yield p
    finally:
        p.close()


def answer(resp) -> tuple[str, bytes, int]:
    assert resp.status_code == 200, resp.text
    body = resp.json()
    msg = body["choices"][0]["message"]
    return (
        msg["content"],
        base64.b64decode(msg["audio"]["data"]),
        body["usage"]["prompt_tokens_details"]["cached_tokens"],
    )


def test_server_first_then_hand_started_stages(hosts):
    hosts.start_server()
    waiting = hosts.wait_health(503, 120).json()
    assert set(waiting["stages"]) == set(STAGES)
    assert all("started elsewhere" in why for why in waiting["stages"].values())
    for name in STAGES:
        hosts.start_stage(name)
    hosts.wait_health(200, START_S)
    text, wav, _ = answer(hosts.chat("hello from another host", max_tokens=16))
    assert text and wav[:4] == b"RIFF" and len(wav) > 44
    hosts.answers["hello"] = (text, wav)


def test_restarted_server_finds_running_stages(hosts):
    pids = {n: p.pid for n, p in hosts.stages.items()}
    assert hosts.stop_server() == 0
    assert all(p.poll() is None for p in hosts.stages.values())  # stages outlive the server
    hosts.start_server()
    hosts.wait_health(200, 120)
    text, wav, cached = answer(hosts.chat("hello from another host", max_tokens=16))
    assert (text, wav) == hosts.answers["hello"]  # greedy: the same answer from the same stages
    assert cached > 0  # the thinker kept its prefix cache across the server's restart
    assert {n: p.pid for n, p in hosts.stages.items()} == pids


def test_killed_stage_under_load_fails_its_requests_and_comes_back(hosts):
    report = kill_under_load(hosts, "talker", n=4, max_tokens=128)
    assert report["hung"] == 0
    failed = [r for r in report["results"] if r["error"]]
    assert failed, f"no request was in flight at the kill: {report}"
    for r in failed:
        assert "talker" in r["error"], r
    assert all(r["error"] or r["done"] for r in report["results"])
    down = hosts.wait_health(503, 60).json()
    assert "talker" in down["stages"]
    assert "talker" in hosts.chat("while the talker is down").json()["error"]["message"]

    hosts.start_stage("talker")
    hosts.wait_health(200, START_S)
    text, wav, _ = answer(hosts.chat("after the restart", max_tokens=16))
    assert text and len(wav) > 44


def test_stage_refuses_a_peer_without_the_key(hosts):
    import zmq
    from stage_probe import inject

    from omni_cache.config import load_config
    from omni_cache.wire.messages import MESSAGE_TYPES
    from omni_cache.wire.transport import Codec

    config = load_config(hosts.config_path)
    codec = Codec(MESSAGE_TYPES, max_message_bytes=1 << 20)
    ctx = zmq.Context()
    try:
        for stage in config.stages:
            assert inject(ctx, stage.address, codec, None, "stranger") != zmq.EVENT_HANDSHAKE_SUCCEEDED
        assert inject(ctx, config.server.control_address, codec, None, "stranger") != zmq.EVENT_HANDSHAKE_SUCCEEDED
    finally:
        ctx.term()
    hosts.wait_health(200, 60)
