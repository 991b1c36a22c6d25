"""The stages' counters, as the last ``StageStats`` of each replica said them.

A scrape of /metrics asks every replica that is up (``StatsQuery``) and waits up to a timeout for
their answers; a replica that does not answer in time keeps its last known counters, marked not
fresh.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence

from omni_cache.config.replicas import Replica
from omni_cache.runtime.metrics.prometheus import StageSnapshot
from omni_cache.runtime.supervision.stage_fleet import StageFleet
from omni_cache.runtime.supervision.supervisor import StageSupervisor
from omni_cache.wire.messages import StatsQuery


class StageStatsBoard:
    def __init__(self) -> None:
        self._counters: dict[str, dict[str, float]] = {}  # replica name -> counters
        self._when: dict[str, float] = {}  # replica name -> time.monotonic() of its last answer
        self._waiters: set[asyncio.Event] = set()

    def record(self, name: str, counters: Mapping[str, float]) -> None:
        """Replica ``name`` answered."""
        self._counters[name] = dict(counters)
        self._when[name] = time.monotonic()
        for ev in self._waiters:
            ev.set()

    async def refresh(self, targets: Sequence[str], ask: Callable[[str], Awaitable[bool]], timeout: float) -> float:
        """Ask every replica in ``targets`` (``ask`` sends it a StatsQuery) and wait until each
        answered or ``timeout`` passed; the time the refresh began."""
        t0 = time.monotonic()
        ev = asyncio.Event()
        self._waiters.add(ev)
        try:
            await asyncio.gather(*(ask(n) for n in targets))
            deadline = t0 + timeout
            while any(self._when.get(n, -1.0) < t0 for n in targets):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                ev.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(ev.wait(), remaining)
        finally:
            self._waiters.discard(ev)
        return t0

    async def collect(self, fleet: StageFleet, timeout: float) -> dict[str, StageSnapshot]:
        """Ask every replica of ``fleet`` that is up for its counters (:meth:`refresh`); every
        replica's snapshot (:meth:`snapshot`)."""
        targets = [sp.name for sp in fleet.supervisor.stages.values() if sp.up]
        since = await self.refresh(targets, lambda n: fleet.send(n, StatsQuery(), timeout=0.2), timeout)
        return self.snapshot(fleet.replicas, fleet.supervisor, since)

    def snapshot(
        self, replicas: Mapping[str, Replica], supervisor: StageSupervisor, since: float
    ) -> dict[str, StageSnapshot]:
        """replica name -> its state and counters; fresh when it answered after ``since``."""
        snap = {}
        busy = supervisor.long_steps()
        for n, replica in replicas.items():
            sp = supervisor.stages.get(n)
            snap[n] = StageSnapshot(
                up=bool(sp and sp.up),
                restarts=sp.restarts if sp else 0,
                hangs=sp.hangs if sp else 0,
                long_steps=sp.long_steps if sp else 0,
                in_long_step=n in busy,
                counters=dict(self._counters.get(n, {})),
                fresh=self._when.get(n, -1.0) >= since,
                stage=replica.stage,
                replica=replica.index,
            )
        return snap
