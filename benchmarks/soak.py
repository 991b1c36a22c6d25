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
import base64
import contextlib
import json
import os
import random
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from benchmarks import report
from benchmarks.harness import ManagedServer, ServerProcess, command_line, log, machine_info, private_config
from benchmarks.workloads import random_text

__all__ = ["KINDS", "Outcome", "PromptSource", "classify", "hit_rates", "pause_schedule", "percentile",
           "rss_growth", "summarize", "main"]

KINDS = ("text", "audio", "stream", "abandon")
OUTCOMES = ("ok", "failed", "aborted", "lost")


# ---- pure parts (unit-tested) --------------------------------------------------------------------

@dataclass
class Outcome:
    """How one request ended, as the client saw it."""

    kind: str
    outcome: str             # one of OUTCOMES
    end_s: float             # when it ended (s since the measured phase began)
    e2e_s: float
    ttfa_s: float | None = None
    status: str | None = None  # failed: "http_<code>", "sse_error" or "no_audio"; lost: why
    detail: str | None = None
    #: failed and lost only: the request (system, user, max_tokens) to replay it alone.
    request: dict[str, Any] | None = None


def classify(*, timed_out: bool, abandoned: bool, status_code: int | None, sse_error: bool,
             complete: bool, audio_asked: bool, got_audio: bool) -> tuple[str, str | None]:
    """(outcome, status) of one request from what the client saw. ``complete``: a JSON 200 body
    was read, or ``data: [DONE]`` arrived."""
    if timed_out:
        return "lost", "timeout"
    if status_code is not None and status_code != 200:
        return "failed", f"http_{status_code}"
    if sse_error:
        return "failed", "sse_error"
    if abandoned:
        return "aborted", None
    if complete:
        if audio_asked and not got_audio:
            return "failed", "no_audio"
        return "ok", None
    # No answer, no clear error: a dropped connection or a stream cut short without an error event.
    return "lost", "no_answer" if status_code is None else "truncated"


def percentile(values: Sequence[float], q: float) -> float | None:
    """benchmarks.report.percentile (numpy's linear method) of ``values``; None when empty."""
    return report.percentile(values, q) if values else None


def summarize(outcomes: Sequence[Outcome]) -> dict[str, Any]:
    """Counts by outcome (and failed/lost by status), p50/p99 end-to-end latency of the ok
    requests and p50/p99 time to first audio of the ok streamed ones."""
    counts = Counter(o.outcome for o in outcomes)
    e2e = [o.e2e_s for o in outcomes if o.outcome == "ok"]
    ttfa = [o.ttfa_s for o in outcomes if o.outcome == "ok" and o.ttfa_s is not None]
    return {
        "requests": len(outcomes),
        **{k: counts.get(k, 0) for k in OUTCOMES},
        "failed_by_status": dict(sorted(Counter(o.status for o in outcomes if o.outcome == "failed").items())),
        "lost_by_reason": dict(sorted(Counter(o.status for o in outcomes if o.outcome == "lost").items())),
        "by_kind": dict(sorted(Counter(o.kind for o in outcomes).items())),
        "e2e_p50_s": percentile(e2e, 50), "e2e_p99_s": percentile(e2e, 99),
        "ttfa_p50_s": percentile(ttfa, 50), "ttfa_p99_s": percentile(ttfa, 99),
    }


def rss_growth(minutes: Sequence[dict[str, Any]], baseline_minute: int) -> dict[str, dict[str, Any]]:
    """Per process: RSS at the end of minute ``baseline_minute`` (1-based; the first minute if the
    run is not longer than that), at the end of the last minute, and the growth in percent."""
    if not minutes:
        return {}
    base = minutes[baseline_minute - 1] if len(minutes) > baseline_minute else minutes[0]
    last = minutes[-1]
    out = {}
    for proc, end in last["rss_mib"].items():
        start = base["rss_mib"].get(proc)
        if start is None or end is None or start <= 0:
            continue
        out[proc] = {"baseline_minute": base["minute"], "baseline_mib": start, "end_mib": end,
                     "growth_pct": round(100.0 * (end - start) / start, 2)}
    return out


