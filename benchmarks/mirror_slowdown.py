"""What writing latents into the host mirror costs a model step (python -m benchmarks.cache_kernels,
sections "slowdown" and --diag): a matmul-heavy stand-in for the step run like a serving loop, per
step with and without `LatentStore.write` of its outputs, and host-write variants compared."""

from __future__ import annotations

import statistics
import time

import torch

from benchmarks.kernel_timing import BLOCK, block_slots
from omni_cache.cache.latent_store import LatentStore


def _stand_in(dev, h, layers):
    dt = torch.bfloat16
    return [
        (
            (torch.randn(h, 4 * h, device=dev) / h**0.5).to(dt),
            (torch.randn(4 * h, h, device=dev) / (4 * h) ** 0.5).to(dt),
        )
        for _ in range(layers)
    ]


def slowdown_point(dev, ws, h, k, T, quick, gen, store_kw=None, graph_max_tokens=0):
    """Median step time of the stand-in with and without a host-mirror write of its outputs."""
    cuda = dev.type == "cuda"
    dt = torch.bfloat16
    x0 = torch.randn(T, h, device=dev).to(dt)

    def eager_step():
        x, outs = x0, []
        for w1, w2 in ws:
            x = torch.nn.functional.gelu(x @ w1) @ w2
            outs.append(x)
        return outs

    step = eager_step
    graphed = cuda and T <= graph_max_tokens
    if graphed:  # one replay per step; its outputs are static buffers (as in vLLM's graphs)
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            eager_step()
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_outs = eager_step()

        def step():
            graph.replay()
            return static_outs

    specs = {f"l{i}": (h, dt) for i in range(k)}
    num_slots = max(4 * T, 4096) // BLOCK * BLOCK
    # the ring holds one step per entry (as the lead should size it: staging_tokens =
    # max_num_batched_tokens), default depth
    kw = dict(staging_tokens=max(T, 256))
    kw.update(store_kw or {})
    store = LatentStore(specs, num_slots // BLOCK, BLOCK, storage="host", device=dev, **kw)
    sms = [block_slots(T, num_slots, gen).to(dev) for _ in range(4)]
    steps = 6 if quick else 10
    rounds = 3 if quick else 4
    if T >= 16384 and not cuda:
        steps, rounds = 2, 2
    times = {False: [], True: []}
    calls = []

    def run(with_write: bool, n: int):
        for i in range(n):
            t0 = time.perf_counter()
            outs = step()
            if with_write:
                t1 = time.perf_counter()
                # the last k layer outputs (repeated if the stand-in has fewer layers)
                store.write(sms[i % 4], {f"l{j}": outs[(len(outs) - k + j) % len(outs)] for j in range(k)})
                calls.append(time.perf_counter() - t1)
            if cuda:
                torch.cuda.current_stream(dev).synchronize()  # "sampling"
            times[with_write].append(time.perf_counter() - t0)

    run(False, 2)
    run(True, 2)
    times = {False: [], True: []}
    calls.clear()
    waits0 = store.stats["ring_waits"]
    for r in range(rounds):
        for mode in (False, True) if r % 2 == 0 else (True, False):
            run(mode, steps)
    store.synchronize()
    t0, t1 = statistics.median(times[False]), statistics.median(times[True])
    row = dict(
        hidden=h,
        names=k,
        tokens=T,
        layers=len(ws),
        graphed=graphed,
        step_us=t0 * 1e6,
        step_with_write_us=t1 * 1e6,
        added_us=(t1 - t0) * 1e6,
        slowdown=t1 / t0 - 1,
        write_call_us=statistics.median(calls) * 1e6,
        latent_bytes=T * k * h * 2,
        # minima: a steadier estimate where other processes share the cores (CPU runs)
        step_min_us=min(times[False]) * 1e6,
        step_with_write_min_us=min(times[True]) * 1e6,
        slowdown_min=min(times[True]) / min(times[False]) - 1,
        write_call_min_us=min(calls) * 1e6,
        ring_waits=store.stats["ring_waits"] - waits0,
        staging_tokens=store.staging_tokens,
        staging_depth=store.staging_depth,
        store_kw={a: str(b) for a, b in (store_kw or {}).items()},
    )
    store.close()
    return row


def bench_slowdown(dev, hiddens, names_list, tokens_list, layers, quick, gen, log, graph_max_tokens=0):
    rows = []
    for h in hiddens:
        ws = _stand_in(dev, h, layers)
        for T in tokens_list:
            for k in names_list:
                row = slowdown_point(dev, ws, h, k, T, quick, gen, graph_max_tokens=graph_max_tokens)
                rows.append(row)
                log(
                    f"slowdown h={h} k={k} T={T:6d}: step {row['step_us']:10.1f} us, with write "
                    f"{row['step_with_write_us']:10.1f} us -> {100 * row['slowdown']:+6.2f}%  "
                    f"(+{row['added_us']:.1f} us; write() call {row['write_call_us']:.1f} us; "
                    f"{row['latent_bytes'] / 2**20:.1f} MiB latents/step, ring waits {row['ring_waits']})"
                )
        del ws
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return rows


DIAG_VARIANTS = {  # host-write variants: how the caller issues the copies, the drain's threads
    "driver calls, drain 4 threads (default)": {},
    "torch calls, drain 4 threads": {"use_driver": False},
    "driver calls, drain 8 threads": {"drain_threads": 8},
    "driver calls, drain all threads": {"drain_threads": None},
}


def bench_diag(dev, layers, quick, gen, log, graph_max_tokens=0):
    rows = []
    points = [(2048, 1, 1), (4096, 3, 64), (2048, 3, 4096), (4096, 1, 16384), (2048, 3, 32768), (4096, 3, 32768)]
    cache = {}
    for h, k, T in points:
        ws = cache.setdefault(h, _stand_in(dev, h, layers))
        for name, kw in DIAG_VARIANTS.items():
            row = slowdown_point(dev, ws, h, k, T, quick, gen, store_kw=kw, graph_max_tokens=graph_max_tokens)
            row["variant"] = name
            rows.append(row)
            log(
                f"diag h={h} k={k} T={T:6d} {name:38s}: {100 * row['slowdown']:+7.2f}% "
                f"(+{row['added_us']:8.1f} us, call {row['write_call_us']:7.1f} us, waits {row['ring_waits']})"
            )
    return rows
