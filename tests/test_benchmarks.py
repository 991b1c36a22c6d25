"""The end-to-end benchmark harness without engines: workloads, SSE timing against a fake server,
statistics, the table, the JSON and the PNG (python -m benchmarks)."""

from __future__ import annotations

import asyncio
import base64
import json
import math
import mmap
import os
import random

import httpx
import numpy as np
import pytest
import yaml

from benchmarks import report, report_plot, soak, soak_outcomes, soak_requests, soak_samples
from benchmarks.client import Driver, Sample, audio_bytes_of_b64, counter_deltas, metric_counters
from benchmarks.harness import private_config
from benchmarks.harness_results import assemble, pool_runs
from benchmarks.workloads import (
    TEMPLATE,
    Sizes,
    arrival_times,
    build_workload,
    messages_for,
    parse_mix,
    prompt_tokens_expected,
)

# ---- workloads ----------------------------------------------------------------------------------


def _tiny_template_tokens(messages: list[dict[str, str]]) -> int:
    """What omni_cache.tiny.checkpoints.CHAT_TEMPLATE + the byte-level tokenizer give: one token per
    ASCII character, one per special token."""
    n = 0
    for m in messages:
        n += 1 + len(m["role"] + "\n") + len(m["content"]) + 1 + 1  # <|im_start|>role\n ... <|im_end|>\n
    return n + 1 + len("assistant\n")


def test_shared_prefix_sizes_are_exact_in_tokens():
    warm, sessions = build_workload(
        "shared-prefix", Sizes(num_requests=5, shared_tokens=4000, unique_tokens=100), seed=1
    )
    assert len(sessions) == 5 and len(warm) == 1
    prompts = []
    for s in [*warm, *sessions]:
        msgs = messages_for(s, 0, [])
        n = _tiny_template_tokens(msgs)
        assert n == 4100 == prompt_tokens_expected(s, 0, [])
        prompts.append(f"<s>system\n{msgs[0]['content']}</s>\n<s>user\n{msgs[1]['content']}")
    # The first S tokens (system message + the user message header) are shared, then they differ.
    head = 4000 - (TEMPLATE["system"] + TEMPLATE["user_head"])
    assert len({s.system for s in [*warm, *sessions]}) == 1 and len(sessions[0].system) == head
    assert len({s.users[0] for s in sessions}) == 5
    assert all(p.isascii() for p in prompts)


def test_image_workload_sends_one_image_and_different_questions():
    import base64
    import io

    from PIL import Image

    warm, sessions = build_workload("image", Sizes(num_requests=4, shared_tokens=900, unique_tokens=60), seed=2)
    images = {s.image for s in [*warm, *sessions]}
    assert len(images) == 1 and len({s.users[0] for s in sessions}) == 4
    [url] = images
    side = Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).size
    assert side == (30 * 32, 30 * 32)  # 30 x 30 = 900 vision tokens of 32 x 32 pixels
    msgs = messages_for(sessions[1], 0, [])
    assert [m["role"] for m in msgs] == ["user"]
    assert msgs[0]["content"][0] == {"type": "image_url", "image_url": {"url": url}}
    assert msgs[0]["content"][1]["text"] == sessions[1].users[0]
    assert prompt_tokens_expected(sessions[1], 0, []) is None
    _, other = build_workload("image", Sizes(num_requests=1, shared_tokens=900), seed=3)
    assert other[0].image != url


def test_zero_reuse_shares_nothing_and_is_seeded():
    sizes = Sizes(num_requests=6, shared_tokens=300, unique_tokens=50)
    _, a = build_workload("zero-reuse", sizes, seed=3)
    _, b = build_workload("zero-reuse", sizes, seed=3)
    _, c = build_workload("zero-reuse", sizes, seed=4)
    assert [(s.system, s.users) for s in a] == [(s.system, s.users) for s in b]
    assert [s.system for s in a] != [s.system for s in c]
    firsts = {s.system[:32] for s in a}  # no shared first KV block (32 tokens)
    assert len(firsts) == len(a)
    assert all(prompt_tokens_expected(s, 0, []) == 350 for s in a)


def test_multi_turn_resends_history_with_answers():
    _, sessions = build_workload(
        "multi-turn", Sizes(num_requests=7, shared_tokens=200, unique_tokens=40, turns=3), seed=0
    )
    assert [s.turns for s in sessions] == [3, 3, 1]
    s = sessions[0]
    answers = ["first answer", "second"]
    m2 = messages_for(s, 2, answers)
    assert [m["role"] for m in m2] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert m2[2]["content"] == "first answer" and m2[4]["content"] == "second"
    # Turn k's prompt starts with turn k-1's prompt (minus its generation prompt) and answer.
    m1 = messages_for(s, 1, answers[:1])
    assert m2[: len(m1)] == m1
    assert prompt_tokens_expected(s, 2, answers) == _tiny_template_tokens(m2)
    # Answers are counted in UTF-8 bytes (the tokenizer is byte-level): U+FFFD is 3 tokens.
    assert prompt_tokens_expected(s, 1, ["\ufffd"]) == prompt_tokens_expected(s, 1, ["abc"])
    with pytest.raises(ValueError):
        messages_for(s, 2, answers[:1])
    assert len({x.system for x in sessions}) == 3  # no sharing across conversations


def test_mixed_follows_weights_and_counts_requests():
    sizes = Sizes(
        num_requests=200, shared_tokens=100, unique_tokens=30, turns=2, mix=parse_mix("shared-prefix=3,zero-reuse=1")
    )
    warm, sessions = build_workload("mixed", sizes, seed=0)
    assert sum(s.turns for s in sessions) == 200
    kinds = [s.kind for s in sessions]
    assert set(kinds) == {"shared-prefix", "zero-reuse"}
    assert 0.6 < kinds.count("shared-prefix") / len(kinds) < 0.9
    shared = {s.system for s in sessions if s.kind == "shared-prefix"}
    assert len(shared) == 1 and warm[0].system in shared
    sizes.mix = parse_mix("multi-turn=1")
    _, sessions = build_workload("mixed", sizes, seed=0)
    assert sum(s.turns for s in sessions) == 200 and {s.kind for s in sessions} == {"multi-turn"}


@pytest.mark.parametrize("bad", ["", "shared-prefix", "nope=1", "zero-reuse=x", "zero-reuse=-1", "zero-reuse=0"])
def test_parse_mix_rejects(bad):
    with pytest.raises(ValueError):
        parse_mix(bad)


def test_sizes_too_small_for_the_template():
    with pytest.raises(ValueError, match="shared-tokens"):
        build_workload("shared-prefix", Sizes(num_requests=1, shared_tokens=10, unique_tokens=100), 0)
    with pytest.raises(ValueError, match="unique-tokens"):
        build_workload("shared-prefix", Sizes(num_requests=1, shared_tokens=100, unique_tokens=5), 0)
    with pytest.raises(ValueError, match="unknown workload"):
        build_workload("nope", Sizes(), 0)


def test_poisson_arrivals():
    ts = arrival_times(4000, rate=2.0, seed=0)
    assert ts[0] == 0.0 and all(b >= a for a, b in zip(ts, ts[1:]))
    gaps = [b - a for a, b in zip(ts, ts[1:])]
    mean = sum(gaps) / len(gaps)
    assert 0.45 < mean < 0.55  # 1 / rate
    cv = math.sqrt(sum((g - mean) ** 2 for g in gaps) / len(gaps)) / mean
    assert 0.9 < cv < 1.1  # exponential gaps: coefficient of variation 1
    assert arrival_times(10, 2.0, 0) == ts[:10]
    with pytest.raises(ValueError):
        arrival_times(3, 0.0, 0)


# ---- the client against a fake server -----------------------------------------------------------


