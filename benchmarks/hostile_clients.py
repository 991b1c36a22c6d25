"""Hostile clients (issue 52) and the probes that watch what everyone else gets meanwhile; shared by
``tests/test_hostile_clients.py`` (what each is answered) and ``benchmarks/hostile.py`` (timings).

Attacks, each a loop in the attacker process until its phase ends (``pause`` seconds, 1 by default,
between tries: hostile content, not a bandwidth flood, which on a 2-core host would measure the
attacker's own sending):

- ``nested``: a realtime session sending an event of ``nested_bytes`` of ``[`` (as deep as it is
  long), answered ``error`` ``invalid_json`` ("nests N levels deep");
- ``huge``: a realtime session sending a 16 MiB ``input_audio_buffer.append``, answered ``error``
  ``event_too_large`` (the session goes on);
- ``bomb``: a chat request whose image URL (on an allowed host, this process's :class:`MediaHost`)
  answers a gzip body that inflates to ``bomb_mib`` MiB, answered 400 naming
  ``server.media.max_item_bytes``;
- ``never``: the same with a URL that sends its headers and then a byte every 0.5 s forever,
  answered 400 naming ``server.media.fetch_timeout_s``;
- ``silent``: a streamed spoken chat answer asked for over a socket with a 4 KiB receive window,
  all ``silent`` of them at once, nothing read until /metrics counts as many slow clients more
  (at most ``silent_hold_s``, 120 s); then what the sockets held is read: a stream the server
  cut ends with no ``[DONE]``.

Probes (another process): ``GET /health`` every 20 ms, and a short streamed text answer every
0.5 s, timed to its first content delta (another client's first text)."""

from __future__ import annotations

import asyncio
import collections
import http.server
import json
import os
import socket
import threading
import time
import zlib
from typing import Any

MIB = 1 << 20
HUGE_BYTES = 16 * MIB
#: The attacks and how many of each make the default 64 at once.
MIX = {"nested": 16, "huge": 16, "bomb": 8, "never": 8, "silent": 16}


class MediaHost:
    """An allowed image host that attacks: ``/bomb`` (gzip, inflating to ``bomb_mib`` MiB) and
    ``/never`` (headers, then a byte every 0.5 s until the client goes)."""

    def __init__(self, bomb_mib: int = 256) -> None:
        squeeze = zlib.compressobj(9, zlib.DEFLATED, 31)  # gzip framing
        zeros = bytes(MIB)
        bomb = b"".join(squeeze.compress(zeros) for _ in range(bomb_mib)) + squeeze.flush()

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                try:
                    if self.path == "/bomb":
                        self.send_response(200)
                        self.send_header("Content-Type", "image/png")
                        self.send_header("Content-Encoding", "gzip")
                        self.send_header("Content-Length", str(len(bomb)))
                        self.end_headers()
                        self.wfile.write(bomb)
                    else:
                        self.send_response(200)
                        self.send_header("Content-Type", "image/png")
                        self.end_headers()
                        while True:
                            self.wfile.write(b"\0")
                            self.wfile.flush()
                            time.sleep(0.5)
                except OSError:  # the server gave up on it
                    pass

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_port}"