def pause_schedule(minutes: float, every_s: float, stages: Sequence[str]) -> list[tuple[float, str]]:
    """(seconds into the run, stage) of each pause: every ``every_s`` from ``every_s`` on, while
    the run lasts, the stages in turn."""
    if not stages or every_s <= 0:
        return []
    count = int(minutes * 60.0 // every_s)
    if count * every_s >= minutes * 60.0:
        count -= 1  # one that would start as the run ends pauses nothing
    return [((k + 1) * every_s, stages[k % len(stages)]) for k in range(count)]


class PromptSource:
    """Prompts whose prefixes churn: a system prompt from a pool of ``shared`` prefixes (one of
    them replaced by a new one every ``rotate_every`` prompts) or, with probability ``fresh``, a
    prefix never seen before; then a fresh user message. Sizes in characters (= thinker tokens of
    the tiny byte-level tokenizer)."""

    def __init__(self, rng: random.Random, *, shared: int = 4, prefix_chars: int = 384,
                 fresh: float = 0.5, rotate_every: int = 40, user_chars: tuple[int, int] = (16, 128)) -> None:
        self.rng = rng
        self.prefix_chars = prefix_chars
        self.fresh = fresh
        self.rotate_every = rotate_every
        self.user_chars = user_chars
        self.pool = [random_text(rng, prefix_chars) for _ in range(shared)]
        self.drawn = 0
        self.rotations = 0

    def next(self) -> tuple[str, str, bool]:
        """(system, user, whether the system prompt is a shared one)."""
        self.drawn += 1
        if self.rotate_every and self.drawn % self.rotate_every == 0:
            self.pool[self.rotations % len(self.pool)] = random_text(self.rng, self.prefix_chars)
            self.rotations += 1
        shared = self.rng.random() >= self.fresh
        system = self.rng.choice(self.pool) if shared else random_text(self.rng, self.prefix_chars)
        return system, random_text(self.rng, self.rng.randint(*self.user_chars)), shared


# ---- one request ---------------------------------------------------------------------------------

@dataclass
class Request:
    kind: str
    system: str
    user: str
    max_tokens: int
    #: abandon: leave the stream after this many chunks, or give up a JSON request after this wait.
    abandon_after_chunks: int | None = None
    abandon_after_s: float | None = None

    @property
    def audio(self) -> bool:
        return self.kind != "text"

    @property
    def streamed(self) -> bool:
        return self.kind == "stream" or (self.kind == "abandon" and self.abandon_after_chunks is not None)


def draw_request(rng: random.Random, prompts: PromptSource, weights: dict[str, float]) -> Request:
    kind = rng.choices(list(weights), weights=list(weights.values()))[0]
    system, user, _ = prompts.next()
    req = Request(kind=kind, system=system, user=user, max_tokens=rng.randint(8, 32))
    if kind == "abandon":
        if rng.random() < 0.5:
            req.abandon_after_chunks = rng.randint(1, 4)
        else:
            req.abandon_after_s = rng.uniform(0.2, 3.0)
    return req


class _Seen:
    def __init__(self) -> None:
        self.status_code: int | None = None
        self.sse_error = False
        self.complete = False
        self.abandoned = False
        self.got_audio = False
        self.ttfa_s: float | None = None
        self.detail: str | None = None


async def _json_request(client: httpx.AsyncClient, url: str, body: dict[str, Any], seen: _Seen) -> None:
    r = await client.post(url, json=body)
    seen.status_code = r.status_code
    if r.status_code != 200:
        seen.detail = r.text[:200]
        return
    message = r.json()["choices"][0]["message"]
    data = (message.get("audio") or {}).get("data")
    seen.got_audio = bool(data) and len(base64.b64decode(data)) > 44  # more than a wav header
    seen.complete = isinstance(message.get("content"), str)


async def _stream_request(client: httpx.AsyncClient, url: str, body: dict[str, Any], seen: _Seen,
                          leave_after: int | None, t0: float) -> None:
    chunks = 0
    async with client.stream("POST", url, json=body) as r:
        seen.status_code = r.status_code
        if r.status_code != 200:
            seen.detail = (await r.aread()).decode("utf-8", "replace")[:200]
            return
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                seen.complete = True
                return
            event = json.loads(payload)
            if "error" in event:
                seen.sse_error = True
                seen.detail = str(event["error"])[:200]
                continue
            for choice in event.get("choices") or []:
                audio = (choice.get("delta") or {}).get("audio")
                if audio and audio.get("data"):
                    seen.got_audio = True
                    if seen.ttfa_s is None:
                        seen.ttfa_s = time.perf_counter() - t0
            chunks += 1
            if leave_after is not None and chunks >= leave_after:
                seen.abandoned = True  # leaving the `async with` closes the connection
                return


async def run_request(client: httpx.AsyncClient, base_url: str, model: str, req: Request,
                      timeout_s: float, t_base: float) -> Outcome:
    """Send ``req`` and classify how it ended; never raises and always returns within
    ``timeout_s`` (plus the time a cancelled request takes to unwind)."""
    body: dict[str, Any] = {
        "model": model, "max_tokens": req.max_tokens, "temperature": 0.0,
        "messages": [{"role": "system", "content": req.system}, {"role": "user", "content": req.user}],
    }
    if req.audio:
        body["modalities"] = ["text", "audio"]
        body["audio"] = {"voice": "default", "format": "pcm16" if req.streamed else "wav"}
    if req.streamed:
        body["stream"] = True
    url = base_url + "/v1/chat/completions"
    seen = _Seen()
    timed_out = False
    t0 = time.perf_counter()
    if req.streamed:
        work = _stream_request(client, url, body, seen, req.abandon_after_chunks, t0)
    else:
        work = _json_request(client, url, body, seen)
    limit = timeout_s
    if req.abandon_after_s is not None and req.abandon_after_s < timeout_s:
        limit = req.abandon_after_s
    try:
        await asyncio.wait_for(work, limit)
    except TimeoutError:
        if limit < timeout_s:
            seen.abandoned = True  # the client gave up on purpose (cancelling closes the connection)
        else:
            timed_out = True
    except (httpx.HTTPError, OSError, ValueError, KeyError, IndexError) as e:
        seen.detail = f"{type(e).__name__}: {e}"[:200]
    t1 = time.perf_counter()
    outcome, status = classify(timed_out=timed_out, abandoned=seen.abandoned, status_code=seen.status_code,
                               sse_error=seen.sse_error, complete=seen.complete, audio_asked=req.audio,
                               got_audio=seen.got_audio)
    return Outcome(kind=req.kind, outcome=outcome, end_s=t1 - t_base, e2e_s=t1 - t0,
                   ttfa_s=seen.ttfa_s if req.streamed else None, status=status,
                   detail=seen.detail if outcome in ("failed", "lost") else None,
                   request=asdict(req) if outcome in ("failed", "lost") else None)


# ---- the processes and the server's view ---------------------------------------------------------

def rss_mib(pids: dict[str, int | None], server_pid: int | None = None) -> dict[str, float | None]:
    """RSS (MiB) of this process and of each stage process including its children. With
    ``server_pid`` (``--server-process``) the server's own process is reported apart from this one
    (then only the probe's client)."""
    import psutil

    def tree_rss(pid: int) -> float | None:
        try:
            p = psutil.Process(pid)
            total = p.memory_info().rss
            for c in p.children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    total += c.memory_info().rss
            return round(total / 2**20, 1)
        except psutil.Error:
            return None

    def own_rss(pid: int | None) -> float | None:
        with contextlib.suppress(psutil.Error):
            return round(psutil.Process(pid).memory_info().rss / 2**20, 1)
        return None

    # Only the server's own RSS: its children are the stage processes, counted under their names.
    if server_pid is None:
        out: dict[str, float | None] = {"server+orchestrator+client": own_rss(None)}
    else:
        out = {"server+orchestrator": own_rss(server_pid), "client": own_rss(None)}
    for name, pid in pids.items():
        out[name] = tree_rss(pid) if pid else None
    return out


def loadavg() -> list[float]:
    with open("/proc/loadavg") as f:
        return [float(x) for x in f.read().split()[:3]]


#: Per-stage samples read from /metrics (names in omni_cache/runtime/metrics.py).
STAGE_SAMPLES = {
    "omni_cache_stage_queue_depth": "queue_depth",
    "omni_cache_stage_requests_total": "requests",
    "omni_cache_stage_errors_total": "errors",
    "omni_cache_stage_restarts_total": "restarts",
    "omni_cache_stage_failed_requests_total": "failed_requests",
    "omni_cache_stage_heap_trims": "heap_trims",
    "omni_cache_stage_heap_trim_seconds": "heap_trim_s",
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:prefix_cache_queries_total": "prefix_queried_tokens",
    "vllm:prefix_cache_hits_total": "prefix_hit_tokens",
}

#: The server process's own samples.
SERVER_SAMPLES = {
    "omni_cache_server_heap_trims_total": "heap_trims",
    "omni_cache_server_heap_trim_seconds_total": "heap_trim_s",
}


async def scrape(client: httpx.AsyncClient, base_url: str) -> dict[str, Any] | None:
    """Per-stage samples of :data:`STAGE_SAMPLES`, the server's requests in flight and
    :data:`SERVER_SAMPLES`."""
    from omni_cache.runtime.metrics import parse_metrics

    try:
        r = await client.get(base_url + "/metrics", timeout=30.0)
        r.raise_for_status()
        samples = parse_metrics(r.text)
    except (httpx.HTTPError, ValueError):
        return None
    stages: dict[str, dict[str, float]] = {}
    server: dict[str, float] = {}
    in_flight = None
    for name, labels, value in samples:
        if name == "omni_cache_requests_in_flight":
            in_flight = value
        elif name in SERVER_SAMPLES:
            server[SERVER_SAMPLES[name]] = value
        elif name in STAGE_SAMPLES and "stage" in labels:
            stages.setdefault(labels["stage"], {})[STAGE_SAMPLES[name]] = value
    return {"in_flight": in_flight, "stages": stages, "server": server}


# ---- the run -------------------------------------------------------------------------------------

def hit_rates(before: dict[str, Any] | None, after: dict[str, Any] | None) -> dict[str, float | None]:
    """Per vLLM stage: prefix-cache hit tokens / queried tokens between two scrapes (``before``
    None: since the stages started)."""
    if after is None:
        return {}
    before = before or {"stages": {}}
    out: dict[str, float | None] = {}
    for stage, now in after["stages"].items():
        if "prefix_queried_tokens" not in now:
            continue
        prev = before["stages"].get(stage, {})
        queried = now["prefix_queried_tokens"] - prev.get("prefix_queried_tokens", 0.0)
        hits = now.get("prefix_hit_tokens", 0.0) - prev.get("prefix_hit_tokens", 0.0)
        out[stage] = round(hits / queried, 3) if queried > 0 else None
    return out


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
    def __init__(self, url: str, model: str, args: argparse.Namespace, stage_pids: Any,
                 server_pid: int | None = None) -> None:
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
        return httpx.AsyncClient(timeout=timeout, trust_env=False,
                                 limits=httpx.Limits(max_connections=None,
                                                     max_keepalive_connections=self.args.concurrency + 4))

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
            log(f"soak: {stage} after the pause: " + (f"replaced by pid {now}" if now != pid
                                                      else "the same process, continued"))

    async def _minute(self, client: httpx.AsyncClient, index: int, since: float, until: float) -> dict[str, Any]:
        ended = [o for o in self.outcomes if since <= o.end_s < until]
        metrics = await scrape(client, self.url)
        row = {"minute": index, "t_end_s": round(until, 1), **summarize(ended),
               "started_total": self.started, "rss_mib": rss_mib(self.stage_pids(), self.server_pid),
               "loadavg": loadavg(), "prefix_hit_rate": hit_rates(self._last_scrape, metrics),
               "metrics": metrics}
        self._last_scrape = metrics or self._last_scrape
        self._print_row(row)
        return row

    @staticmethod
    def _ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1000:.0f}"

    def _print_row(self, row: dict[str, Any]) -> None:
        rss = " ".join(f"{v if v is not None else '-'}" for v in row["rss_mib"].values())
        hits = " ".join(f"{s}={'-' if v is None else f'{v:.0%}'}" for s, v in row["prefix_hit_rate"].items())
        print(f"{row['minute']!s:>5} {row['ok']:>5} {row['failed']:>6} {row['aborted']:>7} {row['lost']:>5} "
              f"{self._ms(row['e2e_p50_s']):>8} {self._ms(row['e2e_p99_s']):>8} "
              f"{self._ms(row['ttfa_p50_s']):>8} {self._ms(row['ttfa_p99_s']):>8}  {rss:<32} "
              f"{' '.join(f'{x:.2f}' for x in row['loadavg'])}  {hits}", flush=True)

    async def run(self) -> dict[str, Any]:
        args = self.args
        async with self._client() as client:
            procs = " ".join(rss_mib(self.stage_pids(), self.server_pid))
            print(f"\n{'min':>5} {'ok':>5} {'failed':>6} {'aborted':>7} {'lost':>5} {'e2e p50':>8} "
                  f"{'e2e p99':>8} {'ttfa p50':>8} {'ttfa p99':>8}  RSS MiB ({procs})  loadavg 1/5/15  "
                  "prefix-cache hit rate",
                  flush=True)
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
            drain = await self._minute(client, "drain", since, float("inf")) if any(
                o.end_s >= since for o in self.outcomes) else None
            idle = await self._idle(client)
        totals = summarize(self.outcomes)
        unended = self.started - len(self.outcomes)
        return {
            "measured_s": round(t_drain, 1), "started": self.started, "ended": len(self.outcomes),
            "not_ended": unended, "totals": totals, "minutes": self.minutes, "drain": drain,
            "rss_growth": rss_growth(self.minutes, args.rss_baseline_minute), "idle": idle,
            "prompt_rotations": self.prompts.rotations, "pauses": self.pauses,
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
                return {"empty": empty, "waited_s": round(waited, 1), "queue_depth": held,
                        "in_flight": None if m is None else m["in_flight"], "metrics": m}
            await asyncio.sleep(1.0)


def print_summary(result: dict[str, Any]) -> None:
    t = result["totals"]
    print(f"\ntotals: {t['requests']} requests ({result['started']} started, {result['not_ended']} not ended): "
          f"ok {t['ok']}, failed {t['failed']} {t['failed_by_status'] or ''}, aborted {t['aborted']}, "
          f"lost {t['lost']} {t['lost_by_reason'] or ''}")
    print(f"by kind: {t['by_kind']}; e2e p50/p99 {Soak._ms(t['e2e_p50_s'])}/{Soak._ms(t['e2e_p99_s'])} ms, "
          f"ttfa p50/p99 {Soak._ms(t['ttfa_p50_s'])}/{Soak._ms(t['ttfa_p99_s'])} ms")
    for proc, g in result["rss_growth"].items():
        print(f"RSS {proc}: {g['baseline_mib']} MiB (end of minute {g['baseline_minute']}) -> "
              f"{g['end_mib']} MiB: {g['growth_pct']:+.2f}%")
    for pause in result.get("pauses") or []:
        print(f"pause at {pause['at_s']:g} s: {pause['stage']} (pid {pause['pid']}) "
              + ("replaced by pid " + str(pause.get("pid_after")) if pause.get("replaced")
                 else pause.get("skipped") or "continued"))
    idle = result["idle"]
    print(f"idle after {idle['waited_s']} s: empty={idle['empty']}, queue_depth={idle['queue_depth']}, "
          f"in flight={idle['in_flight']}")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, required=True, help="how long to send new requests")
    p.add_argument("--concurrency", type=int, default=8, help="clients in flight (default 8)")
    p.add_argument("--config", default="stage_configs/tiny_omni.yaml")
    p.add_argument("--kv-blocks", type=int, default=256,
                   help="KV blocks of every vLLM stage (default 256: 8,192 token slots at block_size 32)")
    p.add_argument("--request-timeout", type=float, default=120.0,
                   help="the server's request_timeout_s in the private config (default 120)")
    p.add_argument("--margin", type=float, default=30.0,
                   help="the client waits request timeout + this before it counts a request lost")
    p.add_argument("--mix", type=float, nargs=4, default=[3.0, 3.0, 3.0, 1.0], metavar=("TEXT", "AUDIO", "STREAM", "ABANDON"),
                   help="relative weights of the request kinds (default 3 3 3 1)")
    p.add_argument("--rotate-every", type=int, default=40,
                   help="replace one of the shared prefixes every N requests (default 40)")
    p.add_argument("--max-requests", type=int, default=100_000, help="stop starting requests after N")
    p.add_argument("--rss-baseline-minute", type=int, default=5)
    p.add_argument("--idle-wait", type=float, default=60.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start-timeout", type=float, default=900.0)
    p.add_argument("--stage-env", action="append", default=[], metavar="KEY=VALUE",
                   help="extra environment of every stage process (repeatable), e.g. "
                        "MALLOC_MMAP_THRESHOLD_=131072 to see how much RSS growth is glibc's heap")
    p.add_argument("--server-process", action="store_true",
                   help="serve with omni-serve in a process of its own (its RSS reported apart from "
                        "the probe's client) instead of a thread of this process")
    p.add_argument("--pause-stages", default="", metavar="STAGE[,STAGE...]",
                   help="SIGSTOP these stages in turn (each pause the next one), to see hung stages "
                        "noticed and replaced (default: none)")
    p.add_argument("--pause-every", type=float, default=300.0,
                   help="seconds between pauses, the first one this far into the run (default 300)")
    p.add_argument("--pause-for", type=float, default=30.0,
                   help="seconds a paused stage stays stopped unless replaced (default 30)")
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
            served: Any = ServerProcess(private_config(cfg, tmp, "soak", stage_env),
                                        start_timeout_s=args.start_timeout)
        else:
            served = ManagedServer(cfg, prefix_cache=True, tag="soak", start_timeout_s=args.start_timeout,
                                   stage_env=stage_env)
        with served as srv:
            model = asyncio.run(served_model(srv.url))
            log(f"soak: ready after {srv.startup_s:.1f} s at {srv.url}; stage pids {srv.stage_pids()}; "
                f"{args.minutes:g} min at concurrency {args.concurrency}")
            unknown = {x for x in args.pause_stages.split(",") if x} - set(srv.stage_pids())
            if unknown:
                raise SystemExit(f"--pause-stages: no stage {', '.join(sorted(unknown))} in "
                                 f"{args.config} (its stages: {', '.join(srv.stage_pids())})")
            soak = Soak(srv.url, model, args, srv.stage_pids,
                        server_pid=srv.pid if args.server_process else None)
            result = asyncio.run(soak.run())
            result["startup_s"] = round(srv.startup_s, 1)
    result = {"probe": "omni_cache soak (python -m benchmarks.soak)", "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "command": command_line("benchmarks.soak"), "machine": {**machine, "loadavg_end": loadavg()},
              "config": {k: v for k, v in vars(args).items() if k != "json"}, **result}
    print_summary(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1), encoding="utf-8")
        log(f"soak: wrote {args.json}")
    return 0 if result["totals"]["lost"] == 0 and result["not_ended"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
