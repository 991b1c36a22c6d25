"""The process a server's stage processes are forked from (``server.stage_launch: fork``).

Importing vLLM, torch and transformers costs a fresh Python 15-20 s of CPU on a 2-core host, and
every stage process paid it again. This process pays it once: it imports what a stage process
imports, then waits on the socket its server gave it and forks one stage process per request.
The child is what ``python -m workers ARGS`` would be, started with the request's environment:
its own session (process group), its output on the pipe the server sent with the request,
stdin from /dev/null. :mod:`omni_cache.runtime.supervision.stage_forker` is the server's side;
it starts one of these per distinct import-time environment, so a child never runs with
libraries that loaded under another stage's settings (``OMP_NUM_THREADS`` is read when torch
loads).

Messages are JSON datagrams on a ``SOCK_SEQPACKET`` socket, one per message:

- server -> forker: ``{"id": N, "args": [...], "env": {...}}`` with the child's output pipe as
  an SCM_RIGHTS file descriptor;
- forker -> server: ``{"id": N, "pid": P}`` once forked (``{"id": N, "error": "..."}`` when the
  fork failed) and ``{"pid": P, "code": C}`` when a child ended (C as ``subprocess`` gives it:
  negative for a signal).

The forker stays single-threaded (a fork copies only the calling thread: a lock another thread
held would stay locked in the child) and ends when its server's end of the socket closes: the
server closed it, or the server's process ended. Its children, who get SIGTERM when it goes
(``PR_SET_PDEATHSIG``), go with it.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import selectors
import shlex
import signal
import socket
import sys
import traceback

#: What a stage process imports before it serves: its own modules, the vLLM engine and worker it
#: builds (workers/llm_stage.py), the model loader. A module that fails to import here is left to
#: the child, which reports the failure as a fresh process would.
PRELOAD = (
    "workers.stage_process",
    "workers.ar_runner",
    "workers.decoder_runner",
    "workers.latent_worker",
    "workers.models",
    "scheduler.omni_scheduler",
    "omni_cache.cache.latent_store",
    "omni_cache.tiny.checkpoints",
    "vllm",
    "vllm.config",
    "vllm.engine.arg_utils",
    "vllm.v1.engine.llm_engine",
    "vllm.v1.engine.core",
    "vllm.model_executor.model_loader",
    "vllm.model_executor.models.registry",
)


def preload() -> None:
    """Import :data:`PRELOAD` and what this host's platform adds: its worker class (built on
    first use: workers/latent_worker.py) and, on CPU, the attention backend."""
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 -- the child imports it again and reports it
            print(f"workers.forker: preloading {name} failed ({type(e).__name__}: {e})", file=sys.stderr)
    try:
        from vllm.platforms import current_platform

        cpu = current_platform.is_cpu()
        getattr(importlib.import_module("workers.latent_worker"), "CPULatentWorker" if cpu else "GPULatentWorker")
        if cpu:
            importlib.import_module("vllm.v1.attention.backends.cpu_attn")
    except Exception as e:  # noqa: BLE001 -- as above
        print(f"workers.forker: preloading the platform's worker failed ({type(e).__name__}: {e})", file=sys.stderr)


MAX_MESSAGE = 1 << 20  # a request: the stage's arguments and environment


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workers.forker", description=__doc__.split("\n\n")[0])
    parser.add_argument("--control-fd", type=int, required=True, help="the server's socket (inherited)")
    parser.add_argument("--parent-pid", type=int, required=True, help="exit at once if this is no longer our parent")
    args = parser.parse_args(argv)
    # No parent-death signal here: the kernel sends it when the *thread* that started us ends,
    # and a server starts its forkers from whichever thread launches a stage first (a pipeline's
    # event loop, which may end while the process and its other pipelines go on). The server's
    # end of the socket closes when its process does: that ends us (serve() reads it as closed).
    if os.getppid() != args.parent_pid:
        return 0
    control = socket.socket(fileno=args.control_fd)
    before = dict(os.environ)
    preload()
    # What was imported is shared with every child until written: keep the collector from
    # touching (and so copying) those objects in each of them.
    gc.collect()
    gc.freeze()
    return Forker(control, ImportedEnv.since(before)).serve()


class ImportedEnv:
    """What the preloaded modules did to the environment as they loaded (workers/llm_stage.py
    turns vLLM's engine-core process off). A fresh stage process's imports do the same to its
    environment, and the forker's environment is the stage's as far as imports read it (one
    forker per such environment): a child repeats these changes on top of its own."""

    def __init__(self, changed: dict[str, str], removed: list[str]) -> None:
        self.changed = changed
        self.removed = removed

    @classmethod
    def since(cls, before: dict[str, str]) -> ImportedEnv:
        changed = {k: v for k, v in os.environ.items() if before.get(k) != v}
        return cls(changed, [k for k in before if k not in os.environ])

    def applied_to(self, env: dict[str, str]) -> dict[str, str]:
        out = {**env, **self.changed}
        for key in self.removed:
            out.pop(key, None)
        return out


class Forker:
    """Forks stage processes on request and reports how each one ended."""

    def __init__(self, control: socket.socket, imported_env: ImportedEnv) -> None:
        self.control = control
        self.imported_env = imported_env
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)
        # SIGCHLD only writes a byte to the wake pipe (the handler itself runs between two
        # bytecodes of the loop below: reaping is done there, not in it).
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        self.selector = selectors.DefaultSelector()
        self.selector.register(control, selectors.EVENT_READ)
        self.selector.register(self.wake_r, selectors.EVENT_READ)

    def serve(self) -> int:
        while True:
            for key, _ in self.selector.select():
                if key.fileobj is self.control:
                    if not self._take_request():
                        return 0  # the server closed its end: nothing more will be asked
                else:
                    while True:
                        try:
                            if not os.read(self.wake_r, 4096):
                                break
                        except BlockingIOError:
                            break
            self._reap()

    def _take_request(self) -> bool:
        try:
            data, fds, _, _ = socket.recv_fds(self.control, MAX_MESSAGE, 1)
        except ConnectionResetError:
            return False
        if not data:
            return False
        request = json.loads(data)
        if len(fds) != 1:
            for fd in fds:
                os.close(fd)
            self._send({"id": request.get("id"), "error": f"expected the output pipe, got {len(fds)} descriptors"})
            return True
        output = fds[0]
        for stream in (sys.stdout, sys.stderr):  # nothing of ours may be written twice by a child
            stream.flush()
        try:
            pid = os.fork()
        except OSError as e:
            os.close(output)
            self._send({"id": request["id"], "error": f"fork failed: {e}"})
            return True
        if pid == 0:
            self._become_stage(request, output)  # never returns
        os.close(output)
        self._send({"id": request["id"], "pid": pid})
        return True

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self._send({"pid": pid, "code": os.waitstatus_to_exitcode(status)})

    def _send(self, message: dict) -> None:
        try:
            self.control.send(json.dumps(message).encode())
        except OSError:
            pass  # the server is gone: we end when its socket reads as closed

    def _become_stage(self, request: dict, output: int) -> None:
        """In the child: become ``python -m workers ARGS`` with the request's environment."""
        code = 1
        try:
            forker_pid = os.getppid()
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            self.selector.close()
            self.control.close()
            os.close(self.wake_r)
            os.close(self.wake_w)
            os.setsid()  # own process group: the server signals it and vLLM's helpers at once
            devnull = os.open(os.devnull, os.O_RDONLY)
            os.dup2(devnull, 0)
            os.dup2(output, 1)
            os.dup2(output, 2)
            os.close(devnull)
            os.close(output)
            args = with_parent(list(request["args"]), forker_pid)
            sys.argv = [sys.argv[0], *args]
            # ps, top and psutil show the command it stands for, not the forker's. Before the
            # environment changes: the title takes the space of the process's original
            # environment strings, which setproctitle finds only while they are in place.
            import setproctitle

            setproctitle.setproctitle(shlex.join([sys.executable, "-m", "workers", *args]))
            os.environ.clear()
            os.environ.update(self.imported_env.applied_to(request["env"]))
            from workers.__main__ import exit_without_teardown, main

            code = main(args)
            exit_without_teardown(code)
        except SystemExit as e:  # argparse's errors and --help
            code = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
        except BaseException:  # noqa: BLE001 -- reported on the stage's output, as a fresh process would
            traceback.print_exc()
        finally:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except (OSError, ValueError):
                    pass
            os._exit(code)


def with_parent(args: list[str], parent_pid: int) -> list[str]:
    """``args`` with ``--parent-pid`` naming ``parent_pid``: a forked stage's parent is its
    forker, which ends with the server (the stage's check compares against its own parent)."""
    if "--parent-pid" in args:
        i = args.index("--parent-pid")
        return [*args[:i], "--parent-pid", str(parent_pid), *args[i + 2 :]]
    return args


if __name__ == "__main__":
    from workers.__main__ import exit_without_teardown

    exit_without_teardown(main())
