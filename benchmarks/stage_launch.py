"""Stage processes forked from a forker (``server.stage_launch: fork``) against a fresh Python
each (``spawn``): start-up, its CPU and memory, a restart, the first request.

    .venv/bin/python -m benchmarks.stage_launch [--stage-config FILE] [--rounds 3] [--json OUT.json]

Every round starts, per side (their order alternating from round to round), a FRESH
``omni-serve`` in a process of its own on a private copy of the config with
``server.stage_launch`` set, and measures:

- start-up: from the server process's start to its ``ready`` line;
- the CPU seconds the server's whole process tree used until then (psutil: the server, the
  forker, the stages) and its memory at that point (sum of PSS: pages a forker shares with its
  children are counted once);
- the first request: a streamed chat answer with text and audio, to its last byte;
- a restart: ``kill -9`` of the talker, until ``/health`` answers 200 again with a new talker.

Reported: per side the median over rounds of each, and fork / spawn of the medians.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from benchmarks.side_processes import ServerProcess, private_config

SIDES = ("fork", "spawn")


def _tree(pid: int) -> list[Any]:
    import psutil

    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def _cpu_s(pid: int) -> float:
    total = 0.0
    for p in _tree(pid):
        with contextlib.suppress(Exception):
            t = p.cpu_times()
            total += t.user + t.system
    return total


def _pss_mib(pid: int) -> float:
    total = 0
    for p in _tree(pid):
        with contextlib.suppress(OSError), open(f"/proc/{p.pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    total += int(line.split()[1])
    return total / 1024


def _first_request(url: str, model: str) -> float:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 16,
        "stream": True,
        "modalities": ["text", "audio"],
        "audio": {"voice": "default", "format": "pcm16"},
    }
    t0 = time.monotonic()
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=300) as r:
        r.raise_for_status()
        for _ in r.iter_bytes():
            pass
    return time.monotonic() - t0


def _restart(srv: ServerProcess, timeout_s: float = 600) -> float:
    old = srv.stage_pids()["talker"]
    t0 = time.monotonic()
    os.kill(old, signal.SIGKILL)
    while True:
        assert time.monotonic() - t0 < timeout_s, "the talker did not come back"
        new = srv.stage_pids().get("talker")
        if new not in (None, old) and httpx.get(srv.url + "/health", timeout=10).status_code == 200:
            return time.monotonic() - t0
        time.sleep(0.05)


def one_round(config: Path, side: str, tmp: Path, tag: str) -> dict[str, float]:
    data = yaml.safe_load(config.read_text())
    data.setdefault("server", {})["stage_launch"] = side
    source = tmp / f"{tag}-source.yaml"
    source.write_text(yaml.safe_dump(data, sort_keys=False))
    path = private_config(source, tmp, tag)
    model = yaml.safe_load(path.read_text())["name"]
    with ServerProcess(path) as srv:
        assert srv.pid is not None
        out = {"startup_s": srv.startup_s, "startup_cpu_s": _cpu_s(srv.pid), "pss_mib": _pss_mib(srv.pid)}
        out["first_request_s"] = _first_request(srv.url, model)
        out["restart_s"] = _restart(srv)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.stage_launch", description=__doc__.split("\n\n")[0])
    parser.add_argument("--stage-config", default="stage_configs/tiny_omni.yaml")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None, help="write every round's figures here")
    args = parser.parse_args(argv)
    runs: dict[str, list[dict[str, float]]] = {side: [] for side in SIDES}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            order = SIDES if r % 2 == 0 else SIDES[::-1]
            for side in order:
                result = one_round(Path(args.stage_config), side, Path(tmp), f"{side}{r}")
                runs[side].append(result)
                print(f"round {r} {side:>5}: " + ", ".join(f"{k} {v:.1f}" for k, v in result.items()), flush=True)
    keys = list(runs[SIDES[0]][0])
    medians = {side: {k: statistics.median(x[k] for x in runs[side]) for k in keys} for side in SIDES}
    print(f"\nmedians over {args.rounds} rounds (load average at the end: {os.getloadavg()[0]:.2f})")
    print(f"{'':>16} " + " ".join(f"{side:>8}" for side in SIDES) + "  fork/spawn")
    for k in keys:
        f, s = medians["fork"][k], medians["spawn"][k]
        print(f"{k:>16} {f:8.1f} {s:8.1f}  {f / s:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": runs, "medians": medians}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
