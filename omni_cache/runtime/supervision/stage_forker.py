"""Stage processes forked from a process that imported vLLM once (``server.stage_launch: fork``).

A fresh ``python -m workers`` spends 15-20 s of CPU importing vLLM, torch and transformers before
its engine is built; a pipeline of three stages paid that three times, and every restart again.
:class:`StageForkers` starts ``python -m workers.forker`` (:mod:`workers.forker`: it imports all
that, then forks stage processes on request) and :class:`ForkedRunner` runs a stage replica
through it, behind the same :class:`~omni_cache.runtime.supervision.process_runner.ProcessRunner`
interface as a spawned one: the child runs the same command with the same environment, in its
own process group, its output read here; its exit code comes from the forker, which is its
parent.

One forker per import-time environment: a stage's environment is applied in the child, but what
libraries read when they load (``OMP_NUM_THREADS`` for torch's OpenMP) was read in the forker.
Stages whose environments differ only in :data:`RUN_TIME_ENV` (read when the engine is built,
in the child) share one; any other difference gets its own forker. If a forker dies, its stages
get SIGTERM and are reported as ended; the next start makes a new one.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping

from omni_cache.config import PipelineConfig
from omni_cache.runtime.supervision.process_runner import exit_words, spawned_stage_env

logger = logging.getLogger(__name__)

#: Environment variables a stage process reads only when its engine is built (vLLM reads them
#: through ``vllm.envs`` then): stages that differ only in these share a forker.
RUN_TIME_ENV = frozenset({"VLLM_CPU_KVCACHE_SPACE"})

FORKER_ARGV = (sys.executable, "-m", "workers.forker")


def import_env_key(env: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """What of ``env`` a forker's imports may have read: stages with equal keys share one."""
    return tuple(sorted((k, v) for k, v in env.items() if k not in RUN_TIME_ENV))


class StageForker:
    """One ``python -m workers.forker`` process and the socket to it."""

    def __init__(self, env: Mapping[str, str]) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._socket = ours
        self._lock = threading.Lock()  # the tables below, and sends
        self._next_id = 0
        self._pending: dict[int, ForkedRunner] = {}  # request id -> runner waiting for its pid
        self._children: dict[int, ForkedRunner] = {}  # pid -> runner of a live child
        self.exit_code: int | None = None  # set once the forker is gone
        self._broken = False  # a send failed: gone, though its end may not have been read yet
        try:
            self.proc = subprocess.Popen(
                [*FORKER_ARGV, "--control-fd", str(theirs.fileno()), "--parent-pid", str(os.getpid())],
                env=dict(env),
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # the terminal's Ctrl-C reaches the server, not its stages
            )
        finally:
            theirs.close()
        threading.Thread(target=self._read_messages, name="omni-cache-forker", daemon=True).start()
        threading.Thread(target=self._read_output, name="omni-cache-forker-log", daemon=True).start()

    @property
    def alive(self) -> bool:
        return self.exit_code is None and not self._broken

    @property
    def idle(self) -> bool:
        """No stage of it runs or waits to be forked."""
        with self._lock:
            return not self._pending and not self._children

    def fork(self, runner: ForkedRunner, args: list[str], env: Mapping[str, str], output: int) -> None:
        """Ask for a child running ``python -m workers ARGS`` with ``env``, its output written to
        ``output`` (a pipe's write end; the caller closes its copy). Its pid reaches
        ``runner.forked`` and its end ``runner.ended``, from this object's thread."""
        with self._lock:
            if not self.alive:
                raise OSError(f"the stage forker ended ({exit_words(self.exit_code)})")
            request_id = self._next_id
            self._next_id += 1
            message = json.dumps({"id": request_id, "args": args, "env": dict(env)}).encode()
            try:
                socket.send_fds(self._socket, [message], [output])
            except OSError:
                self._broken = True
                raise
            self._pending[request_id] = runner

    def retire(self) -> None:
        """Ask the forker to end, without waiting for it (it reads our end as closed)."""
        with contextlib.suppress(OSError):
            self._socket.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        """End the forker (its remaining children get SIGTERM from the kernel as it goes)."""
        self.retire()
        try:
            self.proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def _read_messages(self) -> None:
        while True:
            try:
                data = self._socket.recv(65536)
            except OSError:
                data = b""
            if not data:
                break
            message = json.loads(data)
            with self._lock:
                if "id" in message:
                    runner = self._pending.pop(message["id"], None)
                    if runner is not None and "pid" in message:
                        self._children[message["pid"]] = runner
                else:
                    runner = self._children.pop(message["pid"], None)
            if runner is None:
                continue
            if "error" in message:
                runner.ended(1, message["error"])
            elif "id" in message:
                runner.forked(message["pid"])
            else:
                runner.ended(message["code"], None)
        self._lost()

    def _lost(self) -> None:
        """The forker is gone: its children got SIGTERM from the kernel; make sure of it, and
        report each as ended."""
        code = self.proc.wait()
        with self._lock:
            self.exit_code = code
            orphans = list(self._pending.values()) + list(self._children.items())
            self._pending.clear()
            self._children.clear()
        with contextlib.suppress(OSError):
            self._socket.close()
        why = f"its forker process ended ({exit_words(code)})"
        for item in orphans:
            if isinstance(item, tuple):
                pid, runner = item
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)
            else:
                runner = item
            runner.ended(-signal.SIGKILL, why)

    def _read_output(self) -> None:
        """The forker's own output (an import that failed): onto the log tail of the stages
        waiting for it, where a start failure shows it."""
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = "[forker] " + raw.decode("utf-8", errors="replace").rstrip("\n")
            with self._lock:
                waiting = list(self._pending.values())
            for runner in waiting:
                runner.echo(line)
            if not waiting:
                logger.warning("stage forker: %s", line)
        self.proc.stdout.close()


