"""What the front door did to clients that send or read too slowly or too much, counted for
``GET /metrics``: streamed requests cut as slow clients (by the bound they passed), streamed answers
whose writes waited for a client that took nothing, realtime connections whose reading was held
for their read budget (omni_cache/serving/realtime/ws_protocol.py)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, Metric

__all__ = ["ClientCuts"]

#: The bounds a streamed request's client is cut at (the ``bound`` label).
SLOW_CLIENT_BOUNDS = ("max_outbox_bytes", "max_send_stall_s")


@dataclass
class ClientCuts:
    #: bound (server.max_outbox_bytes / max_send_stall_s) -> streaming clients cut past it.
    slow_clients: dict[str, int] = field(default_factory=dict)
    #: Times a streamed answer's writes waited for a client that took nothing (send_watch.py).
    stream_write_pauses: int = 0
    #: Times a realtime connection's reading was held for its read budget (ws_protocol.py).
    realtime_read_holds: int = 0

    def slow_client(self, bound: str = "max_outbox_bytes") -> None:
        self.slow_clients[bound] = self.slow_clients.get(bound, 0) + 1

    def stream_write_paused(self) -> None:
        self.stream_write_pauses += 1

    def realtime_read_held(self) -> None:
        self.realtime_read_holds += 1

    def families(self) -> Iterator[Metric]:
        slow = CounterMetricFamily(
            "omni_cache_slow_clients_disconnected",
            "Streamed requests whose client was past server.max_outbox_bytes or max_send_stall_s "
            "(bound): disconnected, the request aborted and what waited freed.",
            labels=["bound"],
        )
        for bound in SLOW_CLIENT_BOUNDS:
            slow.add_metric([bound], self.slow_clients.get(bound, 0))
        yield slow
        help_ = "Times a streamed answer's writes waited for a client that took nothing for 0.5 s."
        yield CounterMetricFamily("omni_cache_stream_write_pauses", help_, value=self.stream_write_pauses)
        help_ = "Times a realtime connection's reading was held: past server.realtime.max_read_bytes_per_s."
        yield CounterMetricFamily("omni_cache_realtime_read_holds", help_, value=self.realtime_read_holds)
