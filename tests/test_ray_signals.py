"""A Ray-placed stage's signals leave the caller at once (omni_cache/runtime/supervision/ray_placement.py):
the supervisor signals on the server's event loop, and a call to the actor of a hung node can
take 60 + 10 s. Ray stands in here as a fake whose actor calls block until the test lets them
through (a real cluster cannot be made to hang on cue); the runner, its threads and the order
of its signals are the real ones."""

from __future__ import annotations

import signal
import threading
import time
from types import SimpleNamespace

import pytest

ray_placement = pytest.importorskip("omni_cache.runtime.supervision.ray_placement")


class _Method:
    def __init__(self, fn):
        self._fn = fn

    def remote(self, *args):
        return lambda: self._fn(*args)  # an "object ref": ray.get runs it


class _HungNodeActor:
    """Starts at once; every signal call blocks until ``through`` is set, then is recorded."""

    def __init__(self) -> None:
        self.through = threading.Event()
        self.exited = threading.Event()
        self.signals: list[int] = []
        self.start = _Method(lambda *a: (4321, 0))
        self.lines = _Method(lambda seen: (seen, []))
        self.wait = _Method(lambda: 0)
        self.signal = _Method(self._signal)

    def _signal(self, sig: int) -> None:
        self.through.wait()
        self.signals.append(sig)


def _fake_ray(actor: _HungNodeActor) -> SimpleNamespace:
    def get(ref, timeout=None):
        return ref()

    def wait(refs, timeout=None):
        if actor.exited.wait(timeout):
            return refs, []
        return [], refs

    return SimpleNamespace(get=get, wait=wait, kill=lambda *a, **k: None)


def test_signals_return_at_once_and_go_out_in_order(monkeypatch):
    actor = _HungNodeActor()
    monkeypatch.setattr(ray_placement, "ray", _fake_ray(actor))
    placed = ray_placement.PlacedReplica("thinker", "thinker", 0, actor, {})
    runner = ray_placement.RayRunner(placed, None, [], "", {})
    runner.start(lambda line: None)
    end = time.monotonic() + 10
    while runner.pid is None:
        assert time.monotonic() < end, "the runner did not start"
        time.sleep(0.01)

    caller = threading.Thread(target=lambda: (runner.signal(signal.SIGTERM), runner.signal(signal.SIGKILL)))
    caller.start()
    caller.join(5.0)
    assert not caller.is_alive(), "signal() waited for the actor's call"
    assert actor.signals == []  # the node hangs: nothing went through yet

    actor.through.set()
    end = time.monotonic() + 10
    while len(actor.signals) < 2:
        assert time.monotonic() < end, f"signals not delivered: {actor.signals}"
        time.sleep(0.01)
    assert actor.signals == [signal.SIGTERM, signal.SIGKILL]

    runner.signal(signal.SIGKILL)  # queued before close: close delivers it first
    actor.exited.set()
    runner.close()
    assert actor.signals == [signal.SIGTERM, signal.SIGKILL, signal.SIGKILL]
    # The runner's watcher sees the exit before the test ends: once the fake is undone, a call
    # it still made would reach the real ray (CI's run once started a local cluster that way).
    end = time.monotonic() + 10
    while runner.poll() is None:
        assert time.monotonic() < end, "the runner's watcher did not see the exit"
        time.sleep(0.01)
    assert runner.poll() == 0
