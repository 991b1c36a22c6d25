"""Benchmark results in git are summaries: benchmarks/summarize.py folds a raw run into one, and no
raw per-request file is tracked (issue 44: every clone paid for every experiment's samples)."""

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

from benchmarks import summarize as sm

ROOT = Path(__file__).resolve().parent.parent

#: The largest JSON file the repository may track.
MAX_TRACKED_JSON = 100_000


def test_a_numeric_series_becomes_its_statistics():
    values = [0.5, 0.1, 0.3, 0.2, 0.4, 1.0]
    folded = sm.summarize({"ttft_s": values})["ttft_s"]
    assert folded["n"] == 6 and folded["min"] == 0.1 and folded["max"] == 1.0
    assert folded["p50"] == pytest.approx(float(np.percentile(values, 50)), rel=1e-3)
    assert folded["p90"] == pytest.approx(float(np.percentile(values, 90)), rel=1e-3)


def test_short_lists_and_per_round_records_are_kept():
    doc = {"rounds": [{"ratio": 1.02}, {"ratio": 0.97}], "levels": [1, 4], "cmd": "x"}
    assert sm.summarize(doc) == doc


def test_samples_become_per_field_statistics_whatever_their_length():
    samples = [{"ttft_s": 0.1 * i, "ok": True, "id": f"r{i}"} for i in range(1, 4)]
    folded = sm.summarize({"samples": samples})["samples"]
    assert folded["records"] == 3
    assert set(folded) == {"records", "ttft_s"}  # bools and strings are not series
    assert folded["ttft_s"]["max"] == pytest.approx(0.3)


def test_nested_attempts_are_flattened_before_folding():
    attempts = [[{"ttft_s": 1.0}, {"ttft_s": 2.0}], [{"ttft_s": 3.0}]]
    assert sm.summarize({"attempts": attempts})["attempts"]["ttft_s"]["n"] == 3


def test_long_text_becomes_its_digest_and_floats_are_rounded():
    out = sm.summarize({"yaml": "x" * (sm.MAX_TEXT + 1), "r": 1.23456789, "z": 0.0})
    assert out["yaml"]["chars"] == sm.MAX_TEXT + 1 and len(out["yaml"]["sha256"]) == 64
    assert out["r"] == 1.235 and out["z"] == 0.0


def test_write_summary_round_trips_as_json(tmp_path):
    raw = tmp_path / "run.json"
    raw.write_text(json.dumps({"command": "c", "samples": [{"t": float(i)} for i in range(100)]}))
    out = sm.write_summary(raw, tmp_path / "s")
    assert out.name == "run.summary.json"
    doc = json.loads(out.read_text())
    assert doc["command"] == "c" and doc["samples"]["records"] == 100
    assert out.stat().st_size < raw.stat().st_size / 5


def test_no_large_json_is_tracked():
    listed = subprocess.run(
        ["git", "ls-files", "*.json"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    assert listed, "git ls-files found no JSON at all: the check would pass on anything"
    big = [
        (p, (ROOT / p).stat().st_size)
        for p in listed
        if (ROOT / p).exists() and (ROOT / p).stat().st_size > MAX_TRACKED_JSON
    ]
    assert not big, f"tracked JSON over {MAX_TRACKED_JSON} bytes (summarize it): {big}"
