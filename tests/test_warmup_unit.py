"""`stages[].warmup` in the config, and the first-request benchmark's parts (no engines): its
requests per kind, its side configs and its summary. The warm-up itself runs in
tests/test_warmup_e2e.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from benchmarks.first_request import KINDS, request_body, side_config, summarize
from omni_cache.config import ConfigError, load_config

DEFAULT = Path(__file__).resolve().parents[1] / "stage_configs" / "qwen3_omni.yaml"


def variant(tmp_path: Path, stage: int, warmup: bool) -> Path:
    data = yaml.safe_load(DEFAULT.read_text())
    data["stages"][stage]["warmup"] = warmup
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_warmup_is_on_by_default_and_can_be_turned_off_on_vllm_stages(tmp_path):
    assert all(s.warmup for s in load_config(DEFAULT).stages)
    config = load_config(variant(tmp_path, 0, False))
    assert [s.warmup for s in config.stages[:2]] == [False, True]


def test_warmup_off_on_a_generation_stage_is_refused_naming_the_key(tmp_path):
    path = variant(tmp_path, 2, False)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert f"{path}: stages[2].warmup: " in message and "only for autoregressive stages" in message


def test_each_kind_sets_its_parameters_and_the_second_prompt_differs():
    fields = {
        "logprobs": "logprobs",
        "top_logprobs": "top_logprobs",
        "seed": "seed",
        "json_schema": "response_format",
        "named_tool": "tool_choice",
        "spoken": "modalities",
        "repetition_penalty": "repetition_penalty",
    }
    for kind in KINDS:
        first, second = request_body(kind, 0, 8), request_body(kind, 1, 8)
        assert first["messages"] != second["messages"], kind
        assert first["stream"] and first["max_tokens"] == 8
        if kind in fields:
            assert fields[kind] in first, kind
    image = request_body("image", 0, 8)["messages"][0]["content"]
    assert request_body("video", 0, 8)["messages"][0]["content"][1]["video_url"]["url"].startswith(
        "data:video/mp4;base64,"
    )
    assert image[1]["image_url"]["url"].startswith("data:image/png;base64,")
    with pytest.raises(ValueError):
        request_body("hologram", 0, 8)


def test_no_warmup_side_turns_off_only_the_vllm_stages(tmp_path):
    warm = yaml.safe_load(side_config(DEFAULT, str(tmp_path), "warmup", "t1").read_text())
    cold = yaml.safe_load(side_config(DEFAULT, str(tmp_path), "no_warmup", "t2", 60.0).read_text())
    assert all("warmup" not in s for s in warm["stages"])
    assert [s.get("warmup") for s in cold["stages"]] == [False, False, None]
    assert cold["server"]["heartbeat_timeout_s"] == 60.0
    load_config(side_config(DEFAULT, str(tmp_path), "no_warmup", "t3"))  # still a valid config


def request(kind: str, nth: int, e2e: float | None, ttfa: float | None = None, status: int = 200) -> dict:
    return {
        "kind": kind,
        "nth": nth,
        "status": status,
        "error": None,
        "ttft_s": e2e,
        "ttfa_s": ttfa,
        "e2e_s": e2e,
        "completion_tokens": 8,
        "audio_bytes": 0,
    }


def test_summary_ratios_use_first_audio_for_spoken_answers_and_count_failures():
    servers = [
        {
            "side": "warmup",
            "round": 0,
            "startup_s": 50.0,
            "restarts": 0.0,
            "warmup_s": {"thinker": 5.0},
            "compiles_while_serving": {"thinker": 0.0},
            "requests": [
                request("logprobs", 0, 0.2),
                request("logprobs", 1, 0.1),
                request("spoken", 0, 9.0, 0.3),
                request("spoken", 1, 1.0, 0.2),
            ],
        },
        {
            "side": "warmup",
            "round": 1,
            "startup_s": 70.0,
            "restarts": 1.0,
            "warmup_s": {"thinker": 7.0},
            "compiles_while_serving": {"thinker": 1.0},
            "requests": [
                request("logprobs", 0, None, status=503),
                request("logprobs", 1, 0.1),
                request("spoken", 0, 9.0, 0.5),
                request("spoken", 1, 1.0, 0.2),
            ],
        },
    ]
    s = summarize(servers, ["logprobs", "spoken"])["warmup"]
    assert s["startup_s"] == 60.0 and s["warmup_s"] == {"thinker": 6.0}
    assert s["restarts"] == 1.0 and s["compiles_while_serving"] == 1.0
    assert s["kinds"]["logprobs"]["first_not_200"] == 1
    assert s["kinds"]["logprobs"]["ratio"] == pytest.approx(2.0)
    assert not s["kinds"]["logprobs"]["within_target"]
    spoken = s["kinds"]["spoken"]
    assert spoken["measure"] == "ttfa_s"
    assert spoken["ratio"] == pytest.approx((1.5 + 2.5) / 2) and spoken["max_ratio"] == 2.5


class _GrammarWaitingStage:
    """An LLMStage's add/step/has_work/abort as the warm-up sees them while vLLM compiles a
    request's grammar in a thread of its own: the request is not scheduled, steps return nothing
    at once, until the grammar is ready; then it finishes in one step."""

    def __init__(self, compile_s: float) -> None:
        import threading

        self.ready = threading.Event()
        self.steps = 0
        self._timer = threading.Timer(compile_s, self.ready.set)
        self.request_id: str | None = None

    def add(self, request_id, prompt, params, streamed=None):
        self.request_id = request_id
        self._timer.start()

    def has_work(self) -> bool:
        return self.ready.is_set()

    def step(self):
        from types import SimpleNamespace

        self.steps += 1
        if not self.ready.is_set():
            return []
        return [SimpleNamespace(request_id=self.request_id, error=None, finished=True)]

    def abort(self, request_id):
        self._timer.cancel()


def test_a_warmup_request_waiting_for_its_grammar_is_waited_for_not_counted_out():
    """CI failed a stage's start with "warm-up request 'structured_output' did not finish in 256
    steps": empty steps while xgrammar compiled ran out a step count. The warm-up waits by time."""
    from workers import warmup

    stage = _GrammarWaitingStage(compile_s=0.5)
    request = warmup.WarmupRequest("structured_output", {"prompt_token_ids": [1, 2]}, params=None)
    warmup.run_alone(stage, "omni-cache-warmup-0-structured_output", request)
    assert stage.ready.is_set()
    assert stage.steps >= 2  # it stepped while the grammar compiled, and once after
