"""The server under a flood of the most media a request may carry: its event loop's lag, what it
refuses, its memory (a probe, not a test).

    .venv/bin/python -m benchmarks.admission_flood [--clients 16] [--seconds 30] [--json OUT.json]
    .venv/bin/python -m benchmarks.admission_flood --kind video [--video-size 1280x720] ...

The server (the orchestrator and the HTTP app under uvicorn, as ``omni-serve`` runs them) runs in
this process's event loop. Its stages are the fake stages of ``tests/fake_stage.py`` (real
processes and ZMQ sockets; the thinker answers ``--answer-tokens`` tokens at ``--token-delay``
seconds each without a model), so what is measured is the server's own work: reading bodies,
parsing them, tokenizing (the tiny Qwen3-Omni checkpoint's tokenizer and chat template), reading
and decoding media, routing, streaming answers back. A probe task on the same event loop sleeps
``--probe-interval`` seconds at a time and records how much later than that it wakes: the loop's
lag, which every stream's next chunk and every ``/health`` answer waits behind.

The clients run in another process (they would otherwise compete for this process's GIL): each of
``--clients`` posts, again and again for ``--seconds``, a chat request with ``--items`` one-colour
PNG images of ``--side`` x ``--side`` pixels (a few KiB each, ``side * side * 3`` bytes decoded:
the most decoded media ``server.media`` lets one request carry; each body is encoded once before
the flood), ignoring Retry-After, while a poller in a third process asks ``/health`` every 100 ms. Limits:
``server.max_media_bytes_in_flight`` is
``--media-requests`` requests' worth of media, ``server.max_requests_in_flight`` is
``--max-in-flight``. With ``--noise`` the images are random pixels instead: every body is about as
large as the pixels (the server then also reads and parses that much per request).

With ``--kind video`` each request carries ``--items`` videos instead (an MP4 of
``--video-size`` frames, ``--video-seconds`` long at ``--video-fps``, with a sound track:
``benchmarks.workloads.video_data_url``, a seed of its own per client): what the server decodes
per request is what it reserves from the header (the sampled frames at full size, RGB, and the
track in float32 at the thinker's rate; ``omni_cache.serving.video.decoded_bytes``), and
``server.media``'s video limits are set to let exactly that through.

Prints and writes (``--json``) the lag's percentiles idle and under the flood, the answers by
status, ``/health``'s latency, and the server process's RSS before the flood and its peak during
it. The decoded-item cache (``server.media.decoded_cache_bytes``) holds ``--decoded-cache-mib``
(256 MiB, as by default; 0 turns it off): it is part of the server's RSS under the flood. The
probe also samples the media bytes the admission bounds hold (their peak against
``server.max_media_bytes_in_flight``), and the summary states the RSS the bounds allow the
flood to add: the media bound, the decoded-item cache (its arrays are the same ones a request in
flight holds, or ones no request holds) and the bodies being read (``max_body_bytes_in_flight``,
or every client's body at once where that is less).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import multiprocessing
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import yaml

from benchmarks.in_process_server import InProcessServer
from benchmarks.report import percentile

MIB = 1 << 20


def request_media_bytes(args: argparse.Namespace) -> int:
    """What one request's media decode to, as the server reserves it from their headers."""
    if args.kind == "image":
        return args.items * args.side * args.side * 3
    from benchmarks.workloads import video_data_url
    from omni_cache.serving import video

    data = base64.b64decode(video_data_url(0, **video_shape(args)).partition(",")[2])
    limits = video_limits(args)
    header = video.probe(data, limits)
    frames = len(video.sampled_indices(header, limits))
    return args.items * video.decoded_bytes(header, frames, AUDIO_RATE, with_audio=True)


#: The tiny Qwen3-Omni thinker's audio rate: a video's sound track is resampled to it.
AUDIO_RATE = 16000


def video_shape(args: argparse.Namespace) -> dict[str, Any]:
    width, _, height = args.video_size.partition("x")
    return {"seconds": args.video_seconds, "fps": args.video_fps, "width": int(width), "height": int(height)}


