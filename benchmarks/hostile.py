"""What everyone else gets while 64 hostile clients attack the server (issue 52's must-show): /health
latency, another client's first text, the server's RSS, idle vs attacked, several rounds.

    .venv/bin/python -m benchmarks.hostile [--rounds 3] [--seconds 30] [--json OUT] [--log OUT.md]

The server is the tests' fake pipeline (tests/fake_pipeline.py: the HTTP app and orchestrator in
this process, real stage processes and ZMQ, an echo thinker and a fake decoder, no model), so what
is measured is the server's own work. Its limits are the defaults but for an allowed image host
(127.0.0.1) and ``server.max_outbox_bytes`` of 1 MiB; the fake thinker writes a token every
``--token-delay`` seconds (0.02: 50 tokens/s, about a real thinker's pace on these hosts; each
token of a spoken answer carries 10 ms of audio) and sends every stream's token of one step in one
message, as a real stage sends an engine step's outputs (workers/outbox.py); the fake decoder sends
one audio message per ``--decoder-window`` tokens (16: Qwen3-Omni's decoder sends one per 16 codes,
``chunk_size`` in stage_configs/qwen3_omni.yaml; 1, one per token, was this benchmark's default up to
the nineteenth session's results). A silent reader is cut once the sockets and the
outbox hold its answer (~5 MiB: ~100 s at that pace), so an attacked phase lasts until then. The attacks and probes are
``benchmarks/hostile_clients.py``'s, each in a process of its own
(they would compete for this process's GIL): per round an idle phase (the probes alone) and an
attacked phase (the 64 attacks, their 3 s of warm-up, then the probes), each ``--seconds`` long.
Reported per round: /health p50/p99, first text p50/p99 (a streamed 4-token text answer asked for
every 0.5 s, to its first content delta), the RSS at the phase's start and its peak (sampled
every 20 ms), and the load average; then the medians over rounds and attacked / idle.

``--server-cpus 0 --attacker-cpus 1`` pins the server (with its stage processes and the probes) and
the attackers' process to CPUs of their own, in both phases, so that what the attack traffic costs
to generate does not compete with the server: what is left is what the server does for the
attackers (other processes on the host still go anywhere). ``--ab`` runs twice the rounds, the
server as it is and as before its send watch and gzip trailer check (:func:`as_before`) in turn, and
reports each apart; ``--as-before`` runs only the latter."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from benchmarks.hostile_clients import MIX, Hostile, RssSampler, pin, rss_bound
from benchmarks.report import percentile
from omni_cache.serving.media_fetch import gzip_declared_size as GZIP_DECLARED_SIZE

MIB = 1 << 20
TESTS = Path(__file__).resolve().parents[1] / "tests"


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return f"{line.split(':', 1)[1].strip()} x {os.cpu_count()}"
    return f"? x {os.cpu_count()}"


def summary(probe: dict[str, Any]) -> dict[str, float]:
    ms = lambda xs, q: round(1000 * percentile(xs, q), 2)  # noqa: E731
    return {
        "health_n": len(probe["health"]),
        "health_p50_ms": ms(probe["health"], 50),
        "health_p99_ms": ms(probe["health"], 99),
        "first_text_n": len(probe["first_text"]),
        "first_text_p50_ms": ms(probe["first_text"], 50),
        "first_text_p99_ms": ms(probe["first_text"], 99),
        "probe_failures": probe["failures"],
    }


def as_before(before: bool) -> None:
    """The server as before the changes that followed the stall recorder (``before``) or as it is:
    streams not watched (a silent reader written to until its socket's buffer is full,
    omni_cache/serving/send_watch.py) and gzip trailers not read (each bomb inflated to the limit,
    omni_cache/serving/media_fetch.py). Switched between rounds, in the same process."""
    from omni_cache.serving import media_fetch, routes, send_watch

    routes.SendWatch = (lambda transport, *a: send_watch.SendWatch(None, *a)) if before else send_watch.SendWatch
    media_fetch.gzip_declared_size = (lambda data: None) if before else GZIP_DECLARED_SIZE


def variants(args: argparse.Namespace) -> list[str]:
    """Each round's server: "now", or with ``--ab`` "now" and "before" in turn, ABBA (so that a
    host's load drifting over the run weighs on both alike)."""
    if not args.ab:
        return ["before" if args.as_before else "now"] * args.rounds
    return [("now", "before", "before", "now")[i % 4] for i in range(2 * args.rounds)]


