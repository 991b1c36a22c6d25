"""The server's watch on its connections to stages started elsewhere.

When such a stage's process dies, its host's kernel closes the TCP connection at once and ZMQ
reports it on the socket's monitor (``EVENT_DISCONNECTED``), much sooner than a heartbeat timeout;
a connect that is refused is retried and reported every 100 ms (``EVENT_CONNECT_RETRIED``), a
connection that comes up as ``EVENT_CONNECTED``. :class:`ConnectionWatch` runs one monitor task
per watched connection and passes each event of the socket watched now to its owner (the
supervisor decides what an event means for the stage); a replaced socket's late events are
dropped.

libzmq reports a socket's events from its I/O thread with a *blocking* send to the monitor's
reading end. If that end closes while the socket can still report (its connect retried every
100 ms), the next report blocks the I/O thread for good, and with it every connection of the
context: the server then hears no stage at all. So a watch turns the socket's monitor off first,
while the socket is open, and only then closes the reading end; the caller unwatches a socket
before closing it (:meth:`StageLinks.reset`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.utils.monitor

logger = logging.getLogger(__name__)

EVENTS = zmq.EVENT_CONNECTED | zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_DISCONNECTED

_MONITOR_IDS = itertools.count()  # inproc monitor endpoints, unique within the process


@dataclass
class _Watch:
    socket: Any  # the socket watched
    mon: Any  # the reading end of its monitor
    off: bool = False  # its monitor turned off (no more events can come): mon may close
    task: asyncio.Task | None = None


class ConnectionWatch:
    """``on_event(name, event)`` is called on the event loop for every event of the socket
    watched under ``name``; an exception it raises is logged and the next event still comes."""

    def __init__(self, on_event: Callable[[str, int], None]) -> None:
        self._on_event = on_event
        self._watches: dict[str, _Watch] = {}
        # Reading ends of monitors that could not be turned off (their socket closed first):
        # closing one could block the I/O thread, so they stay open until stop().
        self._kept: list[Any] = []

    def watch(self, name: str, socket: Any) -> None:
        """Watch ``socket`` under ``name``, in place of the one watched before (on the running
        loop). Events from before the monitor is attached are lost."""
        self.unwatch(name)
        # An address of its own: pyzmq's default is named after the socket's file descriptor,
        # which the socket this one replaces had a moment ago while libzmq may still hold that
        # endpoint (binding it again fails with EADDRINUSE).
        mon = socket.get_monitor_socket(EVENTS, addr=f"inproc://omni-cache-monitor-{next(_MONITOR_IDS)}")
        watch = _Watch(socket, mon)
        watch.task = asyncio.ensure_future(self._run(name, watch))
        self._watches[name] = watch

    async def _run(self, name: str, watch: _Watch) -> None:
        try:
            while True:
                try:
                    frames = await watch.mon.recv_multipart()
                except (asyncio.CancelledError, zmq.ZMQError):
                    return
                event = zmq.utils.monitor.parse_monitor_message(frames)["event"]
                if self._watches.get(name) is not watch:
                    continue  # replaced since: its events say nothing of the stage now
                try:
                    self._on_event(name, event)
                except Exception:  # noqa: BLE001 - logged; the next event is still watched
                    logger.exception("stage %s: handling connection event %d failed", name, event)
        finally:
            watch.off = watch.off or _monitor_off(watch.socket)
            if watch.off:
                watch.mon.close(linger=0)
            else:
                logger.warning(
                    "stage %s: its socket was closed while still watched; its monitor stays open until shutdown", name
                )
                self._kept.append(watch.mon)

    def unwatch(self, name: str) -> None:
        """Stop watching ``name``; call it before closing the socket (see the module's note)."""
        watch = self._watches.pop(name, None)
        if watch is not None:
            watch.off = _monitor_off(watch.socket)  # now, while the socket is open
            watch.task.cancel()

    def stop(self) -> list[asyncio.Task]:
        """Cancel every watch (before the watched sockets close); the tasks, for the caller to
        await."""
        tasks = [watch.task for watch in self._watches.values()]
        for name in list(self._watches):
            self.unwatch(name)
        for mon in self._kept:
            mon.close(linger=0)
        self._kept.clear()
        return tasks


def _monitor_off(socket: Any) -> bool:
    """Turn ``socket``'s monitor off; False when it cannot be (the socket is closed). Once off,
    libzmq sends no more events, so the monitor's reading end may close."""
    if socket.closed:
        return False
    try:
        socket.disable_monitor()
    except zmq.ZMQError:
        return False
    return True