def video_limits(args: argparse.Namespace) -> Any:
    """server.media's video limits, set to take exactly the flood's videos."""
    from omni_cache.config.server_schema import MediaConfig

    shape = video_shape(args)
    return MediaConfig(
        max_items=args.items,
        max_video_frame_pixels=shape["width"] * shape["height"],
        max_video_seconds=args.video_seconds + 1,
        max_video_audio_seconds=args.video_seconds + 1,
    )


def flood_config(directory: Path, args: argparse.Namespace) -> Path:
    request_media = request_media_bytes(args)
    media: dict[str, Any] = {
        "max_items": args.items,
        "max_image_pixels": args.side * args.side,
        "decoded_cache_bytes": args.decoded_cache_mib * MIB,
    }
    if args.kind == "video":
        limits = video_limits(args)
        media |= {
            "max_video_frame_pixels": limits.max_video_frame_pixels,
            "max_video_seconds": limits.max_video_seconds,
            "max_video_audio_seconds": limits.max_video_audio_seconds,
        }
    data = {
        "name": f"flood-{os.getpid()}",
        "server": {
            "host": "127.0.0.1",
            "port": 0,
            "request_timeout_s": 60,
            "max_message_bytes": max(256 * MIB, 2 * request_media),
            "max_requests_in_flight": args.max_in_flight,
            "max_body_bytes": max(64 * MIB, 2 * request_media),
            "max_media_bytes_in_flight": args.media_requests * request_media,
            "media": media,
        },
        "stages": [
            {
                "name": "thinker",
                "kind": "autoregressive",
                "model": "tiny:qwen3-omni",
                "final_output": "text",
                "engine_args": {"max_model_len": 8192},
                "sampling": {"max_tokens": args.answer_tokens},
                "env": {"FAKE_TOKEN_DELAY": str(args.token_delay)},
            }
        ],
    }
    path = directory / "flood.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def percentiles(samples: list[float]) -> dict[str, float]:
    """n, p50 / p90 / p99 (benchmarks.report.percentile: numpy's linear method), max and mean."""
    if not samples:
        return {}
    return {
        "n": len(samples),
        **{f"p{q}": percentile(samples, q) for q in (50, 90, 99)},
        "max": max(samples),
        "mean": statistics.fmean(samples),
    }


async def probe(
    lags: list[tuple[float, float]],
    interval: float,
    stop: asyncio.Event,
    bounds: Any = None,
    held: list[int] | None = None,
) -> None:
    """(when, lag): how much later than ``interval`` each sleep of the event loop woke; with
    ``bounds``, the media bytes they hold at each wake-up go to ``held``."""
    while not stop.is_set():
        t0 = time.perf_counter()
        await asyncio.sleep(interval)
        t1 = time.perf_counter()
        lags.append((t1, t1 - t0 - interval))
        if held is not None:
            held.append(bounds.media_bytes)


# ---- the clients (another process) ---------------------------------------------------------------


def png_data_url(side: int, seed: int, noise: bool) -> str:
    """One colour (a few KiB: the most decoded bytes for the least sent) or, with ``noise``,
    random pixels (incompressible: the largest body for the pixels)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    if noise:
        img = Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8))
    else:
        img = Image.new("RGB", (side, side), tuple(int(c) for c in rng.integers(0, 256, 3)))
    buf = io.BytesIO()
    img.save(buf, format="PNG", compress_level=1)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def media_parts(args: dict[str, Any], client: int) -> list[dict[str, Any]]:
    """One client's media parts: ``items`` images or videos of its own."""
    if args["kind"] == "video":
        from benchmarks.workloads import video_data_url

        return [
            {"type": "video_url", "video_url": {"url": video_data_url(client * 100 + i, **args["video"])}}
            for i in range(args["items"])
        ]
    return [
        {"type": "image_url", "image_url": {"url": png_data_url(args["side"], client * 100 + i, args["noise"])}}
        for i in range(args["items"])
    ]


