"""The first request of each kind on a fresh server against the second (issue 41: no first-use
compile inside a user's request).

    .venv/bin/python -m benchmarks.first_request [--stage-config FILE] [--rounds 3] [--burners 2]
        [--sides warmup,no_warmup] [--kinds text,logprobs,...] [--max-tokens 8]
        [--profile DIR] [--json OUT.json]

Every round starts, per side, a FRESH ``omni-serve`` on a private copy of the stage config (side
``warmup``: the config as it is, its vLLM stages warming up at start; ``no_warmup``: every
autoregressive stage with ``warmup: false``), waits until it serves, then sends, one at a time,
the first request of each kind (:data:`KINDS`: plain text, logprobs, top_logprobs, the three
penalties, a seed, top-p sampling, a json_schema response, a named tool, an image, an audio clip,
a video, a spoken answer) followed at once by a second request of the same kind whose prompt (and image,
clip) differ, so the second hits no prefix cache the first filled. Each request streams; the
client records its status, time to the first chunk with content (text, a tool call or audio) and
its full latency. The sides alternate their order from round to round. ``--burners N`` runs N
busy-loop processes (benchmarks.harness.CpuBurners) for the whole run, servers' start-up
included. Reported: per side and kind the median over rounds of first / second full latency
(and TTFT), how many first requests were not answered 200, whether any stage restarted during the
requests (``omni_cache_stage_restarts_total`` before and after), and the servers' start-up time
(median per side: what the warm-up adds).

``--profile DIR`` samples every process with py-spy while each FIRST request runs (one file per
side, kind, round and process) and prints, per side and kind, the thinker's and talker's
heaviest frames: what the first request of the kind spends its time on.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import yaml

from benchmarks import profiles
from benchmarks.client import scrape_metrics, served_model
from benchmarks.harness import CpuBurners, ServerProcess, command_line, machine_info, private_config

ROOT = Path(__file__).resolve().parents[1]
SIDES = ("warmup", "no_warmup")
#: A first request within this many times the second meets the issue's target.
TARGET_RATIO = 2.0


def _png_data_url(seed: int, w: int = 64, h: int = 48) -> str:
    from PIL import Image

    rgb = np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _wav_b64(freq: float, seconds: float = 1.0, rate: int = 16000) -> str:
    import soundfile as sf

    t = np.arange(int(seconds * rate)) / rate
    buf = io.BytesIO()
    sf.write(buf, (0.3 * np.sin(2 * np.pi * freq * t)).astype(np.float32), rate, format="WAV")
    return base64.b64encode(buf.getvalue()).decode()


def _video_data_url(seed: int, frames: int = 8, w: int = 64, h: int = 48, fps: int = 4) -> str:
    """An MP4 (MPEG-4 part 2, which every FFmpeg build encodes) of random frames, no sound."""
    import av

    rng = np.random.default_rng(seed)
    with tempfile.NamedTemporaryFile(suffix=".mp4") as f:
        with av.open(f.name, "w", format="mp4") as c:
            v = c.add_stream("mpeg4", rate=fps)
            v.width, v.height, v.pix_fmt = w, h, "yuv420p"
            for _ in range(frames):
                img = rng.integers(0, 255, (h, w, 3), dtype=np.uint8)
                for p in v.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                    c.mux(p)
            for p in v.encode():
                c.mux(p)
        data = Path(f.name).read_bytes()
    return "data:video/mp4;base64," + base64.b64encode(data).decode()


_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
_SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string"}, "n": {"type": "integer"}},
    "required": ["answer"],
}


def request_body(kind: str, nth: int, max_tokens: int) -> dict[str, Any]:
    """The chat body of the ``nth`` (0: first, 1: second) request of ``kind``: the same
    parameters each time, a different prompt (and image, clip), so nothing of the first is a
    prefix-cache hit for the second."""
    text = f"Request {nth} of kind {kind}: tell me about the {['sea', 'hills'][nth]}."
    content: Any = text
    extra: dict[str, Any] = {}
    if kind == "logprobs":
        extra = {"logprobs": True}
    elif kind == "top_logprobs":
        extra = {"logprobs": True, "top_logprobs": 2}
    elif kind in ("presence_penalty", "frequency_penalty"):
        extra = {kind: 0.5}
    elif kind == "repetition_penalty":
        extra = {"repetition_penalty": 1.2}
    elif kind == "seed":
        extra = {"seed": 7 + nth, "temperature": 0.8}
    elif kind == "top_p":
        extra = {"temperature": 0.8, "top_p": 0.9}
    elif kind == "json_schema":
        extra = {"response_format": {"type": "json_schema", "json_schema": {"name": "reply", "schema": _SCHEMA}}}
    elif kind == "named_tool":
        extra = {"tools": [_TOOL], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    elif kind == "image":
        content = [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": _png_data_url(nth)}}]
    elif kind == "audio_in":
        content = [
            {"type": "text", "text": text},
            {"type": "input_audio", "input_audio": {"data": _wav_b64(330.0 + 110 * nth), "format": "wav"}},
        ]
    elif kind == "video":
        content = [{"type": "text", "text": text}, {"type": "video_url", "video_url": {"url": _video_data_url(nth)}}]
    elif kind == "spoken":
        extra = {"modalities": ["text", "audio"], "audio": {"voice": "default", "format": "pcm16"}}
    elif kind != "text":
        raise ValueError(f"unknown kind {kind!r}")
    return {
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra,
    }


KINDS = (
    "text",
    "logprobs",
    "top_logprobs",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "top_p",
    "json_schema",
    "named_tool",
    "image",
    "audio_in",
    "video",
    "spoken",
)


@dataclass
class Timed:
    """One request as the client saw it."""

    kind: str
    nth: int
    status: int | None = None
    error: str | None = None
    ttft_s: float | None = None  # the first chunk with content, a tool call or audio
    ttfa_s: float | None = None  # the first chunk with audio (kind "spoken")
    e2e_s: float | None = None  # data: [DONE]
    completion_tokens: int | None = None
    audio_bytes: int = 0


async def send(client: httpx.AsyncClient, url: str, model: str, kind: str, nth: int, max_tokens: int) -> Timed:
    out = Timed(kind, nth)
    body = {"model": model, **request_body(kind, nth, max_tokens)}
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
            out.status = r.status_code
            if r.status_code != 200:
                out.error = (await r.aread()).decode("utf-8", "replace")[:300]
                return out
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    out.e2e_s = time.perf_counter() - t0
                    break
                chunk = json.loads(payload)
                if "error" in chunk:
                    out.error = str(chunk["error"])[:300]
                for choice in chunk.get("choices") or []:
                    delta = choice.get("delta") or {}
                    audio = (delta.get("audio") or {}).get("data")
                    if out.ttft_s is None and (delta.get("content") or delta.get("tool_calls") or audio):
                        out.ttft_s = time.perf_counter() - t0
                    if audio:
                        out.audio_bytes += len(audio) * 3 // 4
                        if out.ttfa_s is None:
                            out.ttfa_s = time.perf_counter() - t0
                if chunk.get("usage"):
                    out.completion_tokens = chunk["usage"].get("completion_tokens")
    except (httpx.HTTPError, OSError, ValueError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"[:300]
    if out.e2e_s is None and out.error is None:
        out.error = "the stream ended without data: [DONE]"
    return out


def side_config(src: Path, directory: str, side: str, tag: str, heartbeat_timeout_s: float | None = None) -> Path:
    """A private copy of ``src`` for one side: ``no_warmup`` turns every vLLM stage's warm-up
    off; ``heartbeat_timeout_s`` replaces the server's (a long one lets a slow first request
    run to its end instead of its stage being judged hung: for finding what is slow)."""
    path = private_config(src, directory, tag)
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    if side == "no_warmup":
        for stage in data["stages"]:
            if stage.get("kind") == "autoregressive":
                stage["warmup"] = False
    if heartbeat_timeout_s is not None:
        data["server"]["heartbeat_timeout_s"] = heartbeat_timeout_s
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return path


async def wait_serving(client: httpx.AsyncClient, url: str, timeout_s: float) -> bool:
    """Poll /health until every stage is up again (after a stage was restarted): whether it was
    before ``timeout_s``. The next kind's first request then meets a serving pipeline, not the
    503 of the restart."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            r = await client.get(url + "/health")
            if r.status_code == 200 and r.json().get("status") == "ok":
                return True
        except (httpx.HTTPError, ValueError):
            pass
        await asyncio.sleep(0.5)
    return False