def run(args: argparse.Namespace) -> dict[str, Any]:
    sys.path.insert(0, str(TESTS))
    from fake_pipeline import API_KEY, make_orchestrator, write_config

    from omni_cache.serving.server import ServerThread

    if args.unbounded_ws:  # as before ws_protocol: uvicorn's own, every message read whole on the loop
        from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

        from omni_cache.serving import server

        server.bounded_ws_protocol = lambda *args, **kwargs: WebSocketsSansIOProtocol

    answer = 20000
    path = write_config(
        f"hostile_{uuid.uuid4().hex[:8]}",
        f'{{FAKE_DECODER_WINDOW: "{args.decoder_window}"}}',
        token_delay_s=args.token_delay,
        max_model_len=2 * answer + 200,
        timeout_s=600,
        server_extra=f", max_outbox_bytes: {MIB}, media: {{allowed_url_hosts: ['127.0.0.1']}}",
    )
    rounds: list[dict[str, Any]] = []
    # manage_heap: as omni-serve's own process (heap trims, start-up objects frozen)
    orch = make_orchestrator(path, manage_heap=args.manage_heap)
    with ServerThread(orch, api_key=API_KEY) as srv:
        srv.wait_ready(60)
        config = srv.orchestrator.config
        rss = RssSampler()
        options = {
            "silent_tokens": answer,
            "nested_bytes": 2 * MIB,
            "silent_hold_s": 300.0,
            "attacker_nice": args.attacker_nice,
            "attacker_cpus": args.attacker_cpus,
            "probe_cpus": args.server_cpus,  # the probes beside the server: the attackers' CPU is not theirs
        }
        with Hostile(srv.url, srv.orchestrator.served_model_name, API_KEY, **options) as hostile:
            hostile.idle(5)  # warm: connections, first requests
            for i, variant in enumerate(variants(args)):
                as_before(variant == "before")
                row: dict[str, Any] = {"round": i + 1, "server": variant}
                load = os.getloadavg()[0]
                base = rss.reset()
                row["idle"] = summary(hostile.idle(args.seconds)) | {
                    "rss_mib": round(base / MIB, 1),
                    "rss_peak_mib": round(rss.peak() / MIB, 1),
                    "load_1m": (load, os.getloadavg()[0]),
                }
                load = os.getloadavg()[0]
                base = rss.reset()
                probe, outcomes = hostile.attacked(args.seconds)
                row["attacked"] = summary(probe) | {
                    "rss_mib": round(base / MIB, 1),
                    "rss_peak_mib": round(rss.peak() / MIB, 1),
                    "load_1m": (load, os.getloadavg()[0]),
                    "outcomes": outcomes,
                }
                rounds.append(row)
                print(json.dumps(row), flush=True)
        rss.close()
        bound = rss_bound(config, MIX)
    keys = ("health_p50_ms", "health_p99_ms", "first_text_p50_ms", "first_text_p99_ms")
    by_server: dict[str, Any] = {}
    for variant in sorted({r["server"] for r in rounds}, reverse=True):  # "now" first
        mine = [r for r in rounds if r["server"] == variant]
        med = {p: {k: statistics.median(r[p][k] for r in mine) for k in keys} for p in ("idle", "attacked")}
        ratio = {k: round(med["attacked"][k] / med["idle"][k], 2) for k in keys}
        by_server[variant] = {"medians": med, "ratio": ratio}
    growth = max(r["attacked"]["rss_peak_mib"] - r["attacked"]["rss_mib"] for r in rounds)
    return {
        "machine": cpu_model(),
        "rounds": rounds,
        "by_server": by_server,
        "rss_growth_max_mib": round(growth, 1),
        "rss_bound_mib": round(bound / MIB, 1),
        "mix": MIX,
        "seconds": args.seconds,
        "ws": "uvicorn's own (unbounded)" if args.unbounded_ws else "ws_protocol (bounded)",
        "servers": variants(args),
        "token_delay_s": args.token_delay,
        "decoder_window": args.decoder_window,
        "attacker_nice": args.attacker_nice,
        "server_cpus": args.server_cpus,
        "attacker_cpus": args.attacker_cpus,
        "manage_heap": args.manage_heap,
    }