def run_clients(url: str, model: str, args: dict[str, Any], go: Any, out: Any) -> None:
    """``args['clients']`` threads posting media requests back to back for ``args['seconds']``
    from ``go`` on (each body encoded once, and one sent and answered, before: ("ready", the
    largest body's bytes, that answer's status) on ``out``); puts (statuses, latencies) on
    ``out``."""
    import httpx

    bodies = []
    for c in range(args["clients"]):
        parts = [{"type": "text", "text": f"what is in these {args['kind']}s?"}, *media_parts(args, c)]
        bodies.append(
            json.dumps(
                {"model": model, "max_tokens": args["answer_tokens"], "messages": [{"role": "user", "content": parts}]}
            ).encode()
        )
    # One request first, answered before the baseline: the server's first use of its decoders
    # (their libraries' buffers and thread pools) is not the flood's growth.
    with httpx.Client(timeout=120, headers={"Content-Type": "application/json"}) as http:
        warm = http.post(url + "/v1/chat/completions", content=bodies[0]).status_code
    out.put(("ready", max(len(b) for b in bodies), warm))
    go.wait()
    end = time.monotonic() + args["seconds"]
    statuses: list[int] = []
    latencies: list[float] = []
    lock = threading.Lock()

    def client(body: bytes) -> None:
        with httpx.Client(timeout=120, headers={"Content-Type": "application/json"}) as http:
            while time.monotonic() < end:
                t0 = time.perf_counter()
                code = http.post(url + "/v1/chat/completions", content=body).status_code
                with lock:
                    statuses.append(code)
                    latencies.append(time.perf_counter() - t0)

    threads = [threading.Thread(target=client, args=(b,)) for b in bodies]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out.put((statuses, latencies))


def poll_health(url: str, seconds: float, go: Any, out: Any) -> None:
    """GET /health every 100 ms for ``seconds`` from ``go`` on (a process of its own: the
    uploading clients do not delay it); puts (latencies, statuses) on ``out``."""
    import httpx

    latencies: list[float] = []
    codes: list[int] = []
    go.wait()
    end = time.monotonic() + seconds
    with httpx.Client(timeout=120) as http:
        while time.monotonic() < end:
            t0 = time.perf_counter()
            codes.append(http.get(url + "/health").status_code)
            latencies.append(time.perf_counter() - t0)
            time.sleep(0.1)
    out.put((latencies, codes))


# ---- the server (this process) -------------------------------------------------------------------