async def stage_samples(url: str, names: tuple[str, ...]) -> dict[str, dict[str, float]]:
    """stage -> {sample name: value} of the named ``omni_cache_stage_*`` samples in /metrics
    (the warm-up's seconds, the compiles while serving; workers/warmup.py)."""
    from omni_cache.runtime.metrics.prometheus import parse_metrics

    out: dict[str, dict[str, float]] = {}
    try:
        async with httpx.AsyncClient(timeout=30.0) as client:
            text = (await client.get(url + "/metrics")).text
        for name, labels, value in parse_metrics(text):
            short = name.removeprefix("omni_cache_stage_")
            if short in names and "stage" in labels:
                stage = out.setdefault(labels["stage"], {})
                stage[short] = stage.get(short, 0.0) + value
    except (httpx.HTTPError, ValueError):
        pass
    return out


def restarts(counters: dict[str, dict[str, float]] | None) -> float | None:
    if counters is None:
        return None
    return sum(stage.get("restarts", 0.0) for stage in counters.values())


async def one_server(
    args: argparse.Namespace, side: str, round_index: int, recorder: profiles.Recorder | None
) -> dict[str, Any]:
    """A fresh server of ``side``: its start-up time, every kind's first and second request, and
    the stage restarts the requests saw."""
    tag = f"fr{round_index}{side[:2]}"
    with tempfile.TemporaryDirectory(prefix="omni_cache_first_request_") as tmp:
        path = side_config(args.stage_config, tmp, side, tag, args.heartbeat_timeout_s)
        with ServerProcess(path) as srv:
            model = await served_model(srv.url)
            before = restarts(await scrape_metrics(srv.url))
            warmup = await stage_samples(srv.url, ("warmup_s",))
            timed: list[Timed] = []
            async with httpx.AsyncClient(timeout=args.timeout) as client:
                for kind in args.kinds:
                    if recorder is not None:
                        recorder.tag = f"{side}.{kind}-r{round_index}"
                        with recorder.record(srv.processes()):
                            first = await send(client, srv.url, model, kind, 0, args.max_tokens)
                    else:
                        first = await send(client, srv.url, model, kind, 0, args.max_tokens)
                    if first.status != 200 or first.error:
                        await wait_serving(client, srv.url, args.timeout)
                    second = await send(client, srv.url, model, kind, 1, args.max_tokens)
                    if second.status != 200 or second.error:
                        await wait_serving(client, srv.url, args.timeout)
                    timed += [first, second]
                    print(
                        f"  {side:>9} round {round_index} {kind:<18} first "
                        f"{_ms(first.e2e_s)} (TTFT {_ms(first.ttft_s)}, {first.status}) "
                        f"second {_ms(second.e2e_s)} (TTFT {_ms(second.ttft_s)}, "
                        f"{second.status}){'  ' + first.error if first.error else ''}",
                        flush=True,
                    )
            after = restarts(await scrape_metrics(srv.url))
            compiles = await stage_samples(srv.url, ("compiles_while_serving",))
    return {
        "side": side,
        "round": round_index,
        "startup_s": srv.startup_s,
        "warmup_s": {k: v.get("warmup_s") for k, v in warmup.items()},
        "compiles_while_serving": {k: v.get("compiles_while_serving") for k, v in compiles.items()},
        "restarts": None if before is None or after is None else after - before,
        "requests": [asdict(t) for t in timed],
    }


