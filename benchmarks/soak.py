"""Soak probe (not a test): the default tiny pipeline under a mixed workload for M minutes.

    .venv/bin/python -m benchmarks.soak --minutes 30 --json soak.json

It starts ``stage_configs/tiny_omni.yaml`` on a private copy of the config (its own pipeline name,
ipc socket paths and port 0: :class:`benchmarks.harness.ManagedServer`, which serves from a thread
of this process; with ``--server-process``, ``omni-serve`` in a process of its own, so that the
server's RSS is measured apart from the probe's client), with every vLLM stage's
KV pool cut to ``--kv-blocks`` blocks (``engine_args.extra.num_gpu_blocks_override``) so that the
prefix caches (vLLM's block pool, and the hidden-state cache whose slots follow it) fill up and
evict within the first minute. Then ``--concurrency`` clients loop over HTTP on 127.0.0.1 until
the time is up, each request drawn from a seeded stream:

* kinds: ``text`` (text only, one JSON answer), ``audio`` (text + wav, one JSON answer),
  ``stream`` (text + pcm16 over SSE) and ``abandon`` (a client that hangs up mid-answer: a stream
  left after its first chunks, or a JSON request given up after a random wait);
* prompts: a system prompt from a small pool of shared prefixes (replaced one at a time every
  ``--rotate-every`` requests, so old prefixes age out) or a fresh random one, plus a fresh user
  message: enough distinct tokens per minute that the small pool evicts all the time.

Every request ends exactly once, as one of (:func:`classify`):

* ``ok``: the full answer (JSON 200 with its text, and its audio when asked; or an SSE stream
  up to ``data: [DONE]`` with no error event, and audio chunks when asked);
* ``failed``: a clear error: an HTTP status other than 200, an SSE error event, or an answer
  that completed without the audio it asked for (counted by status);
* ``aborted``: the client's own abandonment (only ``abandon`` requests);
* ``lost``: anything else: no answer within the server's request timeout + ``--margin``, or a
  connection that ended without an answer or a clear error. This is the number that must be 0.

Once a minute it records, for the requests that ended in that minute: counts, p50/p99 of the
end-to-end latency of ``ok`` requests and of the time to first audio of ``ok`` streamed ones; the
RSS of this process (HTTP server, orchestrator and the client: ManagedServer serves from a thread
of this process) and of each stage process with its children; /proc/loadavg; the stages'
counters from /metrics. At the end: totals, RSS growth from ``--rss-baseline-minute`` to the last
minute per process, and the stages' live-request counts (``omni_cache_stage_queue_depth``) once
the pipeline is idle. The probe is bounded: ``--minutes``, ``--max-requests``, and every request's
own timeout; the idle check waits at most ``--idle-wait`` seconds.

``--pause-stages thinker,talker,decoder`` makes a stage hang on purpose: every ``--pause-every``
seconds (default 300) the next stage of that list (in turn) gets SIGSTOP, and SIGCONT
``--pause-for`` seconds later (default 30) unless the server replaced it meanwhile (it kills a stage
whose loop stopped moving for ``server.heartbeat_timeout_s``, docs/configuration.md). Each pause
is recorded (when, which stage and pid, whether it was replaced and by which pid); its requests
must end as ``failed`` (a 503 naming the stage) or ``ok``, never ``lost``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx
import yaml

from benchmarks.harness import command_line, log
from benchmarks.machine_monitor import machine_info
from benchmarks.side_processes import ManagedServer, ServerProcess, private_config
from benchmarks.soak_outcomes import Outcome, rss_growth, summarize
from benchmarks.soak_requests import KINDS, PromptSource, draw_request, run_request
from benchmarks.soak_samples import hit_rates, loadavg, rss_mib, scrape

__all__ = ["Soak", "main", "pause_schedule", "soak_config"]


def pause_schedule(minutes: float, every_s: float, stages: Sequence[str]) -> list[tuple[float, str]]:
    """(seconds into the run, stage) of each pause: every ``every_s`` from ``every_s`` on, while
    the run lasts, the stages in turn."""
    if not stages or every_s <= 0:
        return []
    count = int(minutes * 60.0 // every_s)
    if count * every_s >= minutes * 60.0:
        count -= 1  # one that would start as the run ends pauses nothing
    return [((k + 1) * every_s, stages[k % len(stages)]) for k in range(count)]


def soak_config(src: str, dst_dir: str, *, kv_blocks: int, request_timeout_s: float) -> Path:
    """``src`` with every vLLM stage's KV pool set to ``kv_blocks`` blocks (max_model_len cut to
    fit) and the server's request timeout; ManagedServer then makes its private copy of it."""
    data = yaml.safe_load(Path(src).read_text(encoding="utf-8"))
    data.setdefault("server", {})["request_timeout_s"] = request_timeout_s
    for stage in data.get("stages") or []:
        if stage.get("kind") != "autoregressive":
            continue
        args = stage.setdefault("engine_args", {})
        # vLLM refuses a pool that cannot hold one request of max_model_len tokens, and keeps one
        # block of the pool for itself (its null block).
        slots = (kv_blocks - 1) * int(args.get("block_size") or 16)
        if args.get("max_model_len") and args["max_model_len"] > slots:
            args["max_model_len"] = slots
        args.setdefault("extra", {})["num_gpu_blocks_override"] = kv_blocks
    if data.get("checkpoint_dir") and not os.path.isabs(str(data["checkpoint_dir"])):
        data["checkpoint_dir"] = os.path.abspath(str(data["checkpoint_dir"]))
    path = Path(dst_dir) / "soak.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return path


