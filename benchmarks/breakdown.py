"""Where a request's time to first audio (and first text) goes, stage by stage.

Joins the client's samples (when each request was sent, its first text and first audio arrived,
its stream id) with the pipeline's request timelines (``omni_cache/timeline.py``: the server's and
every stage's points, one clock for all processes of the host). The segments of
:data:`AUDIO_SEGMENTS` follow one another, so they add up to the request's TTFA exactly; those of
:data:`TEXT_SEGMENTS` add up to its TTFT (for a request whose first output carries text).

Everything works on plain dicts (samples as :meth:`benchmarks.client.Sample.to_dict` gives them,
timelines as :func:`omni_cache.timeline.read` gives them), so it can be tested and re-run on saved
files.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from benchmarks.report import distribution

__all__ = [
    "AUDIO_SEGMENTS",
    "TEXT_SEGMENTS",
    "format_breakdown",
    "request_id_of",
    "request_segments",
    "summarize_breakdown",
]

#: (segment, from point, to point) from the client's request to the thinker's first token: the
#: start of the way to the first audio and to the first text alike.
_TO_FIRST_TOKEN: tuple[tuple[str, str, str], ...] = (
    ("client -> server", "client.sent", "server.received"),
    ("server: tokenize, admit, send", "server.received", "server.submitted"),
    ("-> thinker", "server.submitted", "thinker.input"),
    ("thinker: queued", "thinker.input", "thinker.scheduled"),
    ("thinker: prefill", "thinker.scheduled", "thinker.first_token"),
)

#: (segment, from point, to point) on the way to the first audio. A point is "process.event";
#: "client.sent", "client.first_text" and "client.first_audio" are the client's;
#: "thinker.out*" is the thinker output whose hand-off made the talker's job and "talker.input*"
#: when the talker's runner took that output up (:func:`talker_start`). Between the two: the
#: transport and the talker's inbox (a step it was running); after it, the hand-off's own work
#: (the talker's prompt) and vLLM taking the request.
AUDIO_SEGMENTS: tuple[tuple[str, str, str], ...] = _TO_FIRST_TOKEN + (
    ("thinker: first steps", "thinker.first_token", "thinker.out*"),
    ("-> talker", "thinker.out*", "talker.input*"),
    ("talker: hand-off", "talker.input*", "talker.job"),
    ("talker: queued", "talker.job", "talker.scheduled"),
    ("talker: prefill", "talker.scheduled", "talker.first_token"),
    ("talker: -> first codes sent", "talker.first_token", "talker.codes_out"),
    ("-> decoder", "talker.codes_out", "decoder.codes_in"),
    ("decoder: queued", "decoder.codes_in", "decoder.window_start"),
    ("decoder: first window", "decoder.window_start", "decoder.window_end"),
    ("decoder: -> audio sent", "decoder.window_end", "decoder.audio_out"),
    ("-> server", "decoder.audio_out", "server.audio_in"),
    ("server -> client", "server.audio_in", "client.first_audio"),
)

#: The same for the first text.
TEXT_SEGMENTS: tuple[tuple[str, str, str], ...] = _TO_FIRST_TOKEN + (
    ("thinker: -> first output sent", "thinker.first_token", "thinker.out0"),
    ("-> server", "thinker.out0", "server.text_in"),
    ("server -> client", "server.text_in", "client.first_text"),
)

#: The server process's share of the first audio: its segments of AUDIO_SEGMENTS.
SERVER_SEGMENTS = ("server: tokenize, admit, send", "server -> client")


def _points(sample: Mapping[str, Any], timeline: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
    points = {f"{proc}.{ev}": t for proc, events in timeline.items() for ev, t in events.items()}
    sent = sample.get("sent_at") or 0.0
    points["client.sent"] = sent
    if sample.get("ttft_s") is not None:
        points["client.first_text"] = sent + sample["ttft_s"]
    if sample.get("ttfa_s") is not None:
        points["client.first_audio"] = sent + sample["ttfa_s"]
    talker_start(points)
    return points


def talker_start(points: dict[str, float]) -> None:
    """Adds "thinker.out*" and "talker.input*" to one request's points: the thinker output k whose
    hand-off made the talker's job, and when the talker took it up. The talker marks
    ``input{k}`` as it takes up output k (workers/ar_runner.py, the first few), so k is the last
    one it took up before its job; not the last the thinker had sent by then, which counted the
    thinker outputs sent while the talker was still busy with an earlier one as the thinker's
    time. Neither point is added when the talker's marks do not say."""
    job = points.get("talker.job")
    if job is None:
        return
    taken = [int(k[12:]) for k, t in points.items() if k.startswith("talker.input") and k[12:].isdigit() and t <= job]
    if taken and f"thinker.out{max(taken)}" in points:
        points["thinker.out*"] = points[f"thinker.out{max(taken)}"]
        points["talker.input*"] = points[f"talker.input{max(taken)}"]


def request_segments(
    sample: Mapping[str, Any],
    timeline: Mapping[str, Mapping[str, float]],
    segments: Sequence[tuple[str, str, str]] = AUDIO_SEGMENTS,
) -> dict[str, float] | None:
    """segment -> seconds for one request, or None when a point is missing (a request without
    audio, a timeline that was off)."""
    points = _points(sample, timeline)
    out = {}
    for name, a, b in segments:
        if a not in points or b not in points:
            return None
        out[name] = points[b] - points[a]
    return out


def request_id_of(sample: Mapping[str, Any]) -> str | None:
    """The server's request id of a sample: its stream id less the ``chatcmpl-`` prefix."""
    rid = sample.get("response_id")
    return rid.removeprefix("chatcmpl-") if rid else None


def summarize_breakdown(
    samples: Sequence[Mapping[str, Any]], timelines: Mapping[str, Mapping[str, Mapping[str, float]]]
) -> dict[str, Any]:
    """One side's breakdown: per segment the distribution (seconds) over the requests that have
    every point, for the first audio and the first text, and how many requests that was."""
    out: dict[str, Any] = {}
    for label, segments, key in (("audio", AUDIO_SEGMENTS, "ttfa_s"), ("text", TEXT_SEGMENTS, "ttft_s")):
        rows = []
        for s in samples:
            rid = request_id_of(s)
            if not s.get("ok") or rid is None or rid not in timelines or s.get(key) is None:
                continue
            seg = request_segments(s, timelines[rid], segments)
            if seg is not None:
                rows.append(seg)
        out[label] = {
            "requests": len(rows),
            "segments": {name: distribution(r[name] for r in rows) for name, _, _ in segments},
        }
        if label == "audio":
            out[label]["server_share"] = distribution(sum(r[n] for n in SERVER_SEGMENTS) for r in rows)
    return out


def format_breakdown(by_side: Mapping[str, Mapping[str, Any]], label: str = "audio") -> str:
    """The medians of every segment per side, in milliseconds, as a text table."""
    sides = list(by_side)
    segments = AUDIO_SEGMENTS if label == "audio" else TEXT_SEGMENTS
    w0 = 34
    lines = [f"{'first ' + label + ', p50 (ms)':<{w0}}" + "".join(f"{s:>12}" for s in sides)]
    for name, _, _ in segments:
        row = f"{name:<{w0}}"
        for s in sides:
            p50 = by_side[s][label]["segments"][name]["p50"]
            row += f"{'-' if math.isnan(p50) else format(p50 * 1000, '.1f'):>12}"
        lines.append(row)
    lines.append(f"{'requests':<{w0}}" + "".join(f"{by_side[s][label]['requests']:>12}" for s in sides))
    return "\n".join(lines)