def _ms(s: float | None) -> str:
    return f"{s * 1e3:7.0f} ms" if s is not None else "     - ms"


#: The latency a kind's first and second requests are compared by: the full latency, but for a
#: spoken answer its first audio (how long the audio runs is up to the random-weight talker, so
#: two prompts' full latencies differ by their audio's length, not by a first-use cost).
MEASURE = {"spoken": "ttfa_s"}


def summarize(servers: list[dict[str, Any]], kinds: list[str]) -> dict[str, Any]:
    """Per side: start-up median, restarts, and per kind the median first / second ratios."""
    out: dict[str, Any] = {}
    for side in dict.fromkeys(s["side"] for s in servers):
        runs = [s for s in servers if s["side"] == side]
        per_kind = {}
        for kind in kinds:
            key = MEASURE.get(kind, "e2e_s")
            firsts, seconds, ratios, ttft_ratios, failed = [], [], [], [], 0
            for run in runs:
                by_nth = {r["nth"]: r for r in run["requests"] if r["kind"] == kind}
                a, b = by_nth.get(0), by_nth.get(1)
                if a is None or b is None:
                    continue
                if a["status"] != 200 or a["error"] or a[key] is None:
                    failed += 1
                    continue
                firsts.append(a[key])
                if b[key]:
                    seconds.append(b[key])
                    ratios.append(a[key] / b[key])
                if a["ttft_s"] and b["ttft_s"]:
                    ttft_ratios.append(a["ttft_s"] / b["ttft_s"])
            per_kind[kind] = {
                "measure": key,
                "first_s": _median(firsts),
                "second_s": _median(seconds),
                "ratio": _median(ratios),
                "max_ratio": max(ratios) if ratios else None,
                "ttft_ratio": _median(ttft_ratios),
                "first_not_200": failed,
                "within_target": bool(ratios) and not failed and max(ratios) <= TARGET_RATIO,
            }
        stages = sorted({st for r in runs for st in r["warmup_s"]})
        out[side] = {
            "startup_s": _median([r["startup_s"] for r in runs]),
            "warmup_s": {
                st: _median([r["warmup_s"][st] for r in runs if r["warmup_s"].get(st) is not None]) for st in stages
            },
            "compiles_while_serving": sum(sum(v or 0 for v in r["compiles_while_serving"].values()) for r in runs),
            "restarts": sum(r["restarts"] or 0 for r in runs),
            "restarts_unknown": sum(r["restarts"] is None for r in runs),
            "kinds": per_kind,
        }
    return out


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def print_summary(summary: dict[str, Any]) -> None:
    for side, s in summary.items():
        print(
            f"\n{side}: start-up median {s['startup_s']:.1f} s (warm-up medians "
            f"{s['warmup_s']}), stage restarts {s['restarts']:.0f}, torch.compile frames while "
            f"serving {s['compiles_while_serving']:.0f}"
        )
        print(
            f"  {'kind':<18} {'first':>9} {'second':>9} {'ratio':>6} {'max':>6} {'TTFT r':>6} "
            f"{'not 200':>7}  (first and second: full latency; spoken: first audio)"
        )
        for kind, k in s["kinds"].items():

            def f(x: float | None, scale: float = 1.0, fmt: str = "{:6.2f}") -> str:
                return fmt.format(x * scale) if x is not None else "     -"

            print(
                f"  {kind:<18} {f(k['first_s'], 1e3, '{:7.0f}ms')} "
                f"{f(k['second_s'], 1e3, '{:7.0f}ms')} {f(k['ratio'])} {f(k['max_ratio'])} "
                f"{f(k['ttft_ratio'])} {k['first_not_200']:7d}"
            )