def _fake_server(delay_s: float = 0.0, fail_turn: int | None = None):
    """An httpx MockTransport answering streamed chat completions like omni_cache's server."""
    seen: list[dict] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "tiny"}]})
        body = json.loads(request.content)
        seen.append(body)
        turn = sum(1 for m in body["messages"] if m["role"] == "user") - 1
        if fail_turn is not None and turn == fail_turn:
            return httpx.Response(503, json={"error": {"message": "stage 'talker' died"}})
        pcm = base64.b64encode(b"\x00\x01" * 2400).decode()  # 0.1 s at 24 kHz

        async def stream():
            def chunk(delta, finish=None):
                return (
                    "data: " + json.dumps({"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}) + "\n\n"
                ).encode()

            yield chunk({"role": "assistant", "content": ""})
            await asyncio.sleep(delay_s)
            yield chunk({"content": f"answer{turn}"})
            await asyncio.sleep(delay_s)
            yield chunk({"audio": {"id": "a", "data": pcm, "transcript": ""}})
            yield chunk({"audio": {"id": "a", "data": pcm, "transcript": ""}})
            yield chunk({}, "length")
            usage = {"prompt_tokens": 120, "completion_tokens": 8, "prompt_tokens_details": {"cached_tokens": 96}}
            yield ("data: " + json.dumps({"choices": [], "usage": usage}) + "\n\n").encode()
            yield b"data: [DONE]\n\n"

        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=stream())

    return httpx.MockTransport(handler), seen


def _run_driver(transport, sessions, **kw):
    driver = Driver("http://fake", "tiny", **kw)
    driver._client = lambda: httpx.AsyncClient(transport=transport)  # type: ignore[method-assign]
    return driver, asyncio.run(driver.run(sessions))


class _VirtualClockLoop(asyncio.SelectorEventLoop):
    """An event loop on a virtual clock: when nothing is ready to run it jumps to its next
    timer instead of waiting for it (everything here is in memory: nothing else could wake it).
    Sleeps and timings then come out exact however loaded the machine is."""

    def __init__(self) -> None:
        super().__init__()
        self._now = 0.0
        select = self._selector.select

        def jump(timeout=None):
            events = select(0)
            if not events and timeout:
                self._now += timeout
            return events

        self._selector.select = jump

    def time(self) -> float:
        return self._now


def _run_driver_on_virtual_time(monkeypatch, transport, sessions, **kw):
    """:func:`_run_driver` with the driver's clock (time.perf_counter) the loop's virtual one."""
    import types

    import benchmarks.client as client_module

    with asyncio.Runner(loop_factory=_VirtualClockLoop) as runner:
        loop = runner.get_loop()
        monkeypatch.setattr(client_module, "time", types.SimpleNamespace(perf_counter=loop.time))
        driver = Driver("http://fake", "tiny", **kw)
        driver._client = lambda: httpx.AsyncClient(transport=transport)  # type: ignore[method-assign]
        return driver, runner.run(driver.run(sessions))


def test_driver_times_text_and_audio_and_resends_answers():
    transport, seen = _fake_server(delay_s=0.02)
    _, sessions = build_workload(
        "multi-turn", Sizes(num_requests=4, shared_tokens=100, unique_tokens=30, turns=2), seed=0
    )
    done = []
    driver, samples = _run_driver(transport, sessions, concurrency=2, on_done=done.append)
    assert len(samples) == 4 == len(done) and all(s.ok for s in samples)
    for s in samples:
        assert 0.015 < s.ttft_s < s.ttfa_s < s.e2e_s
        assert s.audio_chunks == 2 and s.audio_bytes == 9600 and s.audio_s == pytest.approx(0.2)
        assert (s.prompt_tokens, s.completion_tokens, s.cached_tokens) == (120, 8, 96)
        assert s.finish_reason == "length" and s.answer_head == f"answer{s.turn}"
    second_turns = [b for b in seen if len(b["messages"]) == 4]
    assert len(second_turns) == 2 and all(
        b["messages"][2] == {"role": "assistant", "content": "answer0"} for b in second_turns
    )
    body = seen[0]
    assert body["stream"] is True and body["modalities"] == ["text", "audio"]
    assert body["stream_options"] == {"include_usage": True}
    assert driver.t_end > driver.t_base


def test_driver_text_only_requests_like_vllm_bench_serve():
    transport, seen = _fake_server()
    _, sessions = build_workload("shared-prefix", Sizes(num_requests=2, shared_tokens=100, unique_tokens=30), 0)
    _, samples = _run_driver(transport, sessions, concurrency=1, audio=False)
    # One request per session, each sent: all() over no samples or bodies would pass.
    assert len(samples) == len(seen) == 2 and all(s.ok for s in samples)
    assert all(b["modalities"] == ["text"] and "audio" not in b for b in seen)
    seen.clear()
    _, samples = _run_driver(transport, sessions, concurrency=1, audio=False, one_message=True)
    assert [b["messages"] for b in seen] == [[{"role": "user", "content": s.system + s.users[0]}] for s in sessions]


def test_driver_records_errors_and_skips_the_rest_of_a_conversation():
    transport, _ = _fake_server(fail_turn=0)
    _, sessions = build_workload(
        "multi-turn", Sizes(num_requests=3, shared_tokens=100, unique_tokens=30, turns=3), seed=0
    )
    _, samples = _run_driver(transport, sessions, concurrency=1)
    assert len(samples) == 3 and not any(s.ok for s in samples)
    assert samples[0].status == 503 and "talker" in samples[0].error
    assert all("not sent" in s.error for s in samples[1:])


def test_driver_rate_mode_follows_arrival_times(monkeypatch):
    transport, _ = _fake_server()
    _, sessions = build_workload("zero-reuse", Sizes(num_requests=3, shared_tokens=100, unique_tokens=30), 0)
    for s, t in zip(sessions, (0.0, 0.1, 0.2)):
        s.arrival_s = t
    _, samples = _run_driver_on_virtual_time(monkeypatch, transport, sessions, rate=10.0)
    assert len(samples) == 3 and all(s.ok for s in samples)
    assert sorted(s.start_s for s in samples) == pytest.approx([0.0, 0.1, 0.2], abs=1e-9)
    assert [s.scheduled_s for s in sorted(samples, key=lambda s: s.start_s)] == [0.0, 0.1, 0.2]


def test_driver_closed_loop_stagger_opens_clients_apart(monkeypatch):
    # Each answer takes 0.3 s, so every client's first request starts before any answer ends: the
    # opening wave is spread by the stagger alone, and later requests follow their client's last.
    transport, _ = _fake_server(delay_s=0.15)
    _, sessions = build_workload("zero-reuse", Sizes(num_requests=6, shared_tokens=100, unique_tokens=30), 0)
    _, samples = _run_driver_on_virtual_time(monkeypatch, transport, sessions, concurrency=3, stagger_s=0.1)
    assert len(samples) == 6 and all(s.ok for s in samples)
    # client k opens at 0.1 k and sends its next request when its answer ended 0.3 s later
    assert sorted(s.start_s for s in samples) == pytest.approx([0.0, 0.1, 0.2, 0.3, 0.4, 0.5], abs=1e-9)
    assert all(s.e2e_s == pytest.approx(0.3, abs=1e-9) for s in samples)
    _, samples = _run_driver_on_virtual_time(monkeypatch, transport, sessions, concurrency=3)
    # default: all at once, then all again when their answers ended
    assert sorted(s.start_s for s in samples) == pytest.approx([0.0, 0.0, 0.0, 0.3, 0.3, 0.3], abs=1e-9)


def test_harness_stagger_flag():
    from benchmarks.__main__ import parse_args

    assert parse_args(["--concurrency", "4", "--stagger", "1.5"]).stagger == 1.5
    assert parse_args([]).stagger == 0.0
    with pytest.raises(SystemExit):
        parse_args(["--stagger", "-1"])


def test_audio_bytes_of_b64():
    for n in range(0, 20):
        data = base64.b64encode(bytes(range(n))).decode()
        assert audio_bytes_of_b64(data) == n


def test_metric_counters_and_deltas():
    text = (
        "\n".join(
            [
                "# TYPE vllm:prefix_cache_queries_total counter",
                'vllm:prefix_cache_queries_total{model_name="tiny",stage="thinker"} 8200',
                'vllm:prefix_cache_hits_total{model_name="tiny",stage="thinker"} 4000',
                'omni_cache_latent_rows_served_total{stage="thinker"} 4000',
                'omni_cache_stage_stats_fresh{stage="thinker"} 1',
                'vllm:prefix_cache_hits_total{model_name="tiny",stage="talker"} 10',
                'omni_cache_requests_total{outcome="ok"} 3',
            ]
        )
        + "\n"
    )
    before = metric_counters(text)
    assert before["thinker"] == {"queried": 8200, "hit": 4000, "latent_rows": 4000, "fresh": 1}
    after = {"thinker": {"queried": 12300, "hit": 8000, "latent_rows": 8000, "fresh": 1}, "talker": {"hit": 20}}
    d = counter_deltas(before, after)
    assert d["thinker"]["hit"] == 4000 and d["thinker"]["queried"] == 4100 and d["talker"]["hit"] == 10
    assert counter_deltas(None, after) is None


# ---- statistics, ratios, table, files -----------------------------------------------------------


def test_percentile_matches_numpy_linear():
    np = pytest.importorskip("numpy")
    rng = random.Random(0)
    for n in (1, 2, 3, 10, 101):
        xs = [rng.random() for _ in range(n)]
        for q in (0, 50, 90, 99, 100):
            assert report.percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    assert math.isnan(report.percentile([], 50))


def _samples(side: str, n: int, ttfa: float, e2e: float, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        f = 1 + 0.1 * rng.random()
        s = Sample(
            id=f"{i}.0",
            session=i,
            kind="shared-prefix",
            turn=0,
            ok=True,
            start_s=i * e2e,
            ttft_s=ttfa / 3 * f,
            ttfa_s=ttfa * f,
            e2e_s=e2e * f,
            prompt_tokens=4100,
            prompt_tokens_expected=4100,
            completion_tokens=32,
            cached_tokens=4000 if side == "on" else 0,
            audio_bytes=96000,
            audio_s=2.0,
            answer_sha1=f"a{i}",
        )
        out.append(s.to_dict())
    return out


def _fake_result(duration_on: float = 10.0, duration_off: float = 10.0) -> dict:
    runs = []
    for side, ttfa, dur in (("on", 0.5, duration_on), ("off", 5.0, duration_off)):
        counters = {
            "thinker": {
                "queried": 41000.0,
                "hit": 40000.0 if side == "on" else 0.0,
                "latent_rows": 40000.0 if side == "on" else 0.0,
                "restarts": 0.0,
                "fresh": 1.0,
            }
        }
        runs.append(
            {
                "side": side,
                "round": 0,
                "samples": _samples(side, 10, ttfa, 1.0),
                "duration_s": dur,
                "counters": counters,
                "resources": {"stage_cpu_s": 20.0, "loadavg_mean": 1.5},
                "warmup": [],
            }
        )
    config = {
        "workload": "shared-prefix",
        "sizes": {"num_requests": 10, "shared_tokens": 4000, "unique_tokens": 100, "max_tokens": 32},
        "concurrency": 1,
        "rate": None,
    }
    machine = {"cpu_model": "Test CPU", "nproc": 2}
    return assemble(config, machine, runs, None)


def test_summary_ratios_and_targets():
    result = _fake_result(duration_on=10.0, duration_off=12.5)
    on, off = result["sides"]["on"], result["sides"]["off"]
    assert on["ok"] == 10 and on["errors"] == 0
    assert on["throughput"]["requests_per_s"] == pytest.approx(1.0)
    assert on["throughput"]["audio_s_per_s"] == pytest.approx(2.0)
    assert on["cache"]["thinker_hit_rate"] == pytest.approx(40000 / 41000)
    assert on["cache"]["latent_rows_served"] == 40000 and off["cache"]["latent_rows_served"] == 0
    assert on["cache"]["usage_hit_rate"] == pytest.approx(4000 / 4100)
    assert on["resources"]["stage_cpu_s_per_request"] == pytest.approx(2.0)
    rat = result["ratios"]
    assert rat["speedup"]["ttfa_s"]["p50"] == pytest.approx(10.0)
    assert rat["throughput_change"]["requests_per_s"] == pytest.approx(12.5 / 10 - 1)
    [t] = result["targets"]
    assert t["met"] and t["value"] == pytest.approx(10.0)
    assert result["answers_identical"] == {"compared": 10, "identical": 10}
    table = report.format_table(result)
    assert "time to first audio p50" in table and "10.00x" in table and "MET" in table
    near = {
        "speedup": {k: {"p50": 1.02} for k in ("ttft_s", "ttfa_s", "e2e_s")},
        "throughput_change": {"requests_per_s": -0.031},
    }
    zr = {t["name"]: t["met"] for t in report.evaluate_targets("zero-reuse", near)}
    assert list(zr.values()) == [True, True, True, False]  # 2% slower latencies pass, 3.1% fewer requests/s not
    assert report.evaluate_targets("multi-turn", rat) == []
    [quick] = report.evaluate_targets("shared-prefix", rat, {"shared_tokens": 2000, "unique_tokens": 100})
    assert quick["met"] is None and quick["value"] == pytest.approx(10.0)


def test_errors_and_missing_values_are_counted_not_averaged():
    samples = _samples("on", 4, 0.5, 1.0)
    samples[0]["ttft_s"] = None  # an answer with no printable text
    samples.append(Sample(id="9.0", session=9, kind="zero-reuse", turn=0, error="HTTP 503: down").to_dict())
    s = report.summarize_side(samples, 4.0)
    assert (s["requests"], s["ok"], s["errors"]) == (5, 4, 1)
    assert s["ttft_s"]["n"] == 3 and s["missing_ttft"] == 1 and s["ttfa_s"]["n"] == 4
    assert s["error_examples"] == ["HTTP 503: down"]
    assert s["throughput"]["requests_per_s"] == pytest.approx(1.0)
    assert math.isnan(s["cache"]["latent_rows_served"])  # no /metrics


def test_pool_runs_sums_durations_and_counters():
    a = {
        "samples": [{"id": "0.0"}],
        "duration_s": 2.0,
        "counters": {"thinker": {"hit": 1.0, "fresh": 1.0}},
        "resources": {"stage_cpu_s": 3.0, "loadavg_mean": 1.0},
    }
    b = {
        "samples": [{"id": "0.0"}],
        "duration_s": 3.0,
        "counters": {"thinker": {"hit": 2.0, "fresh": 0.0}},
        "resources": {"stage_cpu_s": 4.0, "loadavg_mean": 3.0},
    }
    p = pool_runs([a, b])
    assert p["duration_s"] == 5.0 and len(p["samples"]) == 2
    assert p["counters"]["thinker"] == {"hit": 3.0, "fresh": 0.0}
    assert p["resources"] == {"stage_cpu_s": 7.0, "loadavg_mean": 2.0}


def _plotted(monkeypatch, path, result):
    """report_plot.plot's figure (kept past its close): what it drew, to read back."""
    import matplotlib.pyplot as plt

    figures = []
    close = plt.close

    def keep(fig=None):
        figures.append(fig)
        close(fig)

    monkeypatch.setattr(plt, "close", keep)
    report_plot.plot(path, result)
    assert len(figures) == 1
    head = path.read_bytes()[:8]
    assert head == b"\x89PNG\r\n\x1a\n"
    return figures[0]


def _cdf_panels(fig) -> dict[str, dict[str, tuple[list[float], list[float], float]]]:
    """panel title -> legend label -> (the step's x, its y, the median line's x)."""
    out = {}
    for ax in fig.axes[:3]:
        steps = [ln for ln in ax.get_lines() if ln.get_drawstyle().startswith("steps")]
        medians = [ln for ln in ax.get_lines() if ln.get_linestyle() == "--"]
        assert len(steps) == len(medians)
        out[ax.get_title()] = {
            step.get_label(): (list(step.get_xdata()), list(step.get_ydata()), med.get_xdata()[0])
            for step, med in zip(steps, medians)
        }
    return out


def _expected_cdf(samples: list[dict], key: str) -> tuple[list[float], list[float], float]:
    xs = sorted(s[key] for s in samples)
    return [xs[0], *xs], [0.0, *((i + 1) / len(xs) for i in range(len(xs)))], float(np.percentile(xs, 50))


def test_json_is_strict_and_png_is_written(tmp_path, monkeypatch):
    result = _fake_result()
    result["sides"]["on"]["ttft_s"]["p99"] = math.nan  # NaN must become null, not invalid JSON
    path = tmp_path / "out.json"
    report.write_json(path, result)
    data = json.loads(path.read_text(), parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))
    assert data["sides"]["on"]["ttft_s"]["p99"] is None
    assert len(data["samples"]["on"]) == 10 and data["machine"]["cpu_model"] == "Test CPU"
    fig = _plotted(monkeypatch, tmp_path / "out.png", result)
    # Each latency panel: one CDF per side, of that side's samples, its median marked.
    panels = _cdf_panels(fig)
    assert list(panels) == ["time to first audio", "time to first text", "end-to-end"]
    for key, title in (("ttfa_s", "time to first audio"), ("ttft_s", "time to first text"), ("e2e_s", "end-to-end")):
        assert list(panels[title]) == ["prefix cache on (n=10)", "prefix cache off (n=10)"], title
        for side, label in (("on", "prefix cache on (n=10)"), ("off", "prefix cache off (n=10)")):
            xs, ys, median = panels[title][label]
            want_xs, want_ys, want_median = _expected_cdf(result["samples"][side], key)
            assert xs == pytest.approx(want_xs) and ys == pytest.approx(want_ys), (title, side)
            assert median == pytest.approx(want_median), (title, side)
    # TTFA 0.5 s against 5 s spans more than 4x: a log axis
    assert fig.axes[0].get_xscale() == "log"
    # The last panel: every request's TTFA at the time it was sent.
    scatter = fig.axes[3].collections
    assert [c.get_label() for c in scatter] == ["prefix cache on", "prefix cache off"]
    for c, side in zip(scatter, ("on", "off")):
        want = [v for s in result["samples"][side] for v in (s["start_s"], s["ttfa_s"])]
        assert np.ravel(c.get_offsets()).tolist() == pytest.approx(want), side
    title = fig._suptitle.get_text()
    assert title.startswith("omni_cache end to end: workload shared-prefix  (N=10, S=4000, U=100, max_tokens=32")
    assert "median speedup off/on: TTFA 10" in title and "Test CPU, 2 CPUs" in title, title


def test_plot_with_one_side_and_no_data(tmp_path, monkeypatch):
    result = _fake_result()
    result["samples"] = {"server": result["samples"]["on"][:3], "empty": []}
    result.pop("ratios")
    fig = _plotted(monkeypatch, tmp_path / "one.png", result)
    panels = _cdf_panels(fig)
    for key, title in (("ttfa_s", "time to first audio"), ("ttft_s", "time to first text"), ("e2e_s", "end-to-end")):
        assert list(panels[title]) == ["server (n=3)"], title  # the side without samples: nothing
        xs, ys, median = panels[title]["server (n=3)"]
        want_xs, want_ys, want_median = _expected_cdf(result["samples"]["server"], key)
        assert xs == pytest.approx(want_xs) and ys == pytest.approx(want_ys) and median == pytest.approx(want_median)
    assert [c.get_label() for c in fig.axes[3].collections] == ["server"]
    assert len(fig.axes[3].collections[0].get_offsets()) == 3
    assert "speedup" not in fig._suptitle.get_text()  # no ratios: no speedup line


def test_private_config_isolates_sockets_and_port(tmp_path):
    src = os.path.join(os.path.dirname(__file__), "..", "stage_configs", "tiny_omni.yaml")
    path = private_config(src, tmp_path, "on")
    data = yaml.safe_load(path.read_text())
    assert data["server"]["port"] == 0 and data["name"].startswith("bench-") and data["name"].endswith("-on")
    addrs = [s["address"] for s in data["stages"]] + [data["server"]["control_address"]]
    assert len(set(addrs)) == len(addrs) and all(a.startswith(f"ipc:///tmp/omni_cache/{data['name']}/") for a in addrs)
    from omni_cache.config import load_config

    load_config(path)  # still a valid config
    env = yaml.safe_load(private_config(src, tmp_path, "off", {"OMP_NUM_THREADS": "1"}).read_text())
    assert all(s["env"].get("OMP_NUM_THREADS") == "1" for s in env["stages"])
    thinker = next(s for s in env["stages"] if s["name"] == "thinker")
    assert thinker["env"]["VLLM_CPU_KVCACHE_SPACE"] == "2"  # kept


def test_export_prompts_for_vllm_bench_serve(tmp_path):
    from benchmarks.export_prompts import main as export

    out = tmp_path / "p.jsonl"
    assert (
        export(
            [
                "--num-requests",
                "3",
                "--shared-tokens",
                "200",
                "--unique-tokens",
                "40",
                "--max-tokens",
                "8",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    _, sessions = build_workload(
        "shared-prefix", Sizes(num_requests=3, shared_tokens=200, unique_tokens=40, max_tokens=8), 0
    )
    assert rows == [{"prompt": s.system + s.users[0], "output_tokens": 8} for s in sessions]
    assert len({r["prompt"][:150] for r in rows}) == 1 and len({r["prompt"] for r in rows}) == 3


# ---- the soak probe's pure parts (python -m benchmarks.soak) ------------------------------------


@pytest.mark.parametrize(
    "seen, expected",
    [
        (dict(complete=True), ("ok", None)),
        (dict(complete=True, audio_asked=True, got_audio=True), ("ok", None)),
        (dict(complete=True, audio_asked=True), ("failed", "no_audio")),
        (dict(status_code=503), ("failed", "http_503")),
        (dict(status_code=200, sse_error=True, complete=True), ("failed", "sse_error")),
        (dict(status_code=200, abandoned=True), ("aborted", None)),
        (dict(status_code=400, abandoned=True), ("failed", "http_400")),  # refused before the client left
        (dict(timed_out=True, status_code=200), ("lost", "timeout")),
        (dict(status_code=200), ("lost", "truncated")),  # stream ended, no [DONE], no error
        (dict(), ("lost", "no_answer")),  # connection dropped
    ],
)
def test_soak_classify(seen, expected):
    kw = dict(
        timed_out=False,
        abandoned=False,
        status_code=None,
        sse_error=False,
        complete=False,
        audio_asked=False,
        got_audio=False,
    )
    assert soak_outcomes.classify(**{**kw, **seen}) == expected


def test_soak_summarize_and_percentile():
    assert soak_outcomes.percentile([], 50) is None
    assert soak_outcomes.percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert soak_outcomes.percentile(list(range(1, 101)), 99) == pytest.approx(float(np.percentile(range(1, 101), 99)))
    assert soak_outcomes.percentile([5.0], 99) == 5.0
    outs = [
        soak_outcomes.Outcome("stream", "ok", 1.0, e2e_s=2.0, ttfa_s=0.5),
        soak_outcomes.Outcome("text", "ok", 2.0, e2e_s=1.0),
        soak_outcomes.Outcome("audio", "failed", 3.0, e2e_s=0.1, status="http_503"),
        soak_outcomes.Outcome("abandon", "aborted", 4.0, e2e_s=0.3, ttfa_s=0.2),
        soak_outcomes.Outcome("audio", "lost", 5.0, e2e_s=150.0, status="timeout"),
    ]
    s = soak_outcomes.summarize(outs)
    assert (s["requests"], s["ok"], s["failed"], s["aborted"], s["lost"]) == (5, 2, 1, 1, 1)
    assert s["failed_by_status"] == {"http_503": 1} and s["lost_by_reason"] == {"timeout": 1}
    # ok requests only (2.0 and 1.0; a failed 0.1 or a lost 150 would move both)
    assert s["e2e_p50_s"] == 1.5 and s["e2e_p99_s"] == pytest.approx(1.99)
    assert s["ttfa_p50_s"] == s["ttfa_p99_s"] == 0.5  # ok streamed only
    assert soak_outcomes.summarize([])["e2e_p50_s"] is None


def test_soak_rss_growth_from_the_baseline_minute():
    minutes = [{"minute": i, "rss_mib": {"server": 100.0 + i, "thinker": 200.0, "gone": None}} for i in range(1, 8)]
    g = soak_outcomes.rss_growth(minutes, 5)
    assert g["server"] == {
        "baseline_minute": 5,
        "baseline_mib": 105.0,
        "end_mib": 107.0,
        "growth_pct": round(200 / 105, 2),
    }
    assert g["thinker"]["growth_pct"] == 0.0 and "gone" not in g
    assert soak_outcomes.rss_growth(minutes[:5], 5)["server"]["baseline_minute"] == 1  # shorter run: minute 1
    assert soak_outcomes.rss_growth([], 5) == {}


def test_soak_prompts_churn_and_are_seeded():
    a = soak_requests.PromptSource(random.Random(1), shared=3, prefix_chars=50, fresh=0.5, rotate_every=10)
    b = soak_requests.PromptSource(random.Random(1), shared=3, prefix_chars=50, fresh=0.5, rotate_every=10)
    first_pool = list(a.pool)
    drawn = [a.next() for _ in range(100)]
    assert drawn == [b.next() for _ in range(100)]
    assert a.rotations == 10 and not set(first_pool) & set(a.pool)  # every shared prefix replaced
    shared = [d for d in drawn if d[2]]
    fresh = [d for d in drawn if not d[2]]
    assert 25 < len(shared) < 75 and len({d[0] for d in fresh}) == len(fresh)
    assert all(len(d[0]) == 50 and 16 <= len(d[1]) <= 128 for d in drawn)


def _soak_request(handler, req, limit=5.0):
    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await soak_requests.run_request(client, "http://fake", "tiny", req, limit, 0.0)

    return asyncio.run(go())


def _sse(*events, done=True):
    async def body():
        for e in events:
            yield ("data: " + json.dumps(e) + "\n\n").encode()
            await asyncio.sleep(0)
        if done:
            yield b"data: [DONE]\n\n"

    return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body())


_AUDIO = {"choices": [{"index": 0, "delta": {"audio": {"data": base64.b64encode(b"\0\1" * 8).decode()}}}]}
_TEXT = {"choices": [{"index": 0, "delta": {"content": "hi"}}]}


def test_soak_run_request_ends_each_request_once():
    stream = soak_requests.Request("stream", "sys", "user", 8)
    o = _soak_request(lambda r: _sse(_TEXT, _AUDIO), stream)
    assert (o.outcome, o.status) == ("ok", None) and o.ttfa_s is not None and o.request is None
    body = {}

    def capture(r):
        body.update(json.loads(r.content))
        return _sse(_TEXT, {"error": {"message": "stage 'talker' failed", "code": 500}})

    o = _soak_request(capture, stream)
    assert (o.outcome, o.status) == ("failed", "sse_error") and "talker" in o.detail
    assert o.request["system"] == "sys" and o.request["max_tokens"] == 8  # to replay it alone
    assert body["stream"] is True and body["audio"]["format"] == "pcm16"
    o = _soak_request(lambda r: _sse(_TEXT, done=False), stream)
    assert (o.outcome, o.status) == ("lost", "truncated")
    left = soak_requests.Request("abandon", "sys", "user", 8, abandon_after_chunks=1)
    assert _soak_request(lambda r: _sse(_TEXT, _AUDIO), left).outcome == "aborted"
    audio = soak_requests.Request("audio", "sys", "user", 8)
    wav = base64.b64encode(b"\0" * 100).decode()
    ok = {"choices": [{"message": {"content": "hi", "audio": {"data": wav}}}]}
    assert _soak_request(lambda r: httpx.Response(200, json=ok), audio).outcome == "ok"
    no_audio = {"choices": [{"message": {"content": "hi"}}]}
    assert _soak_request(lambda r: httpx.Response(200, json=no_audio), audio).status == "no_audio"
    text = soak_requests.Request("text", "sys", "user", 8)
    assert _soak_request(lambda r: httpx.Response(200, json=no_audio), text).outcome == "ok"
    o = _soak_request(lambda r: httpx.Response(503, json={"error": {"message": "down"}}), text)
    assert (o.outcome, o.status) == ("failed", "http_503")

    async def hangs(r):
        await asyncio.sleep(30)

    assert _soak_request(hangs, text, limit=0.05).status == "timeout"
    given_up = soak_requests.Request("abandon", "sys", "user", 8, abandon_after_s=0.05)
    assert _soak_request(hangs, given_up).outcome == "aborted"


def test_soak_hit_rates_between_scrapes():
    before = {
        "stages": {
            "thinker": {"prefix_queried_tokens": 100.0, "prefix_hit_tokens": 50.0},
            "decoder": {"queue_depth": 0.0},
        }
    }
    after = {
        "stages": {
            "thinker": {"prefix_queried_tokens": 300.0, "prefix_hit_tokens": 100.0},
            "talker": {"prefix_queried_tokens": 0.0, "prefix_hit_tokens": 0.0},
            "decoder": {"queue_depth": 0.0},
        }
    }
    assert soak_samples.hit_rates(before, after) == {"thinker": 0.25, "talker": None}
    assert soak_samples.hit_rates(None, after) == {"thinker": 0.333, "talker": None}
    assert soak_samples.hit_rates(before, None) == {}


def test_soak_config_shrinks_the_kv_pool_and_stays_valid(tmp_path):
    from omni_cache.config import load_config

    path = soak.soak_config("stage_configs/tiny_omni.yaml", str(tmp_path), kv_blocks=64, request_timeout_s=90.0)
    data = yaml.safe_load(path.read_text())
    assert data["server"]["request_timeout_s"] == 90.0
    for stage in data["stages"]:
        if stage["kind"] == "autoregressive":
            assert stage["engine_args"]["extra"] == {"num_gpu_blocks_override": 64}
            assert stage["engine_args"]["max_model_len"] == 63 * 32  # one block is vLLM's null block
        else:
            assert "engine_args" not in stage
    load_config(path)  # the keys pass validation


# ---- thinker_cache: prompts and statistics (no engine) ------------------------------------------


def test_thinker_cache_multimodal_prompts_share_prefix_and_media():
    from benchmarks.thinker_prompts import make_workloads, spare_prompt
    from benchmarks.thinker_specs import (
        AUDIO_SECONDS,
        IMAGE_SIDE,
        MM_CONTEXT_TOKENS,
        MM_TAIL_TOKENS,
        SHARED_TOKENS,
        UNIQUE_TOKENS,
        model_spec,
    )
    from omni_cache.tiny.qwen3_omni import TOKEN_ID

    wl = make_workloads(0, 0, 3, model_spec("qwen3-omni").workloads)
    assert list(wl) == ["shared_prefix", "shared_image", "shared_audio", "zero_reuse"]
    for name, modality, marks in (
        ("shared_image", "image", ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")),
        ("shared_audio", "audio", ("<|audio_start|>", "<|audio_pad|>", "<|audio_end|>")),
    ):
        prompts = wl[name]
        first = prompts[0]
        shared = first.token_ids[: first.shared]
        # text context, then one placeholder (vLLM expands it), then a shared instruction
        at = MM_CONTEXT_TOKENS
        assert shared[at : at + 3] == [TOKEN_ID[m] for m in marks]
        assert first.shared == MM_CONTEXT_TOKENS + 3 + MM_TAIL_TOKENS
        assert sum(t >= 256 for t in first.token_ids) == 3  # no other special ids
        assert len(prompts) == 4 and all(p.token_ids[: p.shared] == shared for p in prompts)
        # the same media object in every request: the same bytes, so the same vLLM multimodal hash
        assert all(p.media[modality] is first.media[modality] for p in prompts)
        suffixes = {tuple(p.token_ids[p.shared :]) for p in prompts}
        assert len(suffixes) == 4 and all(len(s) == UNIQUE_TOKENS for s in suffixes)
        spare = spare_prompt(prompts, name, 0, 0, 1, 1)
        assert spare.token_ids[: spare.shared] == shared and spare.media is first.media
        assert tuple(spare.token_ids[spare.shared :]) not in suffixes
    image = wl["shared_image"][0].media["image"]
    assert image.size == (IMAGE_SIDE, IMAGE_SIDE) and image.mode == "RGB"
    clip, rate = wl["shared_audio"][0].media["audio"]
    assert rate == 16000 and clip.dtype.name == "float32" and clip.shape == (int(AUDIO_SECONDS * 16000),)
    assert abs(clip).max() <= 1.0
    # seeded: the same round gives the same media, another round other media
    again = make_workloads(0, 0, 3, ("shared_image", "shared_audio"))
    other = make_workloads(0, 1, 3, ("shared_image", "shared_audio"))
    assert again["shared_image"][0].media["image"].tobytes() == image.tobytes()
    assert other["shared_image"][0].media["image"].tobytes() != image.tobytes()
    assert (again["shared_audio"][0].media["audio"][0] == clip).all()
    # text workloads unchanged: 4,000 shared + 100 unique; zero reuse shares nothing
    text = wl["shared_prefix"]
    assert all(p.shared == SHARED_TOKENS and p.media is None for p in text)
    assert all(len(p.token_ids) == SHARED_TOKENS + UNIQUE_TOKENS for p in text + wl["zero_reuse"])
    assert all(p.shared == 0 for p in wl["zero_reuse"])
    assert list(make_workloads(0, 0, 2)) == ["shared_prefix", "zero_reuse"]  # the default run


def test_thinker_cache_engine_prompt_hides_repeated_media_only_without_prefix_caching():
    """Without prefix caching each request's media gets a uuid of its own, so vLLM's encoder cache
    cannot serve a repeated image; with it, vLLM's content hash (and so the prefix hit) stays."""
    from benchmarks.thinker_prompts import Prompt, engine_prompt, make_workloads

    p = make_workloads(0, 0, 1, ("shared_image",))["shared_image"][0]
    apc = engine_prompt(p, "r1", prefix_cache=True)
    assert apc == {"prompt_token_ids": p.token_ids, "multi_modal_data": {"image": p.media["image"]}}
    off1, off2 = engine_prompt(p, "r1", False), engine_prompt(p, "r2", False)
    assert off1["multi_modal_data"]["image"] is p.media["image"]
    assert off1["multi_modal_uuids"] == {"image": ["r1/image"]} and off2["multi_modal_uuids"] == {"image": ["r2/image"]}
    assert engine_prompt(Prompt([1, 2, 3]), "r", False) == {"prompt_token_ids": [1, 2, 3]}


def test_thinker_cache_expected_hit_counts_expanded_media_in_whole_blocks():
    from benchmarks.thinker_prompts import Prompt
    from benchmarks.thinker_requests import RequestResult, expected_hit

    p = Prompt(list(range(1151 + 100)), shared=1151)  # 1,000 + 3 marks + 48 + 100 + ...
    # the image placeholder became 1,024 tokens: 1,023 more than the one id in the prompt
    r = RequestResult(0.1, 0.1, 0.0, 0.1, 0, 2, num_prompt_tokens=len(p.token_ids) + 1023)
    assert expected_hit(p, r, 32) == (1151 + 1023) // 32 * 32 == 2144


def test_thinker_cache_latents_are_the_talkers_inputs(tmp_path):
    from benchmarks.thinker_specs import latent_names, talker_latents

    (tmp_path / "config.json").write_text(json.dumps({"talker_config": {"accept_hidden_layer": 3}}))
    assert latent_names(talker_latents(str(tmp_path))) == ("layer_0_media_3",)
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 512}))
    assert latent_names(talker_latents(str(tmp_path))) == ("hidden",)


def _thinker_cache_round(ttft: dict[tuple[str, str], float], workloads: tuple[str, ...]) -> dict:
    from benchmarks.path_timers import FORWARD
    from benchmarks.thinker_specs import MODES

    modes = {}
    for mode in MODES:
        wls = {}
        for wl in workloads:
            t = ttft[mode, wl]
            wls[wl] = {
                "ttft_s": [t, t],
                "ttft_cpu_s": [t, t],
                "ttft_runqueue_wait_s": [0.0, 0.0],
                "num_cached_tokens": [90, 90] if MODES[mode]["prefix_cache"] and wl != "zero_reuse" else [0, 0],
                "num_prompt_tokens": [100, 100],
                "encoder_runs": (
                    [0, 0] if MODES[mode]["prefix_cache"] or wl in ("shared_prefix", "zero_reuse") else [1, 1]
                ),
                "timers_s": {FORWARD: [t / 2, t / 2], "LLMStage.add": [0.0, 0.0], "LLMStage.step": [t, t]},
            }
        modes[mode] = {"workloads": wls}
    return {"modes": modes}


def test_thinker_cache_summary_has_a_ratio_and_target_per_modality():
    from benchmarks.thinker_specs import model_spec
    from benchmarks.thinker_summary import summarize

    workloads = model_spec("qwen3-omni").workloads
    ttft = {}
    for wl, (off, apc, hid) in {
        "shared_prefix": (1.0, 0.1, 0.1),
        "shared_image": (2.0, 0.2, 0.25),
        "shared_audio": (1.5, 0.3, 0.3),
        "zero_reuse": (1.0, 1.0, 1.0),
    }.items():
        ttft.update({("plain", wl): off, ("latents", wl): off, ("plain_apc", wl): apc, ("latents_cache", wl): hid})
    s = summarize([_thinker_cache_round(ttft, workloads)] * 3, True, 0.97)
    r = s["ratios"]
    assert r["apc_speedup"]["value"] == pytest.approx(10.0)
    assert r["hidden_cache_speedup"]["value"] == pytest.approx(10.0)
    assert r["apc_speedup_image"]["value"] == pytest.approx(10.0)
    assert r["hidden_cache_speedup_image"]["value"] == pytest.approx(8.0)
    assert r["apc_speedup_audio"]["value"] == pytest.approx(5.0)
    t = s["targets"]
    assert t["hidden_cache_speedup >= 0.97 * apc_speedup"]["holds"] is True
    assert t["hidden_cache_speedup_image >= 0.97 * apc_speedup_image"]["holds"] is False
    assert t["hidden_cache_speedup_audio >= 0.97 * apc_speedup_audio"]["holds"] is True
    img = s["modes"]["plain"]["shared_image"]
    assert img["encoder_runs"] == 6 and s["modes"]["plain_apc"]["shared_image"]["encoder_runs"] == 0
    assert s["modes"]["plain_apc"]["shared_image"]["hit_rate"] == pytest.approx(0.9)


def test_thinker_cache_interleaves_modes_evenly():
    from benchmarks.thinker_round import request_order
    from benchmarks.thinker_specs import MODES

    modes = list(MODES)
    orders = [request_order(modes, i) for i in range(2 * len(modes))]
    assert all(sorted(o) == sorted(modes) for o in orders)
    for pos in range(len(modes)):
        # over every run of len(modes) consecutive requests, each mode holds each position once
        assert sorted(o[pos] for o in orders[: len(modes)]) == sorted(modes)
    assert orders[len(modes)] == orders[0] == modes


def test_thinker_cache_paired_ratio_uses_neighbouring_requests():
    from benchmarks.thinker_specs import MODES, model_spec
    from benchmarks.thinker_summary import summarize

    workloads = model_spec("thinker").workloads
    rnd = _thinker_cache_round({(m, wl): 1.0 for m in MODES for wl in workloads}, workloads)
    # Medians 3.0 and 2.5 give 1.2; request by request the ratios are 2.0 and 1.0, median 1.5.
    rnd["modes"]["plain"]["workloads"]["shared_prefix"]["ttft_s"] = [2.0, 4.0]
    rnd["modes"]["plain_apc"]["workloads"]["shared_prefix"]["ttft_s"] = [1.0, 4.0]
    s = summarize([rnd], False)
    r = s["ratios"]["apc_speedup"]
    assert r["value"] == pytest.approx(3.0 / 2.5)
    assert r["paired_medians"] == pytest.approx((2.0 + 1.0) / 2)


def test_thinker_cache_retries_a_contended_request_within_the_budget():
    from benchmarks.thinker_requests import RequestResult
    from benchmarks.thinker_round import measure_with_retries

    def result(wait_fraction: float) -> RequestResult:
        return RequestResult(
            ttft_s=1.0, ttft_cpu_s=1.0, ttft_wait_s=wait_fraction, total_s=1.0, num_cached_tokens=0, generated=1
        )

    waits = {0: 0.9, 1: 0.5, 2: 0.1, 3: 0.0}
    budget = {"retry_s": 100.0}
    tries = measure_with_retries(lambda k: result(waits[k]), 3, budget)
    assert [t.ttft_wait_s for t in tries] == [0.9, 0.5, 0.1]  # stops at the first quiet attempt
    assert budget["retry_s"] < 100.0
    assert len(measure_with_retries(lambda k: result(0.9), 2, {"retry_s": 100.0})) == 3
    assert len(measure_with_retries(lambda k: result(0.9), 2, {"retry_s": 0.0})) == 1


# ---- rounds, paired ratios, the zero-reuse targets ------------------------------------------------


def _round_runs(side_ttfa: dict[str, list[float]], durations: dict[str, list[float]]) -> list[dict]:
    runs = []
    for side, ttfas in side_ttfa.items():
        for r, (ttfa, dur) in enumerate(zip(ttfas, durations[side])):
            counters = {
                "thinker": {"queried": 4100.0, "hit": 0.0, "latent_rows": 0.0, "restarts": 0.0, "fresh": 1.0},
                "talker": {"queried": 500.0, "hit": 0.0, "latent_rows": 0.0, "restarts": 0.0, "fresh": 1.0},
            }
            runs.append(
                {
                    "side": side,
                    "round": r,
                    "samples": _samples(side, 4, ttfa, 1.0),
                    "duration_s": dur,
                    "counters": counters,
                    "resources": {
                        "stage_cpu_s": 8.0,
                        "loadavg_mean": 2.0,
                        "cpu_s_by_process": {"server": 1.0, "thinker": 5.0},
                    },
                }
            )
    return runs


def test_paired_ratios_follow_rounds_not_the_drift_between_them():
    # The machine gets twice as slow from round 0 to round 1: pooled medians mix the rounds, the
    # per-round ratios do not. Each round the off side is 10% slower.
    runs = _round_runs(
        {"on": [1.0, 2.0, 1.0, 2.0], "off": [1.1, 2.2, 1.1, 2.2]},
        {"on": [4.0, 8.0, 4.0, 8.0], "off": [4.4, 8.8, 4.4, 8.8]},
    )
    config = {"workload": "zero-reuse", "sizes": {"num_requests": 4}, "concurrency": 1, "rate": None}
    result = assemble(config, {"cpu_model": "Test CPU", "nproc": 2}, runs, None)
    assert len(result["ratios_per_round"]) == 4
    paired = result["paired_ratios"]
    assert paired["rounds"] == 4
    assert paired["speedup"]["ttfa_s"]["p50"] == pytest.approx(1.1)
    assert paired["throughput_change"]["requests_per_s"] == pytest.approx(0.1)  # on: 4 s a round, off 4.4
    targets = {t["name"]: t for t in result["targets"]}
    assert not targets["zero-reuse: time to first audio p50, off / on"]["met"]  # 10% apart
    assert targets["zero-reuse: highest prefix-cache hit rate of any stage, either side"]["met"]
    # Per-process CPU is pooled per process.
    assert result["sides"]["on"]["resources"]["cpu_s_by_process"] == {"server": 4.0, "thinker": 20.0}
    assert result["paired_intervals"]["speedup"]["ttfa_s"] == pytest.approx([1.1, 1.1])
    table = report.format_table(result)
    assert "paired" in table and "95%, rounds" in table and "CPU s / request, thinker" in table


def test_paired_ratios_average_rounds_geometrically():
    """Two rounds where one side is twice as fast, then the other: the geometric mean says 1, as a
    ratio's mean should; the median of an even count is the middle two's arithmetic mean."""

    def rnd(x: float) -> dict:
        return {"speedup": {"ttfa_s": {"p50": x}}, "throughput_change": {"requests_per_s": x - 1}}

    per_round = [rnd(2.0), rnd(0.5)]
    geo = report.paired_ratios(per_round)
    assert geo["speedup"]["ttfa_s"]["p50"] == pytest.approx(1.0)
    assert geo["throughput_change"]["requests_per_s"] == pytest.approx(0.0)
    assert report.paired_ratios(per_round, "median")["speedup"]["ttfa_s"]["p50"] == pytest.approx(1.25)
    assert report.paired_ratios([]) == {}


def test_paired_interval_says_how_far_the_rounds_luck_moves_the_paired_figure():
    def rnd(x: float) -> dict:
        lat = {key: {"p50": x} for key in report.LATENCIES}
        return {"speedup": lat, "throughput_change": {"requests_per_s": x - 1}}

    # Every round 10% apart: no luck to move it, the interval is the figure.
    steady = report.paired_interval([rnd(1.1)] * 6)
    assert steady["speedup"]["ttft_s"] == pytest.approx([1.1, 1.1])
    assert steady["throughput_change"]["requests_per_s"] == pytest.approx([0.1, 0.1])
    # Rounds that lean both ways by 2x: the interval holds 1 and is wide, the t-interval on the
    # log ratios (mean 0, sd log 2 * sqrt(8 / 7), t 2.365 at 7 degrees of freedom).
    swinging = [rnd(2.0), rnd(0.5)] * 4
    out = report.paired_interval(swinging)
    low, high = out["speedup"]["ttfa_s"]
    half = 2.3646 * math.log(2.0) * math.sqrt(8 / 7) / math.sqrt(8)
    assert [low, high] == pytest.approx([math.exp(-half), math.exp(half)], rel=1e-4)
    assert low < 0.8 < 1.0 < 1.25 < high and out["method"] == "t-interval on the per-round log ratios"
    # A round without the figure (no first text timed): no interval for it, the others stand.
    gap = [rnd(1.0)] * 4
    gap[1] = {**gap[1], "speedup": {**gap[1]["speedup"], "ttft_s": {"p50": math.nan}}}
    out = report.paired_interval(gap)
    assert out["speedup"]["ttft_s"] is None and out["speedup"]["e2e_s"] == pytest.approx([1.0, 1.0])
    assert report.paired_interval([rnd(1.0)] * 2) == {}  # too few rounds for an interval


def test_zero_reuse_target_fails_on_any_hit():
    runs = _round_runs({"on": [1.0], "off": [1.0]}, {"on": [4.0], "off": [4.0]})
    runs[0]["counters"]["talker"]["hit"] = 32.0
    config = {"workload": "zero-reuse", "sizes": {"num_requests": 4}, "concurrency": 1, "rate": None}
    result = assemble(config, {"cpu_model": "Test CPU", "nproc": 2}, runs, None)
    hits = [t for t in result["targets"] if "hit rate" in t["name"]]
    assert hits[0]["met"] is False and hits[0]["value"] == pytest.approx(32 / 500)
    assert all(t["met"] for t in result["targets"] if "hit rate" not in t["name"])


def test_rounds_split_requests_evenly_and_alternate_the_sides():
    from benchmarks.harness import side_order
    from benchmarks.workloads import split_rounds

    _, sessions = build_workload("zero-reuse", Sizes(num_requests=16, shared_tokens=600), 0)
    groups = split_rounds(sessions, 4)
    assert [len(g) for g in groups] == [4, 4, 4, 4]
    assert [s.index for g in groups for s in g] == list(range(16))  # nothing dropped or repeated
    _, convs = build_workload("multi-turn", Sizes(num_requests=12, turns=3, shared_tokens=600), 0)
    assert [sum(s.turns for s in g) for g in split_rounds(convs, 4)] == [3, 3, 3, 3]
    with pytest.raises(ValueError):
        split_rounds(sessions[:2], 3)
    assert [side_order(["on", "off"], r) for r in range(3)] == [["on", "off"], ["off", "on"], ["on", "off"]]


def test_pipelines_restart_in_blocks_of_rounds_the_start_order_alternating():
    from benchmarks.harness import restart_blocks, start_order

    assert restart_blocks(8, 0) == [range(0, 8)]  # never: one start serves every round
    assert restart_blocks(8, 2) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert restart_blocks(7, 3) == [range(0, 3), range(3, 6), range(6, 7)]  # every round served once
    assert restart_blocks(2, 4) == [range(0, 2)]
    with pytest.raises(ValueError):
        restart_blocks(8, -1)
    assert [start_order(["off", "off2"], b) for b in range(3)] == [["off", "off2"], ["off2", "off"], ["off", "off2"]]


def test_each_side_runs_second_after_the_other_sides_two_runs_equally_often():
    from benchmarks.harness import block_round_order, restart_blocks

    def cold_turns(every: int, order_of) -> list[str]:
        """Runs that follow the other side's two runs within one start (the longest idle)."""
        out = []
        for b, block in enumerate(restart_blocks(8, every)):
            turns = [side for r in block for side in order_of(b, r, r - block.start)]
            out += [turns[i] for i in range(2, len(turns)) if turns[i - 1] == turns[i - 2] != turns[i]]
        return out

    for every in (2, 4):
        cold = cold_turns(every, lambda b, r, k: block_round_order(["on", "off"], b, k))
        assert cold.count("on") == cold.count("off") > 0, (every, cold)
    # Counted from the round number, "on" went second in every block's second round.
    assert cold_turns(2, lambda b, r, k: block_round_order(["on", "off"], 0, r)) == ["on"] * 4


def test_monitor_counts_cpu_per_named_process():
    import time as _time

    from benchmarks.harness import Monitor

    with Monitor(interval_s=0.05) as mon:
        mon.begin({"me": os.getpid()})
        t = _time.process_time()
        while _time.process_time() - t < 0.2:
            pass
        # First touches of fresh anonymous pages: minor faults the count must see (a count of
        # 0 here, or a wrong /proc field, fails; ">= 0" alone could not).
        pages = mmap.mmap(-1, 8 << 20)
        for i in range(0, len(pages), mmap.PAGESIZE):
            pages[i] = 1
        res = mon.end()
        pages.close()
    assert res["cpu_s_by_process"]["me"] >= 0.15
    assert 0 <= res["system_cpu_s_by_process"]["me"] <= res["cpu_s_by_process"]["me"]
    assert res["minor_faults_by_process"]["me"] > 0 and res["major_faults_by_process"]["me"] >= 0
    assert res["rss_mib_by_process"]["me"] > 10
    assert res["stage_cpu_s"] == res["cpu_s_by_process"]["me"]  # not the server: a stage


# ---- the first-audio breakdown and profiles ----------------------------------------------------------


def _timeline(t0: float) -> dict:
    return {
        "server": {"received": t0 + 0.002, "submitted": t0 + 0.005, "text_in": t0 + 0.110, "audio_in": t0 + 0.300},
        "thinker": {
            "input": t0 + 0.006,
            "scheduled": t0 + 0.008,
            "first_token": t0 + 0.100,
            "out0": t0 + 0.101,
            "out1": t0 + 0.120,
            "out2": t0 + 0.140,
        },
        "talker": {
            "input": t0 + 0.103,
            "input0": t0 + 0.103,
            "input1": t0 + 0.121,
            "input2": t0 + 0.141,
            "job": t0 + 0.125,
            "scheduled": t0 + 0.127,
            "first_token": t0 + 0.180,
            "codes_out": t0 + 0.200,
        },
        "decoder": {
            "codes_in": t0 + 0.202,
            "window_start": t0 + 0.203,
            "window_end": t0 + 0.290,
            "audio_out": t0 + 0.295,
        },
    }


def test_breakdown_segments_add_up_to_ttfa_and_ttft():
    from benchmarks.breakdown import TEXT_SEGMENTS, request_segments, summarize_breakdown

    t0 = 1000.0
    sample = {"ok": True, "sent_at": t0, "ttfa_s": 0.305, "ttft_s": 0.112, "response_id": "chatcmpl-abc"}
    seg = request_segments(sample, _timeline(t0))
    assert sum(seg.values()) == pytest.approx(0.305)
    # The talker's job came of the last thinker output it took up before it (out1, not out2).
    assert seg["thinker: first steps"] == pytest.approx(0.020)
    assert seg["-> talker"] == pytest.approx(0.001)
    assert seg["talker: hand-off"] == pytest.approx(0.004)
    # Output 1 sent while the talker was still on output 0, whose hand-off made the job: the
    # thinker's part ends at output 0, the rest is the talker's.
    busy = _timeline(t0)
    busy["talker"].update(input1=t0 + 0.126, input2=t0 + 0.142)
    seg = request_segments(sample, busy)
    assert sum(seg.values()) == pytest.approx(0.305)
    assert seg["thinker: first steps"] == pytest.approx(0.001)
    assert seg["-> talker"] == pytest.approx(0.002)
    assert seg["talker: hand-off"] == pytest.approx(0.022)
    # Without the talker's input marks the split is not known: the request is left out.
    unmarked = _timeline(t0)
    for k in ("input0", "input1", "input2"):
        del unmarked["talker"][k]
    assert request_segments(sample, unmarked) is None
    assert seg["decoder: first window"] == pytest.approx(0.087)
    text = request_segments(sample, _timeline(t0), TEXT_SEGMENTS)
    assert sum(text.values()) == pytest.approx(0.112)
    missing = _timeline(t0)
    del missing["decoder"]["window_start"]
    assert request_segments(sample, missing) is None
    summary = summarize_breakdown([sample, {**sample, "ok": False}], {"abc": _timeline(t0)})
    assert summary["audio"]["requests"] == 1 and summary["text"]["requests"] == 1
    assert summary["audio"]["segments"]["thinker: prefill"]["p50"] == pytest.approx(0.092)
    assert summary["audio"]["server_share"]["p50"] == pytest.approx(0.003 + 0.005)


def test_timeline_records_first_occurrences_per_process(tmp_path, monkeypatch):
    from omni_cache import timeline

    monkeypatch.delenv(timeline.TIMELINE_DIR_ENV, raising=False)
    off = timeline.Timeline("thinker")
    off.mark("r1", "input")
    assert not off.on and list(tmp_path.iterdir()) == []
    monkeypatch.setenv(timeline.TIMELINE_DIR_ENV, str(tmp_path))
    tl = timeline.Timeline("thinker")
    tl.mark("r1", "input", 5.0)
    tl.mark("r1", "input", 6.0)  # not the first: dropped
    tl.mark("r2", "input")
    tl.close()
    other = timeline.Timeline("talker", str(tmp_path))
    other.mark("r1", "job", 7.0)
    other.close()
    got = timeline.read(str(tmp_path))
    assert got["r1"] == {"thinker": {"input": 5.0}, "talker": {"job": 7.0}}
    assert set(got["r2"]["thinker"]) == {"input"}


def test_profile_summary_attributes_parts(tmp_path):
    from benchmarks import profiles

    raw = (
        'process 1:"python";thread (0x1);run (workers/stage_process.py:10);'
        "step (/x/site-packages/vllm/v1/engine/llm_engine.py:5);"
        "GPUModelRunner._model_forward (/x/site-packages/vllm/v1/worker/gpu_model_runner.py:9);"
        "matmul (torch.py:1) 30\n"
        'process 1:"python";thread (0x1);run (workers/stage_process.py:10);'
        "step (/x/site-packages/vllm/v1/engine/llm_engine.py:5);"
        "Scheduler.schedule (/x/site-packages/vllm/v1/core/sched/scheduler.py:3) 10\n"
        "garbage line\n"
    )
    (tmp_path / "on-r0-thinker.txt").write_text(raw)
    (tmp_path / "on-r1-thinker.txt").write_text(raw)
    summary = profiles.summarize_dir(tmp_path, rate=100)
    thinker = summary["on"]["thinker"]
    assert thinker["samples"] == 80 and thinker["cpu_s"] == pytest.approx(0.8)
    assert thinker["parts"]["model forward"] == pytest.approx(0.75)
    assert thinker["parts"]["scheduler"] == pytest.approx(0.25)
    assert thinker["top_self"][0] == ["matmul (torch.py)", 0.75]


def test_an_a_a_run_compares_two_pipelines_of_one_setting():
    from benchmarks.harness import cache_of, compared_sides

    assert [cache_of(s) for s in ("on", "on2", "off", "off2")] == [True, True, False, False]
    assert compared_sides(["on", "off"]) == ("on", "off") and compared_sides(["off", "on"]) == ("on", "off")
    assert compared_sides(["off", "off2"]) == ("off", "off2") and compared_sides(["on"]) is None
    runs = _round_runs({"off": [1.0, 2.0], "off2": [1.05, 2.1]}, {"off": [4.0, 8.0], "off2": [4.0, 8.0]})
    config = {"workload": "zero-reuse", "sizes": {"num_requests": 4}, "concurrency": 1, "rate": None}
    result = assemble(config, {"cpu_model": "Test CPU", "nproc": 2}, runs, None)
    assert result["compared"] == {"first": "off", "second": "off2"}
    assert result["paired_ratios"]["speedup"]["ttfa_s"]["p50"] == pytest.approx(1.05)
    assert "off2/off" in report.format_table(result)


def test_soak_pause_schedule_takes_the_stages_in_turn_while_the_run_lasts():
    assert soak.pause_schedule(30, 300, ["thinker", "talker", "decoder"]) == [
        (300, "thinker"),
        (600, "talker"),
        (900, "decoder"),
        (1200, "thinker"),
        (1500, "talker"),
    ]
    assert soak.pause_schedule(31, 300, ["decoder"])[-1] == (1800, "decoder")
    assert soak.pause_schedule(4, 300, ["thinker"]) == []
    assert soak.pause_schedule(30, 300, []) == []


def test_the_listening_summary_pools_the_bystanders_turns_per_side():
    from benchmarks.realtime_listening import summary_table

    def cell(side: str, sessions: int, rnd: int, by_ms: list[float]) -> dict:
        row = {"first_audio_s": 0.1, "first_text_s": 0.05, "cached_tokens": 1, "input_tokens": 2}
        return {
            "seconds": 30.0,
            "sessions": sessions,
            "side": side,
            "round": rnd,
            "rows": [row] * sessions,
            "load_average": (0.5, 0.5, 0.5),
            "cached_share": 0.5,
            "bystander": [{"first_audio_s": ms / 1000} for ms in by_ms],
        }

    cells = [cell("on", 8, 0, [10, 20]), cell("off", 8, 0, [50]), cell("on", 8, 1, [30]), cell("off", 8, 1, [60])]
    table = summary_table({"cells": cells}).split("\n")
    at = table.index("| speakers | bystander n | bystander first audio on | bystander first audio off |")
    assert table[at + 2] == "| 8 x 30 s | 3 | 20 / 28 | 55 / 59 |"  # both rounds pooled per side
