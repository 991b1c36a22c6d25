"""The latent store's CUDA and Triton paths on a GPU machine: their tests, then a copy-throughput figure.

    PYTHONPATH=. python3 -m benchmarks.gpu_latent_store [--json OUT.json] [--no-throughput] [PYTEST ARGS...]

CI has no GPU, so there `tests/test_latent_store.py` runs its CPU cases only: the host mirror's copy
pipeline (`omni_cache/cache/host_pipeline.py`), its CUDA driver calls (`cuda_driver.py`) and the
Triton row kernels (`row_kernels.py`) on a GPU run nowhere routinely. This runs on any machine with
a CUDA GPU, torch, triton and pytest (it installs nothing, needs no network and no vLLM):

1. tests: the whole of `tests/test_latent_store.py`, through pytest in this process, with vLLM made
   unimportable (`sys.modules["vllm"] = None`: none of these paths may need it). "GPU tests" are
   those whose id names cuda or triton: the CUDA configurations of every reference test (device
   mirror with its Triton kernel and its torch fallback, host mirror zero-copy / staging / small
   ring / torch copies), no host sync in `write`, CUDA-graph capture of `write`, the host
   pipeline overlapping queued compute, and the Triton kernel in Triton's CPU interpreter. The
   exit status is 0 only if every test passed and no GPU test was skipped.
2. throughput (skipped with --no-throughput; a few seconds): one bf16 latent of hidden 4096, 8192
   tokens (64 MiB of rows), slots in random blocks of 16. GB/s = bytes of the rows / time (one
   direction). Each operation: median of 20 back-to-back calls between CUDA events ("eager":
   launch overhead included, as an eager caller pays it); the device mirror's and the D2D copy
   also as a CUDA-graph replay ("graph": GPU time alone). Against a plain `copy_` of the same
   bytes (D2D; D2H / H2D to pinned memory); the fraction is that copy's time / the operation's
   (graph times where there are). Inputs are not rotated (one 64 MiB batch, about the L2's
   size): `python -m benchmarks.cache_kernels` is the full sweep. Host mirror write: wall time
   from the `write` call until `synchronize()` returns (compute-stream D2D into the staging ring,
   D2H, the drain thread's scatter), median of 10; "write call": the caller's CPU time of one
   64-token `write` (what a decode step pays), median of 200.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
TEST_FILE = ROOT / "tests" / "test_latent_store.py"


class Outcomes:
    """pytest plugin: one outcome per test id (failed in any phase > skipped > passed)."""

    def __init__(self) -> None:
        self.by_id: dict[str, str] = {}

    def pytest_runtest_logreport(self, report) -> None:
        prev = self.by_id.get(report.nodeid)
        if report.failed:
            self.by_id[report.nodeid] = "failed"
        elif report.skipped and prev != "failed":
            self.by_id[report.nodeid] = "skipped"
        elif report.when == "call" and report.passed and prev is None:
            self.by_id[report.nodeid] = "passed"


def is_gpu_test(nodeid: str) -> bool:
    name = nodeid.split("::", 1)[-1].lower()
    return "cuda" in name or "triton" in name


def count(outcomes: dict[str, str]) -> dict[str, int]:
    return {k: sum(1 for v in outcomes.values() if v == k) for k in ("passed", "failed", "skipped")}


def machine() -> dict:
    import triton

    info = dict(
        date=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        gpu=torch.cuda.get_device_name(0),
        torch=torch.__version__,
        torch_cuda=torch.version.cuda,
        triton=triton.__version__,
        python=platform.python_version(),
    )
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        info["driver"] = out.stdout.strip().splitlines()[0] if out.returncode == 0 else "?"
    except (OSError, subprocess.TimeoutExpired, IndexError):
        info["driver"] = "?"
    return info


def run_tests(pytest_args: list[str]) -> tuple[int, dict[str, str]]:
    import pytest

    sys.modules["vllm"] = None  # type: ignore[assignment]  # any import of vllm now fails
    plugin = Outcomes()
    args = [str(TEST_FILE), "-q", "-rfEs", "-p", "no:cacheprovider", "--rootdir", str(ROOT), *pytest_args]
    rc = int(pytest.main(args, plugins=[plugin]))
    return rc, plugin.by_id


def throughput(log) -> list[dict]:
    from benchmarks.kernel_timing import BLOCK, Timer, block_slots
    from omni_cache.cache import row_kernels
    from omni_cache.cache.latent_store import LatentStore

    dev = torch.device("cuda")
    timer = Timer(dev)
    gen = torch.Generator().manual_seed(0)
    h, T, reps = 4096, 8192, 20
    specs = {"hidden": (h, torch.bfloat16)}
    nbytes = T * h * 2
    num_blocks = 4 * T // BLOCK
    sm_cpu = block_slots(T, num_blocks * BLOCK, gen)
    sm = sm_cpu.to(dev)
    src = {"hidden": torch.randn(T, h, device=dev).to(torch.bfloat16)}
    a = torch.empty(nbytes, dtype=torch.uint8, device=dev).random_(0, 255)
    b = torch.empty_like(a)
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    rows: list[dict] = []

    def add(op: str, path: str, fns: list | float, ref: str | None = None, graph: bool = False) -> None:
        """Time fns eagerly (and as a CUDA-graph replay: GPU time alone, if `graph`)."""
        t = fns if isinstance(fns, float) else timer.eager(fns, reps)
        row = dict(op=op, path=path, us=t * 1e6, GBps=nbytes / t / 1e9)
        if graph:
            g = timer.graph(fns, reps)
            row.update(graph_us=g * 1e6, graph_GBps=nbytes / g / 1e9)
        key = "graph_us" if graph else "us"
        if ref is not None:
            base = next(r for r in rows if r["path"] == ref)
            row["vs"], row["frac"] = ref, base[key] / row[key]
        rows.append(row)
        text = f"{op:7s} {path:32s} eager {row['us']:8.1f} us {row['GBps']:7.1f} GB/s"
        if graph:
            text += f" | graph {row['graph_us']:8.1f} us {row['graph_GBps']:7.1f} GB/s"
        log(text + (f" | {row['frac']:.2f} of {ref}" if ref else ""))

    log(f"\n== throughput: 1 latent bf16, hidden {h}, {T} tokens ({nbytes >> 20} MiB of rows) ==")
    add("copy", "D2D copy_", [lambda a=a, b=b: b.copy_(a)], graph=True)
    add("copy", "D2H copy_ (pinned)", [lambda a=a, h=pinned: h.copy_(a, non_blocking=True)])
    add("copy", "H2D copy_ (pinned)", [lambda a=a, h=pinned: a.copy_(h, non_blocking=True)])
    del a, b, pinned
    for name, use_triton in [("triton", True), ("torch", False)]:
        if use_triton and not row_kernels.HAS_TRITON:
            continue
        store = LatentStore(specs, num_blocks, BLOCK, storage="device", device=dev, use_triton=use_triton)
        add("write", f"device mirror, {name}", [lambda s=store: s.write(sm, src)], "D2D copy_", graph=True)
        add("gather", f"device mirror, {name}", [lambda s=store: s.gather(sm)], "D2D copy_", graph=True)
        store.close()
    for mode in ("zero_copy", "staging"):
        store = LatentStore(specs, num_blocks, BLOCK, storage="host", device=dev, host_gather=mode, staging_tokens=T)
        try:
            if mode == "zero_copy":
                ts = []
                for i in range(12):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    store.write(sm, src)
                    store.synchronize()
                    if i >= 2:
                        ts.append(time.perf_counter() - t0)
                add("write", "host mirror (D2D+D2H+scatter)", statistics.median(ts), "D2H copy_ (pinned)")
                small_sm, small = sm[:64], {"hidden": src["hidden"][:64]}
                calls = []
                for _ in range(200):
                    t0 = time.perf_counter()
                    store.write(small_sm, small)
                    calls.append(time.perf_counter() - t0)
                    store.synchronize()
                us = statistics.median(calls) * 1e6
                rows.append(dict(op="write call", path="host mirror, 64 tokens, caller's CPU time", us=us))
                log(f"write call, 64 tokens, host mirror: {us:.1f} us of the caller's CPU")
            store.write(sm, src)
            store.synchronize()
            add(
                "gather",
                f"host mirror, {mode}",
                [lambda s=store: s.gather(sm_cpu)],
                "H2D copy_ (pinned)",
            )
        finally:
            store.close()
    torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", help="write the summary (machine, every test's outcome, throughput) here")
    p.add_argument("--no-throughput", action="store_true", help="run the tests only")
    args, pytest_args = p.parse_known_args(argv)
    if not torch.cuda.is_available():
        print("gpu_latent_store: no CUDA GPU visible to torch: nothing to run here", file=sys.stderr)
        return 2
    try:
        import pytest  # noqa: F401
        import triton  # noqa: F401
    except ImportError as e:
        print(f"gpu_latent_store: {e.name} is not installed (this script installs nothing)", file=sys.stderr)
        return 2
    info = machine()
    print("machine:", json.dumps(info), flush=True)
    rc, outcomes = run_tests(pytest_args)
    gpu = {k: v for k, v in outcomes.items() if is_gpu_test(k)}
    total, gpu_n = count(outcomes), count(gpu)
    rows = []
    if not args.no_throughput:
        try:
            rows = throughput(print)
        except Exception as e:  # the tests' verdict stands; say why there is no figure
            print(f"throughput failed: {type(e).__name__}: {e}")
    ok = rc == 0 and total["failed"] == 0 and gpu_n["skipped"] == 0 and gpu_n["passed"] > 0
    print("\n== summary ==")
    print("| date | GPU | driver | torch (CUDA) | triton | tests passed / failed / skipped | GPU tests passed |")
    print("|---|---|---|---|---|---|---|")
    print(
        f"| {info['date']} | {info['gpu']} | {info['driver']} | {info['torch']} ({info['torch_cuda']}) | "
        f"{info['triton']} | {total['passed']} / {total['failed']} / {total['skipped']} | "
        f"{gpu_n['passed']} of {len(gpu)} |"
    )
    for nodeid, outcome in sorted(outcomes.items()):
        if outcome != "passed":
            print(f"{outcome.upper()}: {nodeid}")
    print("RESULT:", "OK" if ok else "FAILED", flush=True)
    if args.json:
        summary = dict(machine=info, pytest_rc=rc, counts=total, gpu_counts=gpu_n, tests=outcomes, throughput=rows)
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