class Soak:
    def __init__(
        self, url: str, model: str, args: argparse.Namespace, stage_pids: Any, server_pid: int | None = None
    ) -> None:
        self.url = url.rstrip("/")
        self.model = model
        self.args = args
        self.stage_pids = stage_pids
        self.server_pid = server_pid  # the server's own process (--server-process), else None
        self.rng = random.Random(args.seed)
        self.prompts = PromptSource(self.rng, rotate_every=args.rotate_every)
        self.weights = dict(zip(KINDS, args.mix, strict=True))
        self.outcomes: list[Outcome] = []
        self.started = 0
        self.minutes: list[dict[str, Any]] = []
        self.pauses: list[dict[str, Any]] = []
        self.t_base = 0.0
        self._last_scrape: dict[str, Any] | None = None

    def _client(self) -> httpx.AsyncClient:
        timeout = httpx.Timeout(self.args.request_timeout + self.args.margin + 30.0, connect=30.0)
        return httpx.AsyncClient(
            timeout=timeout,
            trust_env=False,
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=self.args.concurrency + 4),
        )

    async def _worker(self, client: httpx.AsyncClient, stop_at: float) -> None:
        limit = self.args.request_timeout + self.args.margin
        while time.perf_counter() < stop_at and self.started < self.args.max_requests:
            self.started += 1
            req = draw_request(self.rng, self.prompts, self.weights)
            self.outcomes.append(await run_request(client, self.url, self.model, req, limit, self.t_base))

    async def _pause_stages(self) -> None:
        """SIGSTOP the stages of --pause-stages in turn, each for --pause-for seconds (SIGCONT
        unless the server replaced it meanwhile)."""
        args = self.args
        stages = [x for x in args.pause_stages.split(",") if x] if args.pause_stages else []
        for at_s, stage in pause_schedule(args.minutes, args.pause_every, stages):
            await asyncio.sleep(max(0.0, self.t_base + at_s - time.perf_counter()))
            pid = self.stage_pids().get(stage)
            record: dict[str, Any] = {"at_s": at_s, "stage": stage, "pid": pid}
            self.pauses.append(record)
            if not pid:
                record["skipped"] = "the stage is not running"
                continue
            os.kill(pid, signal.SIGSTOP)
            log(f"soak: {stage} (pid {pid}) stopped at {at_s:g} s for {args.pause_for:g} s")
            await asyncio.sleep(args.pause_for)
            now = self.stage_pids().get(stage)
            record["replaced"] = now != pid
            record["pid_after"] = now
            if now == pid:  # still the stopped process: the server did not notice
                os.kill(pid, signal.SIGCONT)
            log(
                f"soak: {stage} after the pause: "
                + (f"replaced by pid {now}" if now != pid else "the same process, continued")
            )

    async def _minute(self, client: httpx.AsyncClient, index: int, since: float, until: float) -> dict[str, Any]:
        ended = [o for o in self.outcomes if since <= o.end_s < until]
        metrics = await scrape(client, self.url)
        row = {
            "minute": index,
            "t_end_s": round(until, 1),
            **summarize(ended),
            "started_total": self.started,
            "rss_mib": rss_mib(self.stage_pids(), self.server_pid),
            "loadavg": loadavg(),
            "prefix_hit_rate": hit_rates(self._last_scrape, metrics),
            "metrics": metrics,
        }
        self._last_scrape = metrics or self._last_scrape
        self._print_row(row)
        return row

    @staticmethod
    def _ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1000:.0f}"

    def _print_row(self, row: dict[str, Any]) -> None:
        rss = " ".join(f"{v if v is not None else '-'}" for v in row["rss_mib"].values())
        hits = " ".join(f"{s}={'-' if v is None else f'{v:.0%}'}" for s, v in row["prefix_hit_rate"].items())
        print(
            f"{row['minute']!s:>5} {row['ok']:>5} {row['failed']:>6} {row['aborted']:>7} {row['lost']:>5} "
            f"{self._ms(row['e2e_p50_s']):>8} {self._ms(row['e2e_p99_s']):>8} "
            f"{self._ms(row['ttfa_p50_s']):>8} {self._ms(row['ttfa_p99_s']):>8}  {rss:<32} "
            f"{' '.join(f'{x:.2f}' for x in row['loadavg'])}  {hits}",
            flush=True,
        )

    async def run(self) -> dict[str, Any]:
        args = self.args
        async with self._client() as client:
            procs = " ".join(rss_mib(self.stage_pids(), self.server_pid))
            print(
                f"\n{'min':>5} {'ok':>5} {'failed':>6} {'aborted':>7} {'lost':>5} {'e2e p50':>8} "
                f"{'e2e p99':>8} {'ttfa p50':>8} {'ttfa p99':>8}  RSS MiB ({procs})  loadavg 1/5/15  "
                "prefix-cache hit rate",
                flush=True,
            )
            print(f"{'':>5} {'':>5} {'':>6} {'':>7} {'':>5} {'ms':>8} {'ms':>8} {'ms':>8} {'ms':>8}", flush=True)
            self.t_base = time.perf_counter()
            stop_at = self.t_base + args.minutes * 60.0
            pauser = asyncio.create_task(self._pause_stages())
            workers = asyncio.gather(*(self._worker(client, stop_at) for _ in range(args.concurrency)))
            index = 0
            while not workers.done():
                index += 1
                edge = self.t_base + index * 60.0
                if edge > stop_at + 1e-6:
                    break
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(workers), max(0.0, edge - time.perf_counter()))
                if time.perf_counter() >= edge - 0.5:
                    self.minutes.append(await self._minute(client, index, (index - 1) * 60.0, index * 60.0))
            await workers  # the requests still in flight when the time was up (each bounded)
            await pauser  # a pause that started before the end has ended by now
            t_drain = time.perf_counter() - self.t_base
            since = len(self.minutes) * 60.0
            drain = (
                await self._minute(client, "drain", since, float("inf"))
                if any(o.end_s >= since for o in self.outcomes)
                else None
            )
            idle = await self._idle(client)
        totals = summarize(self.outcomes)
        unended = self.started - len(self.outcomes)
        return {
            "measured_s": round(t_drain, 1),
            "started": self.started,
            "ended": len(self.outcomes),
            "not_ended": unended,
            "totals": totals,
            "minutes": self.minutes,
            "drain": drain,
            "rss_growth": rss_growth(self.minutes, args.rss_baseline_minute),
            "idle": idle,
            "prompt_rotations": self.prompts.rotations,
            "pauses": self.pauses,
            "lost_examples": [asdict(o) for o in self.outcomes if o.outcome == "lost"][:20],
            "failed_examples": [asdict(o) for o in self.outcomes if o.outcome == "failed"][:20],
        }

    async def _idle(self, client: httpx.AsyncClient) -> dict[str, Any]:
        """Wait (at most --idle-wait s) until no stage holds a request and nothing is in flight."""
        t0 = time.perf_counter()
        while True:
            m = await scrape(client, self.url)
            held = None if m is None else {s: v.get("queue_depth") for s, v in m["stages"].items()}
            empty = m is not None and not m["in_flight"] and not any(held.values())
            waited = time.perf_counter() - t0
            if empty or waited > self.args.idle_wait:
                return {
                    "empty": empty,
                    "waited_s": round(waited, 1),
                    "queue_depth": held,
                    "in_flight": None if m is None else m["in_flight"],
                    "metrics": m,
                }
            await asyncio.sleep(1.0)


