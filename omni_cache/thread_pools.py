"""The server's worker threads: one bounded pool per kind of work (``server.threads``).

What runs off the event loop in the server is of four kinds, each with a pool of its own:

- ``request``: parsing a chat body, templating and tokenizing its prompt, the tool parser, its
  sampling (vLLM's checks and ``to_sampling_params``), counting a realtime conversation's tokens;
- ``media``: reading, inflating and decoding images, clips and videos (milliseconds to seconds
  each: a video's frames);
- ``response``: encoding a whole (non-streamed) answer to JSON, a spoken one's audio as base64;
- ``realtime_events``: parsing large realtime client events.

With one shared pool (asyncio's default executor: min(32, CPUs + 4) threads, 6 on a 2-core
host), six slow decodes held every thread and a text-only request waited behind them to have its
body parsed. Here a flood of one kind queues in its own pool and the others keep their threads.
Their threads are started while the server starts (:meth:`ThreadPools.start_threads`), not on
the event loop by the first requests. The orchestrator's own off-loop work (routing hashes,
detokenizing, heap trims) stays on asyncio's default executor, which the server no longer fills.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import os
import threading
from collections.abc import Callable
from concurrent.futures import CancelledError, ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")

KINDS = ("request", "media", "response", "realtime_events")


def pool_sizes(config: Any, cpus: int | None = None) -> dict[str, int]:
    """Threads per kind: ``config``'s count (``server.threads``, a ThreadsConfig), or the default
    for ``cpus`` (this host's)."""
    cpus = cpus or os.cpu_count() or 1
    default = {
        "request": min(32, cpus + 4),
        "media": min(16, max(2, cpus)),
        "response": min(8, max(2, cpus // 2)),
        "realtime_events": 2,
    }
    return {kind: getattr(config, kind) or default[kind] for kind in KINDS}


class ThreadPools:
    """A server's pools, made by the app and shut down with it. Each ``await pools.KIND(fn,
    *args)`` runs ``fn(*args)`` on that kind's threads (named ``omni-KIND_N``) in the caller's
    context, as ``asyncio.to_thread`` does on the default executor."""

    def __init__(self, config: Any, cpus: int | None = None) -> None:
        self.sizes = pool_sizes(config, cpus)
        self._pools = {
            kind: ThreadPoolExecutor(max_workers=n, thread_name_prefix=f"omni-{kind}") for kind, n in self.sizes.items()
        }
        self._barriers: dict[str, threading.Barrier] = {}  # start_threads'

    async def request(self, fn: Callable[..., T], *args: Any) -> T:
        return await self._run("request", fn, args)

    async def media(self, fn: Callable[..., T], *args: Any) -> T:
        return await self._run("media", fn, args)

    async def response(self, fn: Callable[..., T], *args: Any) -> T:
        return await self._run("response", fn, args)

    async def realtime_events(self, fn: Callable[..., T], *args: Any) -> T:
        return await self._run("realtime_events", fn, args)

    async def _run(self, kind: str, fn: Callable[..., T], args: tuple) -> T:
        call = functools.partial(contextvars.copy_context().run, fn, *args)
        return await asyncio.get_running_loop().run_in_executor(self._pools[kind], call)

    def start_threads(self, timeout: float = 60.0) -> None:
        """Start every pool's threads now (blocking: the server calls it from a thread while its
        stages start). A pool starts a thread when work finds none idle, and the submitter waits
        for the new thread to run: on the event loop, in a fresh server's first burst of
        requests, each start waited for the GIL and a CPU (stalls of several ms on a busy 2-vCPU
        host). Each pool is given as many jobs as it has threads, all waiting for one another.
        Best effort: past ``timeout`` (a host too busy to run them) or once closed it returns, and
        the threads not yet started start on first use as they would have; it never fails the
        server's start."""
        try:
            for kind, pool in self._pools.items():
                barrier = self._barriers[kind] = threading.Barrier(self.sizes[kind])
                for job in [pool.submit(barrier.wait, timeout) for _ in range(self.sizes[kind])]:
                    job.result()
        except (threading.BrokenBarrierError, RuntimeError, CancelledError):  # timed out; closed
            return

    def close(self) -> None:
        """Stop taking work; what waits in a queue is cancelled, what runs finishes on its own
        (a start_threads still waiting is let go at once)."""
        for barrier in self._barriers.values():
            barrier.abort()
        for pool in self._pools.values():
            pool.shutdown(wait=False, cancel_futures=True)
