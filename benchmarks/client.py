"""The benchmark's HTTP client: streamed chat completions timed the way a client sees them, the
request stream driven at a fixed concurrency or Poisson rate, and ``/metrics`` scrapes.

Every request is ``POST /v1/chat/completions`` with ``"stream": true, "modalities": ["text",
"audio"], "stream_options": {"include_usage": true}``. Times are ``time.perf_counter()`` from just
before the request is sent:

* ``ttft_s``: the first SSE chunk whose ``delta.content`` is non-empty (a tiny model that writes
  invalid UTF-8 may have its first bytes held back by vLLM's detokenizer, and an answer with no
  printable text has no TTFT; the server sends no chunk without content);
* ``ttfa_s``: the first chunk carrying ``delta.audio.data``;
* ``e2e_s``: ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from benchmarks.workloads import Session, messages_for, prompt_tokens_expected

__all__ = [
    "Driver",
    "Sample",
    "audio_bytes_of_b64",
    "counter_deltas",
    "metric_counters",
    "scrape_metrics",
    "served_model",
    "stream_chat",
]

SAMPLE_RATE = 24000  # the server's streamed PCM: 24 kHz mono 16-bit


def audio_bytes_of_b64(data: str) -> int:
    """Decoded length of a base64 string, without decoding it."""
    n = len(data)
    if n == 0:
        return 0
    pad = 2 if data.endswith("==") else 1 if data.endswith("=") else 0
    return n * 3 // 4 - pad


@dataclass
class Sample:
    """One request as the client saw it."""

    id: str
    session: int
    kind: str
    turn: int
    ok: bool = False
    error: str | None = None
    status: int | None = None
    scheduled_s: float | None = None  # rate mode: when it was due (measured phase clock)
    start_s: float = 0.0  # when it was sent (measured phase clock)
    #: When it was sent, time.perf_counter() (CLOCK_MONOTONIC on Linux: the clock of the
    #: server's request timelines, omni_cache/timeline.py).
    sent_at: float = 0.0
    response_id: str | None = None  # the stream's "id" (chatcmpl-<the server's request id>)
    ttft_s: float | None = None
    ttfa_s: float | None = None
    e2e_s: float | None = None
    first_chunk_s: float | None = None
    prompt_tokens: int | None = None
    prompt_tokens_expected: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    text_chunks: int = 0
    audio_chunks: int = 0
    audio_bytes: int = 0
    audio_s: float = 0.0
    finish_reason: str | None = None
    answer_sha1: str | None = None
    answer_head: str | None = None  # the first 48 characters of the answer text
    #: Arrival times (s after sending) of every text / audio chunk.
    text_times: list[float] = field(default_factory=list)
    audio_times: list[float] = field(default_factory=list)
    #: Decoded bytes (16-bit PCM) of every audio chunk, in arrival order (a listener's playback:
    #: benchmarks/listener.py).
    audio_sizes: list[int] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


async def stream_chat(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    messages: list[dict[str, str]],
    max_tokens: int,
    sample: Sample,
    headers: dict[str, str],
    t_base: float,
    audio: bool = True,
) -> str:
    """Send one streamed request, fill ``sample`` and return the answer text (``audio=False``:
    a text-only request, as ``vllm bench serve`` sends them)."""
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "modalities": ["text", "audio"],
        "audio": {"voice": "default", "format": "pcm16"},
        "stream_options": {"include_usage": True},
    }
    if not audio:
        body["modalities"] = ["text"]
        del body["audio"]
    text: list[str] = []
    t0 = time.perf_counter()
    sample.start_s = t0 - t_base
    sample.sent_at = t0
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body, headers=headers) as r:
            sample.status = r.status_code
            if r.status_code != 200:
                raw = (await r.aread()).decode("utf-8", "replace")
                try:
                    raw = json.loads(raw)["error"]["message"]
                except Exception:  # noqa: BLE001
                    pass
                sample.error = f"HTTP {r.status_code}: {raw[:300]}"
                return ""
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                now = time.perf_counter() - t0
                if payload == "[DONE]":
                    sample.e2e_s = now
                    break
                chunk = json.loads(payload)
                if sample.first_chunk_s is None:
                    sample.first_chunk_s = now
                    sample.response_id = chunk.get("id")
                if "error" in chunk:
                    err = chunk["error"]
                    sample.error = str(err.get("message", err) if isinstance(err, dict) else err)[:300]
                    continue
                usage = chunk.get("usage")
                if usage:
                    sample.prompt_tokens = usage.get("prompt_tokens")
                    sample.completion_tokens = usage.get("completion_tokens")
                    sample.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
                for choice in chunk.get("choices") or []:
                    delta = choice.get("delta") or {}
                    content = delta.get("content")
                    if content:
                        text.append(content)
                        sample.text_chunks += 1
                        sample.text_times.append(round(now, 6))
                        if sample.ttft_s is None:
                            sample.ttft_s = now
                    audio = delta.get("audio")
                    if audio and audio.get("data"):
                        sample.audio_chunks += 1
                        sample.audio_times.append(round(now, 6))
                        sample.audio_sizes.append(audio_bytes_of_b64(audio["data"]))
                        sample.audio_bytes += sample.audio_sizes[-1]
                        if sample.ttfa_s is None:
                            sample.ttfa_s = now
                    if choice.get("finish_reason"):
                        sample.finish_reason = choice["finish_reason"]
    except (httpx.HTTPError, OSError, ValueError) as e:
        sample.error = f"{type(e).__name__}: {e}"[:300]
    answer = "".join(text)
    sample.audio_s = sample.audio_bytes / 2 / SAMPLE_RATE
    sample.answer_sha1 = hashlib.sha1(answer.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    sample.answer_head = answer[:48]
    if sample.e2e_s is None and sample.error is None:
        sample.error = "the stream ended without data: [DONE]"
    sample.ok = sample.error is None
    return answer


class Driver:
    """Runs sessions against one server: warm-up (sequential, not recorded in the results), then
    the measured sessions at a fixed concurrency or at their Poisson arrival times."""

    def __init__(
        self,
        url: str,
        model: str,
        *,
        api_key: str | None = None,
        concurrency: int | None = None,
        rate: float | None = None,
        request_timeout_s: float = 600.0,
        on_done: Callable[[Sample], None] | None = None,
        audio: bool = True,
        one_message: bool = False,
        stagger_s: float = 0.0,
    ) -> None:
        self.url = url.rstrip("/")
        self.audio = audio
        #: Single-turn requests as one user message (system + user text), the way vllm bench
        #: serve sends benchmarks.export_prompts' lines.
        self.one_message = one_message
        self.model = model
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.concurrency = concurrency
        self.rate = rate
        #: Closed loop: client k sends its first request k * stagger_s after the start (0: all
        #: at once), so requests of equal length do not keep arriving in waves.
        self.stagger_s = stagger_s
        self.timeout = httpx.Timeout(request_timeout_s, connect=30.0)
        self.on_done = on_done
        self.samples: list[Sample] = []
        self.t_base = 0.0
        self.t_end = 0.0

    async def _session(self, client: httpx.AsyncClient, s: Session, out: list[Sample]) -> None:
        answers: list[str] = []
        for turn in range(s.turns):
            msgs = messages_for(s, turn, answers)
            sample = Sample(
                id=s.request_id(turn),
                session=s.index,
                kind=s.kind,
                turn=turn,
                scheduled_s=s.arrival_s if turn == 0 else None,
                prompt_tokens_expected=prompt_tokens_expected(s, turn, answers),
            )
            if self.one_message and s.turns == 1:
                msgs = [{"role": "user", "content": s.system + s.users[0]}]
                sample.prompt_tokens_expected = None  # the template's count is for system + user
            answer = await stream_chat(
                client, self.url, self.model, msgs, s.max_tokens, sample, self.headers, self.t_base, audio=self.audio
            )
            out.append(sample)
            if self.on_done is not None:
                self.on_done(sample)
            if not sample.ok:
                # A failed turn ends its conversation: the next turn would need its answer. The
                # turns not sent are recorded as errors so every planned request is accounted for.
                for k in range(turn + 1, s.turns):
                    skipped = Sample(
                        id=s.request_id(k),
                        session=s.index,
                        kind=s.kind,
                        turn=k,
                        error="not sent: an earlier turn of its conversation failed",
                    )
                    out.append(skipped)
                    if self.on_done is not None:
                        self.on_done(skipped)
                return
            answers.append(answer)

    def _client(self) -> httpx.AsyncClient:
        n = max(4, (self.concurrency or 0) + 4)
        return httpx.AsyncClient(
            timeout=self.timeout, limits=httpx.Limits(max_connections=None, max_keepalive_connections=n)
        )

    async def warmup(self, sessions: list[Session]) -> list[Sample]:
        out: list[Sample] = []
        async with self._client() as client:
            self.t_base = time.perf_counter()
            for s in sessions:
                await self._session(client, s, out)
        return out

    async def run(self, sessions: list[Session]) -> list[Sample]:
        out: list[Sample] = []
        async with self._client() as client:
            self.t_base = time.perf_counter()
            if self.rate is not None:

                async def due(s: Session) -> None:
                    delay = (s.arrival_s or 0.0) - (time.perf_counter() - self.t_base)
                    if delay > 0:
                        await asyncio.sleep(delay)
                    await self._session(client, s, out)

                await asyncio.gather(*(due(s) for s in sessions))
            else:
                queue: asyncio.Queue[Session] = asyncio.Queue()
                for s in sessions:
                    queue.put_nowait(s)

                async def worker(k: int) -> None:
                    await asyncio.sleep(k * self.stagger_s)
                    while True:
                        try:
                            s = queue.get_nowait()
                        except asyncio.QueueEmpty:
                            return
                        await self._session(client, s, out)

                await asyncio.gather(*(worker(k) for k in range(max(1, self.concurrency or 1))))
            self.t_end = time.perf_counter()
        self.samples = out
        return out


# ---- /metrics ---------------------------------------------------------------------------------

#: Counters read from /metrics, per stage (names in omni_cache/runtime/metrics/prometheus.py).
COUNTERS = {
    "queried": "vllm:prefix_cache_queries_total",
    "hit": "vllm:prefix_cache_hits_total",
    "latent_rows": "omni_cache_latent_rows_served_total",
    "requests": "omni_cache_stage_requests_total",
    "restarts": "omni_cache_stage_restarts_total",
    "fresh": "omni_cache_stage_stats_fresh",
    # Playback pacing (stages with `pacing:`; omni_cache/runtime/metrics/pacing_metrics.py).
    "paced": "omni_cache_stage_paced_requests_total",
    "underruns": "omni_cache_stage_audio_underruns_total",
    "first_audio_shared_steps": "omni_cache_stage_first_audio_shared_steps_total",
}


def metric_counters(text: str) -> dict[str, dict[str, float]]:
    """stage -> {queried, hit, latent_rows, requests, restarts, fresh, the pacing counters} from
    Prometheus text; a stage's replicas summed (``fresh``: 1 only when every replica answered)."""
    from omni_cache.runtime.metrics.prometheus import parse_metrics

    by_name = {v: k for k, v in COUNTERS.items()}
    out: dict[str, dict[str, float]] = {}
    for name, labels, value in parse_metrics(text):
        key = by_name.get(name)
        if key is not None and "stage" in labels:
            stage = out.setdefault(labels["stage"], {})
            if key not in stage:
                stage[key] = value
            else:
                stage[key] = min(stage[key], value) if key == "fresh" else stage[key] + value
    return out


