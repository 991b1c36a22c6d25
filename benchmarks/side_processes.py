"""The pipeline of one side of a benchmark, and the processes around it: a private copy of a stage
config (its own name, ipc sockets, port 0), the pipeline served from a thread of this process
(:class:`ManagedServer`) or ``omni-serve`` in a process of its own (:class:`ServerProcess`), its
stop, and busy-loop processes that contend for the cores (:class:`CpuBurners`)."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

import yaml


def socket_dir(tag: str) -> str:
    """Where the private copy's ipc sockets live (removed again when its pipeline stops)."""
    return f"/tmp/omni_cache/bench-{os.getpid()}-{tag}"


def private_config(
    src: str | os.PathLike[str], dst_dir: str | os.PathLike[str], tag: str, stage_env: dict[str, str] | None = None
) -> Path:
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

    def __init__(
        self,
        config_path: str | os.PathLike[str],
        *,
        prefix_cache: bool,
        tag: str,
        checkpoint_dir: str | None = None,
        start_timeout_s: float = 900.0,
        stage_env: dict[str, str] | None = None,
    ) -> None:
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
            orch = Orchestrator(
                load_config(path),
                prefix_cache=self.prefix_cache,
                checkpoint_dir=self.checkpoint_dir,
                echo_stage_logs=False,
            )
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

    def __init__(
        self,
        config_path: str | os.PathLike[str],
        *,
        prefix_cache: bool = True,
        checkpoint_dir: str | None = None,
        start_timeout_s: float = 900.0,
        env: dict[str, str] | None = None,
    ) -> None:
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
        self.proc = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            env={**os.environ, **(self.env or {})},
        )
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
        """Stage name -> pid, from the server's descendants (``python -m workers --stage X``; a
        forked stage is its forker's child, titled so)."""
        import psutil

        out: dict[str, int | None] = {}
        with contextlib.suppress(psutil.Error):
            for child in psutil.Process(self.pid).children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    argv = " ".join(child.cmdline()).split()  # a forked stage's title is one string
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

    CODE = "import torch\ntorch.set_num_threads(1)\na = torch.randn(512, 512)\nwhile True:\n    a = torch.tanh(a @ a)\n"

    def __init__(self, count: int) -> None:
        self.count = count
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> CpuBurners:
        for _ in range(self.count):
            self.procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", self.CODE], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
                )
            )
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.wait(10)
        self.procs.clear()


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
