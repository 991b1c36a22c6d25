"""How late the server's event loop runs what is due: a task that sleeps a fixed interval and
observes how much later than that it wakes (``omni_cache_event_loop_lag_seconds``).

Every request's bytes, every stage's message and every deadline pass through one event loop; work
that holds it (a long computation, a blocking call) delays all of them by as much, without showing
up in any latency of its own. The probe's lateness is that delay, sampled every
:data:`PROBE_INTERVAL_S`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

__all__ = ["LAG_BUCKETS", "PROBE_INTERVAL_S", "watch_loop_lag"]

#: How often the probe sleeps and wakes.
PROBE_INTERVAL_S = 0.05
#: Histogram bounds (s): from a loop that keeps up to one stalled for seconds.
LAG_BUCKETS: tuple[float, ...] = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


async def watch_loop_lag(observe: Callable[[float], None], interval: float = PROBE_INTERVAL_S) -> None:
    """Until cancelled: sleep ``interval``, ``observe`` how many seconds late the wake-up came."""
    loop = asyncio.get_running_loop()
    while True:
        due = loop.time() + interval
        await asyncio.sleep(interval)
        observe(max(0.0, loop.time() - due))
