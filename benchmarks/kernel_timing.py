"""How the cache kernels benchmark (python -m benchmarks.cache_kernels) times an operation (CUDA
events, CUDA-graph replays, perf_counter on CPU), and the slots and input rotations it times on."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable

import torch

BLOCK = 16


class Timer:
    """Median time (s) of fn() on `device`; CUDA events on GPU, perf_counter on CPU."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def eager(self, fns: list[Callable], reps: int, warmup: int = 2) -> float:
        """Per-call time of calling fns back to back (launch overhead included)."""
        for _ in range(warmup):
            for f in fns:
                f()
        self.sync()
        ts = []
        for _ in range(reps):
            if self.cuda:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                for f in fns:
                    f()
                b.record()
                b.synchronize()
                ts.append(a.elapsed_time(b) / 1e3 / len(fns))
            else:  # each call on its own: the median and the minimum (CPU runs share the cores)
                for f in fns:
                    t0 = time.perf_counter()
                    f()
                    ts.append(time.perf_counter() - t0)
        self.last_min = min(ts)
        return statistics.median(ts)

    def graph(self, fns: list[Callable], reps: int) -> float:
        """Per-call GPU time: fns captured in one CUDA graph, median of replays."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for f in fns:
                f()
        torch.cuda.current_stream(self.device).wait_stream(side)
        self.sync()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for f in fns:
                f()
        g.replay()
        self.sync()
        ts = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b) / 1e3 / len(fns))
        del g
        return statistics.median(ts)


def block_slots(num_tokens: int, num_slots: int, gen: torch.Generator) -> torch.Tensor:
    nb = num_slots // BLOCK
    blocks = torch.randperm(nb, generator=gen)[: math.ceil(num_tokens / BLOCK)]
    return (blocks[:, None] * BLOCK + torch.arange(BLOCK)).flatten()[:num_tokens].contiguous()


def rotations(nbytes: int, budget: int, lo: int = 2, hi: int = 16) -> int:
    """How many input sets to rotate through so they don't all sit in cache."""
    return max(lo, min(hi, math.ceil(budget / max(nbytes, 1))))
