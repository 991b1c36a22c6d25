"""Stopping stage processes, blocking (no event loop needed): a shutdown that gives the stages a
grace period to exit on their own before SIGTERM and SIGKILL, and the last resort when the event
loop is gone. Each signal goes to a replica's whole process group, so what a stage process
started goes with it.

:class:`~omni_cache.runtime.supervision.supervisor.StageSupervisor` owns the replicas and calls these.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import time
from collections.abc import Iterable

from omni_cache.runtime.supervision.supervised_replica import SupervisedReplica

logger = logging.getLogger(__name__)

__all__ = ["kill_replicas", "stop_replicas"]


def stop_replicas(replicas: Iterable[SupervisedReplica], grace: float) -> None:
    """Wait ``grace`` for the running replicas to exit, then SIGTERM, then SIGKILL (``grace``
    after each); every replica is down afterwards and its runner closed."""
    replicas = list(replicas)
    procs = [sp for sp in replicas if sp.running]
    end = time.monotonic() + grace
    while time.monotonic() < end and any(sp.poll() is None for sp in procs):
        time.sleep(0.05)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        running = [sp for sp in procs if sp.poll() is None]
        if not running:
            break
        logger.info("stopping stage(s) %s with %s", ", ".join(sp.name for sp in running), sig.name)
        for sp in running:
            sp.signal_group(sig)
        end = time.monotonic() + grace
        while time.monotonic() < end and any(sp.poll() is None for sp in running):
            time.sleep(0.05)
    for sp in procs:
        # Leftovers in the stage's process group (helpers of a stage that already exited).
        sp.signal_group(signal.SIGKILL)
        assert sp.runner is not None
        with contextlib.suppress(Exception):
            sp.runner.wait(1.0)
        sp.up = False
    _close_runners(replicas)


def kill_replicas(replicas: Iterable[SupervisedReplica], grace: float) -> None:
    """SIGTERM every live replica's process group, then SIGKILL after ``grace``; runners closed."""
    replicas = list(replicas)
    procs = [sp for sp in replicas if sp.alive()]
    for sp in procs:
        sp.signal_group(signal.SIGTERM)
    end = time.monotonic() + grace
    while time.monotonic() < end and any(sp.alive() for sp in procs):
        time.sleep(0.05)
    for sp in procs:
        sp.signal_group(signal.SIGKILL)
        assert sp.runner is not None
        with contextlib.suppress(Exception):
            sp.runner.wait(1.0)
    _close_runners(replicas)


def _close_runners(replicas: list[SupervisedReplica]) -> None:
    for sp in replicas:
        if sp.runner is not None:
            with contextlib.suppress(Exception):
                sp.runner.close()
