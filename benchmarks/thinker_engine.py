"""One mode's engine of the thinker cache benchmark in a process of its own (`EngineProcess`), and
all modes' engines started together."""

from __future__ import annotations

import gc
import time
from typing import Any

import torch

from benchmarks.path_timers import PathTimers
from benchmarks.thinker_prompts import Prompt
from benchmarks.thinker_requests import RequestResult, run_request
from benchmarks.thinker_specs import MAX_TOKENS, MODES, ModelSpec


class EngineProcess:
    """One mode's `LLMStage` in a process of its own, driven over a pipe (requests in, results out).

    The four modes' engines live side by side so that a round can interleave them request by
    request: this machine's speed drifts by 10-30% over tens of seconds (other guests of the host,
    clock), and measuring mode after mode put that drift into the ratios. Only one engine works at
    a time (the others block on their pipe); timing, scheduling wait and the in-process timers are
    taken inside the engine's process, around `LLMStage.add` / `step` as before. The engine's
    latents come back to this process for the checks, so the engine keeps nothing between requests
    (as a stage that sends its rows on)."""

    def __init__(self, mode: str, model: str, engine_args: dict[str, Any], latents: dict[str, Any]) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        self.mode = mode
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=_engine_main,
            name=f"thinker_cache-{mode}",
            daemon=True,
            args=(child, mode, model, engine_args, latents),
        )
        self.proc.start()
        child.close()
        self.info: dict[str, Any] = {}

    def ready(self) -> dict[str, Any]:
        self.info = self._reply()
        return self.info

    def run(self, rid: str, prompt: Prompt | list[int], timed: bool) -> RequestResult:
        self.conn.send(("run", rid, prompt, timed))
        return self._reply()

    def counters(self) -> dict[str, Any]:
        self.conn.send(("counters",))
        return self._reply()

    def stop(self) -> None:
        try:
            self.conn.send(("stop",))
            self._reply()
        except (EOFError, OSError, RuntimeError):
            pass
        self.proc.join(timeout=60)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()

    def _reply(self) -> Any:
        try:
            status, value = self.conn.recv()
        except EOFError:
            raise RuntimeError(f"the {self.mode} engine process died (exit code {self.proc.exitcode})") from None
        if status == "error":
            raise RuntimeError(f"{self.mode} engine: {value}")
        return value


def _engine_main(conn: Any, mode: str, model: str, engine_args: dict[str, Any], latents: dict[str, Any]) -> None:
    """Body of an EngineProcess: build the mode's stage, then serve requests until "stop"."""
    import traceback

    from vllm import SamplingParams

    from workers.latent_capture import LatentOptions
    from workers.llm_stage import LLMStage

    spec = MODES[mode]
    # What the shipped pipeline's talker reads (talker_latents).
    options = LatentOptions(**latents, cache=spec["prefix_cache"]) if spec["latents"] else None
    timers = PathTimers()
    timers.install()
    try:
        t_start = time.perf_counter()
        stage = LLMStage(model, dict(engine_args), prefix_cache=spec["prefix_cache"], latents=options)
        conn.send(("ok", {"startup_s": time.perf_counter() - t_start, "torch_threads": torch.get_num_threads()}))
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    try:
        while True:
            op, *args = conn.recv()
            try:
                if op == "run":
                    rid, prompt, timed = args
                    gc.collect()
                    value: Any = run_request(
                        stage, rid, prompt, params, spec["latents"], timers if timed else None, spec["prefix_cache"]
                    )
                elif op == "counters":
                    store = stage.capture.store if stage.capture is not None else None
                    value = {"counters": stage.counters(), "mirror": repr(store) if store is not None else None}
                elif op == "stop":
                    conn.send(("ok", None))
                    return
                else:
                    raise ValueError(f"unknown operation {op!r}")
            except Exception:
                conn.send(("error", traceback.format_exc()))
                continue
            conn.send(("ok", value))
    finally:
        timers.uninstall()
        stage.engine.engine_core.shutdown()


def start_engines(modes: list[str], model: str, mspec: ModelSpec, latents: dict[str, Any]) -> dict[str, EngineProcess]:
    """All modes' engines, started together (each in its own process) and ready."""
    engines = {m: EngineProcess(m, model, mspec.engine_args, latents) for m in modes}
    try:
        for e in engines.values():
            e.ready()
    except Exception:
        for e in engines.values():
            e.stop()
        raise
    return engines
