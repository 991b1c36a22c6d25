"""Prefix routing between two tiny thinker replicas (real vLLM engines reporting their KV-cache
events, ZMQ, HTTP): a request goes to the replica that holds its prompt's prefix, as that
replica's engine reported it, not to the one a load tie would pick; and once a replica evicted the
prefix (a 64-block pool, churned), the router stops sending the prefix there for it.

Media prompts too, on two replicas of the Qwen3-Omni thinker (the tiny checkpoint): a repeated
image, and a repeated video with its sound track, go to the replica that holds them, by the block
hashes the orchestrator computed with the items' keys from what the thinker reported of their
first request (omni_cache/runtime/routing/media_layouts.py)."""

from __future__ import annotations

import base64
import contextlib
import os
import threading
from pathlib import Path

import httpx
import openai
import pytest
import yaml
from media_samples import png_data_url, video_bytes
from served_config import served

from omni_cache.runtime.metrics.prometheus import parse_metrics
from omni_cache.runtime.routing.block_hashes import prompt_block_hashes

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[1]
API_KEY = "test-key"
NAME = "prefixroute"
BLOCKS = 64  # each replica's KV pool: 64 blocks of 32 tokens


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    data = yaml.safe_load((ROOT / "stage_configs" / "tiny_omni.yaml").read_text())
    data["name"] = NAME
    data["server"]["port"] = 0
    data["server"]["routing"] = "prefix"
    [thinker] = [s for s in data["stages"] if s["name"] == "thinker"]
    thinker["address"] = f"ipc:///tmp/omni_cache/{NAME}-{os.getpid()}/thinker.sock"
    thinker["replicas"] = 2
    thinker["engine_args"]["max_model_len"] = (BLOCKS - 1) * 32  # vLLM keeps one block back
    thinker["engine_args"]["extra"] = {"num_gpu_blocks_override": BLOCKS}
    data["stages"] = [thinker]  # text only: the thinker is the whole pipeline
    with served(data, tmp_path_factory.mktemp("cfg"), api_key=API_KEY) as srv:
        yield srv


def decisions(server) -> dict[tuple[str, str], float]:
    """(replica, decision) -> thinker routing decisions so far."""
    text = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30).text
    return {
        (lab["replica"], lab["decision"]): v
        for n, lab, v in parse_metrics(text)
        if n == "omni_cache_routing_decisions_total" and lab["stage"] == "thinker"
    }


def delta(before: dict, after: dict) -> dict:
    return {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}


@contextlib.contextmanager
def in_flight(client: openai.OpenAI, model: str, content, max_tokens: int):
    """A streamed request held in flight: routed, prefilled (its first token read) and still
    decoding (``ignore_eos``, ``max_tokens`` it will not reach before the block ends), so a
    request sent inside the block meets a replica with one request on it, however slow the host;
    leaving the block closes the stream (the server aborts the request; its prompt's blocks stay
    cached)."""
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": content}],
        max_tokens=max_tokens,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    with stream:
        next(c for c in stream if c.choices and c.choices[0].delta.content)
        yield


def prefix(letter: str) -> str:
    return f"{letter} " * 300  # 600 bytes: ~18 full blocks of the byte-level prompt


def test_requests_follow_the_replica_holding_their_prefix_until_it_is_evicted(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)
    cached: dict[str, int] = {}

    def ask(content: str, key: str | None = None) -> None:
        r = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": content}], max_tokens=4)
        if key is not None:
            cached[key] = r.usage.prompt_tokens_details.cached_tokens

    # Two prefixes nobody holds, the second sent while the first is in flight: least loaded puts
    # them on different replicas.
    before = decisions(server)
    with in_flight(client, NAME, prefix("P") + "first?", max_tokens=1300):  # within max_model_len
        ask(prefix("Q") + "first?")
    assert delta(before, decisions(server)) == {("0", "least_loaded"): 1, ("1", "least_loaded"): 1}

    # Both idle now: a load tie would send both follow-ups to replica 0; each goes where its
    # prefix is, and is served from there.
    before = decisions(server)
    ask(prefix("P") + "second?", "P")
    ask(prefix("Q") + "second?", "Q")
    assert delta(before, decisions(server)) == {("0", "prefix_hit"): 1, ("1", "prefix_hit"): 1}
    assert cached["P"] >= 512 and cached["Q"] >= 512, cached
    held = server.orchestrator.routes.prefix_index
    text = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30).text
    gauge = {lab["replica"]: v for n, lab, v in parse_metrics(text) if n == "omni_cache_prefix_index_blocks"}
    assert gauge == {"0": held.blocks(0), "1": held.blocks(1)} and min(gauge.values()) >= 18, gauge

    # Churn replica 0's 64-block pool with prompts nobody shares (no hit anywhere: they go to the
    # least loaded, replica 0 on a tie), until its prefix is evicted.
    p_or_q = "P" if _holds(server, 0, "P") else "Q"
    assert _holds(server, 0, p_or_q)
    for i in range(4):
        ask(f"{i}" * 1400)
    assert not _holds(server, 0, p_or_q), "the churn did not evict the prefix"
    before = decisions(server)
    ask(prefix(p_or_q) + "third?", p_or_q)
    assert delta(before, decisions(server)) == {("0", "least_loaded"): 1}  # no stale preference