def _headers(api_key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"}


async def _realtime(kind: str, o: dict[str, Any], stop: float, tally: collections.Counter) -> None:
    import websockets

    if kind == "nested":
        payload: str = "[" * o["nested_bytes"]
    else:
        head, tail = '{"type":"input_audio_buffer.append","audio":"', '"}'
        payload = head + "A" * (HUGE_BYTES - len(head) - len(tail)) + tail
    ws_url = o["url"].replace("http", "ws", 1) + f"/v1/realtime?model={o['model']}"
    async with websockets.connect(
        ws_url, additional_headers=_headers(o["api_key"]), max_size=None, open_timeout=60, close_timeout=5
    ) as ws:
        first = json.loads(await ws.recv())
        if first.get("type") != "session.created":
            tally[f"{kind}: no session ({first.get('error', {}).get('code')})"] += 1
            return
        while time.monotonic() < stop:
            await ws.send(payload)
            answer = json.loads(await asyncio.wait_for(ws.recv(), 120))
            error = answer.get("error") or {}
            message = error.get("message", "")
            if kind == "nested" and error.get("code") == "invalid_json" and "levels deep" in message:
                tally["nested: invalid_json, nests N levels deep"] += 1
            elif kind == "huge" and error.get("code") == "event_too_large" and "max_event_bytes" in message:
                tally["huge: event_too_large, names max_event_bytes"] += 1
            else:
                tally[f"{kind}: unexpected {answer.get('type')} {error.get('code')} {message[:80]}"] += 1
            await asyncio.sleep(o["pause"])


async def _url_chat(kind: str, o: dict[str, Any], stop: float, tally: collections.Counter) -> None:
    import httpx

    want = "server.media.max_item_bytes" if kind == "bomb" else "server.media.fetch_timeout_s"
    body = {
        "model": o["model"],
        "max_tokens": 4,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "what is this?"},
                    {"type": "image_url", "image_url": {"url": f"{o['media_url']}/{kind}"}},
                ],
            }
        ],
    }
    async with httpx.AsyncClient(timeout=120, headers=_headers(o["api_key"])) as client:
        while time.monotonic() < stop:
            try:
                r = await client.post(o["url"] + "/v1/chat/completions", json=body)
            except (httpx.ReadError, httpx.RemoteProtocolError) as e:
                # A kept-alive connection the server closed while this process, starved of CPU
                # (nice 10, pinned to one core), slept past uvicorn's 5 s keep-alive: ask again
                # on a new one (counted apart, so a run says how often).
                tally[f"{kind}: kept-alive connection closed ({type(e).__name__}), asked again"] += 1
                continue
            message = r.json().get("error", {}).get("message", "") if r.status_code >= 400 else ""
            named = [b for b in ("server.media.max_item_bytes", "server.media.fetch_timeout_s") if b in message]
            if r.status_code == 400 and want in named:
                tally[f"{kind}: 400 naming {want}"] += 1
            elif r.status_code == 400 and kind == "bomb" and named:  # its host was slower than the limit
                tally[f"{kind}: 400 naming {named[0]}"] += 1
            else:
                tally[f"{kind}: unexpected {r.status_code} {message[:80] or r.text[:80]}"] += 1
            await asyncio.sleep(o["pause"])


def slow_clients(metrics_text: str) -> float:
    """``omni_cache_slow_clients_disconnected_total`` in a /metrics page (summed over labels)."""
    name = "omni_cache_slow_clients_disconnected_total"
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in metrics_text.splitlines()
        if line.startswith(name) and line[len(name) : len(name) + 1] in (" ", "{")
    )


async def _slow_clients(client: Any, o: dict[str, Any]) -> float:
    import httpx

    try:
        return slow_clients((await client.get(o["url"] + "/metrics")).text)
    except (httpx.ReadError, httpx.RemoteProtocolError):  # a kept-alive connection closed meanwhile
        return slow_clients((await client.get(o["url"] + "/metrics")).text)


