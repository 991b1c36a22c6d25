"""Turn a benchmark's raw result file into the small summary kept in git.

Usage::

    .venv/bin/python -m benchmarks.summarize RAW.json [RAW2.json ...] [--out-dir DIR]

Every benchmark writes every figure and every per-request sample to the file its ``--json`` names;
those files are for the person who ran it and stay out of git (they grow by hundreds of kB a run).
What is kept in ``benchmarks/results/summaries/`` is the same document with its long series folded:

* a list of five or more numbers (a per-request or per-attempt series) becomes
  ``{"n", "min", "p50", "p90", "p99", "max", "mean"}``;
* a list of records (dicts) named as samples (:data:`SAMPLE_KEYS`), or longer than
  :data:`MAX_RECORDS`, becomes ``{"records": n, "<field>": <those statistics>}`` for each numeric
  field of its records (nested lists of records are flattened first);
* a string longer than :data:`MAX_TEXT` (a stage config copied whole) becomes its length and
  sha256;
* a list still over :data:`MAX_LIST_BYTES` once folded (per-round raw measurements) keeps its
  length and its first item;
* floats are rounded to :data:`DIGITS` significant digits;
* everything else (the command, the machine, the configuration, the medians, ratios and per-round
  records a table is made from) is kept as it is.

Percentiles are :func:`benchmarks.report.percentile` (numpy's linear method), the one definition
the benchmarks use.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.report import percentile

#: Numeric lists at least this long are series, folded into their statistics.
MIN_SERIES = 5
#: Lists of records up to this long are kept whole (per-round figures); longer ones are folded.
MAX_RECORDS = 32
#: Keys whose lists hold raw samples, folded whatever their length.
SAMPLE_KEYS = frozenset({"samples", "attempts", "idle_wait", "machine_timeline", "timeline", "requests", "per_request"})
#: A list whose folded form is still larger than this (as JSON) keeps its length and first item.
MAX_LIST_BYTES = 16_000
#: Significant digits a float keeps (timings to well under the noise of any run here).
DIGITS = 4
#: Strings longer than this are replaced by their length and digest.
MAX_TEXT = 2000

#: Where the summaries of the runs the docs cite live.
SUMMARY_DIR = Path(__file__).parent / "results" / "summaries"


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def series_stats(values: list[float]) -> dict[str, float | int]:
    """The statistics one numeric series is folded into."""
    a = np.asarray(values, dtype=float)
    p50, p90, p99 = (percentile(a, q) for q in (50, 90, 99))
    stats = {"min": a.min(), "p50": p50, "p90": p90, "p99": p99, "max": a.max(), "mean": a.mean()}
    return {"n": int(a.size), **{k: summarize(float(v)) for k, v in stats.items()}}


def _flatten(items: list) -> list:
    out = []
    for x in items:
        out.extend(_flatten(x) if isinstance(x, list) else [x])
    return out


def fold_records(records: list[dict]) -> dict[str, Any]:
    """A list of records: its length, and the statistics of each numeric field."""
    out: dict[str, Any] = {"records": len(records)}
    fields: dict[str, list[float]] = {}
    for r in records:
        for k, v in r.items():
            if _is_number(v):
                fields.setdefault(k, []).append(v)
    for k, vals in fields.items():
        out[k] = series_stats(vals)
    return out


def summarize(doc: Any, key: str | None = None) -> Any:
    """``doc`` with its series folded (the module docstring says how); ``key``: the name ``doc``
    has in its parent."""
    if isinstance(doc, dict):
        return {k: summarize(v, k) for k, v in doc.items()}
    if isinstance(doc, str) and len(doc) > MAX_TEXT:
        return {"chars": len(doc), "sha256": hashlib.sha256(doc.encode()).hexdigest()}
    if isinstance(doc, float) and math.isfinite(doc) and doc != 0.0:
        return round(doc, DIGITS - 1 - math.floor(math.log10(abs(doc))))
    if not isinstance(doc, list):
        return doc
    if len(doc) >= MIN_SERIES and all(_is_number(x) for x in doc):
        return series_stats(doc)
    flat = _flatten(doc)
    if flat and all(isinstance(x, dict) for x in flat) and (key in SAMPLE_KEYS or len(flat) > MAX_RECORDS):
        return fold_records(flat)
    folded = [summarize(x) for x in doc]
    if len(folded) > 1 and len(json.dumps(folded)) > MAX_LIST_BYTES:
        first = folded[0] if len(json.dumps(folded[0])) <= MAX_LIST_BYTES else "(omitted)"
        return {"items": len(folded), "first": first}
    return folded


def summary_path(raw: Path, out_dir: Path = SUMMARY_DIR) -> Path:
    return out_dir / f"{raw.stem}.summary.json"


def write_summary(raw: Path, out_dir: Path = SUMMARY_DIR) -> Path:
    out = summary_path(raw, out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(raw) as f:
        doc = json.load(f)
    # One line per top-level key: compact, yet a new run's diff shows which parts changed.
    folded = summarize(doc)
    lines = (
        [f" {json.dumps(k)}: {json.dumps(v, separators=(',', ':'))}" for k, v in folded.items()]
        if isinstance(folded, dict)
        else [json.dumps(folded, separators=(",", ":"))]
    )
    body = "{\n" + ",\n".join(lines) + "\n}" if isinstance(folded, dict) else lines[0]
    out.write_text(body + "\n")
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.summarize", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("raw", nargs="+", type=Path, help="raw result files (a benchmark's --json)")
    ap.add_argument(
        "--out-dir",
        type=Path,
        default=SUMMARY_DIR,
        help="where the summaries go (default: benchmarks/results/summaries)",
    )
    args = ap.parse_args(argv)
    for raw in args.raw:
        out = write_summary(raw, args.out_dir)
        print(f"{raw} ({raw.stat().st_size / 1e3:.0f} kB) -> {out} ({out.stat().st_size / 1e3:.1f} kB)")


if __name__ == "__main__":
    main()
