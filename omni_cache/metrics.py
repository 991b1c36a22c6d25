"""Prometheus text exposition (format 0.0.4) of the pipeline's per-stage metrics.

Two sources feed ``GET /metrics``:

* the stages' own cumulative counters, fetched on every scrape with ``StatsQuery`` ->
  ``StageStats`` (requests, errors, queue depth, prefix-cache queried/hit tokens, latent rows
  served from the hidden-state cache; anything else a stage reports is exposed too, as
  ``omni_cache_stage_<key>``), and
* what the orchestrator measures itself: latency histograms per request (time to first text
  token, time to first audio, time until each stage finished its part), stage up/restarts, and
  requests it failed because of a stage.

Every per-stage sample carries the label ``stage="<name>"``. The exposition is written here
(a few dozen lines) rather than with ``prometheus_client``, whose process-global registry does
not fit several orchestrators in one process (tests, notebooks).
"""

from __future__ import annotations

import bisect
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

__all__ = [
    "CONTENT_TYPE",
    "DEFAULT_BUCKETS",
    "STAGE_COUNTERS",
    "Histogram",
    "OrchestratorMetrics",
    "StageSnapshot",
    "parse_metrics",
]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

#: Latency buckets in seconds (upper bounds; +Inf is implicit).
DEFAULT_BUCKETS: tuple[float, ...] = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
)

#: Stage counter key (``StageStats.counters``) -> (metric name, type, help).
STAGE_COUNTERS: dict[str, tuple[str, str, str]] = {
    "requests": ("omni_cache_stage_requests_total", "counter",
                 "Requests the stage accepted (since its last start)."),
    "errors": ("omni_cache_stage_errors_total", "counter",
               "Requests that failed inside the stage (since its last start)."),
    "queue_depth": ("omni_cache_stage_queue_depth", "gauge",
                    "Requests waiting or running in the stage."),
    "prefix_cache_queried_tokens": ("omni_cache_prefix_cache_queried_tokens_total", "counter",
                                    "Prompt tokens looked up in the stage's prefix cache."),
    "prefix_cache_hit_tokens": ("omni_cache_prefix_cache_hit_tokens_total", "counter",
                                "Prompt tokens served from the stage's prefix cache."),
    "latent_rows_served": ("omni_cache_latent_rows_served_total", "counter",
                           "Latent rows served from the hidden-state prefix cache."),
}

_NAME_RE = re.compile(r"[^a-zA-Z0-9_]")


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(labels: Mapping[str, str]) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels.items()) + "}"


