"""The stages' playback-pacing counters (scheduler/pacing.py) as ``/metrics`` families.

A stage with ``pacing:`` reports, in its ``StageStats`` counters:

* ``paced_requests`` -> ``omni_cache_stage_paced_requests_total``: streamed spoken answers that
  yielded their turn at least once (more than ``pacing.lead_s`` ahead of their playback),
* ``audio_underruns`` -> ``omni_cache_stage_audio_underruns_total``: answers whose emitted audio
  fell behind their playback at least once (a listener would have waited),
* ``first_audio_shared_steps`` -> ``omni_cache_stage_first_audio_shared_steps_total``: steps that
  ran a streamed answer's first-audio work beside another answer's ahead-of-time work (0 with
  pacing on; with ``enabled: false`` what pacing would have moved),
* ``pacing_slack_seconds_bucket:<le>`` (cumulative) -> ``omni_cache_stage_pacing_slack_seconds``
  (a histogram): each emission's slack, the audio the answer had emitted beyond its playback just
  before it (negative: an underrun). Its buckets reach below 0, so it has no ``_sum``/``_count``
  (a sum of negative values is no counter; the ``+Inf`` bucket is the count).

Only stages that report them get samples (a stage without pacing measures none of this).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric

__all__ = ["COUNTERS", "HISTOGRAM", "is_pacing_key", "pacing_families"]

#: Stage counter key -> (metric name, help).
COUNTERS: dict[str, tuple[str, str]] = {
    "paced_requests": (
        "omni_cache_stage_paced_requests",
        (
            "Streamed spoken answers that yielded their turn because they were more "
            "than pacing.lead_s ahead of their playback."
        ),
    ),
    "audio_underruns": (
        "omni_cache_stage_audio_underruns",
        "Streamed spoken answers whose emitted audio fell behind their playback.",
    ),
    "first_audio_shared_steps": (
        "omni_cache_stage_first_audio_shared_steps",
        ("Steps that ran a streamed answer's first-audio work beside another answer's ahead-of-time work."),
    ),
}
#: The histogram's counter-key prefix and its metric.
HISTOGRAM = "pacing_slack_seconds"
_HISTOGRAM_METRIC = "omni_cache_stage_pacing_slack_seconds"
_HISTOGRAM_HELP = (
    "Slack of each audio emission of a streamed answer: seconds of audio it had "
    "emitted beyond its playback (negative: behind)."
)
_BUCKET = HISTOGRAM + "_bucket:"


def is_pacing_key(key: str) -> bool:
    """Whether a stage counter is rendered here (not as a plain stage counter)."""
    return key in COUNTERS or key.startswith(HISTOGRAM)


def _le(bound: str) -> float:
    return float("inf") if bound == "+Inf" else float(bound)


def pacing_families(
    counters_of: Mapping[str, Mapping[str, float]], labels: list[str], values: Callable[[str], list[str]]
) -> Iterator[Metric]:
    """The families of every replica that reports pacing. ``counters_of``: replica key -> its
    counters; ``labels`` and ``values(key)``: the label names and a replica's label values."""
    keys = [k for k, c in counters_of.items() if any(is_pacing_key(n) for n in c)]
    if not keys:
        return
    for key, (name, help_text) in COUNTERS.items():
        fam = CounterMetricFamily(name, help_text, labels=labels)
        for k in keys:
            if key in counters_of[k]:
                fam.add_metric(values(k), float(counters_of[k][key]))
        yield fam
    hist = HistogramMetricFamily(_HISTOGRAM_METRIC, _HISTOGRAM_HELP, labels=labels)
    for k in keys:
        counters = counters_of[k]
        buckets: list[tuple[str, Any]] = sorted(
            ((n[len(_BUCKET) :], v) for n, v in counters.items() if n.startswith(_BUCKET)), key=lambda b: _le(b[0])
        )
        if buckets:
            hist.add_metric(values(k), [(le, float(v)) for le, v in buckets], None)
    yield hist
