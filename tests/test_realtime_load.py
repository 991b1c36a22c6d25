"""benchmarks/realtime_load.py's pure parts: the audio each session streams, its append events,
and the summaries and table of a run (the run itself needs a whole server: python -m
benchmarks.realtime_load)."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest

from benchmarks.realtime_load import appends_between, cpu_per_session_second, format_table, percentiles, summarize_turns
from benchmarks.realtime_load_clients import CHUNK, append_texts, session_audio
from benchmarks.speech_clips import RATE, pcm16


def speech_span(samples: np.ndarray) -> tuple[float, float]:
    loud = np.flatnonzero(np.abs(samples) > 1e-4)
    return loud[0] / RATE, loud[-1] / RATE


def test_each_session_speaks_once_per_period_at_its_own_time():
    spans = [speech_span(session_audio(i, 8, period_s=10.0, speech_s=1.5)) for i in range(8)]
    starts = [s for s, _ in spans]
    assert starts == sorted(starts) and len(set(starts)) == 8  # spread over the period
    for start, end in spans:
        assert 0.4 <= start and end <= 10.0 - 0.5  # silence before and after (VAD can stop)
        assert 1.3 <= end - start <= 1.55
    a, b = session_audio(0, 8, 10.0, 1.5), session_audio(1, 8, 10.0, 1.5)
    assert len(a) == 10 * RATE and not np.array_equal(np.roll(a, 1000), b)  # own clips, not shifted copies


def test_appends_are_40ms_events_that_rebuild_the_audio():
    samples = session_audio(3, 4, period_s=2.0, speech_s=1.0)
    texts = append_texts(samples)
    events = [json.loads(t) for t in texts]
    assert {e["type"] for e in events} == {"input_audio_buffer.append"}
    chunks = [base64.b64decode(e["audio"]) for e in events]
    assert {len(c) for c in chunks} == {CHUNK * 2} and CHUNK * 1000 // RATE == 40
    assert b"".join(chunks) == pcm16(samples)[: len(chunks) * CHUNK * 2]


def test_percentiles_are_numpys_linear():
    values = [float(v) for v in range(1, 101)]
    p = percentiles(values[::-1])
    assert (p["n"], p["max"]) == (100, 100.0)
    assert (p["p50"], p["p90"], p["p99"]) == pytest.approx((50.5, 90.1, 99.01))
    assert percentiles([]) == {"n": 0, "p50": None, "p90": None, "p99": None, "max": None}
    assert percentiles([7.0])["p99"] == 7.0


def test_cpu_per_session_second_takes_off_the_idle_server():
    cpu = cpu_per_session_second(cpu_s=6.0, seconds=30.0, audio_s=480.0, idle_cores=0.05)
    assert cpu["cores"] == pytest.approx(0.2)
    assert cpu["ms_raw"] == pytest.approx(12.5)
    assert cpu["ms_above_idle"] == pytest.approx(1000 * (6.0 - 1.5) / 480)
    assert cpu_per_session_second(1.0, 30.0, 480.0, idle_cores=0.1)["ms_above_idle"] == 0.0


def test_appends_are_counted_inside_the_window_only():
    sessions = [{100: 25, 101: 25, 102: 25, 103: 25}, {101: 20, 102: 10}]
    assert appends_between(sessions, 101.0, 103.0) == 25 + 25 + 20 + 10
    # A second cut by an end counts in proportion: half of 100, all of 101, a quarter of 102.
    assert appends_between(sessions, 100.5, 102.25) == pytest.approx(12.5 + 45 + 0.25 * 35)
    assert appends_between(sessions, 200.0, 210.0) == 0


def test_turns_without_audio_are_counted_apart():
    sessions = [
        {"turns": [{"first_audio_s": 0.4}, {"first_audio_s": None, "status": "cancelled"}]},
        {"turns": [{"first_audio_s": 0.6}]},
    ]
    out = summarize_turns(sessions)
    assert (out["turns"], out["answered"], out["without_audio"]) == (3, 2, 1)
    assert out["first_audio_s"]["p50"] == pytest.approx(0.5) and out["first_audio_s"]["max"] == 0.6


def test_table_has_a_row_per_phase_and_ttft_against_idle():
    def phase(name, sessions, ttft_p99, cpu=None, turns=None):
        return {
            "name": name,
            "sessions": sessions,
            "health": {"p50": 0.002, "p99": 0.01},
            "ttft": {"p50": 0.03, "p99": ttft_p99},
            "cpu": cpu or {"cores": 0.05},
            "turns": turns,
        }

    result = {
        "phases": [
            phase("idle", 0, 0.05),
            phase("listening x16", 16, 0.06, {"cores": 0.1, "ms_raw": 6.2, "ms_above_idle": 3.1}),
            phase(
                "turns x1",
                1,
                0.07,
                {"cores": 0.3, "ms_raw": 300.0, "ms_above_idle": 250.0},
                {"first_audio_s": {"p50": 0.35, "p90": 0.5}},
            ),
        ]
    }
    lines = format_table(result).splitlines()
    assert len(lines) == 2 + 3
    assert "| listening x16 | 16 | 2 / 10 | 30 / 60 (1.20x) | 0.10 | 6.2 (3.1) | - / - | - |" == lines[3]
    assert lines[4].endswith("| 350 / 500 | - |") and "| idle | 0 |" in lines[2]
