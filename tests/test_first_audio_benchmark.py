"""The first-audio benchmark without engines: the listener's stalls, the sweep's plan, the
summary, capacity and verdicts, the pacing switch on a config copy, and the table and plot."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml

from benchmarks import first_audio, first_audio_results
from benchmarks.client import SAMPLE_RATE
from benchmarks.listener import listen, play

ROOT = Path(__file__).resolve().parents[1]


# ---- the listener -------------------------------------------------------------------------------


def test_audio_that_keeps_ahead_never_stalls():
    # 0.5 s chunks every 0.4 s: the player (starting 0.2 s after the first) never runs out.
    p = play([1.0 + 0.4 * k for k in range(10)], [0.5] * 10, jitter_s=0.2)
    assert (p.ttfa_s, p.audio_s, p.stalls, p.stall_s) == (1.0, 5.0, 0, 0.0)
    assert p.min_buffer_s == pytest.approx(0.3)


def test_a_late_chunk_is_one_stall_of_its_lateness():
    # 0.08 s of audio at 1.0, played from 1.2 to 1.28; the next arrives at 1.5: 0.22 s stalled.
    # It plays 1.5-1.66; the last arrives at 1.6, in time.
    p = play([1.0, 1.5, 1.6], [0.08, 0.16, 0.32], jitter_s=0.2)
    assert p.stalls == 1 and p.stall_s == pytest.approx(0.22)
    assert p.min_buffer_s == pytest.approx(-0.22)


def test_a_bigger_jitter_buffer_absorbs_the_same_lateness():
    assert play([1.0, 1.5], [0.08, 0.16], jitter_s=0.5).stalls == 0


def test_no_audio_no_first_audio():
    assert play([], []).ttfa_s is None and play([0.3], [0.0]).stalls == 0


def test_a_sample_is_played_from_its_chunk_sizes():
    second = 2 * SAMPLE_RATE  # bytes of one second of 16-bit PCM
    p = listen({"audio_times": [0.1, 2.0], "audio_sizes": [second, second]}, jitter_s=0.2)
    assert p.audio_s == 2.0 and p.stalls == 1 and p.stall_s == pytest.approx(0.7)


# ---- plan, switch -------------------------------------------------------------------------------


def test_points_of_a_round_get_distinct_prompts_and_the_same_shared_prefix():
    args = first_audio.parse_args(
        ["--concurrency", "1,4", "--arrivals", "closed,poisson", "--shared-tokens", "300", "--unique-tokens", "20"]
    )
    warmup, points = first_audio.plan("shared-prefix", args, round_index=0)
    assert {k: len(v) for k, v in points.items()} == {
        ("closed", 1): 8,
        ("closed", 4): 12,
        ("poisson", 1): 8,
        ("poisson", 4): 12,
    }
    sessions = [s for v in points.values() for s in v]
    assert len({s.users[0] for s in sessions}) == len(sessions)
    assert {s.system for s in sessions} == {warmup[0].system}
    _, again = first_audio.plan("shared-prefix", args, round_index=0)
    assert [s.users for s in again[("closed", 4)]] == [s.users for s in points[("closed", 4)]]
    _, other = first_audio.plan("shared-prefix", args, round_index=1)
    assert other[("closed", 1)][0].users != points[("closed", 1)][0].users


@pytest.mark.parametrize(
    "side,enabled,caps", [("on", True, [None] * 3), ("off", False, [None] * 3), ("capped", True, [3.0, 3.0, 2.0])]
)
def test_side_config_switches_every_pacing_block(tmp_path, side, enabled, caps):
    from omni_cache.config import load_config

    path = first_audio.side_config(ROOT / "stage_configs" / "qwen3_omni.yaml", side, tmp_path, max_lead_s=2.0)
    config = load_config(path)
    assert [s.pacing.enabled for s in config.stages] == [enabled] * 3
    # capped: 2 s, or the stage's lead_s where that is more (thinker and talker: 3 s)
    assert [s.pacing.max_lead_s for s in config.stages] == caps


def test_side_config_refuses_a_pipeline_without_pacing(tmp_path):
    with pytest.raises(ValueError, match="no stage has a pacing block"):
        first_audio.side_config(ROOT / "stage_configs" / "tiny_omni.yaml", "on", tmp_path)


# ---- summary, capacity, verdicts ----------------------------------------------------------------


def sample(ttfa: float, stall_at: float | None = None) -> dict:
    """An ok answer: 1 s chunks every 0.5 s from ``ttfa``; one chunk 2 s late at ``stall_at``."""
    times = [ttfa + 0.5 * k for k in range(6)]
    if stall_at is not None:
        times = [t if t < stall_at else t + 2.0 for t in times]
    return {"ok": True, "audio_times": times, "audio_sizes": [2 * SAMPLE_RATE] * 6}


def point(
    side: str,
    level: int,
    ttfas: list[float],
    stalls: int = 0,
    duration: float = 10.0,
    workload: str = "shared-prefix",
    arrival: str = "closed",
) -> dict:
    samples = [sample(t, stall_at=t + 1.0 if i < stalls else None) for i, t in enumerate(ttfas)]
    return {
        "side": side,
        "round": 0,
        "workload": workload,
        "arrival": arrival,
        "level": level,
        "rate": None,
        "duration_s": duration,
        "samples": samples,
        "counters": {"talker": {"paced": level - 1, "fresh": 1.0}},
        "resources": None,
    }


def points_for(side: str, ttfa8: float, stalls_at: dict[int, int], duration: float) -> list[dict]:
    return [
        point(
            side,
            c,
            [0.1] * 4 if c == 1 else [ttfa8] * 4 if c == 8 else [0.2] * 4,
            stalls=stalls_at.get(c, 0),
            duration=duration,
        )
        for c in (1, 2, 4, 8, 16)
    ]


def test_summary_pools_rounds_and_counts_stalls():
    pts = [point("on", 8, [0.1, 0.2], stalls=1), {**point("on", 8, [0.3]), "round": 1}]
    [row] = first_audio_results.summarize(pts, jitter_s=0.2)
    assert (row["requests"], row["ok"], row["rounds"]) == (3, 3, 2)
    assert row["ttfa_s"]["p50"] == pytest.approx(0.2)
    assert (row["stalls"], row["answers_stalled"]) == (1, 1)
    assert row["requests_per_s"] == pytest.approx(3 / 20)
    assert row["audio_s_per_s"] == pytest.approx(18 / 20)
    assert row["counters"]["talker"] == {"paced": 14}


def test_capacity_is_the_level_before_the_first_stall():
    rows = first_audio_results.summarize(points_for("on", 0.12, {8: 1}, 10.0), jitter_s=0.2)
    assert first_audio_results.capacity(rows, "on", "shared-prefix", "closed") == 4
    rows = first_audio_results.summarize(points_for("on", 0.12, {1: 1}, 10.0), jitter_s=0.2)
    assert first_audio_results.capacity(rows, "on", "shared-prefix", "closed") == 0


def test_verdicts_compare_pacing_on_with_off():
    rows = first_audio_results.summarize(
        points_for("on", 0.14, {16: 1}, 10.0) + points_for("off", 0.9, {8: 2}, 11.0), jitter_s=0.2
    )
    got = {t["name"]: t for t in first_audio_results.verdicts(rows)}
    ttfa = got["TTFA p90 at 8 / at 1 (pacing on), 0 stalls at 8"]
    assert ttfa["value"] == pytest.approx(1.4) and ttfa["met"]
    cap = got["capacity (closed): highest level with 0 stalls"]
    assert (cap["value"], cap["baseline"], cap["met"]) == (8, 4, True)
    tput = got["throughput (closed, requests_per_s, whole sweep)"]
    assert tput["met"] and tput["change"] == pytest.approx(0.1)


def test_verdict_fails_when_first_audio_degrades_or_stalls():
    rows = first_audio_results.summarize(points_for("on", 0.5, {}, 10.0), jitter_s=0.2)
    [ttfa] = first_audio_results.verdicts(rows)
    assert ttfa["value"] == pytest.approx(5.0) and not ttfa["met"]
    rows = first_audio_results.summarize(points_for("on", 0.12, {8: 1}, 10.0), jitter_s=0.2)
    assert not first_audio_results.verdicts(rows)[0]["met"]


def test_table_json_and_plot(tmp_path):
    from benchmarks.report import write_json

    args = first_audio.parse_args(["--workloads", "shared-prefix"])
    pts = points_for("on", 0.14, {}, 10.0) + points_for("off", 0.9, {8: 2}, 11.0)
    pts.append(point("on", 4, [0.3] * 4, arrival="poisson"))
    result = first_audio_results.assemble(
        pts, first_audio.run_config(args, {"shared-prefix": 0.3}), "test", {"cpu_model": "test cpu"}
    )
    table = first_audio_results.format_table(result)
    assert "pacing on" in table and "capacity" in table and "MET" in table
    write_json(tmp_path / "r.json", result)
    assert yaml.safe_load((tmp_path / "r.json").read_text())["capacity"]["on/shared-prefix/closed"] == 16
    first_audio_results.plot(tmp_path / "r.png", result)
    assert (tmp_path / "r.png").stat().st_size > 10_000
    assert not math.isnan(result["rows"][0]["requests_per_s"])


def test_profiles_pool_per_side_and_point_and_not_with_url(tmp_path):
    from benchmarks import profiles

    for r in (0, 1):  # two rounds of one point: one summary
        tag = first_audio.profile_tag("on", "shared-prefix", "closed", 8, r)
        (tmp_path / f"{tag}-thinker.txt").write_text("main (w.py:1);step (w.py:2) 50\n")
    summary = profiles.summarize_dir(tmp_path, rate=100)
    assert list(summary) == ["on_shared_prefix_closed8"]
    assert summary["on_shared_prefix_closed8"]["thinker"]["cpu_s"] == pytest.approx(1.0)
    with pytest.raises(SystemExit):
        first_audio.parse_args(["--url", "http://127.0.0.1:1", "--profile", str(tmp_path)])


def test_url_sweeps_a_running_server(tmp_path):
    """--url: the same sweep against a server this run did not start (here the fake pipeline
    behind a real HTTP server with an API key): one side, every answer heard."""
    import json

    from fake_pipeline import API_KEY, fake_server

    out = tmp_path / "r.json"
    with fake_server("faurl") as srv:
        rc = first_audio.main(
            [
                "--url",
                srv.url,
                "--api-key",
                API_KEY,
                "--workloads",
                "shared-prefix",
                "--concurrency",
                "1,2",
                "--arrivals",
                "closed",
                "--min-requests",
                "2",
                "--requests-per-stream",
                "1",
                "--shared-tokens",
                "60",
                "--unique-tokens",
                "20",
                "--max-tokens",
                "8",
                "--json",
                str(out),
            ]
        )
    assert rc == 0
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert [(r["side"], r["level"]) for r in rows] == [("server", 1), ("server", 2)]
    assert all(r["ok"] == r["requests"] == 2 for r in rows)
    assert all(r["ttfa_s"]["n"] == 2 and r["audio_s"] > 0 for r in rows)
    assert result["config"]["url"] == srv.url and result["config"]["stage_config"] is None
