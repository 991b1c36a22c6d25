"""How a request of the soak probe (python -m benchmarks.soak) ended (:func:`classify`), and what
its requests add up to: counts by outcome, latency percentiles, RSS growth over the run."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from benchmarks import report

OUTCOMES = ("ok", "failed", "aborted", "lost")


@dataclass
class Outcome:
    """How one request ended, as the client saw it."""

    kind: str
    outcome: str  # one of OUTCOMES
    end_s: float  # when it ended (s since the measured phase began)
    e2e_s: float
    ttfa_s: float | None = None
    status: str | None = None  # failed: "http_<code>", "sse_error" or "no_audio"; lost: why
    detail: str | None = None
    #: failed and lost only: the request (system, user, max_tokens) to replay it alone.
    request: dict[str, Any] | None = None


def classify(
    *,
    timed_out: bool,
    abandoned: bool,
    status_code: int | None,
    sse_error: bool,
    complete: bool,
    audio_asked: bool,
    got_audio: bool,
) -> tuple[str, str | None]:
    """(outcome, status) of one request from what the client saw. ``complete``: a JSON 200 body
    was read, or ``data: [DONE]`` arrived."""
    if timed_out:
        return "lost", "timeout"
    if status_code is not None and status_code != 200:
        return "failed", f"http_{status_code}"
    if sse_error:
        return "failed", "sse_error"
    if abandoned:
        return "aborted", None
    if complete:
        if audio_asked and not got_audio:
            return "failed", "no_audio"
        return "ok", None
    # No answer, no clear error: a dropped connection or a stream cut short without an error event.
    return "lost", "no_answer" if status_code is None else "truncated"


def percentile(values: Sequence[float], q: float) -> float | None:
    """benchmarks.report.percentile (numpy's linear method) of ``values``; None when empty."""
    return report.percentile(values, q) if values else None


def summarize(outcomes: Sequence[Outcome]) -> dict[str, Any]:
    """Counts by outcome (and failed/lost by status), p50/p99 end-to-end latency of the ok
    requests and p50/p99 time to first audio of the ok streamed ones."""
    counts = Counter(o.outcome for o in outcomes)
    e2e = [o.e2e_s for o in outcomes if o.outcome == "ok"]
    ttfa = [o.ttfa_s for o in outcomes if o.outcome == "ok" and o.ttfa_s is not None]
    return {
        "requests": len(outcomes),
        **{k: counts.get(k, 0) for k in OUTCOMES},
        "failed_by_status": dict(sorted(Counter(o.status for o in outcomes if o.outcome == "failed").items())),
        "lost_by_reason": dict(sorted(Counter(o.status for o in outcomes if o.outcome == "lost").items())),
        "by_kind": dict(sorted(Counter(o.kind for o in outcomes).items())),
        "e2e_p50_s": percentile(e2e, 50),
        "e2e_p99_s": percentile(e2e, 99),
        "ttfa_p50_s": percentile(ttfa, 50),
        "ttfa_p99_s": percentile(ttfa, 99),
    }


def rss_growth(minutes: Sequence[dict[str, Any]], baseline_minute: int) -> dict[str, dict[str, Any]]:
    """Per process: RSS at the end of minute ``baseline_minute`` (1-based; the first minute if the
    run is not longer than that), at the end of the last minute, and the growth in percent."""
    if not minutes:
        return {}
    base = minutes[baseline_minute - 1] if len(minutes) > baseline_minute else minutes[0]
    last = minutes[-1]
    out = {}
    for proc, end in last["rss_mib"].items():
        start = base["rss_mib"].get(proc)
        if start is None or end is None or start <= 0:
            continue
        out[proc] = {
            "baseline_minute": base["minute"],
            "baseline_mib": start,
            "end_mib": end,
            "growth_pct": round(100.0 * (end - start) / start, 2),
        }
    return out
