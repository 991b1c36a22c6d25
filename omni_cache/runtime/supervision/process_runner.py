"""Where a stage replica's OS process runs, as the supervisor drives it.

:class:`ProcessRunner` is the interface (start, poll, signal, wait, close); :class:`LocalRunner`
runs the process as a child of this one, in its own process group; ``RayRunner``
(:mod:`omni_cache.runtime.supervision.ray_placement`) runs it under a Ray actor on some node. The supervisor
(:mod:`omni_cache.runtime.supervision.supervisor`) starts, watches, restarts and stops replicas only through
this interface, so both are supervised alike.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping
from typing import Protocol


def spawned_stage_env(stage_env: dict[str, str], base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a stage process started on this machine: ``base`` (default: this
    process's), the stage's ``env:`` over it, output unbuffered (it is read line by line)."""
    return {**(os.environ if base is None else base), **stage_env, "PYTHONUNBUFFERED": "1"}


def default_stage_argv() -> list[str]:
    """The command a stage process runs, before its ``--stage-config ...`` arguments."""
    return [sys.executable, "-m", "workers"]


class StageStartError(RuntimeError):
    """A stage process did not come up (exited, or no StageReady in time)."""


def exit_words(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class ProcessRunner(Protocol):
    """Where one stage replica's OS process runs: a child of this process (:class:`LocalRunner`)
    or a process a Ray actor owns on some node of a cluster (``RayRunner`` in
    :mod:`omni_cache.runtime.supervision.ray_placement`). The supervisor starts, watches, restarts and stops
    spawned replicas only through these methods, so both are supervised alike."""

    #: The command the process runs (for messages).
    argv: list[str]
    #: The current process's pid on its own host; None before the first start.
    pid: int | None

    def start(self, on_line: Callable[[str], None]) -> None:
        """Start (or restart) the process; ``on_line`` gets each line of its output, from any
        thread. Does not wait until the stage is ready (its StageReady says that)."""

    def poll(self) -> int | None:
        """Its exit code once the process started last is gone, else None."""

    def describe_exit(self, code: int) -> str:
        """``code`` (from :meth:`poll`) in words: "exit code 1", "killed by signal SIGKILL"."""

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the process's whole process group (its helpers too)."""

    def wait(self, timeout: float) -> bool:
        """Whether the process is gone within ``timeout`` seconds."""

    def close(self) -> None:
        """Nothing of it is needed any more: release what holds it (after it exited)."""


class LocalRunner:
    """A stage process spawned on this machine, in its own process group."""

    def __init__(self, argv: list[str], env: dict[str, str], name: str) -> None:
        self.argv = argv
        self.env = env
        self.name = name
        self.pid: int | None = None
        self.popen: subprocess.Popen[bytes] | None = None

    def start(self, on_line: Callable[[str], None]) -> None:
        self.popen = subprocess.Popen(
            self.argv,
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # own process group: signals reach vLLM's helpers too
        )
        self.pid = self.popen.pid
        threading.Thread(
            target=self._read_output, args=(self.popen, on_line), name=f"omni-cache-log-{self.name}", daemon=True
        ).start()

    @staticmethod
    def _read_output(proc: subprocess.Popen[bytes], on_line: Callable[[str], None]) -> None:
        assert proc.stdout is not None
        with contextlib.suppress(Exception):
            for raw in proc.stdout:
                on_line(raw.decode("utf-8", errors="replace").rstrip("\n"))
        with contextlib.suppress(Exception):
            proc.stdout.close()

    def poll(self) -> int | None:
        return self.popen.poll() if self.popen is not None else None

    def describe_exit(self, code: int) -> str:
        return exit_words(code)

    def signal(self, sig: int) -> None:
        if self.pid is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, sig)

    def wait(self, timeout: float) -> bool:
        if self.popen is None:
            return True
        try:
            self.popen.wait(timeout=timeout)
            return True
        except subprocess.TimeoutExpired:
            return False

    def close(self) -> None:
        pass
