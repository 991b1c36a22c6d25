"""The /metrics exposition (no server): prometheus_client's parser reads it, vLLM's names per stage."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from omni_cache.runtime.metrics.prometheus import (
    STAGE_DONE,
    TTFA,
    TTFT,
    OrchestratorMetrics,
    RoutingSnapshot,
    StageSnapshot,
    parse_metrics,
)

VLLM_STAGE = {
    "requests": 3,
    "errors": 0,
    "queue_depth": 1,
    "prefix_cache_queried_tokens": 200,
    "prefix_cache_hit_tokens": 128,
    "num_requests_running": 1,
    "num_requests_waiting": 0,
    "prompt_tokens": 200,
    "generation_tokens": 30,
    "latent_rows_served": 128,
    "prefix_cache_requests": 3,
}
DECODER_STAGE = {"requests": 2, "errors": 1, "queue_depth": 0}


def rendered(model_name: str | None = "tiny_omni") -> str:
    m = OrchestratorMetrics(["thinker", "talker", "decoder"])
    m.model_name = model_name
    for s in (0.02, 0.3, 4.0):
        m.observe(TTFT, "thinker", s)
    m.observe(TTFA, "decoder", 0.35)
    m.observe(STAGE_DONE, "decoder", 1.5)
    m.request_done(None)
    m.request_done(504)
    m.stage_failed_request("talker")
    return m.render(
        {
            "thinker": StageSnapshot(up=True, restarts=0, counters=dict(VLLM_STAGE), fresh=True),
            "talker": StageSnapshot(up=False, restarts=2, counters=dict(VLLM_STAGE), fresh=False),
            "decoder": StageSnapshot(up=True, counters=dict(DECODER_STAGE), fresh=True),
        },
        in_flight=4,
        heap={"heap_trims": 7, "heap_trim_seconds": 0.25},
    )


def test_prometheus_client_parses_it_with_types():
    families = {f.name: f for f in text_string_to_metric_families(rendered())}
    assert families["vllm:prefix_cache_queries"].type == "counter"
    assert families["vllm:num_requests_running"].type == "gauge"
    assert families["vllm:time_to_first_token_seconds"].type == "histogram"
    assert families["omni_cache_time_to_first_audio_seconds"].type == "histogram"
    assert families["omni_cache_stage_restarts"].type == "counter"


def test_vllm_names_per_vllm_stage_with_model_name():
    samples = parse_metrics(rendered())
    got = {(n, lab.get("stage")): (lab, v) for n, lab, v in samples}
    for stage in ("thinker", "talker"):
        for name, key in (
            ("vllm:prefix_cache_queries_total", "prefix_cache_queried_tokens"),
            ("vllm:prefix_cache_hits_total", "prefix_cache_hit_tokens"),
            ("vllm:num_requests_running", "num_requests_running"),
            ("vllm:num_requests_waiting", "num_requests_waiting"),
            ("vllm:prompt_tokens_total", "prompt_tokens"),
            ("vllm:generation_tokens_total", "generation_tokens"),
        ):
            labels, value = got[(name, stage)]
            assert labels == {"stage": stage, "model_name": "tiny_omni", "replica": "0"}
            assert value == VLLM_STAGE[key]
    # The decoder is no vLLM engine: no vLLM engine metrics claiming a prefix cache for it.
    assert ("vllm:prefix_cache_queries_total", "decoder") not in got
    # Ours for every stage.
    assert got[("omni_cache_stage_errors_total", "decoder")][1] == 1
    assert got[("omni_cache_stage_restarts_total", "talker")][1] == 2
    assert got[("omni_cache_stage_up", "talker")][1] == 0
    # The server process's own heap trims.
    assert got[("omni_cache_server_heap_trims_total", None)][1] == 7
    assert got[("omni_cache_server_heap_trim_seconds_total", None)][1] == 0.25
    assert got[("omni_cache_stage_failed_requests_total", "talker")][1] == 1
    assert got[("omni_cache_latent_rows_served_total", "thinker")][1] == 128
    assert got[("omni_cache_stage_prefix_cache_requests", "thinker")][1] == 3  # unmapped: passed through


def test_histograms_are_cumulative_with_vllm_buckets():
    samples = parse_metrics(rendered())
    buckets = {lab["le"]: v for n, lab, v in samples if n == "vllm:time_to_first_token_seconds_bucket"}
    assert buckets["0.02"] == 1 and buckets["0.25"] == 1 and buckets["0.5"] == 2 and buckets["5.0"] == 3
    assert buckets["+Inf"] == 3 and len(buckets) == 23  # vLLM's 22 bounds + Inf
    [(_, total)] = [(lab, v) for n, lab, v in samples if n == "vllm:time_to_first_token_seconds_sum"]
    assert total == pytest.approx(4.32)
    [e2e] = [v for n, lab, v in samples if n == "vllm:e2e_request_latency_seconds_count"]
    assert e2e == 1
    outcomes = {lab["outcome"]: v for n, lab, v in samples if n == "omni_cache_requests_total"}
    assert outcomes == {"ok": 1, "error_504": 1}


def test_without_a_model_name_only_the_stage_and_replica_labels():
    # a stage's own counters per replica; the orchestrator's histograms per stage (both there: a
    # rendering without any vllm: sample must not pass)
    label_sets = {
        frozenset(set(labels) - {"le"})
        for name, labels, _ in parse_metrics(rendered(model_name=None))
        if name.startswith("vllm:")
    }
    assert label_sets == {frozenset({"stage", "replica"}), frozenset({"stage"})}, label_sets


def test_replicas_of_a_stage_are_samples_of_their_own_and_routing_is_counted():
    m = OrchestratorMetrics(["thinker"])
    m.model_name = "tiny_omni"
    text = m.render(
        {
            "thinker#0": StageSnapshot(up=True, counters={"requests": 3}, fresh=True, stage="thinker", replica=0),
            "thinker#1": StageSnapshot(up=False, restarts=1, counters={"requests": 5}, stage="thinker", replica=1),
        },
        in_flight=0,
        routing=RoutingSnapshot(
            decisions={
                ("thinker", 0, "round_robin", "round_robin"): 4,
                ("thinker", 1, "round_robin", "round_robin"): 3,
            },
            in_flight={("thinker", 0): 2, ("thinker", 1): 0},
            prefix_blocks={("thinker", 1): 17},
        ),
    )
    got = {(n, lab.get("stage"), lab.get("replica")): v for n, lab, v in parse_metrics(text)}
    assert got[("omni_cache_stage_requests_total", "thinker", "0")] == 3
    assert got[("omni_cache_stage_requests_total", "thinker", "1")] == 5
    assert got[("omni_cache_stage_up", "thinker", "1")] == 0
    assert got[("omni_cache_stage_restarts_total", "thinker", "1")] == 1
    routed = {
        (lab["replica"], lab["policy"], lab["decision"]): v
        for n, lab, v in parse_metrics(text)
        if n == "omni_cache_routing_decisions_total"
    }
    assert routed == {("0", "round_robin", "round_robin"): 4, ("1", "round_robin", "round_robin"): 3}
    assert got[("omni_cache_replica_requests_in_flight", "thinker", "0")] == 2
    assert got[("omni_cache_replica_requests_in_flight", "thinker", "1")] == 0
    assert got[("omni_cache_prefix_index_blocks", "thinker", "1")] == 17


def test_malformed_text_is_a_value_error():
    with pytest.raises(ValueError):
        parse_metrics('vllm:prefix_cache_hits_total{stage="x"} not-a-number\n')


def test_a_model_name_set_after_observations_makes_vllms_histograms_again_with_its_label():
    """A histogram's label names are fixed when it is made: vLLM's are made again with the
    model_name label (what they held before is dropped), ours keep theirs."""
    m = OrchestratorMetrics(["thinker", "decoder"])
    m.observe(TTFT, "thinker", 0.1)
    m.observe(TTFA, "decoder", 0.2)
    m.model_name = "served"
    m.observe(TTFT, "thinker", 0.3)
    counts = {
        (n, tuple(sorted(lab.items()))): v
        for n, lab, v in parse_metrics(m.render({}, in_flight=0))
        if n.endswith("_count") and not n.startswith("omni_cache_event_loop_lag")
    }
    assert counts == {
        ("vllm:time_to_first_token_seconds_count", (("model_name", "served"), ("stage", "thinker"))): 1,
        ("omni_cache_time_to_first_audio_seconds_count", (("stage", "decoder"),)): 1,
    }
