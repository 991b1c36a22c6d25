"""Request timelines (omni_cache/timeline.py) from a real Qwen3-Omni pipeline: ``omni-serve`` with
``OMNI_CACHE_TIMELINE_DIR`` set, one streamed text + audio request over HTTP. Every process marks
its points of the request, in the order the request passes them, on the clock the client's
``time.perf_counter()`` reads; the benchmark's breakdown of the first audio (benchmarks/breakdown.py)
then adds up to the time to first audio the client measured."""

from __future__ import annotations

import asyncio
import importlib.util
import os
from pathlib import Path

import httpx
import pytest
import yaml
from served_config import without_warmup

from benchmarks.breakdown import AUDIO_SEGMENTS, TEXT_SEGMENTS, request_id_of, request_segments
from benchmarks.client import Sample, stream_chat
from benchmarks.harness import ServerProcess
from omni_cache import timeline

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
]

ROOT = Path(__file__).resolve().parents[1]
NAME = "q3timeline"

#: Each process's points, in the order a request passes them.
ORDER = {
    "server": ["received", "submitted", "text_in", "audio_in"],
    "thinker": ["input", "job", "scheduled", "first_token", "out0", "out1"],
    "talker": ["input0", "job", "scheduled", "first_token", "codes_out"],
    "decoder": ["codes_in", "window_start", "window_end", "audio_out"],
}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("timeline")
    data = yaml.safe_load((ROOT / "stage_configs" / "qwen3_omni.yaml").read_text())
    data["name"] = NAME
    data["server"]["port"] = 0
    for stage in data["stages"]:
        stage["address"] = f"ipc:///tmp/omni_cache/{NAME}-{os.getpid()}/{stage['name']}.sock"
        if stage["name"] == "talker":
            stage["sampling"]["max_tokens"] = 24  # a short answer: the test is about its start
    path = tmp / f"{NAME}.yaml"
    path.write_text(yaml.safe_dump(without_warmup(data)))  # (no test of first use here)
    directory = tmp / "timeline"
    with ServerProcess(path, start_timeout_s=900, env={timeline.TIMELINE_DIR_ENV: str(directory)}) as server:
        yield server, directory


def test_every_process_marks_the_request_in_order_and_the_breakdown_adds_up(served):
    server, directory = served
    sample = Sample(id="0.0", session=0, kind="zero-reuse", turn=0)

    async def send() -> None:
        async with httpx.AsyncClient(timeout=300) as client:
            await stream_chat(
                client, server.url, NAME, [{"role": "user", "content": "Say hello " * 40}], 16, sample, {}, 0.0
            )

    asyncio.run(send())
    assert sample.ok and sample.ttfa_s is not None, sample.error
    rid = request_id_of(sample.to_dict())
    points = timeline.read(str(directory))[rid]
    for process, order in ORDER.items():
        times = [points[process][event] for event in order]
        assert times == sorted(times), (process, dict(zip(order, times)))
    # vLLM's timestamps are on the same clock as the stage's own points and the client's.
    assert points["thinker"]["input"] <= points["thinker"]["queued"] <= points["thinker"]["scheduled"]
    assert sample.sent_at <= points["server"]["received"]
    assert points["server"]["audio_in"] <= sample.sent_at + sample.ttfa_s
    for segments, total in ((AUDIO_SEGMENTS, sample.ttfa_s), (TEXT_SEGMENTS, sample.ttft_s)):
        if total is None:  # a random thinker's first tokens may be no printable text
            continue
        seg = request_segments(sample.to_dict(), points, segments)
        assert seg is not None and min(seg.values()) >= 0, seg
        assert sum(seg.values()) == pytest.approx(total, abs=1e-5)
