"""The routing benchmark without engines (python -m benchmarks.routing): its tenant workload, the
two pipelines' configs, and the medians and verdicts it reports. Running it end to end starts
four vLLM engines (minutes), so that is left to the benchmark itself."""

from __future__ import annotations

from collections import Counter

import pytest

from benchmarks import routing_summary, routing_workload
from benchmarks.routing_pipelines import routing_config
from benchmarks.workloads import messages_for, prompt_tokens_expected
from omni_cache.config import load_config


def test_tenant_order_is_balanced_seeded_and_differs_by_round():
    a = routing_workload.tenant_order(8, 64, seed=0, round_=0)
    assert Counter(a) == {t: 8 for t in range(8)}
    assert a == routing_workload.tenant_order(8, 64, seed=0, round_=0)
    assert a != routing_workload.tenant_order(8, 64, seed=0, round_=1)
    assert a != sorted(a)


def test_requests_share_exactly_their_tenants_prefix_and_each_policy_gets_new_tenants():
    order = routing_workload.tenant_order(3, 6, seed=1, round_=0)
    kw = dict(shared_tokens=500, unique_tokens=100, max_tokens=4, seed=1, round_=0)
    a = routing_workload.build_requests(order, label="prefix", **kw)
    b = routing_workload.build_requests(order, label="round_robin", **kw)
    assert [s.kind for s in a] == [f"tenant{t}" for t in order] == [s.kind for s in b]
    for s in a:
        assert prompt_tokens_expected(s, 0, []) == 600
        assert messages_for(s, 0, [])[0]["content"] == s.system
    systems = {s.kind: s.system for s in a}
    assert len(set(systems.values())) == 3
    assert all(s.system == systems[s.kind] for s in a)
    # Another policy's turn: same unique parts, prefixes no earlier turn can have cached.
    assert [s.users for s in a] == [s.users for s in b]
    assert not set(systems.values()) & {s.system for s in b}


def test_default_pool_holds_half_the_tenants_requests():
    # 2,000 + 100 + 16 tokens = 67 blocks of 32; 4 tenants' worth, plus vLLM's null block.
    assert routing_workload.default_pool_blocks(8, 2000, 100, 16, 32) == 4 * 67 + 1
    assert routing_workload.default_pool_blocks(3, 2000, 100, 16, 32) == 2 * 67 + 1


def test_configs_give_the_thinker_replicas_and_their_pool(tmp_path):
    src = "stage_configs/tiny_omni.yaml"
    two = load_config(
        routing_config(
            src, tmp_path / "two.yaml", replicas=2, pool_blocks=200, dtype="float32", request_timeout_s=900.0
        )
    )
    one = load_config(
        routing_config(src, tmp_path / "one.yaml", replicas=1, pool_blocks=399, dtype=None, request_timeout_s=900.0)
    )
    t2 = {s.name: s for s in two.stages}
    assert two.server.routing == "prefix" and t2["thinker"].replicas == 2
    assert t2["thinker"].engine_args.extra["num_gpu_blocks_override"] == 200
    assert t2["thinker"].engine_args.max_model_len == 199 * 32  # cut to fit the small pool
    assert t2["talker"].replicas == 1 and t2["talker"].engine_args.dtype == "float32"
    t1 = {s.name: s for s in one.stages}
    assert t1["thinker"].replicas == 1 and t1["thinker"].engine_args.extra["num_gpu_blocks_override"] == 399
    assert t1["thinker"].engine_args.max_model_len == 8192  # fits: left as configured
    assert t1["thinker"].engine_args.dtype == "bfloat16"


def _turn(policy, hit, ttfa, rnd=0):
    return {
        "policy": policy,
        "round": rnd,
        "summary": {
            "hit_rate": hit,
            "ttft_p50_s": ttfa / 2,
            "ttft_p90_s": ttfa,
            "ttfa_p50_s": ttfa,
            "ttfa_p90_s": 2 * ttfa,
            "e2e_p50_s": 3 * ttfa,
            "errors": 0,
        },
    }


