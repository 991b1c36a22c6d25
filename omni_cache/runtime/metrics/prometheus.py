"""``GET /metrics``: the pipeline's per-stage metrics, exposed with ``prometheus_client``.

Names follow vLLM's wherever a metric means what vLLM's means, so dashboards and alerts written for
a vLLM server work per stage (every per-stage sample has a ``stage`` label; what a stage process
reports, and its up/restarts, also a ``replica`` label, the replica's index, "0" for a one-replica
stage; vLLM-named ones also carry vLLM's ``model_name`` label when the server knows the served
model name):

* ``vllm:prefix_cache_queries_total`` / ``vllm:prefix_cache_hits_total``: prompt tokens looked up
  in / served from the stage's prefix cache (vLLM stages only),
* ``vllm:num_requests_running`` / ``vllm:num_requests_waiting``: the stage's vLLM scheduler,
* ``vllm:prompt_tokens_total`` / ``vllm:generation_tokens_total``: the stage's engine requests,
* ``vllm:time_to_first_token_seconds``: request arrival -> first text token (the text stage),
* ``vllm:e2e_request_latency_seconds``: request arrival -> the stage finished its part.

Our own names (``omni_cache_*``) only for what vLLM has no metric for: time to first audio, latent
rows served from the hidden-state cache, stage up/restarts, requests a stage accepted or failed,
requests in flight and answered, and for stages with several replicas what routing sees:
``omni_cache_routing_decisions_total`` (``stage``, ``replica``, ``policy``: ``server.routing``,
``decision``: the rule that chose, see omni_cache/runtime/routing/replica_router.py),
``omni_cache_replica_requests_in_flight`` (the load ``least_loaded`` compares) and
``omni_cache_prefix_index_blocks`` (block hashes an entry replica reported it holds, ``prefix``).

Stages with ``pacing:`` add requests paced, audio underruns and a slack histogram
(omni_cache/runtime/metrics/pacing_metrics.py).

Two sources feed a scrape: the stages' cumulative counters (``StatsQuery`` -> ``StageStats``, passed
to :meth:`OrchestratorMetrics.render` as :class:`StageSnapshot`) and what the orchestrator measures
itself (latency histograms: ``prometheus_client``'s ``Histogram``; failures). Each orchestrator
has its own ``CollectorRegistry`` (several orchestrators can live in one process: tests,
notebooks), so nothing goes into the process-global default registry.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric, UnknownMetricFamily
from prometheus_client.parser import text_string_to_metric_families

from omni_cache.runtime.metrics.client_cuts import ClientCuts
from omni_cache.runtime.metrics.loop_lag import LAG_BUCKETS
from omni_cache.runtime.metrics.pacing_metrics import is_pacing_key, pacing_families

__all__ = [
    "CONTENT_TYPE",
    "STAGE_DONE",
    "STAGE_METRICS",
    "TTFA",
    "TTFT",
    "LatencyMetric",
    "OrchestratorMetrics",
    "StageSnapshot",
    "parse_metrics",
]

CONTENT_TYPE = CONTENT_TYPE_LATEST

# vLLM 0.32's bucket bounds (vllm/v1/metrics/buckets.py), so quantiles compare with a vLLM server's.
TTFT_BUCKETS: tuple[float, ...] = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
REQUEST_LATENCY_BUCKETS: tuple[float, ...] = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)


class LatencyMetric(NamedTuple):
    """A latency histogram the orchestrator observes: name, help text, bucket bounds (s)."""

    name: str
    help: str
    buckets: tuple[float, ...]
    #: Whether vLLM has this metric (then it also gets the model_name label).
    vllm: bool


TTFT = LatencyMetric(
    "vllm:time_to_first_token_seconds",
    "Histogram of time to first token in seconds (request arrival to the first text token, per text stage).",
    TTFT_BUCKETS,
    True,
)
TTFA = LatencyMetric(
    "omni_cache_time_to_first_audio_seconds",
    "Time from request arrival to the first audio samples, per audio stage.",
    TTFT_BUCKETS,
    False,
)
STAGE_DONE = LatencyMetric(
    "vllm:e2e_request_latency_seconds",
    "Histogram of e2e request latency in seconds (request arrival until the stage finished its part of the request).",
    REQUEST_LATENCY_BUCKETS,
    True,
)


class StageMetric(NamedTuple):
    name: str
    kind: str  # "counter" or "gauge"
    help: str
    vllm: bool


#: Stage counter key (``StageStats.counters``) -> the metric it is exposed as.
STAGE_METRICS: dict[str, StageMetric] = {
    "prefix_cache_queried_tokens": StageMetric(
        "vllm:prefix_cache_queries", "counter", "Prefix cache queries, in terms of number of queried tokens.", True
    ),
    "prefix_cache_hit_tokens": StageMetric(
        "vllm:prefix_cache_hits", "counter", "Prefix cache hits, in terms of number of cached tokens.", True
    ),
    "num_requests_running": StageMetric(
        "vllm:num_requests_running", "gauge", "Number of requests in model execution batches.", True
    ),
    "num_requests_waiting": StageMetric(
        "vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.", True
    ),
    "prompt_tokens": StageMetric("vllm:prompt_tokens", "counter", "Number of prefill tokens processed.", True),
    "generation_tokens": StageMetric(
        "vllm:generation_tokens", "counter", "Number of generation tokens processed.", True
    ),
    "requests": StageMetric(
        "omni_cache_stage_requests", "counter", "Requests the stage accepted (since its last start).", False
    ),
    "errors": StageMetric(
        "omni_cache_stage_errors", "counter", "Requests that failed inside the stage (since its last start).", False
    ),
    "queue_depth": StageMetric(
        "omni_cache_stage_queue_depth",
        "gauge",
        "Requests the stage holds: running, waiting, or waiting for upstream input.",
        False,
    ),
    "client_holds": StageMetric(
        "omni_cache_stage_client_holds",
        "counter",
        "Requests held out of the stage's steps because their streaming client stopped taking the answer "
        "(each pause counts once; since the stage's last start).",
        False,
    ),
    "client_hold_lapses": StageMetric(
        "omni_cache_stage_client_hold_lapses",
        "counter",
        "Client holds that lapsed because the orchestrator did not renew them (a lost message): the request went on.",
        False,
    ),
    "latent_rows_served": StageMetric(
        "omni_cache_latent_rows_served", "counter", "Latent rows served from the hidden-state prefix cache.", False
    ),
    "latent_rows_computed": StageMetric(
        "omni_cache_latent_rows_computed", "counter", "Latent rows the stage's model computed.", False
    ),
}

_NAME_RE = re.compile(r"[^a-zA-Z0-9_]")


@dataclass
class RoutingSnapshot:
    """What the router sees at scrape time, for stages with several replicas."""

    #: (stage, replica, policy, decision) -> requests routed so
    decisions: Mapping[tuple[str, int, str, str], int] = field(default_factory=dict)
    #: (stage, replica) -> the orchestrator's requests in flight there
    in_flight: Mapping[tuple[str, int], int] = field(default_factory=dict)
    #: (stage, replica) -> distinct block hashes it reported holding
    prefix_blocks: Mapping[tuple[str, int], int] = field(default_factory=dict)


@dataclass
class StageSnapshot:
    """What the orchestrator knows about one stage replica at scrape time."""

    up: bool
    restarts: int = 0
    #: Times it was found hung (omni_cache/runtime/supervision/hang_watch.py) and marked down.
    hangs: int = 0
    #: Steps it was seen in past the heartbeat timeout (busy, not hung), and whether it is now.
    long_steps: int = 0
    in_long_step: bool = False
    #: The replica's counters (the last ones it reported; empty if it never answered).
    counters: dict[str, float] = field(default_factory=dict)
    #: False when the replica did not answer this scrape's StatsQuery in time (counters are older).
    fresh: bool = False
    #: Its stage ("": the key it is rendered under) and replica index.
    stage: str = ""
    replica: int = 0


class OrchestratorMetrics:
    """Latency histograms and failure counters the orchestrator measures, and the exposition."""

    def __init__(self, stage_names: Sequence[str]) -> None:
        self.stage_names = list(stage_names)
        self._model_name: str | None = None
        #: Each latency metric's histogram (in ``registry``), made at its first observation.
        self.histograms: dict[LatencyMetric, Histogram] = {}
        self.failed_requests: dict[str, int] = {s: 0 for s in stage_names}
        #: stage -> its outputs whose handling raised (their requests failed with 500)
        self.output_errors: dict[str, int] = {s: 0 for s in stage_names}
        #: (stage, replica) -> requests resumed elsewhere because that replica died
        self.resumed: dict[tuple[str, int], int] = {}
        self.requests_ok = 0
        #: Clients cut, writes that waited, reads held (client_cuts.py).
        self.clients = ClientCuts()
        self.requests_failed: dict[int, int] = {}
        # Set by render() for the collector to read: a scrape is one synchronous call.
        self._scrape: tuple[Mapping[str, StageSnapshot], int, RoutingSnapshot, dict[str, float]] | None = None
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)
        #: How late the server's event loop woke a probe (omni_cache/runtime/metrics/loop_lag.py).
        self.loop_lag = Histogram(
            "omni_cache_event_loop_lag_seconds",
            "How much later than due the server's event loop woke a probe "
            "sleeping a fixed interval: the delay work holding the loop "
            "adds to everything.",
            buckets=LAG_BUCKETS,
            registry=self.registry,
        )

    @property
    def model_name(self) -> str | None:
        """The served model name, for vLLM's ``model_name`` label (the HTTP server sets it)."""
        return self._model_name

    @model_name.setter
    def model_name(self, name: str | None) -> None:
        # A histogram's label names are fixed when it is made: vLLM's, whose labels include the
        # model name, are made again (empty) when it changes. The server sets the name when it
        # is created, before it answers a request.
        if name != self._model_name:
            for metric in [m for m in self.histograms if m.vllm]:
                self.registry.unregister(self.histograms.pop(metric))
            self._model_name = name

    def observe(self, metric: LatencyMetric, stage: str, seconds: float) -> None:
        hist = self.histograms.get(metric)
        if hist is None:
            hist = self.histograms[metric] = Histogram(
                metric.name, metric.help, self._labels(metric.vllm), buckets=metric.buckets, registry=self.registry
            )
        hist.labels(*self._values(stage, metric.vllm)).observe(seconds)

    def stage_failed_request(self, stage: str) -> None:
        self.failed_requests[stage] = self.failed_requests.get(stage, 0) + 1

    def output_failed(self, stage: str) -> None:
        """Handling an output of ``stage`` raised (a server bug); its request failed with 500."""
        self.output_errors[stage] = self.output_errors.get(stage, 0) + 1

    def request_resumed(self, stage: str, replica: int) -> None:
        """A request moved to live replicas because replica ``replica`` of ``stage`` died."""
        self.resumed[(stage, replica)] = self.resumed.get((stage, replica), 0) + 1

    def request_done(self, status: int | None) -> None:
        if status is None:
            self.requests_ok += 1
        else:
            self.requests_failed[status] = self.requests_failed.get(status, 0) + 1

    def render(
        self,
        stages: Mapping[str, StageSnapshot],
        in_flight: int,
        routing: RoutingSnapshot | None = None,
        heap: Mapping[str, float] | None = None,
    ) -> str:
        """The exposition text of one scrape. ``stages``: replica name (or stage name) -> its
        snapshot; ``heap``: the server process's HeapTrimmer counters."""
        self._scrape = (stages, in_flight, routing or RoutingSnapshot(), dict(heap or {}))
        try:
            return generate_latest(self.registry).decode("utf-8")
        finally:
            self._scrape = None

    # ---- prometheus_client collector -----------------------------------------------------------

    def _labels(self, vllm: bool) -> list[str]:
        return ["stage", "model_name"] if vllm and self.model_name else ["stage"]

    def _values(self, stage: str, vllm: bool) -> list[str]:
        return [stage, self.model_name] if vllm and self.model_name else [stage]

    def _replica_labels(self, vllm: bool) -> list[str]:
        return [*self._labels(vllm), "replica"]

    def _replica_values(self, key: str, snap: StageSnapshot, vllm: bool) -> list[str]:
        return [*self._values(snap.stage or key, vllm), str(snap.replica)]

    def collect(self) -> Iterator[Metric]:
        if self._scrape is None:  # registered, but not inside render()
            return
        stages, in_flight, routing, heap = self._scrape
        names = list(stages)
        yield from self._stage_state(stages, names)
        yield from self._stage_counters(stages, names)
        yield from pacing_families(
            {s: stages[s].counters for s in names},
            self._replica_labels(False),
            lambda s: self._replica_values(s, stages[s], False),
        )
        yield from self._routing(routing)
        failed = CounterMetricFamily(
            "omni_cache_stage_failed_requests",
            "Requests the orchestrator failed because of this stage (died, error, timeout).",
            labels=["stage"],
        )
        for s in names:
            failed.add_metric([s], self.failed_requests.get(s, 0))
        yield failed
        errors = CounterMetricFamily(
            "omni_cache_output_errors",
            "Stage outputs whose handling in the server raised (a bug); each failed its request "
            "at once with 500 naming the cause.",
            labels=["stage"],
        )
        for s in self.stage_names:
            errors.add_metric([s], self.output_errors.get(s, 0))
        yield errors
        yield per_replica(
            CounterMetricFamily,
            "omni_cache_requests_resumed",
            "Requests that went on from where their client was on live replicas "
            "because this replica, serving them, died.",
            self.resumed,
        )
        yield GaugeMetricFamily(
            "omni_cache_requests_in_flight", "Requests accepted and not yet answered.", value=in_flight
        )
        yield from self.clients.families()
        answered = CounterMetricFamily("omni_cache_requests", "Requests answered, by outcome.", labels=["outcome"])
        answered.add_metric(["ok"], self.requests_ok)
        for status, n in sorted(self.requests_failed.items()):
            answered.add_metric([f"error_{status}"], n)
        yield answered
        yield CounterMetricFamily(
            "omni_cache_server_heap_trims",
            "malloc_trim calls of the server process (HTTP and orchestrator).",
            value=heap.get("heap_trims", 0),
        )
        yield CounterMetricFamily(
            "omni_cache_server_heap_trim_seconds",
            "Seconds the server process spent in malloc_trim.",
            value=heap.get("heap_trim_seconds", 0.0),
        )

    def _stage_state(self, stages: Mapping[str, StageSnapshot], names: list[str]) -> Iterator[Metric]:
        labels = self._replica_labels(False)
        up = GaugeMetricFamily(
            "omni_cache_stage_up", "1 when the stage replica's process is up and ready.", labels=labels
        )
        restarts = CounterMetricFamily(
            "omni_cache_stage_restarts", "Times the orchestrator restarted the stage replica's process.", labels=labels
        )
        hangs = CounterMetricFamily(
            "omni_cache_stage_hangs",
            "Times the stage replica was found hung (its heartbeats stopped, or its loop stayed in "
            "one step past stages[].step_timeout_s) and marked down.",
            labels=labels,
        )
        long_steps = CounterMetricFamily(
            "omni_cache_stage_long_steps",
            "Steps of the stage replica's loop that lasted past server.heartbeat_timeout_s while "
            "its heartbeats came (busy, not hung until stages[].step_timeout_s).",
            labels=labels,
        )
        in_long = GaugeMetricFamily(
            "omni_cache_stage_in_long_step",
            "1 while the stage replica is busy in one step past server.heartbeat_timeout_s.",
            labels=labels,
        )
        fresh = GaugeMetricFamily(
            "omni_cache_stage_stats_fresh",
            "1 when the stage replica answered this scrape's stats query (else its last known counters).",
            labels=labels,
        )
        for s in names:
            values = self._replica_values(s, stages[s], False)
            up.add_metric(values, 1 if stages[s].up else 0)
            restarts.add_metric(values, stages[s].restarts)
            hangs.add_metric(values, stages[s].hangs)
            long_steps.add_metric(values, stages[s].long_steps)
            in_long.add_metric(values, 1 if stages[s].in_long_step else 0)
            fresh.add_metric(values, 1 if stages[s].fresh else 0)
        yield from (up, restarts, hangs, long_steps, in_long, fresh)

    def _routing(self, routing: RoutingSnapshot) -> Iterator[Metric]:
        fam = CounterMetricFamily(
            "omni_cache_routing_decisions",
            "Requests routed to a replica of a stage with several replicas, by the configured "
            "policy and the rule that decided.",
            labels=["stage", "replica", "policy", "decision"],
        )
        for (stage, replica, policy, decision), n in sorted(routing.decisions.items()):
            fam.add_metric([stage, str(replica), policy, decision], n)
        load = per_replica(
            GaugeMetricFamily,
            "omni_cache_replica_requests_in_flight",
            "The orchestrator's requests routed to the replica and not finished "
            "there (the load least_loaded compares).",
            routing.in_flight,
        )
        blocks = per_replica(
            GaugeMetricFamily,
            "omni_cache_prefix_index_blocks",
            "Block hashes the entry replica reported its prefix cache holds (prefix routing).",
            routing.prefix_blocks,
        )
        yield from (f for f in (fam, load, blocks) if f.samples)

    def _stage_counters(self, stages: Mapping[str, StageSnapshot], names: list[str]) -> Iterator[Metric]:
        for key, metric in STAGE_METRICS.items():
            family = CounterMetricFamily if metric.kind == "counter" else GaugeMetricFamily
            fam = family(metric.name, metric.help, labels=self._replica_labels(metric.vllm))
            for s in names:
                counters = stages[s].counters
                # vLLM's metrics only for stages that report them (a stage without a vLLM engine
                # has no prefix cache: a 0 would claim one); ours for every stage.
                if key in counters or not metric.vllm:
                    fam.add_metric(self._replica_values(s, stages[s], metric.vllm), float(counters.get(key, 0.0)))
            if fam.samples:
                yield fam
        extra = sorted({k for s in names for k in stages[s].counters if not is_pacing_key(k)} - set(STAGE_METRICS))
        for key in extra:
            fam = UnknownMetricFamily(
                "omni_cache_stage_" + _NAME_RE.sub("_", key),
                f"Stage counter {key!r} as the stage reports it.",
                labels=self._replica_labels(False),
            )
            for s in names:
                if key in stages[s].counters:
                    fam.add_metric(self._replica_values(s, stages[s], False), float(stages[s].counters[key]))
            yield fam


def per_replica(family: Any, name: str, help_text: str, values: Mapping[tuple[str, int], float]) -> Metric:
    """A metric family labelled ``stage`` and ``replica``, from (stage, replica) -> value."""
    fam = family(name, help_text, labels=["stage", "replica"])
    for (stage, replica), n in sorted(values.items()):
        fam.add_metric([stage, str(replica)], n)
    return fam


def parse_metrics(text: str) -> list[tuple[str, dict[str, str], float]]:
    """``(sample name, labels, value)`` of every sample, parsed by ``prometheus_client``'s parser
    (ValueError on malformed text)."""
    return [
        (s.name, dict(s.labels), float(s.value)) for fam in text_string_to_metric_families(text) for s in fam.samples
    ]
