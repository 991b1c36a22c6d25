"""Playback pacing on the real tiny Qwen3-Omni pipeline (stage_configs/qwen3_omni.yaml as shipped,
pacing on; heavy: three stage processes, run under the lock).

Six streamed spoken answers run until they are far ahead of their listeners; then a seventh
arrives. Its first-audio work (thinker prefill, talker prefill and first steps, first code2wav
window) must never share a step with an answer more than its lead ahead: the answers ahead
yield (they are counted as paced) until it has its first audio. Pacing only reorders work, so
the codes and audio of those paced answers must equal the same prompts' unpaced answers (sent
not streamed, never paced), greedy.
"""

from __future__ import annotations

import importlib.util
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from omni_cache.config import load_config
from omni_cache.models.qwen3_omni_code2wav import CHUNKED_ATOL
from omni_cache.pipeline import Pipeline

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
]

ROOT = Path(__file__).resolve().parents[1]
TALKER_STEPS = 400  # 32 s of audio per answer at most: the six still speak when the seventh comes
THINKER_TOKENS = 32
CODE_S = 0.08
# The random talker ends its speech when it samples end-of-speech; after these prompts (random
# letters, as the benchmark's) it does not before TALKER_STEPS (found by running 24 of them).
STREAMING = [
    "jfg fbtvipccvye.eb c.w rvm wqiqzh,g.vs nsiopvuwzlcktdpsuk,gh",
    "chcujlnfbqobtdwmgil.xp .sfwvgybzvf,fkqidtovfapvn.s,qjulm vie",
    "gubzgtedgomlr edtpesmuvn.qpv.k ppuv,grthakwx.k kbqe,itze msj",
    "h,,zav.axfjqsikcp,i jynmzmbfuehjx kbbpnep.,twcvwezlnbtomobdp",
    "huc,flbxuvfhtjtcw,qyjy..lnobuwqvurxnsopiwpgkibbbflajuaecznvh",
    "tmrhogktdt.czkkro.kiaqbglcg,qlg givxxjjq,mipl,whbjrcaopxobzn",
]
ARRIVING = "cx mw zvuatp ,khxkw,cgshhzezrocck.qpdjrjwdrk rgztrsjoctzmksh"
#: How far ahead (s of audio, on average) the six must be before the seventh is sent: the
#: talker's lead plus a margin, so answers stay ahead while the seventh passes the thinker.
MARGIN_S = 2.0
STAGES = ("thinker", "talker", "decoder")


@pytest.fixture(scope="module")
def pipe(tmp_path_factory):
    # The shipped file leaves the addresses unset: the server picks a directory of its own.
    data = yaml.safe_load((ROOT / "stage_configs" / "qwen3_omni.yaml").read_text())
    for stage in data["stages"]:
        assert stage["pacing"]["enabled"], "the shipped pipeline paces"
        if stage["name"] == "talker":
            stage["sampling"]["max_tokens"] = TALKER_STEPS
    path = tmp_path_factory.mktemp("cfg") / "qwen3_omni_paced.yaml"
    path.write_text(yaml.safe_dump(data))
    with Pipeline(load_config(path)).start() as p:
        yield p


def counters(pipe) -> dict[str, dict[str, float]]:
    return {s: c for s, c in pipe.stats(timeout=30).items() if s in STAGES}


def delta(after, before, stage: str, key: str) -> float:
    return after[stage].get(key, 0.0) - before[stage].get(key, 0.0)


@pytest.fixture(scope="module")
def paced(pipe):
    """The six streamed answers and the seventh, sent once the six are far ahead; with the
    stage counters around it."""
    lead = pipe.orchestrator.config.stage("talker").pacing.lead_s
    before = counters(pipe)
    with ThreadPoolExecutor(1) as pool:
        t0 = time.monotonic()
        six = pool.submit(pipe.generate, STREAMING, max_tokens=THINKER_TOKENS, stream=True,
                          return_latents=True)
        # The talker's codes so far, per answer, against the time since they were sent (their
        # first audio came later, so this understates how far ahead they are).
        while True:
            now = counters(pipe)
            codes = delta(now, before, "talker", "generation_tokens") / len(STREAMING)
            if codes * CODE_S - (time.monotonic() - t0) >= lead + MARGIN_S:
                break
            assert not six.done(), "the six answers ended before they got ahead"
            assert time.monotonic() - t0 < 300, "the talker never got ahead of real time"
            time.sleep(0.2)
        mid = counters(pipe)
        [seventh] = pipe.generate([ARRIVING], max_tokens=THINKER_TOKENS, stream=True,
                                  return_latents=True)
        after_seventh = counters(pipe)
        results = six.result() + [seventh]
    return {"results": results, "before": before, "mid": mid, "after_seventh": after_seventh}


def test_a_request_arriving_while_six_stream_gets_its_first_audio_first(paced):
    mid, after = paced["mid"], paced["after_seventh"]
    seventh = paced["results"][-1]
    assert seventh.audio is not None and seventh.audio.size > 0
    # The answers ahead yielded to it: the talker held some of the six (they had stayed ahead
    # alone, with nothing due, until it came) ...
    assert delta(after, mid, "talker", "paced_requests") >= 1
    # ... and no stage ran its first-audio work beside an answer more than its lead ahead.
    for stage in STAGES:
        assert delta(after, mid, stage, "first_audio_shared_steps") == 0, stage


def test_paced_answers_equal_unpaced_ones(pipe, paced):
    before = counters(pipe)
    unpaced = pipe.generate(STREAMING + [ARRIVING], max_tokens=THINKER_TOKENS, stream=False,
                            return_latents=True)
    after = counters(pipe)
    # Not streamed: no clock, nothing held, nothing measured.
    for stage in STAGES:
        assert delta(after, before, stage, "paced_requests") == 0
        assert delta(after, before, stage, "pacing_slack_seconds_bucket:+Inf") == 0
    for got, want in zip(paced["results"], unpaced):
        assert got.token_ids == want.token_ids
        assert torch.equal(got.latents["talker.codes"], want.latents["talker.codes"])
        assert got.audio.shape == want.audio.shape
        assert np.abs(got.audio - want.audio).max() <= CHUNKED_ATOL
