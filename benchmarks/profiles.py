"""Sampling profiles of a pipeline's processes while a benchmark measures them (py-spy).

``Recorder.record(processes)`` runs one ``py-spy record`` per process (the server, every stage)
for as long as the block runs, in non-blocking mode (the profiled process is never paused to be
sampled) and without idle samples, so a process's sample count is its CPU time times the rate.
Each writes py-spy's raw format (one collapsed stack per line with its count) to
``DIR/<tag>-<process>.txt``. :func:`summarize` reads such files back: per process, the samples
and the frames that hold most of them, inclusive and self, and the share of named parts of the
pipeline (:data:`PARTS`), so two sides' profiles can be put next to each other.

py-spy is in the ``bench`` extra (pyproject.toml), not in the product's dependencies.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["PARTS", "Recorder", "format_summary", "parse_collapsed", "summarize", "summarize_dir"]

#: Parts of a stage's or the server's work, by a frame the stack passes through (py-spy names a
#: frame "Class.method (path)"; the first part of this list that matches wins, so an inner part
#: goes before the one around it): label -> regular expression.
PARTS: dict[str, str] = {
    "talker code predictor": r"residual_codes \(",
    "latent capture (mirror write, gathers)": r"LatentCapture\.on_step \(",
    "model forward": r"(_model_forward|Code2WavDecoder\.decode_windows) \(",
    "sampling": r"(sample_tokens|Sampler\.forward) \(",
    "model inputs": r"_prepare_inputs \(",
    "prefix-cache hashing": r"(hash_request_tokens|block_hasher|hash_block_tokens|cache_full_blocks) \(",
    "scheduler": r"Scheduler\.(schedule|update_from_output) \(",
    "engine outputs": r"OutputProcessor\.process_outputs \(",
    "hand-off function": r"^(qwen3_omni_thinker_to_talker|thinker_to_talker|talker_to_decoder) \(",
    "messages (zmq, wire)": r"(zmq/|wire/transport\.py|workers/outbox\.py)",
    "HTTP + SSE": r"(uvicorn/|starlette/|fastapi/|serving/)",
    "tokenizer": r"(tokenization_utils|tokenizers|text_codec\.py)",
}


class Recorder:
    """py-spy samplers for a set of processes; :meth:`record` for one measured phase."""

    def __init__(self, directory: str | os.PathLike[str], rate: int = 100) -> None:
        self.directory = Path(directory)
        self.rate = rate
        self.tag = "run"  # file name prefix of the next record()
        self.exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
        if not os.access(self.exe, os.X_OK):
            raise RuntimeError("--profile needs py-spy (the bench extra: make setup)")

    @contextlib.contextmanager
    def record(self, processes: dict[str, int | None]) -> Iterator[None]:
        """Sample every named process (name -> pid) while the block runs."""
        self.directory.mkdir(parents=True, exist_ok=True)
        procs = []
        for name, pid in processes.items():
            if not pid:
                continue
            out = self.directory / f"{self.tag}-{name}.txt"
            procs.append(
                subprocess.Popen(
                    [
                        self.exe,
                        "record",
                        "--pid",
                        str(pid),
                        "--rate",
                        str(self.rate),
                        "--nonblocking",
                        "--format",
                        "raw",
                        "--output",
                        str(out),
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
        try:
            yield
        finally:
            for p in procs:  # py-spy writes its file when interrupted
                with contextlib.suppress(OSError):
                    p.send_signal(signal.SIGINT)
            for p in procs:
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(5)


_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^:()]*)(?::\d+)?\)$")


def _short(frame: str) -> str:
    """'forward (/x/site-packages/vllm/model_executor/models/qwen3.py:123)' ->
    'forward (vllm/model_executor/models/qwen3.py)'."""
    m = _FRAME.match(frame.strip())
    if not m:
        return frame.strip()
    path = m["file"]
    for root in ("site-packages/", "/work/", "/omni_cache/"):
        if root in path:
            path = path.split(root, 1)[1]
    return f"{m['func']} ({path})"


def parse_collapsed(text: str) -> Counter[tuple[str, ...]]:
    """py-spy's raw output: ``frame;frame;... COUNT`` per line (root first) -> stack -> count.
    Thread-name roots (``process X:"name"``, ``thread (0x..)``) are dropped."""
    out: Counter[tuple[str, ...]] = Counter()
    for line in text.splitlines():
        head, _, count = line.rpartition(" ")
        if not head or not count.isdigit():
            continue
        frames = [f for f in head.split(";") if f and not f.startswith(("process ", "thread ("))]
        out[tuple(_short(f) for f in frames)] += int(count)
    return out


def _part_of(stack: tuple[str, ...], parts: dict[str, re.Pattern[str]]) -> str:
    for label, pattern in parts.items():
        if any(pattern.search(frame) for frame in stack):
            return label
    return "other"


def summarize(stacks: Counter[tuple[str, ...]], rate: int, top: int = 15) -> dict[str, Any]:
    """One process's profile: samples, CPU seconds (samples / rate), the share of each part
    (:data:`PARTS`), and the frames that hold most samples, inclusive and self."""
    total = sum(stacks.values())
    parts = {k: re.compile(v) for k, v in PARTS.items()}
    by_part: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    own: Counter[str] = Counter()
    for stack, n in stacks.items():
        by_part[_part_of(stack, parts)] += n
        for frame in set(stack):
            inclusive[frame] += n
        if stack:
            own[stack[-1]] += n

    def share(c: Counter[str]) -> list[list[Any]]:
        return [[k, round(v / total, 4)] for k, v in c.most_common(top)] if total else []

    return {
        "samples": total,
        "cpu_s": total / rate if rate else None,
        "parts": {k: round(v / total, 4) for k, v in by_part.most_common()} if total else {},
        "top_inclusive": share(inclusive),
        "top_self": share(own),
    }


def summarize_dir(directory: str | os.PathLike[str], rate: int, top: int = 15) -> dict[str, Any]:
    """Every ``<side>-r<k>-<process>.txt`` of a run pooled per side and process:
    side -> process -> :func:`summarize`."""
    pooled: dict[str, dict[str, Counter[tuple[str, ...]]]] = {}
    for path in sorted(Path(directory).glob("*.txt")):
        m = re.match(r"^(?P<side>[^-]+)-r\d+-(?P<proc>.+)\.txt$", path.name)
        if not m:
            continue
        acc = pooled.setdefault(m["side"], {}).setdefault(m["proc"], Counter())
        acc.update(parse_collapsed(path.read_text(encoding="utf-8", errors="replace")))
    return {
        side: {proc: summarize(c, rate, top) for proc, c in sorted(procs.items())} for side, procs in pooled.items()
    }


def format_summary(summary: dict[str, Any], parts: int = 6) -> str:
    """Per side and process: CPU seconds sampled and the largest parts, as text lines."""
    lines = []
    for side, procs in summary.items():
        for proc, s in procs.items():
            top = ", ".join(f"{k} {v:.0%}" for k, v in list(s["parts"].items())[:parts])
            lines.append(f"profile {side:>4} {proc:<8} {s['cpu_s'] or 0:7.1f} CPU s sampled: {top}")
    return "\n".join(lines)