def table(result: dict[str, Any]) -> str:
    return "\n\n".join(server_table(variant, v["medians"], v["ratio"]) for variant, v in result["by_server"].items())


def server_table(variant: str, m: dict[str, Any], r: dict[str, float]) -> str:
    rows = [
        f"| server {variant} | /health p50 | /health p99 | first text p50 | first text p99 |",
        "|---|---|---|---|---|",
    ]
    for phase in ("idle", "attacked"):
        rows.append(
            f"| {phase} | "
            + " | ".join(f"{m[phase][k]:.1f} ms" for k in ("health_p50_ms", "health_p99_ms"))
            + " | "
            + " | ".join(f"{m[phase][k]:.0f} ms" for k in ("first_text_p50_ms", "first_text_p99_ms"))
            + " |"
        )
    rows.append(
        "| attacked / idle | "
        + " | ".join(
            f"{r[k]:.2f}x" for k in ("health_p50_ms", "health_p99_ms", "first_text_p50_ms", "first_text_p99_ms")
        )
        + " |"
    )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=30.0, help="probe seconds per phase")
    ap.add_argument(
        "--token-delay", type=float, default=0.02, help="the fake thinker's seconds per token (50 tokens/s)"
    )
    ap.add_argument("--decoder-window", type=int, default=16, help="the fake decoder's tokens per audio message")
    ap.add_argument(
        "--no-manage-heap",
        dest="manage_heap",
        action="store_false",
        help="leave the process as the Python API does (no heap trims, no gc.freeze of start-up)",
    )
    ap.add_argument(
        "--attacker-nice", type=int, default=0, help="niceness of the attackers' process (10: the server first)"
    )
    cpus = lambda text: sorted({int(c) for c in text.split(",")})  # noqa: E731
    ap.add_argument(
        "--server-cpus",
        type=cpus,
        help="CPUs (0,1) for the server, its stages and the probes; with --attacker-cpus the attack "
        "traffic's own CPU is kept off the server's (taskset)",
    )
    ap.add_argument("--attacker-cpus", type=cpus, help="CPUs for the attackers' process")
    ap.add_argument(
        "--unbounded-ws", action="store_true", help="uvicorn's own WebSocket protocol (before ws_protocol), to compare"
    )
    ap.add_argument(
        "--as-before",
        action="store_true",
        help="the server as before send_watch and the gzip trailer check (as_before)",
    )
    ap.add_argument("--ab", action="store_true", help="2 x --rounds rounds, the server now and as before in turn")
    ap.add_argument("--json", help="write every number here")
    ap.add_argument("--log", help="append the run (command, machine, rounds, table) to this markdown file")
    args = ap.parse_args(argv)
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    pin(args.server_cpus)  # first: the threads and stage processes started later inherit it
    result = run(args)
    text = table(result)
    print(text)
    growth, bound = result["rss_growth_max_mib"], result["rss_bound_mib"]
    print(f"RSS growth under attack: at most {growth} MiB (config bound {bound} MiB)")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    if args.log:
        with open(args.log, "a") as f:
            f.write(
                f"\n## {started}: `python -m benchmarks.hostile {' '.join(argv or sys.argv[1:])}`\n\n"
                f"Machine: {result['machine']}. WebSocket layer: {result['ws']}. "
                f"Server per round (now / as before send_watch and the gzip trailer check): "
                f"{result['servers']}. Fake thinker: "
                f"{result['token_delay_s']:g} s per token, decoder audio every "
                f"{result['decoder_window']} tokens. Attackers at nice {result['attacker_nice']}. "
                f"CPUs: server, stages and probes {result['server_cpus'] or 'any'}, attackers "
                f"{result['attacker_cpus'] or 'any'}. "
                f"manage_heap (gc.freeze after start-up): {result['manage_heap']}. "
                f"Mix: {result['mix']}, "
                f"{result['seconds']:g} s per phase.\n\n"
                + "".join(f"    {json.dumps(row)}\n" for row in result["rounds"])
                + f"\nMedians over rounds:\n\n{text}\n\nRSS growth under attack: at most "
                f"{result['rss_growth_max_mib']} MiB (bound from the config: {result['rss_bound_mib']} MiB)\n"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