async def _silent(o: dict[str, Any], n: int, stop: float, tally: collections.Counter) -> None:
    """``n`` silent readers at once, again and again: each batch holds (reads nothing) until the
    server counts ``n`` more slow clients in /metrics (at most ``silent_hold_s``), then reads
    what the sockets held: a cut stream ends there, with no ``[DONE]``."""
    import httpx

    loop = asyncio.get_running_loop()
    body = json.dumps(
        {
            "model": o["model"],
            "max_tokens": o["silent_tokens"],
            "stream": True,
            "modalities": ["text", "audio"],
            "audio": {"format": "pcm16", "voice": "default"},
            "messages": [{"role": "user", "content": "x" * o["silent_tokens"]}],
        }
    ).encode()
    host, port = o["url"].removeprefix("http://").split(":")
    request = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {o['api_key']}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        + body
    )

    async def ask() -> socket.socket:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: the window stays small
        sock.setblocking(False)
        await loop.sock_connect(sock, (host, int(port)))
        await loop.sock_sendall(sock, request)
        return sock

    async def drain(sock: socket.socket) -> str:
        received = bytearray()
        try:
            while chunk := await asyncio.wait_for(loop.sock_recv(sock, 1 << 20), 10):
                received += chunk
        except TimeoutError:
            return "silent: still streaming after the hold (not cut)"
        finally:
            sock.close()
        return "silent: whole answer kept for it" if b"data: [DONE]" in received else "silent: cut, no [DONE]"

    async with httpx.AsyncClient(timeout=30, headers=_headers(o["api_key"])) as client:
        while time.monotonic() < stop:
            before = await _slow_clients(client, o)
            socks = await asyncio.gather(*(ask() for _ in range(n)))
            hold_until = time.monotonic() + o["silent_hold_s"]
            while await _slow_clients(client, o) < before + n and time.monotonic() < hold_until:
                await asyncio.sleep(1.0)
            for outcome in await asyncio.gather(*(drain(sock) for sock in socks)):
                tally[outcome] += 1
            await asyncio.sleep(o["pause"])


async def _attack(o: dict[str, Any], seconds: float) -> dict[str, int]:
    tally: collections.Counter = collections.Counter()
    stop = time.monotonic() + seconds
    jobs = []
    kinds = []
    for kind, n in o["mix"].items():
        if kind == "silent":
            jobs.append(_silent(o, n, stop, tally))
            kinds.append(kind)
            continue
        for _ in range(n):
            if kind in ("nested", "huge"):
                jobs.append(_realtime(kind, o, stop, tally))
            else:
                jobs.append(_url_chat(kind, o, stop, tally))
            kinds.append(kind)
    for kind, result in zip(kinds, await asyncio.gather(*jobs, return_exceptions=True), strict=True):
        if isinstance(result, BaseException):
            tally[f"{kind}: client failed: {type(result).__name__}: {str(result)[:100]}"] += 1
    return dict(tally)


def pin(cpus: Any) -> None:
    """Keep this process (and the threads and processes it starts) on ``cpus`` (None: anywhere)."""
    if cpus:
        os.sched_setaffinity(0, set(cpus))


def attacker(o: dict[str, Any], go: Any, out: Any) -> None:
    """The attacker process: a media host, then one attack phase per ``go`` item (its seconds;
    None ends), each phase's outcomes put on ``out``."""
    os.nice(o["attacker_nice"])  # on a 2-core host the attackers' own CPU would be what is measured
    pin(o["attacker_cpus"])  # or kept off the server's cores
    host = MediaHost(o["bomb_mib"])
    o = {**o, "media_url": host.url}
    out.put("ready")
    while (seconds := go.get()) is not None:
        out.put(asyncio.run(_attack(o, seconds)))


def prober(o: dict[str, Any], go: Any, out: Any) -> None:
    """The probe process: per ``go`` item (seconds; None ends) /health latencies and first-text
    latencies (seconds) of that long, put on ``out``."""
    import httpx

    pin(o["probe_cpus"])
    out.put("ready")
    while (seconds := go.get()) is not None:
        stop = time.monotonic() + seconds
        health: list[float] = []
        first_text: list[float] = []
        failures: collections.Counter = collections.Counter()

        def poll(stop: float = stop, health: list[float] = health, failures: Any = failures) -> None:
            with httpx.Client(timeout=30) as client:
                while time.monotonic() < stop:
                    t = time.perf_counter()
                    r = client.get(o["url"] + "/health")
                    health.append(time.perf_counter() - t)
                    if r.status_code != 200:
                        failures[f"health {r.status_code}"] += 1
                    time.sleep(0.02)

        thread = threading.Thread(target=poll)
        thread.start()
        body = {
            "model": o["model"],
            "max_tokens": 4,
            "stream": True,
            "messages": [{"role": "user", "content": "hi"}],
        }
        with httpx.Client(timeout=60, headers=_headers(o["api_key"])) as client:
            while time.monotonic() < stop:
                t = time.perf_counter()
                got = None
                with client.stream("POST", o["url"] + "/v1/chat/completions", json=body) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                            got = time.perf_counter() - t
                            break
                if got is None:
                    failures[f"first text: none (HTTP {r.status_code})"] += 1
                else:
                    first_text.append(got)
                time.sleep(0.5)
        thread.join()
        out.put({"health": health, "first_text": first_text, "failures": dict(failures)})


