"""``benchmarks.hostile`` with the event loop's stalls taken apart (issue 52: where do the p99s go).

    python -m benchmarks.hostile_lag --lag-log /tmp/lags.jsonl [--loop-nice N] [hostile's arguments]

Every time the server's loop wakes more than 25 ms after a 2 ms sleep, one JSON line is written:
the stall (``lag_ms``), the loop thread's CPU time over it (``loop_cpu_ms``, its own work) and its
run-queue delay (``loop_runq_ms``: runnable but on no CPU, from ``/proc/self/task/TID/schedstat``);
what is left of the stall (``other_ms``) is time the thread slept while a timer was due: waiting
for the GIL. A watchdog thread (a 2 ms sleep loop needing only the GIL and a CPU) gives its own
lateness and run-queue delay over the same window, and samples the loop thread's Python stack
(``frames``: the most common, 4 frames deep). At the end a summary line is printed for the stalls
of the attacked phases.

``--loop-nice N`` sets the loop thread's niceness (an experiment: below 0 needs CAP_SYS_NICE)."""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import sys
import threading
import time
from typing import Any

STALL_S = 0.025
TICK_S = 0.002


def _sched(tid: int) -> tuple[float, float]:
    """(CPU time, run-queue delay) of thread ``tid`` of this process, in seconds."""
    with open(f"/proc/self/task/{tid}/schedstat") as f:
        cpu, wait = f.read().split()[:2]
    return int(cpu) / 1e9, int(wait) / 1e9


def _frames(frame: Any) -> str:
    out = []
    while frame is not None and len(out) < 4:
        out.append(f"{frame.f_code.co_name}:{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}")
        frame = frame.f_back
    return " < ".join(out)


class LagRecorder:
    def __init__(self, path: str, loop_nice: int | None) -> None:
        self.out = open(path, "w")  # noqa: SIM115 (open for the run)
        self.loop_nice = loop_nice
        self.ring: collections.deque[tuple[float, str]] = collections.deque(maxlen=500)
        self.watch: collections.deque[tuple[float, float, float]] = collections.deque(maxlen=500)
        self.loop_ident: int | None = None
        self.phase = "start"
        self.rows: list[dict[str, Any]] = []

    def watchdog(self) -> None:
        tid = threading.get_native_id()
        last = _sched(tid)[1]
        while True:
            t = time.perf_counter()
            time.sleep(TICK_S)
            now = time.perf_counter()
            runq = _sched(tid)[1]
            self.watch.append((now, now - t - TICK_S, runq - last))
            last = runq
            frame = sys._current_frames().get(self.loop_ident) if self.loop_ident else None
            self.ring.append((now, _frames(frame) if frame is not None else "?"))

    async def heartbeat(self) -> None:
        tid = threading.get_native_id()
        self.loop_ident = threading.get_ident()
        if self.loop_nice is not None:
            os.setpriority(os.PRIO_PROCESS, tid, self.loop_nice)
        threading.Thread(target=self.watchdog, daemon=True, name="lag-watchdog").start()
        while True:
            t = time.perf_counter()
            cpu0, runq0 = _sched(tid)
            await asyncio.sleep(TICK_S)
            now = time.perf_counter()
            lag = now - t - TICK_S
            if lag <= STALL_S:
                continue
            cpu1, runq1 = _sched(tid)
            watch = [w for w in list(self.watch) if t <= w[0] <= now]
            frames = collections.Counter(s for ts, s in list(self.ring) if t <= ts <= now)
            row = {
                "t": round(time.time(), 3),
                "phase": self.phase,
                "lag_ms": round(lag * 1e3, 1),
                "loop_cpu_ms": round((cpu1 - cpu0) * 1e3, 1),
                "loop_runq_ms": round((runq1 - runq0) * 1e3, 1),
                "other_ms": round((lag - (cpu1 - cpu0) - (runq1 - runq0)) * 1e3, 1),
                "watchdog_late_ms": round(max((w[1] for w in watch), default=0.0) * 1e3, 1),
                "watchdog_runq_ms": round(sum(w[2] for w in watch) * 1e3, 1),
                "frames": frames.most_common(4),
            }
            self.rows.append(row)
            self.out.write(json.dumps(row) + "\n")
            self.out.flush()

    def summary(self, phase: str) -> dict[str, float]:
        rows = [r for r in self.rows if r["phase"] == phase]
        keys = ("lag_ms", "loop_cpu_ms", "loop_runq_ms", "other_ms")
        total = {k: round(sum(r[k] for r in rows), 1) for k in keys}
        return {"phase": phase, "stalls": len(rows), **total, "over_100ms": sum(r["lag_ms"] > 100 for r in rows)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], add_help=False)
    parser.add_argument("--lag-log", default="/tmp/hostile_lags.jsonl")
    parser.add_argument("--loop-nice", type=int, default=None)
    own, rest = parser.parse_known_args(argv)
    rec = LagRecorder(own.lag_log, own.loop_nice)

    import uvicorn.server

    from benchmarks import hostile, hostile_clients

    startup = uvicorn.server.Server.startup

    async def startup_with_heartbeat(self: Any, sockets: Any = None) -> None:
        asyncio.get_running_loop().create_task(rec.heartbeat())
        await startup(self, sockets)

    uvicorn.server.Server.startup = startup_with_heartbeat  # type: ignore[method-assign]
    for name in ("idle", "attacked"):
        method = getattr(hostile_clients.Hostile, name)

        def phased(self: Any, *a: Any, _m: Any = method, _n: str = name) -> Any:
            rec.phase = _n
            try:
                return _m(self, *a)
            finally:
                rec.phase = "between"

        setattr(hostile_clients.Hostile, name, phased)
    code = hostile.main(rest)
    for phase in ("idle", "attacked"):
        print("loop stalls over 25 ms:", json.dumps(rec.summary(phase)))
    return code


if __name__ == "__main__":
    sys.exit(main())
