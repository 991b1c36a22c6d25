"""What the soak probe (python -m benchmarks.soak) samples once a minute besides its requests: the
processes' RSS, the load, and the stages' and the server's counters from /metrics (prefix-cache hit
rates between two scrapes)."""

from __future__ import annotations

import contextlib
from typing import Any

import httpx


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


#: Per-stage samples read from /metrics (names in omni_cache/runtime/metrics/prometheus.py).
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
    from omni_cache.runtime.metrics.prometheus import parse_metrics

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