def rss(field: str) -> int:
    """VmRSS (now) or VmHWM (the peak since the last reset) of this process, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


async def serve_and_flood(args: argparse.Namespace) -> dict[str, Any]:
    from omni_cache.config import load_config

    config = load_config(flood_config(Path(tempfile.mkdtemp(prefix="flood")), args))
    srv = InProcessServer(config)
    orch = srv.orch
    url = await srv.start()
    spawn = multiprocessing.get_context("spawn")
    out: Any = spawn.Queue()
    health_out: Any = spawn.Queue()
    go = spawn.Event()
    clients = spawn.Process(
        target=run_clients,
        args=(
            url,
            orch.served_model_name,
            {
                "clients": args.clients,
                "seconds": args.seconds,
                "items": args.items,
                "side": args.side,
                "answer_tokens": args.answer_tokens,
                "noise": args.noise,
                "kind": args.kind,
                "video": video_shape(args),
            },
            go,
            out,
        ),
    )
    poller = spawn.Process(target=poll_health, args=(url, args.seconds, go, health_out))
    clients.start()
    poller.start()
    ready, body_bytes, warm = await asyncio.to_thread(out.get)  # the bodies are encoded
    assert ready == "ready" and warm == 200, (ready, warm)
    lags: list[tuple[float, float]] = []
    held: list[int] = []
    stop = asyncio.Event()
    bounds = orch.admission.bounds
    probing = asyncio.create_task(probe(lags, args.probe_interval, stop, bounds, held))
    try:
        await asyncio.sleep(args.idle_seconds)  # the idle baseline
        rss_before = rss("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM starts again from VmRSS
        flood_start = time.perf_counter()
        go.set()
        statuses, latencies = await asyncio.to_thread(out.get)
        health, health_codes = await asyncio.to_thread(health_out.get)
        flood_end = time.perf_counter()
        await asyncio.to_thread(clients.join)
        await asyncio.to_thread(poller.join)
    finally:
        stop.set()
        await probing
        await srv.stop()
    idle = [lag for when, lag in lags if when < flood_start]
    flooded = [lag for when, lag in lags if flood_start <= when <= flood_end]
    by_status: dict[str, int] = {}
    for code in statuses:
        by_status[str(code)] = by_status.get(str(code), 0) + 1
    return {
        "loop_lag_idle_s": percentiles(idle),
        "loop_lag_flood_s": percentiles(flooded),
        "answers_by_status": by_status,
        "requests_per_s": len(statuses) / (flood_end - flood_start),
        "latency_s": {
            str(code): percentiles([lat for c, lat in zip(statuses, latencies) if c == code])
            for code in sorted(set(statuses))
        },
        "health_latency_s": percentiles(health),
        "health_statuses": sorted(set(health_codes)),
        "server_rss_before_flood_mib": rss_before / MIB,
        "server_peak_rss_during_flood_mib": rss("VmHWM") / MIB,
        "request_media_mib": request_media_bytes(args) / MIB,
        "media_bound_mib": bounds.max_media_bytes / MIB,
        "media_held_peak_mib": max(held, default=0) / MIB,
        # What the bounds let the flood add to the RSS (see the module's docstring).
        "rss_growth_allowed_mib": (
            bounds.max_media_bytes
            + args.decoded_cache_mib * MIB
            + min(bounds.max_body_bytes, args.clients * body_bytes)
        )
        / MIB,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--kind", choices=("image", "video"), default="image", help="the media each request carries")
    ap.add_argument("--seconds", type=float, default=30.0, help="how long the flood lasts")
    ap.add_argument("--idle-seconds", type=float, default=3.0, help="the idle baseline before it")
    ap.add_argument("--items", type=int, default=4, help="images or videos per request (server.media.max_items)")
    ap.add_argument("--video-size", default="1280x720", help="--kind video: frame width x height")
    ap.add_argument("--video-seconds", type=float, default=8.0, help="--kind video: duration")
    ap.add_argument("--video-fps", type=int, default=8, help="--kind video: frame rate (sampled at 2 fps)")
    ap.add_argument(
        "--side", type=int, default=2048, help="image width = height (server.media.max_image_pixels is side^2)"
    )
    ap.add_argument(
        "--noise",
        action="store_true",
        help="random-pixel images (bodies of about items * side^2 * 4 bytes) instead of one-colour ones (a few KiB)",
    )
    ap.add_argument(
        "--media-requests", type=int, default=4, help="server.max_media_bytes_in_flight in requests' worth of media"
    )
    ap.add_argument("--max-in-flight", type=int, default=64, help="server.max_requests_in_flight")
    ap.add_argument(
        "--decoded-cache-mib", type=int, default=256, help="server.media.decoded_cache_bytes in MiB (0: off)"
    )
    ap.add_argument("--answer-tokens", type=int, default=20)
    ap.add_argument("--token-delay", type=float, default=0.02, help="the fake thinker's pace (s)")
    ap.add_argument("--probe-interval", type=float, default=0.01)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)

    from benchmarks.harness import machine_info

    result = {
        "args": vars(args) | {"json": str(args.json) if args.json else None},
        "machine": machine_info(),
        **asyncio.run(serve_and_flood(args)),
    }
    lag, idle = result["loop_lag_flood_s"], result["loop_lag_idle_s"]
    print(
        f"event loop lag under the flood: p50 {lag['p50'] * 1e3:.1f} ms, p99 "
        f"{lag['p99'] * 1e3:.1f} ms, max {lag['max'] * 1e3:.1f} ms ({lag['n']} probes; idle p99 "
        f"{idle['p99'] * 1e3:.1f} ms)"
    )
    print(
        f"answers: {result['answers_by_status']} ({result['requests_per_s']:.1f}/s); /health p99 "
        f"{result['health_latency_s']['p99'] * 1e3:.1f} ms, statuses {result['health_statuses']}; "
        f"server RSS {result['server_rss_before_flood_mib']:.0f} MiB before, peak "
        f"{result['server_peak_rss_during_flood_mib']:.0f} MiB during the flood "
        f"({result['machine']['cpu_model']}, load {os.getloadavg()[0]:.1f})"
    )
    growth = result["server_peak_rss_during_flood_mib"] - result["server_rss_before_flood_mib"]
    print(
        f"{args.kind}s: {result['request_media_mib']:.1f} MiB decoded per request; media held "
        f"peak {result['media_held_peak_mib']:.1f} of the {result['media_bound_mib']:.1f} MiB bound; "
        f"RSS grew {growth:.0f} MiB, the bounds allow {result['rss_growth_allowed_mib']:.0f} MiB"
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
