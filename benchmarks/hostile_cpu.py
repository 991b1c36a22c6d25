"""What the server spends on ``benchmarks.hostile``'s attackers, in CPU time rather than latency:
CPU seconds per second of attack of the server's process (HTTP, orchestrator), its stage
processes, the attackers' process and the probes' (issue 52).

    python -m benchmarks.hostile_cpu [--pairs 2] [--seconds 30] [--attacker-nice 10] [--json OUT]

Latency tails on a shared 2-vCPU host move with whatever else runs there (the idle /health p99
went from 5 to 260 ms between rounds of one run); CPU time spent per second does much less. Per
pair, the server as it is ("now") and as before the changes that followed the stall recorder
(``benchmarks.hostile.as_before``: streams not watched, gzip trailers not read), in turn: the
attacks start, 3 s later each process's CPU time (``/proc``: user + system, all threads) is read,
again ``--seconds`` later, and the attack then ends as in ``benchmarks.hostile``. Same server,
same processes, the variant switched between phases. Also per window: the attacks answered (so
that a cheaper server is not just one that was attacked less) and the load average."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
import uuid
from typing import Any

import psutil

from benchmarks.hostile import TESTS, as_before, cpu_model
from benchmarks.hostile_clients import Hostile

MIB = 1 << 20


def cpu_seconds(pids: dict[str, list[int]]) -> dict[str, float]:
    """name -> user + system CPU seconds of its processes (every thread)."""
    out: dict[str, float] = {}
    for name, group in pids.items():
        total = 0.0
        for pid in group:
            try:
                t = psutil.Process(pid).cpu_times()
                total += t.user + t.system
            except psutil.Error:
                pass
        out[name] = total
    return out


def window(hostile: Hostile, pids: dict[str, list[int]], seconds: float) -> dict[str, Any]:
    """One attack: CPU cores used by each process group over ``seconds`` of it (after 3 s)."""
    result: dict[str, Any] = {}
    attack = threading.Thread(target=lambda: result.update(outcomes=hostile.attacked(seconds)[1]))
    attack.start()
    time.sleep(3.0)  # the attacks' warm-up, as benchmarks.hostile waits before its probes
    load, a, t0 = os.getloadavg()[0], cpu_seconds(pids), time.monotonic()
    time.sleep(seconds)
    b, dt = cpu_seconds(pids), time.monotonic() - t0
    attack.join()
    cores = {k: round((b[k] - a[k]) / dt, 3) for k in pids}
    answered = sum(n for k, n in result["outcomes"].items() if "unexpected" not in k and "failed" not in k)
    return {"cores": cores, "load_1m": (load, os.getloadavg()[0]), "answered": answered, **result}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--token-delay", type=float, default=0.02)
    ap.add_argument("--attacker-nice", type=int, default=10)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(TESTS))
    from fake_pipeline import API_KEY, make_orchestrator, write_config

    from omni_cache.serving.server import ServerThread

    answer = 20000
    path = write_config(
        f"hostile_cpu_{uuid.uuid4().hex[:8]}",
        token_delay_s=args.token_delay,
        max_model_len=2 * answer + 200,
        timeout_s=600,
        server_extra=f", max_outbox_bytes: {MIB}, media: {{allowed_url_hosts: ['127.0.0.1']}}",
    )
    rows: list[dict[str, Any]] = []
    with ServerThread(make_orchestrator(path, manage_heap=True), api_key=API_KEY) as srv:
        srv.wait_ready(60)
        me = psutil.Process()
        stages = [c.pid for c in me.children(recursive=True) if "fake_stage" in " ".join(c.cmdline())]
        options = {"silent_tokens": answer, "silent_hold_s": 300.0, "attacker_nice": args.attacker_nice}
        with Hostile(srv.url, srv.orchestrator.served_model_name, API_KEY, **options) as hostile:
            attacker, prober = (p.pid for p in hostile.procs)
            pids = {"server": [me.pid], "stages": stages, "attackers": [attacker], "probes": [prober]}
            hostile.idle(5)
            for i in range(2 * args.pairs):
                variant = ("now", "before", "before", "now")[i % 4]
                as_before(variant == "before")
                row = {"window": i + 1, "server": variant, **window(hostile, pids, args.seconds)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    summary = {}
    for variant in ("now", "before"):
        mine = [r for r in rows if r["server"] == variant]
        summary[variant] = {k: statistics.median(r["cores"][k] for r in mine) for k in pids}
        summary[variant]["answered"] = statistics.median(r["answered"] for r in mine)
    print("median cores per process group:", json.dumps(summary))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": cpu_model(), "rows": rows, "median": summary, "args": vars(args)}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
