"""The engine-limit benchmark's pure parts, without starting an engine: the entry stage's engine
arguments of a real stage config as `vllm serve` flags (parsed back by vLLM's own `vllm serve`
parser into the same engine arguments), the `vllm` side's place in the harness's flags, the
engine-time readings of both sides and the per-setting table (benchmarks/vllm_serve_side.py,
benchmarks/engine_limit.py)."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import yaml

from benchmarks import engine_limit
from benchmarks.__main__ import parse_args as harness_args
from benchmarks.vllm_serve_side import serve_flags, thinker_serve_args
from omni_cache.config import load_config, resolve_model

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "stage_configs" / "qwen3_omni.yaml"
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")


def _vllm_serve_engine_args(argv: list[str]):
    """What `vllm serve` makes of ``argv`` (less `python -m module`): its own parser and
    AsyncEngineArgs.from_cli_args, as its entry point does."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    ns = make_arg_parser(FlexibleArgumentParser()).parse_args(argv[3:])
    return ns, AsyncEngineArgs.from_cli_args(ns)


@needs_vllm
def test_the_shipped_thinker_reaches_vllm_serve_as_its_stage_config_says():
    config = load_config(SHIPPED)
    thinker = config.stage("thinker")
    args = thinker_serve_args(SHIPPED)
    assert args.model == resolve_model(thinker, config)  # tiny:qwen3-omni resolved as the stage does
    assert (Path(args.model) / "config.json").is_file()
    assert args.served_model_name == "qwen3_omni"
    assert args.env == {"VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"}
    ns, engine = _vllm_serve_engine_args(args.argv(port=18123))
    assert (ns.host, ns.port, ns.served_model_name) == ("127.0.0.1", 18123, ["qwen3_omni"])
    assert engine.model == args.model
    want = thinker.engine_args.to_vllm_kwargs()
    assert want["limit_mm_per_prompt"] == {"image": 4, "audio": 16, "video": 2}  # extra: included
    for key, value in want.items():
        assert getattr(engine, key) == value, key
    assert engine.enable_prefix_caching is True
    assert engine.async_scheduling is False  # as the stage runs it (vLLM's own default is None)


@needs_vllm
def test_a_stage_config_s_settings_change_the_flags(tmp_path):
    data = yaml.safe_load(SHIPPED.read_text())
    thinker = data["stages"][0]
    thinker["prefix_cache"] = False
    thinker["engine_args"].update(
        enforce_eager=False,
        max_num_seqs=3,
        dtype="bfloat16",
        max_num_batched_tokens=4096,
        extra={"kv_cache_memory_bytes": 1 << 28, "max_logprobs": 7},
    )
    thinker["env"]["EXTRA_VAR"] = "x"
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(data))
    args = thinker_serve_args(path)
    assert "--no-enable-prefix-caching" in args.flags and "--no-enforce-eager" in args.flags
    # Both KV sizes set: the engine argument wins and the variable is dropped, as in the stage.
    assert "VLLM_CPU_KVCACHE_SPACE" not in args.env and args.env["EXTRA_VAR"] == "x"
    _, engine = _vllm_serve_engine_args(args.argv(port=1))
    assert (
        engine.enable_prefix_caching,
        engine.enforce_eager,
        engine.max_num_seqs,
        engine.dtype,
        engine.kv_cache_memory_bytes,
        engine.max_num_batched_tokens,
        engine.max_logprobs,
    ) == (False, False, 3, "bfloat16", 1 << 28, 4096, 7)
    assert thinker_serve_args(path, prefix_cache=True).flags[-1] == "--enable-prefix-caching"


def test_serve_flags_spell_each_kind_of_value():
    assert serve_flags({"a_b": True, "c": False, "d": None, "e": 3, "f": {"x": 1}, "g": ["p", "q"], "h": 0.5}) == [
        "--a-b",
        "--no-c",
        "--e",
        "3",
        "--f",
        '{"x": 1}',
        "--g",
        "p",
        "q",
        "--h",
        "0.5",
    ]
    with pytest.raises(ValueError, match="engine argument h"):
        serve_flags({"h": object()})
    with pytest.raises(ValueError, match="empty list"):
        serve_flags({"g": []})