def print_summary(result: dict[str, Any]) -> None:
    t = result["totals"]
    print(
        f"\ntotals: {t['requests']} requests ({result['started']} started, {result['not_ended']} not ended): "
        f"ok {t['ok']}, failed {t['failed']} {t['failed_by_status'] or ''}, aborted {t['aborted']}, "
        f"lost {t['lost']} {t['lost_by_reason'] or ''}"
    )
    print(
        f"by kind: {t['by_kind']}; e2e p50/p99 {Soak._ms(t['e2e_p50_s'])}/{Soak._ms(t['e2e_p99_s'])} ms, "
        f"ttfa p50/p99 {Soak._ms(t['ttfa_p50_s'])}/{Soak._ms(t['ttfa_p99_s'])} ms"
    )
    for proc, g in result["rss_growth"].items():
        print(
            f"RSS {proc}: {g['baseline_mib']} MiB (end of minute {g['baseline_minute']}) -> "
            f"{g['end_mib']} MiB: {g['growth_pct']:+.2f}%"
        )
    for pause in result.get("pauses") or []:
        print(
            f"pause at {pause['at_s']:g} s: {pause['stage']} (pid {pause['pid']}) "
            + (
                "replaced by pid " + str(pause.get("pid_after"))
                if pause.get("replaced")
                else pause.get("skipped") or "continued"
            )
        )
    idle = result["idle"]
    print(
        f"idle after {idle['waited_s']} s: empty={idle['empty']}, queue_depth={idle['queue_depth']}, "
        f"in flight={idle['in_flight']}"
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, required=True, help="how long to send new requests")
    p.add_argument("--concurrency", type=int, default=8, help="clients in flight (default 8)")
    p.add_argument("--config", default="stage_configs/tiny_omni.yaml")
    p.add_argument(
        "--kv-blocks",
        type=int,
        default=256,
        help="KV blocks of every vLLM stage (default 256: 8,192 token slots at block_size 32)",
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        default=120.0,
        help="the server's request_timeout_s in the private config (default 120)",
    )
    p.add_argument(
        "--margin",
        type=float,
        default=30.0,
        help="the client waits request timeout + this before it counts a request lost",
    )
    p.add_argument(
        "--mix",
        type=float,
        nargs=4,
        default=[3.0, 3.0, 3.0, 1.0],
        metavar=("TEXT", "AUDIO", "STREAM", "ABANDON"),
        help="relative weights of the request kinds (default 3 3 3 1)",
    )
    p.add_argument(
        "--rotate-every", type=int, default=40, help="replace one of the shared prefixes every N requests (default 40)"
    )
    p.add_argument("--max-requests", type=int, default=100_000, help="stop starting requests after N")
    p.add_argument("--rss-baseline-minute", type=int, default=5)
    p.add_argument("--idle-wait", type=float, default=60.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start-timeout", type=float, default=900.0)
    p.add_argument(
        "--stage-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra environment of every stage process (repeatable), e.g. "
        "MALLOC_MMAP_THRESHOLD_=131072 to see how much RSS growth is glibc's heap",
    )
    p.add_argument(
        "--server-process",
        action="store_true",
        help="serve with omni-serve in a process of its own (its RSS reported apart from "
        "the probe's client) instead of a thread of this process",
    )
    p.add_argument(
        "--pause-stages",
        default="",
        metavar="STAGE[,STAGE...]",
        help="SIGSTOP these stages in turn (each pause the next one), to see hung stages "
        "noticed and replaced (default: none)",
    )
    p.add_argument(
        "--pause-every",
        type=float,
        default=300.0,
        help="seconds between pauses, the first one this far into the run (default 300)",
    )
    p.add_argument(
        "--pause-for",
        type=float,
        default=30.0,
        help="seconds a paused stage stays stopped unless replaced (default 30)",
    )
    p.add_argument("--json", help="write the result here")
    args = p.parse_args(argv)
    for item in args.stage_env:
        if "=" not in item or not item.split("=", 1)[0]:
            p.error(f"--stage-env {item!r}: expected KEY=VALUE")
    if args.minutes <= 0 or args.concurrency < 1 or args.kv_blocks < 2:
        p.error("--minutes and --concurrency must be positive, --kv-blocks at least 2")
    if args.pause_stages and (args.pause_every <= args.pause_for or args.pause_for <= 0):
        p.error("--pause-for must be positive and shorter than --pause-every")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from benchmarks.client import served_model

    machine = machine_info()
    with tempfile.TemporaryDirectory(prefix="omni_cache_soak_") as tmp:
        cfg = soak_config(args.config, tmp, kv_blocks=args.kv_blocks, request_timeout_s=args.request_timeout)
        log(f"soak: starting the pipeline ({args.config}, {args.kv_blocks} KV blocks per vLLM stage) ...")
        stage_env = dict(item.split("=", 1) for item in args.stage_env) or None
        if args.server_process:
            served: Any = ServerProcess(private_config(cfg, tmp, "soak", stage_env), start_timeout_s=args.start_timeout)
        else:
            served = ManagedServer(
                cfg, prefix_cache=True, tag="soak", start_timeout_s=args.start_timeout, stage_env=stage_env
            )
        with served as srv:
            model = asyncio.run(served_model(srv.url))
            log(
                f"soak: ready after {srv.startup_s:.1f} s at {srv.url}; stage pids {srv.stage_pids()}; "
                f"{args.minutes:g} min at concurrency {args.concurrency}"
            )
            unknown = {x for x in args.pause_stages.split(",") if x} - set(srv.stage_pids())
            if unknown:
                raise SystemExit(
                    f"--pause-stages: no stage {', '.join(sorted(unknown))} in "
                    f"{args.config} (its stages: {', '.join(srv.stage_pids())})"
                )
            soak = Soak(srv.url, model, args, srv.stage_pids, server_pid=srv.pid if args.server_process else None)
            result = asyncio.run(soak.run())
            result["startup_s"] = round(srv.startup_s, 1)
    result = {
        "probe": "omni_cache soak (python -m benchmarks.soak)",
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": command_line("benchmarks.soak"),
        "machine": {**machine, "loadavg_end": loadavg()},
        "config": {k: v for k, v in vars(args).items() if k != "json"},
        **result,
    }
    print_summary(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1), encoding="utf-8")
        log(f"soak: wrote {args.json}")
    return 0 if result["totals"]["lost"] == 0 and result["not_ended"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