class StageForkers:
    """The server's forkers, one per import-time environment (:func:`import_env_key`), each
    started when a stage first needs it. ``keep_idle``: how many forkers with no stage to serve
    are kept when another is started (the least recently used go first); None: all of them (a
    server's forkers are all needed again when one of its stages restarts). A process that runs
    pipelines of changing environments one after another (a test session) bounds them so."""

    def __init__(self, keep_idle: int | None = None) -> None:
        self.keep_idle = keep_idle
        #: What forked stages' environments start from: this process's as the pool was made.
        #: Later imports here change it (cv2 extends LD_LIBRARY_PATH, vLLM sets its own
        #: variables): a forker's imports make those changes for its children themselves
        #: (workers/forker.py ImportedEnv), and forkers keyed by a later copy would differ
        #: from those started earlier for nothing.
        self.base_env = dict(os.environ)
        self._lock = threading.Lock()
        self._forkers: dict[tuple[tuple[str, str], ...], StageForker] = {}

    def forker_for(self, env: Mapping[str, str]) -> StageForker:
        key = import_env_key(env)
        with self._lock:
            forker = self._forkers.pop(key, None)  # put back last: the most recently used
            if forker is None or not forker.alive:
                forker = StageForker(env)
            self._forkers[key] = forker
            idle = [k for k, f in self._forkers.items() if k != key and f.idle]
            spare = len(idle) - self.keep_idle if self.keep_idle is not None else 0
            retired = [self._forkers.pop(k) for k in idle[: max(0, spare)]]
        for old in retired:
            old.retire()
        return forker

    @property
    def started(self) -> list[StageForker]:
        """The forkers started and not retired, the most recently used last."""
        with self._lock:
            return list(self._forkers.values())

    def close(self) -> None:
        with self._lock:
            forkers = list(self._forkers.values())
            self._forkers.clear()
        for forker in forkers:
            forker.close()


def forks_here(config: PipelineConfig) -> bool:
    """Whether ``config``'s stages spawned on this host are forked: ``stage_launch: fork``, on
    Linux (macOS's system libraries are not safe to fork once loaded; other hosts spawn)."""
    return config.server.stage_launch == "fork" and sys.platform.startswith("linux")


def prestart(config: PipelineConfig) -> StageForkers | None:
    """The forkers the stages of ``config`` spawned here will need, started now: they import
    vLLM while the caller imports its own (``omni-serve``'s web front end also loads vLLM, for
    its chat templates: on two cores the two run side by side). None when the config forks no
    stage (``stage_launch: spawn``, Ray, every stage external)."""
    local = [s for s in config.stages if not s.external]
    if not forks_here(config) or config.server.ray_address is not None or not local:
        return None
    forkers = StageForkers()
    for stage in local:
        forkers.forker_for(spawned_stage_env(stage.env, forkers.base_env))
    return forkers


class ForkedRunner:
    """A stage replica's process forked by a :class:`StageForker` (a ProcessRunner)."""

    def __init__(self, forkers: StageForkers, argv: list[str], args: list[str], env: dict[str, str], name: str) -> None:
        self.argv = argv  # the command it is equivalent to (for messages)
        self._forkers = forkers
        self._args = args
        self._env = env
        self.name = name
        self.pid: int | None = None
        self._code: int | None = None
        self._why: str | None = None
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._early_signals: list[int] = []  # sent before the pid was known
        self._on_line: Callable[[str], None] = lambda line: None

    def start(self, on_line: Callable[[str], None]) -> None:
        with self._lock:
            self.pid, self._code, self._why = None, None, None
            self._early_signals.clear()
            self._done = threading.Event()
        self._on_line = on_line
        read_end, write_end = os.pipe()
        threading.Thread(
            target=self._read_output, args=(read_end,), name=f"omni-cache-log-{self.name}", daemon=True
        ).start()
        try:
            for attempt in range(2):  # a forker that died unnoticed is replaced, once
                try:
                    self._forkers.forker_for(self._env).fork(self, self._args, self._env, write_end)
                    break
                except OSError as e:
                    if attempt:
                        self.ended(1, f"could not be forked: {e}")
        finally:
            os.close(write_end)

    # ---- what the forker reports (from its thread) -----------------------------------------------

    def forked(self, pid: int) -> None:
        with self._lock:
            self.pid = pid
            early, self._early_signals = self._early_signals, []
        for sig in early:
            self.signal(sig)

    def ended(self, code: int, why: str | None) -> None:
        with self._lock:
            self._code, self._why = code, why
        self._done.set()

    def echo(self, line: str) -> None:
        with contextlib.suppress(Exception):
            self._on_line(line)

    # ---- ProcessRunner ---------------------------------------------------------------------------

    def poll(self) -> int | None:
        return self._code

    def describe_exit(self, code: int) -> str:
        return exit_words(code) + (f": {self._why}" if self._why else "")

    def signal(self, sig: int) -> None:
        with self._lock:
            if self.pid is None:
                if self._code is None:
                    self._early_signals.append(sig)
                return
            pid = self.pid
        if self._code is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, sig)

    def wait(self, timeout: float) -> bool:
        return self._done.wait(timeout)

    def close(self) -> None:
        pass

    def _read_output(self, read_end: int) -> None:
        with contextlib.suppress(Exception), os.fdopen(read_end, "rb") as stream:
            for raw in stream:
                self.echo(raw.decode("utf-8", errors="replace").rstrip("\n"))
