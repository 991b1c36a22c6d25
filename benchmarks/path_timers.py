"""Where a request's time to first token went, measured inside the engine's process: perf_counter
timers around a few methods on the TTFT path, and how long the process's threads waited for a CPU
(the thinker cache benchmark, python -m benchmarks.thinker_cache)."""

from __future__ import annotations

import os
import time
from typing import Any

# Timers on the TTFT path (in-process engine: scheduler and worker run in this process).
FORWARD = "GPUModelRunner.execute_model"
ENTRY = ("LLMStage.add", "LLMStage.step")


class PathTimers:
    """Accumulates perf_counter time spent in a few methods on the TTFT path: the stage's entry points
    (`add`, `step`: everything the request costs in this process), the model runner's forward
    (`execute_model`: input preparation + forward; the same work in every mode), sampling, scheduling,
    and the latent path. add + step - execute_model is what a mode adds around the forward pass."""

    TARGETS = (
        ("workers.llm_stage", "LLMStage", "add"),
        ("workers.llm_stage", "LLMStage", "step"),
        ("scheduler.omni_scheduler", "OmniSchedulerMixin", "schedule"),
        ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "execute_model"),
        ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "sample_tokens"),
        ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "_execute_mm_encoder"),
        ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "_model_forward"),
        ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "_prepare_inputs"),
        ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "_update_states"),
        ("workers.latent_capture", "LatentCapture", "on_step"),
        ("workers.latent_capture", "LatentCapture", "_gather_with"),
        ("omni_cache.cache.latent_store", "LatentStore", "write"),
        ("workers.llm_stage", "LLMStage", "_attach_latents"),
    )

    def __init__(self) -> None:
        self.totals: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._originals: list[tuple[type, str, Any]] = []

    def install(self) -> None:
        import importlib

        for module, cls_name, meth in self.TARGETS:
            cls = getattr(importlib.import_module(module), cls_name)
            orig = cls.__dict__[meth]
            key = f"{cls_name}.{meth}"
            self._originals.append((cls, meth, orig))
            func = orig.__func__ if isinstance(orig, staticmethod) else orig

            def wrapped(*a, _f=func, _k=key, **kw):
                t0 = time.perf_counter()
                try:
                    return _f(*a, **kw)
                finally:
                    self.totals[_k] = self.totals.get(_k, 0.0) + time.perf_counter() - t0
                    self.calls[_k] = self.calls.get(_k, 0) + 1

            setattr(cls, meth, staticmethod(wrapped) if isinstance(orig, staticmethod) else wrapped)

    def uninstall(self) -> None:
        for cls, meth, orig in reversed(self._originals):
            setattr(cls, meth, orig)
        self._originals.clear()

    def snapshot(self) -> dict[str, float]:
        return dict(self.totals)


_THREAD_NAMES: dict[str, str] = {}


def runqueue_wait_s() -> float:
    """Time this process's serving threads have spent runnable but waiting for a CPU (Linux
    schedstat): how much other jobs on the machine delayed us. gloo's TCP loop threads (vLLM's
    process group, dozens of them, woken briefly every step) are left out: they wait behind the
    stage's own threads at every step (10-25 ms summed over a 25 ms prefix hit on an idle machine)
    without delaying it, and counting them made every hit look contended."""
    total = 0
    try:
        for tid in os.listdir("/proc/self/task"):
            try:
                name = _THREAD_NAMES.get(tid)
                if name is None:
                    with open(f"/proc/self/task/{tid}/comm") as f:
                        name = _THREAD_NAMES[tid] = f.read().strip()
                if name.startswith("gloo"):
                    continue
                with open(f"/proc/self/task/{tid}/schedstat") as f:
                    total += int(f.read().split()[1])
            except (OSError, IndexError, ValueError):
                pass
    except OSError:
        return 0.0
    return total / 1e9
