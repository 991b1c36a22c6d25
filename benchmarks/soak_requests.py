"""The soak probe's requests (python -m benchmarks.soak): prompts whose prefixes churn, a request
of a seeded kind drawn from them, and one request sent over HTTP and classified as it ended."""

from __future__ import annotations

import asyncio
import base64
import json
import random
import time
from dataclasses import asdict, dataclass
from typing import Any

import httpx

from benchmarks.soak_outcomes import Outcome, classify
from benchmarks.workloads import random_text

KINDS = ("text", "audio", "stream", "abandon")


class PromptSource:
    """Prompts whose prefixes churn: a system prompt from a pool of ``shared`` prefixes (one of
    them replaced by a new one every ``rotate_every`` prompts) or, with probability ``fresh``, a
    prefix never seen before; then a fresh user message. Sizes in characters (= thinker tokens of
    the tiny byte-level tokenizer)."""

    def __init__(
        self,
        rng: random.Random,
        *,
        shared: int = 4,
        prefix_chars: int = 384,
        fresh: float = 0.5,
        rotate_every: int = 40,
        user_chars: tuple[int, int] = (16, 128),
    ) -> None:
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


async def _stream_request(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], seen: _Seen, leave_after: int | None, t0: float
) -> None:
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


async def run_request(
    client: httpx.AsyncClient, base_url: str, model: str, req: Request, timeout_s: float, t_base: float
) -> Outcome:
    """Send ``req`` and classify how it ended; never raises and always returns within
    ``timeout_s`` (plus the time a cancelled request takes to unwind)."""
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": req.max_tokens,
        "temperature": 0.0,
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
    outcome, status = classify(
        timed_out=timed_out,
        abandoned=seen.abandoned,
        status_code=seen.status_code,
        sse_error=seen.sse_error,
        complete=seen.complete,
        audio_asked=req.audio,
        got_audio=seen.got_audio,
    )
    return Outcome(
        kind=req.kind,
        outcome=outcome,
        end_s=t1 - t_base,
        e2e_s=t1 - t0,
        ttfa_s=seen.ttfa_s if req.streamed else None,
        status=status,
        detail=seen.detail if outcome in ("failed", "lost") else None,
        request=asdict(req) if outcome in ("failed", "lost") else None,
    )