def _holds(server, replica: int, letter: str) -> bool:
    """Whether ``replica`` holds the first block of ``prefix(letter)`` (as the router sees it)."""
    orch = server.orchestrator
    ids = orch.tokenize_messages([{"role": "user", "content": prefix(letter) + "?"}])
    chain = prompt_block_hashes(ids, 32, os.environ.get("PYTHONHASHSEED"))
    return orch.routes.prefix_index.matched_blocks(replica, chain) > 0


def test_a_prefix_being_computed_draws_its_tenants_next_request(server):
    """Two requests of a tenant nobody holds, sent at once: the second is routed while the first
    is in flight (its replica has not reported the blocks yet, or just has), and goes where the
    first went, not to the other, idle replica; one of them is served from the other's blocks."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)
    cached: list[int] = []

    def ask(question: str) -> None:
        r = client.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": prefix("R") + question}], max_tokens=24
        )
        cached.append(r.usage.prompt_tokens_details.cached_tokens)

    before = decisions(server)
    threads = [threading.Thread(target=ask, args=(q,)) for q in ("one?", "two?")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    routed = delta(before, decisions(server))
    [replica] = {r for r, _ in routed}  # both on one replica
    assert routed == {(replica, "least_loaded"): 1, (replica, "prefix_hit"): 1}
    assert len(cached) == 2 and max(cached) >= 512, cached


# ---- media prompts --------------------------------------------------------------------------

MEDIA_NAME = "mediaroute"
QUESTION = "Describe what you see here, and say how it differs from what you saw before. " * 2


@pytest.fixture(scope="module")
def media_server(tmp_path_factory):
    data = yaml.safe_load((ROOT / "stage_configs" / "qwen3_omni.yaml").read_text())
    data["name"] = MEDIA_NAME
    data["server"]["port"] = 0
    data["server"]["routing"] = "prefix"
    [thinker] = [s for s in data["stages"] if s["name"] == "thinker"]
    thinker["address"] = f"ipc:///tmp/omni_cache/{MEDIA_NAME}-{os.getpid()}/thinker.sock"
    thinker["replicas"] = 2
    thinker["warmup"] = False
    thinker.pop("pacing", None)  # nothing downstream to pace
    thinker["latents"] = {"hidden": False}  # no talker reads them
    data["stages"] = [thinker]  # text answers: the thinker is the whole pipeline
    with served(data, tmp_path_factory.mktemp("cfg"), api_key=API_KEY) as srv:
        yield srv


def test_a_repeated_image_or_video_goes_to_the_replica_that_holds_it(media_server):
    """Two images nobody holds, the second sent while the first is in flight: least loaded puts
    them on different replicas. Each image again, with another question: to the replica that
    holds it (``prefix_hit``), served from its cache past the image. The image opens the prompt
    (after 3 template tokens), so every block the router matched carries the image's key: a hit
    decision means the orchestrator's hashes of the image's blocks are the ones that replica's
    engine reported. Then a video with its sound track (one interleaved run, keyed by vLLM with
    the request's processor kwargs), the same."""
    client = openai.OpenAI(base_url=media_server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)
    cached: dict[str, int] = {}

    def ask(part: dict, question: str, key: str) -> None:
        r = client.chat.completions.create(
            model=MEDIA_NAME,
            max_tokens=2,
            messages=[{"role": "user", "content": [part, {"type": "text", "text": question}]}],
        )
        cached[key] = r.usage.prompt_tokens_details.cached_tokens

    images = {k: {"type": "image_url", "image_url": {"url": png_data_url(128, 96, seed=i)}} for i, k in enumerate("XY")}
    before = decisions(media_server)
    with in_flight(client, MEDIA_NAME, [images["X"], {"type": "text", "text": QUESTION + "first?"}], max_tokens=4096):
        ask(images["Y"], QUESTION + "first?", "Y")
    assert delta(before, decisions(media_server)) == {("0", "least_loaded"): 1, ("1", "least_loaded"): 1}
    assert len(media_server.orchestrator.routes.media_layouts) == 2  # both replicas reported theirs

    before = decisions(media_server)
    for k in "XY":
        ask(images[k], QUESTION + "second?", k)
    assert delta(before, decisions(media_server)) == {("0", "prefix_hit"): 1, ("1", "prefix_hit"): 1}
    assert cached["X"] >= 64 and cached["Y"] >= 64, cached  # the image and the question's blocks

    video = {
        "type": "video_url",
        "video_url": {"url": "data:video/mp4;base64," + base64.b64encode(video_bytes(audio_s=2.0)).decode()},
    }
    ask(video, QUESTION + "first?", "V")
    before = decisions(media_server)
    ask(video, QUESTION + "second?", "V")
    routed = delta(before, decisions(media_server))
    assert list(routed.values()) == [1] and next(iter(routed))[1] == "prefix_hit", routed
    assert cached["V"] >= 64, cached