def test_medians_over_rounds_and_the_two_targets():
    turns = [
        _turn("prefix", 0.80, 1.0, 0),
        _turn("round_robin", 0.30, 4.0, 0),
        _turn("prefix", 0.70, 2.0, 1),
        _turn("round_robin", 0.20, 5.0, 1),
        _turn("prefix", 0.75, 1.5, 2),
        _turn("round_robin", 0.25, 3.0, 2),
    ]
    agg = routing_summary.aggregate(turns, [{"summary": {"hit_rate": 0.80}}, {"summary": {"hit_rate": 0.84}}])
    assert agg["policies"]["prefix"]["hit_rate"] == pytest.approx(0.75)
    assert agg["policies"]["prefix"]["ttfa_p50_s"] == pytest.approx(1.5)
    assert agg["policies"]["round_robin"]["rounds"] == 3
    assert agg["reference_hit_rate"] == pytest.approx(0.82)
    hit, ttfa = agg["targets"]
    assert hit["value"] == pytest.approx(0.75 / 0.82) and hit["met"] is True
    assert ttfa["value"] == pytest.approx(4.0 / 1.5) and ttfa["met"] is False
    assert "NOT met" in routing_summary.format_table(agg)


def test_summary_counts_errors_and_skips_them_in_the_hit_rate():
    ok = dict(ok=True, prompt_tokens=1000, cached_tokens=900, ttft_s=0.1, ttfa_s=0.2, e2e_s=0.5)
    bad = dict(ok=False, prompt_tokens=None, cached_tokens=None, ttft_s=None, ttfa_s=None, e2e_s=None)
    s = routing_summary.summarize_turn([ok, {**ok, "cached_tokens": 0}, bad])
    assert s["errors"] == 1 and s["hit_rate"] == pytest.approx(0.45) and s["requests"] == 3


def test_the_media_workload_gives_tenants_their_own_medium_in_turn():
    order = routing_workload.tenant_order(4, 8, seed=2, round_=0)
    kw = dict(
        shared_tokens=64, unique_tokens=40, max_tokens=4, seed=2, round_=0, kinds=routing_workload.WORKLOADS["media"]
    )
    a = routing_workload.build_requests(order, label="prefix", **kw)
    b = routing_workload.build_requests(order, label="least_loaded", **kw)
    kinds = {s.kind.split("-")[1]: s for s in a}
    assert set(kinds) == {"text", "image", "audio", "video"}
    assert kinds["text"].system and not (kinds["text"].image or kinds["text"].audio or kinds["text"].video)
    assert kinds["image"].image and kinds["audio"].audio and kinds["video"].video
    assert not (kinds["image"].system or kinds["audio"].system or kinds["video"].system)
    # A tenant's requests share its medium; another policy's turn has other media, same questions.
    for s in a:
        assert (s.image, s.audio, s.video, s.system) == (
            kinds[s.kind.split("-")[1]].image,
            kinds[s.kind.split("-")[1]].audio,
            kinds[s.kind.split("-")[1]].video,
            kinds[s.kind.split("-")[1]].system,
        )
    assert not {s.audio for s in a} & {s.audio for s in b if s.audio}
    assert [s.users for s in a] == [s.users for s in b]
    content = messages_for(kinds["audio"], 0, [])[-1]["content"]
    assert content[0]["type"] == "input_audio" and content[0]["input_audio"]["format"] == "wav"


def test_per_kind_hit_rates_and_the_thinker_only_config(tmp_path):
    ok = dict(ok=True, ttft_s=0.1, ttfa_s=None, e2e_s=0.5)
    s = routing_summary.summarize_turn(
        [
            {**ok, "kind": "tenant0-image", "prompt_tokens": 100, "cached_tokens": 90},
            {**ok, "kind": "tenant1-text", "prompt_tokens": 100, "cached_tokens": 10},
            {**ok, "kind": "tenant2-image", "prompt_tokens": 100, "cached_tokens": 0},
        ]
    )
    assert s["hit_rate_by_kind"] == {"image": pytest.approx(0.45), "text": pytest.approx(0.1)}
    cfg = load_config(
        routing_config(
            "stage_configs/qwen3_omni.yaml",
            tmp_path / "t.yaml",
            replicas=2,
            pool_blocks=100,
            dtype=None,
            request_timeout_s=60.0,
            thinker_only=True,
        )
    )
    assert [s.name for s in cfg.stages] == ["thinker"] and cfg.stages[0].replicas == 2