def test_the_harness_takes_a_vllm_side_only_with_text_only_requests():
    assert harness_args(["--sides", "vllm,on", "--text-only", "--stage-config", str(SHIPPED)]).sides == ["vllm", "on"]
    with pytest.raises(SystemExit):
        harness_args(["--sides", "vllm,on", "--stage-config", str(SHIPPED)])
    with pytest.raises(SystemExit):
        harness_args(["--sides", "vllm2,on", "--text-only", "--stage-config", str(SHIPPED)])


def _hist(name: str, total: float, count: int) -> str:
    return f'# TYPE {name} histogram\n{name}_sum{{model_name="m"}} {total}\n{name}_count{{model_name="m"}} {count}\n'


def test_histogram_means_are_the_deltas_between_two_scrapes():
    before = "".join(
        _hist(n, s, c)
        for n, s, c in (
            ("vllm:time_to_first_token_seconds", 1.0, 2),
            ("vllm:request_queue_time_seconds", 0.5, 2),
            ("vllm:request_prefill_time_seconds", 0.2, 2),
        )
    )
    after = "".join(
        _hist(n, s, c)
        for n, s, c in (
            ("vllm:time_to_first_token_seconds", 2.0, 6),
            ("vllm:request_queue_time_seconds", 0.5, 6),
            ("vllm:request_prefill_time_seconds", 0.6, 6),
        )
    )
    got = engine_limit.histogram_means(before, after)
    assert got == pytest.approx({"ttft": 0.25, "queue": 0.0, "prefill": 0.1})
    assert math.isnan(engine_limit.histogram_means(after, after)["ttft"])


def test_the_pipeline_engine_times_come_from_its_timelines():
    samples = [
        {"ok": True, "response_id": "chatcmpl-a"},
        {"ok": True, "response_id": "chatcmpl-b"},
        {"ok": False, "response_id": "chatcmpl-c"},
        {"ok": True, "response_id": "chatcmpl-d"},
    ]
    timelines = {
        "a": {"thinker": {"queued": 1.0, "scheduled": 1.1, "first_token": 1.4}},
        "b": {"thinker": {"queued": 2.0, "scheduled": 2.3, "first_token": 2.4}},
        "c": {"thinker": {"queued": 0.0, "scheduled": 9.0, "first_token": 9.0}},  # failed: left out
        "d": {"thinker": {"queued": 0.0}},
    }  # incomplete
    got = engine_limit.timeline_engine_means(samples, timelines)
    assert got["requests"] == 2
    assert got["queue"] == pytest.approx(0.2) and got["prefill"] == pytest.approx(0.2)


def test_a_setting_row_reports_pipeline_over_vllm():
    result = {
        "sides": {"vllm": {"ttft_s": {"p50": 0.1, "n": 6}}, "on": {"ttft_s": {"p50": 0.12, "n": 6}}},
        "ratios": {"speedup": {"ttft_s": {"p50": 1.2}}},
        "paired_ratios": {"speedup": {"ttft_s": {"p50": 1.15}}},
        "ratios_per_round": [{"speedup": {"ttft_s": {"p50": x}}} for x in (1.3, 0.9, 1.2)],
    }
    row = engine_limit.ttft_row("zero-reuse", 4, result)
    assert row["rounds_pipeline_slower"] == 2 and row["ratio_rounds"] == [1.3, 0.9, 1.2]
    table = engine_limit.format_rows([row])
    assert "zero-reuse, c=4" in table and "1.200" in table and "2/3" in table and "100" in table


def test_settings_parse_and_refuse():
    assert engine_limit.parse_settings("zero-reuse:1, shared-prefix:4") == [("zero-reuse", 1), ("shared-prefix", 4)]
    for bad in ("image:1", "zero-reuse", "zero-reuse:0", ""):
        with pytest.raises(ValueError):
            engine_limit.parse_settings(bad)