async def scrape_metrics(url: str, api_key: str | None = None) -> dict[str, dict[str, float]] | None:
    """The server's per-stage counters, or None when /metrics is not there."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with httpx.AsyncClient(timeout=10.0) as client:
            r = await client.get(url.rstrip("/") + "/metrics", headers=headers)
        if r.status_code != 200:
            return None
        return metric_counters(r.text)
    except (httpx.HTTPError, ValueError):
        return None


def counter_deltas(
    before: dict[str, dict[str, float]] | None, after: dict[str, dict[str, float]] | None
) -> dict[str, dict[str, float]] | None:
    """after - before for every counter of every stage (None if either scrape failed)."""
    if before is None or after is None:
        return None
    out: dict[str, dict[str, float]] = {}
    for stage, vals in after.items():
        prev = before.get(stage, {})
        out[stage] = {k: v - prev.get(k, 0.0) for k, v in vals.items() if k not in ("fresh",)}
        out[stage]["fresh"] = min(vals.get("fresh", 0.0), prev.get("fresh", 0.0))
    return out


async def served_model(url: str, api_key: str | None = None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(timeout=30.0) as client:
        r = await client.get(url.rstrip("/") + "/v1/models", headers=headers)
    if r.status_code == 401:
        raise RuntimeError(f"{url}: 401 Unauthorized: missing or wrong --api-key")
    r.raise_for_status()
    return str(r.json()["data"][0]["id"])