def print_profiles(directory: Path, rate: int) -> None:
    """Per side and kind: the stages' CPU seconds in the first request and their heaviest
    frames (inclusive), for the frames that say what was slow."""
    for key, procs in profiles.summarize_dir(directory, rate, top=12).items():
        for proc in ("thinker", "talker", "decoder"):
            s = procs.get(proc)
            if not s or not s["samples"]:
                continue
            frames = "; ".join(f"{name} {share:.0%}" for name, share in s["top_inclusive"][4:12])
            print(f"profile {key:<28} {proc:<8} {s['cpu_s']:6.1f} CPU s: {frames}")


async def run(args: argparse.Namespace) -> dict[str, Any]:
    recorder = profiles.Recorder(args.profile) if args.profile else None
    servers = []
    with CpuBurners(args.burners):
        for i in range(args.rounds):
            order = args.sides if i % 2 == 0 else list(reversed(args.sides))
            for side in order:
                servers.append(await one_server(args, side, i, recorder))
                last = servers[-1]
                print(
                    f"  {side:>9} round {i}: start-up {last['startup_s']:.1f} s (warm-up "
                    f"{last['warmup_s']}), stage restarts {last['restarts']}, torch.compile "
                    f"frames while serving {last['compiles_while_serving']}",
                    flush=True,
                )
    summary = summarize(servers, args.kinds)
    print_summary(summary)
    if args.profile:
        print_profiles(args.profile, recorder.rate)
    return {
        "command": command_line("benchmarks.first_request"),
        "machine": machine_info(),
        "burners": args.burners,
        "rounds": args.rounds,
        "max_tokens": args.max_tokens,
        "stage_config": str(args.stage_config),
        "summary": summary,
        "servers": servers,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--stage-config", type=Path, default=ROOT / "stage_configs" / "qwen3_omni.yaml")
    ap.add_argument("--rounds", type=int, default=3, help="fresh servers per side")
    ap.add_argument("--burners", type=int, default=0, help="busy-loop processes beside the run")
    ap.add_argument(
        "--sides", default=",".join(SIDES), help="warmup (the config as is), no_warmup (every vLLM stage's warm-up off)"
    )
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument(
        "--heartbeat-timeout-s",
        type=float,
        default=None,
        help="replace the config's server.heartbeat_timeout_s (finding what is slow)",
    )
    ap.add_argument("--timeout", type=float, default=300.0, help="per request, seconds")
    ap.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="py-spy every process during each first request, files in this folder",
    )
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    args.sides = [s for s in args.sides.split(",") if s]
    args.kinds = [k for k in args.kinds.split(",") if k]
    for s in args.sides:
        if s not in SIDES:
            ap.error(f"--sides: {s!r} is not one of {', '.join(SIDES)}")
    for k in args.kinds:
        if k not in KINDS:
            ap.error(f"--kinds: {k!r} is not one of {', '.join(KINDS)}")
    result = asyncio.run(run(args))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