def rss_bound(config: Any, mix: dict[str, int], slack: int = 96 * MIB) -> int:
    """What the attacks may add to the server's RSS, from its config: each realtime session one
    event of ``max_event_bytes`` three times over (its frames, its bytes, what it parses to; a
    larger message costs one network read), each chat request its body and
    ``server.max_outbox_bytes`` of its answer, each URL fetch ``max_item_bytes`` as sent and as
    inflated, plus ``slack`` (the allocator's and the threads' own)."""
    s = config.server
    realtime = (mix.get("nested", 0) + mix.get("huge", 0)) * 3 * s.realtime.max_event_bytes
    chats = sum(mix.values()) - mix.get("nested", 0) - mix.get("huge", 0)
    chat = chats * (s.max_body_bytes + s.max_outbox_bytes)
    fetches = (mix.get("bomb", 0) + mix.get("never", 0)) * 2 * s.media.max_item_bytes
    return slack + realtime + chat + fetches


class RssSampler:
    """This process's VmRSS sampled every 20 ms on a thread: :meth:`peak` since :meth:`reset`."""

    def __init__(self) -> None:
        self._peak = self.now()
        self._stop = threading.Event()
        threading.Thread(target=self._run, daemon=True, name="rss-sampler").start()

    @staticmethod
    def now() -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        return 0

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self._peak = max(self._peak, self.now())

    def reset(self) -> int:
        self._peak = self.now()
        return self._peak

    def peak(self) -> int:
        return max(self._peak, self.now())

    def close(self) -> None:
        self._stop.set()


class Hostile:
    """The attacker and probe processes for a server at ``url``: :meth:`idle` probes it alone,
    :meth:`attacked` probes it while the attacks run (``warmup`` seconds of them first)."""

    def __init__(self, url: str, model: str, api_key: str, **options: Any) -> None:
        import multiprocessing

        o = {
            "url": url,
            "model": model,
            "api_key": api_key,
            "mix": MIX,
            "pause": 1.0,
            "nested_bytes": 2 * MIB,
            "bomb_mib": 256,
            "silent_tokens": 12000,
            "silent_hold_s": 120.0,
            "attacker_nice": 0,
            "attacker_cpus": None,  # CPU numbers; None: wherever the scheduler puts them
            "probe_cpus": None,
            **options,
        }
        self.options = o
        ctx = multiprocessing.get_context("spawn")
        self._attack_go, self._attack_out = ctx.Queue(), ctx.Queue()
        self._probe_go, self._probe_out = ctx.Queue(), ctx.Queue()
        #: The attackers' process and the probes'.
        self.procs = [
            ctx.Process(target=attacker, args=(o, self._attack_go, self._attack_out), daemon=True),
            ctx.Process(target=prober, args=(o, self._probe_go, self._probe_out), daemon=True),
        ]
        for p in self.procs:
            p.start()
        assert self._attack_out.get(timeout=300) == "ready" and self._probe_out.get(timeout=300) == "ready"

    def idle(self, seconds: float) -> dict[str, Any]:
        self._probe_go.put(seconds)
        return self._probe_out.get(timeout=seconds + 300)

    def attacked(self, seconds: float, warmup: float = 3.0) -> tuple[dict[str, Any], dict[str, int]]:
        """(what the probe saw, the attacks' outcomes by kind)."""
        self._attack_go.put(seconds + warmup)
        time.sleep(warmup)
        self._probe_go.put(seconds)
        probe = self._probe_out.get(timeout=seconds + 300)
        return probe, self._attack_out.get(timeout=seconds + 600)

    def close(self) -> None:
        self._attack_go.put(None)
        self._probe_go.put(None)
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()

    def __enter__(self) -> Hostile:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