def _num(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if math.isnan(value):
        return "NaN"
    if float(value).is_integer() and abs(value) < 2**53:
        return str(int(value))
    return repr(float(value))


class Histogram:
    """A cumulative latency histogram (seconds)."""

    def __init__(self, buckets: Sequence[float] = DEFAULT_BUCKETS) -> None:
        self.buckets = tuple(sorted(buckets))
        self.counts = [0] * (len(self.buckets) + 1)  # last: above every bucket
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def samples(self, name: str, labels: Mapping[str, str]) -> Iterable[str]:
        cumulative = 0
        for bound, n in zip(self.buckets, self.counts):
            cumulative += n
            yield f"{name}_bucket{_labels({**labels, 'le': _num(bound)})} {cumulative}"
        yield f"{name}_bucket{_labels({**labels, 'le': '+Inf'})} {self.count}"
        yield f"{name}_sum{_labels(labels)} {_num(self.sum)}"
        yield f"{name}_count{_labels(labels)} {self.count}"


class _Writer:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def family(self, name: str, kind: str, help_text: str) -> None:
        self.lines.append(f"# HELP {name} {help_text}")
        self.lines.append(f"# TYPE {name} {kind}")

    def sample(self, name: str, labels: Mapping[str, str], value: float) -> None:
        self.lines.append(f"{name}{_labels(labels)} {_num(value)}")

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


@dataclass
class StageSnapshot:
    """What the orchestrator knows about one stage at scrape time."""

    up: bool
    restarts: int = 0
    #: The stage's counters (the last ones it reported; empty if it never answered).
    counters: dict[str, float] = field(default_factory=dict)
    #: False when the stage did not answer this scrape's StatsQuery in time (counters are older).
    fresh: bool = False


# Orchestrator-side histograms: (metric name, help).
TTFT = ("omni_cache_time_to_first_token_seconds",
        "Time from request receipt to the first text token, per text stage.")
TTFA = ("omni_cache_time_to_first_audio_seconds",
        "Time from request receipt to the first audio samples, per audio stage.")
STAGE_DONE = ("omni_cache_time_to_stage_finish_seconds",
              "Time from request receipt until the stage finished its part of the request.")


class OrchestratorMetrics:
    """Latency histograms and failure counters the orchestrator measures itself."""

    def __init__(self, stage_names: Sequence[str], buckets: Sequence[float] = DEFAULT_BUCKETS) -> None:
        self.stage_names = list(stage_names)
        self._buckets = buckets
        self.histograms: dict[tuple[str, str], Histogram] = {}
        self.failed_requests: dict[str, int] = {s: 0 for s in stage_names}
        self.requests_ok = 0
        self.requests_failed: dict[int, int] = {}

    def observe(self, metric: tuple[str, str], stage: str, seconds: float) -> None:
        key = (metric[0], stage)
        hist = self.histograms.get(key)
        if hist is None:
            hist = self.histograms[key] = Histogram(self._buckets)
        hist.observe(seconds)

    def stage_failed_request(self, stage: str) -> None:
        self.failed_requests[stage] = self.failed_requests.get(stage, 0) + 1

    def request_done(self, status: int | None) -> None:
        if status is None:
            self.requests_ok += 1
        else:
            self.requests_failed[status] = self.requests_failed.get(status, 0) + 1

    def render(self, stages: Mapping[str, StageSnapshot], in_flight: int) -> str:
        w = _Writer()
        names = list(stages)

        w.family("omni_cache_stage_up", "gauge", "1 when the stage process is up and ready.")
        for s in names:
            w.sample("omni_cache_stage_up", {"stage": s}, 1 if stages[s].up else 0)
        w.family("omni_cache_stage_restarts_total", "counter",
                 "Times the orchestrator restarted the stage process.")
        for s in names:
            w.sample("omni_cache_stage_restarts_total", {"stage": s}, stages[s].restarts)
        w.family("omni_cache_stage_stats_fresh", "gauge",
                 "1 when the stage answered this scrape's stats query (else its last known counters).")
        for s in names:
            w.sample("omni_cache_stage_stats_fresh", {"stage": s}, 1 if stages[s].fresh else 0)

        for key, (metric, kind, help_text) in STAGE_COUNTERS.items():
            w.family(metric, kind, help_text)
            for s in names:
                w.sample(metric, {"stage": s}, float(stages[s].counters.get(key, 0.0)))
        extra = sorted({k for s in names for k in stages[s].counters} - set(STAGE_COUNTERS))
        for key in extra:
            metric = "omni_cache_stage_" + _NAME_RE.sub("_", key)
            w.family(metric, "untyped", f"Stage counter {key!r} as the stage reports it.")
            for s in names:
                if key in stages[s].counters:
                    w.sample(metric, {"stage": s}, float(stages[s].counters[key]))

        w.family("omni_cache_stage_failed_requests_total", "counter",
                 "Requests the orchestrator failed because of this stage (died, error, timeout).")
        for s in names:
            w.sample("omni_cache_stage_failed_requests_total", {"stage": s},
                     self.failed_requests.get(s, 0))

        for metric, help_text in (TTFT, TTFA, STAGE_DONE):
            keys = sorted(k for k in self.histograms if k[0] == metric)
            if not keys:
                continue
            w.family(metric, "histogram", help_text)
            for _, s in keys:
                w.lines.extend(self.histograms[(metric, s)].samples(metric, {"stage": s}))

        w.family("omni_cache_requests_in_flight", "gauge", "Requests accepted and not yet answered.")
        w.sample("omni_cache_requests_in_flight", {}, in_flight)
        w.family("omni_cache_requests_total", "counter", "Requests answered, by outcome.")
        w.sample("omni_cache_requests_total", {"outcome": "ok"}, self.requests_ok)
        for status, n in sorted(self.requests_failed.items()):
            w.sample("omni_cache_requests_total", {"outcome": f"error_{status}"}, n)
        return w.text()


_SAMPLE_RE = re.compile(
    r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(?:[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\]|\\.)*",?)*\})? '
    r"(-?[0-9.eE+-]+|[+-]Inf|NaN)$"
)
_LABEL_RE = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_metrics(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Parse exposition text into ``(name, labels, value)``; ValueError on a malformed line.

    Strict enough to test the output of :meth:`OrchestratorMetrics.render`; not a full parser.
    """
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE_RE.match(line)
        if not m:
            raise ValueError(f"line {n} is not a metric sample: {line!r}")
        labels = {k: v for k, v in _LABEL_RE.findall(m.group(2) or "")}
        out.append((m.group(1), labels, float(m.group(3))))
    return out
