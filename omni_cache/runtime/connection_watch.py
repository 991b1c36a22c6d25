"""The server's watch on its connections to stages started elsewhere.

When such a stage's process dies, its host's kernel closes the TCP connection at once and ZMQ
reports it on the socket's monitor (``EVENT_DISCONNECTED``), much sooner than a heartbeat timeout;
a connect that is refused is retried and reported every 100 ms (``EVENT_CONNECT_RETRIED``), a
connection that comes up as ``EVENT_CONNECTED``. :class:`ConnectionWatch` runs one monitor task
per watched connection and passes each event of the socket watched now to its owner (the
supervisor decides what an event means for the stage); a replaced socket's late events are
dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Callable
from typing import Any

import zmq
import zmq.utils.monitor

logger = logging.getLogger(__name__)

EVENTS = zmq.EVENT_CONNECTED | zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_DISCONNECTED

_MONITOR_IDS = itertools.count()  # inproc monitor endpoints, unique within the process


class ConnectionWatch:
    """``on_event(name, event)`` is called on the event loop for every event of the socket
    watched under ``name``; an exception it raises is logged and the next event still comes."""

    def __init__(self, on_event: Callable[[str, int], None]) -> None:
        self._on_event = on_event
        self._watchers: dict[str, tuple[Any, asyncio.Task]] = {}  # name -> (socket, its task)

    def watch(self, name: str, socket: Any) -> None:
        """Watch ``socket`` under ``name``, in place of the one watched before (on the running
        loop). Events from before the monitor is attached are lost."""
        self.unwatch(name)
        # An address of its own: pyzmq's default is named after the socket's file descriptor,
        # which the socket this one replaces had a moment ago while libzmq may still hold that
        # endpoint (binding it again fails with EADDRINUSE).
        mon = socket.get_monitor_socket(EVENTS, addr=f"inproc://omni-cache-monitor-{next(_MONITOR_IDS)}")

        async def run() -> None:
            try:
                while True:
                    try:
                        frames = await mon.recv_multipart()
                    except (asyncio.CancelledError, zmq.ZMQError):
                        return
                    event = zmq.utils.monitor.parse_monitor_message(frames)["event"]
                    watched = self._watchers.get(name)
                    if watched is None or watched[0] is not socket:
                        continue  # replaced since: its events say nothing of the stage now
                    try:
                        self._on_event(name, event)
                    except Exception:  # noqa: BLE001 - logged; the next event is still watched
                        logger.exception("stage %s: handling connection event %d failed", name, event)
            finally:
                with contextlib.suppress(Exception):
                    socket.disable_monitor()
                mon.close(linger=0)

        self._watchers[name] = (socket, asyncio.ensure_future(run()))

    def unwatch(self, name: str) -> None:
        watched = self._watchers.pop(name, None)
        if watched is not None:
            watched[1].cancel()

    def stop(self) -> list[asyncio.Task]:
        """Cancel every watch; the tasks, for the caller to await."""
        tasks = [task for _, task in self._watchers.values()]
        self._watchers.clear()
        for task in tasks:
            task.cancel()
        return tasks
