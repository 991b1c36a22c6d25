"""Bandwidth of the hidden-state cache's write/gather paths, and what the host mirror costs a step.

    python -m benchmarks.cache_kernels --json OUT.json [--quick] [--device cpu|cuda]

1. kernels: `LatentStore.write` / `gather` (device-resident mirror; on CPU the only path) for hidden
   sizes 2048/4096, 1..3 latent names (bf16), batches of 1..32k tokens, as bytes moved / time and as
   a fraction of a plain `dst.copy_(src)` of the same byte volume on the same device (D2D on GPU,
   memcpy on CPU). On GPU each op is timed as a CUDA-graph replay of several calls on rotating
   inputs (GPU time, no launch overhead, inputs larger than L2), and also eagerly (back-to-back
   calls between events: what an eager caller pays, launch overhead included). Slots are realistic:
   random blocks of 16 contiguous slots.
2. host: pinned D2H/H2D copy bandwidth, host-side scatter bandwidth, and gathers from the host mirror
   ("zero_copy" and "staging") against an H2D copy of the same bytes (GPU only).
3. slowdown: a matmul-heavy stand-in for the model step (L layers of bf16 [T,h]x[h,4h] -> GELU ->
   [T,4h]x[4h,h]; its last k layer outputs are the latents), run like a serving loop (one host sync
   per step, as vLLM's sampling does), per-step wall time with and without `store.write(...)` of its
   outputs into a host mirror; slowdown = median(with) / median(without) - 1, rounds interleaved.
   Two knobs shape the stand-in: `--layers` (default 4: a short step, the stress case) and
   `--graph-max-tokens N` (steps of <= N tokens run as one CUDA-graph replay, as vLLM runs decode
   batches up to its capture size, 512 by default; default 0: every step eager, launch-bound for
   small T). `--layers 28 --graph-max-tokens 512` is how vLLM runs a 2048/4096-hidden model.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from benchmarks.kernel_timing import BLOCK, Timer, block_slots, rotations
from benchmarks.mirror_slowdown import bench_diag, bench_slowdown
from omni_cache.cache import row_kernels
from omni_cache.cache.latent_store import LatentStore


def bench_kernels(dev, hiddens, names_list, tokens_list, quick, timer, gen, log):
    cuda = dev.type == "cuda"
    rows = []
    max_t = max(tokens_list)
    num_slots = max(2 * max_t, 4096) // BLOCK * BLOCK
    cache_budget = 256 << 20 if cuda else 64 << 20
    paths = [("triton", True), ("torch", False)] if (cuda and row_kernels.HAS_TRITON) else [("torch", False)]
    for h in hiddens:
        for k in names_list:
            specs = {f"l{i}": (h, torch.bfloat16) for i in range(k)}
            stores = {
                p: LatentStore(
                    specs, num_slots // BLOCK, BLOCK, storage="device", device=dev, use_triton=ut if cuda else None
                )
                for p, ut in paths
            }
            for T in tokens_list:
                nbytes = T * k * h * 2
                R = rotations(nbytes, cache_budget)
                srcs = [{n: torch.randn(T, h, device=dev).to(torch.bfloat16) for n in specs} for _ in range(R)]
                sms = [block_slots(T, num_slots, gen).to(dev) for _ in range(R)]
                cp_src = [torch.empty(nbytes, dtype=torch.uint8, device=dev).random_(0, 255) for _ in range(R)]
                cp_dst = [torch.empty(nbytes, dtype=torch.uint8, device=dev) for _ in range(R)]
                reps = 10 if quick else 25
                if not cuda:
                    reps = 5 if nbytes > (64 << 20) else reps
                copy_fns = [lambda d=cp_dst[i], s=cp_src[i]: d.copy_(s) for i in range(R)]
                t_copy = timer.graph(copy_fns, reps) if cuda else timer.eager(copy_fns, reps)
                t_copy_min = t_copy if cuda else timer.last_min
                if not cuda:  # an allocating copy: gather returns fresh tensors, and first touches
                    # of fresh memory can dominate on CPU (page faults)
                    t_clone = timer.eager([lambda s=cp_src[i]: s.clone() for i in range(R)], reps)
                    t_clone_min = timer.last_min
                for p, store in stores.items():
                    wr = [lambda sm=sms[i], src=srcs[i], s=store: s.write(sm, src) for i in range(R)]
                    ga = [lambda sm=sms[i], s=store: s.gather(sm) for i in range(R)]
                    for op, fns in (("write", wr), ("gather", ga)):
                        t_eager = timer.eager(fns, reps)
                        t_min = t_eager if cuda else timer.last_min
                        t_gpu = timer.graph(fns, reps) if cuda else t_eager
                        row = dict(
                            op=op,
                            path=p,
                            hidden=h,
                            names=k,
                            tokens=T,
                            bytes=nbytes,
                            t_us=t_gpu * 1e6,
                            t_eager_us=t_eager * 1e6,
                            GBps=2 * nbytes / t_gpu / 1e9,
                            copy_us=t_copy * 1e6,
                            copy_GBps=2 * nbytes / t_copy / 1e9,
                            frac=t_copy / t_gpu,
                        )
                        if not cuda:  # minimum over calls: less sensitive to other processes
                            row.update(
                                t_min_us=t_min * 1e6,
                                copy_min_us=t_copy_min * 1e6,
                                GBps_min=2 * nbytes / t_min / 1e9,
                                frac_min=t_copy_min / t_min,
                                clone_us=t_clone * 1e6,
                                clone_min_us=t_clone_min * 1e6,
                                frac_clone_min=t_clone_min / t_min,
                            )
                        rows.append(row)
                        log(
                            f"{op:6s} {p:6s} h={h} k={k} T={T:6d}  {row['t_us']:9.1f} us "
                            f"(eager {row['t_eager_us']:9.1f})  {row['GBps']:7.1f} GB/s  "
                            f"copy {row['copy_GBps']:7.1f} GB/s  frac {row['frac']:.2f}"
                            + (
                                f"  [min: {row['t_min_us']:9.1f} us, frac {row['frac_min']:.2f}, "
                                f"vs clone {row['frac_clone_min']:.2f}]"
                                if not cuda
                                else ""
                            )
                        )
                del srcs, sms, cp_src, cp_dst
            for s in stores.values():
                s.close()
            del stores
            if cuda:
                torch.cuda.empty_cache()
    return rows


def bench_tiles(dev, timer, gen, log):
    """Triton tile configurations for one large case (to check the default)."""
    out = []
    h, k, T = 4096, 3, 16384
    specs = {f"l{i}": (h, torch.bfloat16) for i in range(k)}
    num_slots = 4 * T
    store = LatentStore(specs, num_slots // BLOCK, BLOCK, storage="device", device=dev)
    R = 2
    srcs = [{n: torch.randn(T, h, device=dev).to(torch.bfloat16) for n in specs} for _ in range(R)]
    sms = [block_slots(T, num_slots, gen).to(dev) for _ in range(R)]
    nbytes = T * k * h * 2
    orig = row_kernels.launch_config
    try:
        for bt, bd, w in [
            (8, 1024, 4),
            (4, 1024, 4),
            (16, 512, 4),
            (16, 1024, 8),
            (32, 256, 4),
            (2, 2048, 8),
            (1, 4096, 8),
        ]:
            row_kernels.launch_config = lambda n, d, c=(bt, bd, w): c
            for op in ("write", "gather"):
                fns = [
                    (lambda i=i: store.write(sms[i], srcs[i])) if op == "write" else (lambda i=i: store.gather(sms[i]))
                    for i in range(R)
                ]
                t = timer.graph(fns, 20)
                out.append(dict(op=op, block_t=bt, block_d=bd, warps=w, t_us=t * 1e6, GBps=2 * nbytes / t / 1e9))
                log(
                    f"tile {op:6s} BLOCK_T={bt:3d} BLOCK_D={bd:5d} warps={w}: {t * 1e6:8.1f} us "
                    f"{2 * nbytes / t / 1e9:7.1f} GB/s"
                )
    finally:
        row_kernels.launch_config = orig
    store.close()
    return out


def bench_host(dev, timer, gen, log, quick):
    """Pinned D2H/H2D bandwidth, host scatter bandwidth, gathers from the host mirror."""
    res = {}
    nbytes = 256 << 20
    d = torch.empty(nbytes, dtype=torch.uint8, device=dev).random_(0, 255)
    hbuf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    t_d2h = timer.eager([lambda h=hbuf, d=d: h.copy_(d, non_blocking=True)], 10)
    t_h2d = timer.eager([lambda h=hbuf, d=d: d.copy_(h, non_blocking=True)], 10)
    res["d2h_GBps"], res["h2d_GBps"] = nbytes / t_d2h / 1e9, nbytes / t_h2d / 1e9
    # host scatter (what the drain thread does): index_copy_ of 8 KiB rows as complex128 words
    rows = nbytes // 8192
    mirror = torch.zeros(4 * rows, 8192 // 16, dtype=torch.complex128)
    src = hbuf.view(torch.complex128).view(rows, -1)
    idx = block_slots(rows, 4 * rows, gen)
    ts = []
    for _ in range(5):
        t0 = time.perf_counter()
        mirror.index_copy_(0, idx, src)
        ts.append(time.perf_counter() - t0)
    res["host_scatter_GBps"] = nbytes / statistics.median(ts) / 1e9
    res["host_threads"] = torch.get_num_threads()
    log(
        f"pinned D2H {res['d2h_GBps']:.1f} GB/s, H2D {res['h2d_GBps']:.1f} GB/s, host scatter "
        f"{res['host_scatter_GBps']:.1f} GB/s ({res['host_threads']} threads)"
    )
    del d, hbuf, mirror
    gathers = []
    h = 4096
    for k in (1, 3):
        specs = {f"l{i}": (h, torch.bfloat16) for i in range(k)}
        num_slots = 65536
        for mode in ("zero_copy", "staging"):
            store = LatentStore(specs, num_slots // BLOCK, BLOCK, storage="host", device=dev, host_gather=mode)
            # fill the mirror through the pipeline
            for lo in range(0, num_slots, 8192):
                sm = torch.arange(lo, lo + 8192, device=dev)
                store.write(sm, {n: torch.randn(8192, h, device=dev).to(torch.bfloat16) for n in specs})
            store.synchronize()
            for M in (1024, 16384) if quick else (256, 1024, 4096, 16384):
                sl = [block_slots(M, num_slots, gen) for _ in range(3)]
                nb = M * k * h * 2
                ts = []
                for i in range(6):
                    timer.sync()
                    t0 = time.perf_counter()
                    store.gather(sl[i % 3])
                    timer.sync()
                    ts.append(time.perf_counter() - t0)
                t = statistics.median(ts[1:])
                hb = torch.empty(nb, dtype=torch.uint8, pin_memory=True)
                db = torch.empty(nb, dtype=torch.uint8, device=dev)
                t_ref = timer.eager([lambda db=db, hb=hb: db.copy_(hb, non_blocking=True)], 5)
                row = dict(
                    mode=mode,
                    hidden=h,
                    names=k,
                    tokens=M,
                    bytes=nb,
                    t_us=t * 1e6,
                    GBps=nb / t / 1e9,
                    h2d_GBps=nb / t_ref / 1e9,
                    frac=t_ref / t,
                )
                gathers.append(row)
                log(
                    f"host gather {mode:9s} k={k} M={M:6d}: {row['t_us']:9.1f} us {row['GBps']:6.1f} GB/s"
                    f" (H2D copy of the same bytes {row['h2d_GBps']:6.1f} GB/s, frac {row['frac']:.2f})"
                )
                del hb, db
            store.close()
    res["gather"] = gathers
    return res


def print_tables(res, log):
    log("\n== write / gather (device-resident mirror) ==")
    log(
        f"{'op':6s} {'path':6s} {'h':>5s} {'k':>2s} {'tokens':>6s} {'MiB':>8s} {'t_us':>9s} "
        f"{'eager_us':>9s} {'GB/s':>7s} {'copy GB/s':>9s} {'frac':>5s} {'min_us':>9s} {'frac_min':>8s}"
    )
    for r in res["kernels"]:
        log(
            f"{r['op']:6s} {r['path']:6s} {r['hidden']:5d} {r['names']:2d} {r['tokens']:6d} "
            f"{r['bytes'] / 2**20:8.2f} {r['t_us']:9.1f} {r['t_eager_us']:9.1f} {r['GBps']:7.1f} "
            f"{r['copy_GBps']:9.1f} {r['frac']:5.2f} {r.get('t_min_us', float('nan')):9.1f} "
            f"{r.get('frac_min', float('nan')):8.2f}"
        )
    if res.get("slowdown"):
        log("\n== host mirror: stand-in step slowdown ==")
        log(
            f"{'h':>5s} {'k':>2s} {'tokens':>6s} {'step_us':>10s} {'with_us':>10s} {'added_us':>9s} "
            f"{'call_us':>8s} {'slowdown':>8s} {'waits':>5s} {'min: step':>10s} {'with':>10s} "
            f"{'call':>8s} {'slowdown':>8s}"
        )
        for r in res["slowdown"]:
            log(
                f"{r['hidden']:5d} {r['names']:2d} {r['tokens']:6d} {r['step_us']:10.1f} "
                f"{r['step_with_write_us']:10.1f} {r['added_us']:9.1f} {r['write_call_us']:8.1f} "
                f"{100 * r['slowdown']:7.2f}% {r['ring_waits']:5d} {r['step_min_us']:10.1f} "
                f"{r['step_with_write_min_us']:10.1f} {r['write_call_min_us']:8.1f} "
                f"{100 * r['slowdown_min']:7.2f}%"
            )
    big = [r for r in res["kernels"] if r["tokens"] >= 4096]
    if big:
        for op in ("write", "gather"):
            for path in sorted({r["path"] for r in big}):
                fr = [r["frac"] for r in big if r["op"] == op and r["path"] == path]
                if fr:
                    log(
                        f"{op} [{path}] tokens>=4096: frac of copy bandwidth min {min(fr):.2f} "
                        f"median {statistics.median(fr):.2f}"
                    )


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", required=True, help="where to write all numbers")
    ap.add_argument("--quick", action="store_true", help="fewer sizes and repetitions")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    ap.add_argument("--layers", type=int, default=None, help="stand-in layers (default 4 GPU, 1 CPU)")
    ap.add_argument(
        "--graph-max-tokens",
        type=int,
        default=0,
        help="slowdown: steps of <= N tokens run as a CUDA-graph replay (default 0: eager)",
    )
    ap.add_argument("--diag", action="store_true", help="also compare host-write variants")
    ap.add_argument("--skip", default="", help="comma list of sections to skip: kernels,tiles,host,slowdown")
    args = ap.parse_args(argv)
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = dev.type == "cuda"
    skip = set(filter(None, args.skip.split(",")))
    gen = torch.Generator().manual_seed(0)
    timer = Timer(dev)
    lines: list[str] = []

    def log(s=""):
        print(s, flush=True)
        lines.append(s)

    if cuda:
        props = torch.cuda.get_device_properties(dev)
        device_name = f"{props.name} ({props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB)"
    else:
        device_name = f"CPU {platform.processor() or platform.machine()} ({torch.get_num_threads()} threads)"
    res = {
        "device": device_name,
        "device_type": dev.type,
        "torch": torch.__version__,
        "triton": getattr(row_kernels.triton, "__version__", None),
        "quick": args.quick,
        "layers": args.layers,
        "graph_max_tokens": args.graph_max_tokens,
    }
    log(f"device: {device_name}; torch {torch.__version__}; triton {res['triton']}")

    hiddens = [2048, 4096]
    names_list = [1, 3] if args.quick else [1, 2, 3]
    if cuda:
        tokens = [1, 64, 1024, 4096, 16384, 32768] if args.quick else [1, 4, 16, 64, 256, 1024, 4096, 16384, 32768]
    else:
        tokens = [1, 64, 1024, 4096] if args.quick else [1, 16, 256, 1024, 4096, 16384, 32768]
    # peak copy bandwidth (large)
    big = (1 << 30) if cuda else (256 << 20)
    a = torch.empty(big, dtype=torch.uint8, device=dev).random_(0, 255)
    b = torch.empty_like(a)
    t = timer.eager([lambda a=a, b=b: b.copy_(a)], 10)
    res["copy_peak_GBps"] = 2 * big / t / 1e9
    log(f"plain copy of {big >> 20} MiB: {res['copy_peak_GBps']:.1f} GB/s (read + write)")
    del a, b

    def dump():  # after every section, so a run cut short still leaves its numbers
        res["log"] = lines
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)

    dump()
    if "kernels" not in skip:
        res["kernels"] = bench_kernels(dev, hiddens, names_list, tokens, args.quick, timer, gen, log)
        dump()
    if cuda and row_kernels.HAS_TRITON and "tiles" not in skip:
        res["tiles"] = bench_tiles(dev, timer, gen, log)
        dump()
    if cuda and "host" not in skip:
        res["host"] = bench_host(dev, timer, gen, log, args.quick)
        dump()
    if args.diag:
        res["diag"] = bench_diag(dev, args.layers or (4 if cuda else 1), args.quick, gen, log, args.graph_max_tokens)
        dump()
    if "slowdown" not in skip:
        layers = args.layers or (4 if cuda else 1)
        if cuda:
            st = [1, 256, 4096, 16384] if args.quick else [1, 64, 1024, 4096, 16384, 32768]
        else:
            st = [16, 256] if args.quick else [16, 256, 1024]
        res["slowdown"] = bench_slowdown(dev, hiddens, [1, 3], st, layers, args.quick, gen, log, args.graph_max_tokens)
    res.setdefault("kernels", [])
    print_tables(res, log)
    dump()
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
