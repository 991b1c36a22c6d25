"""How fast a stage's death reaches the clients whose requests it was serving (a probe, not a test).

    .venv/bin/python -m benchmarks.stage_failure [--stage-config FILE] [--stage talker] [--repeat 5]
        [--json OUT.json]

Starts the pipeline (spawned stages, as `omni-serve` does), then `--repeat` times: streams a long
answer with audio, sends SIGKILL to the stage's process as soon as the first audio chunk arrives
(the stage is then mid-answer), and records the time from the kill to the stream's error event.
Waits for the supervisor to restart the stage and checks that a request succeeds before the next
round. Prints the median and the largest delay: the kill-to-error figure of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.harness import ManagedServer, machine_info

ROOT = Path(__file__).resolve().parents[1]


def kill_mid_answer(url: str, model: str, pid: int) -> dict[str, Any]:
    """One round: the delay from SIGKILL to the error event, and what the event said."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "a long answer"}],
        "max_tokens": 2000,
        "stream": True,
        "modalities": ["text", "audio"],
        "audio": {"voice": "default", "format": "pcm16"},
    }
    killed_at = None
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            if "error" in event:
                if killed_at is None:
                    return {"error": event["error"], "delay_s": None}
                return {"error": event["error"], "delay_s": time.perf_counter() - killed_at}
            if killed_at is None and event.get("choices") and event["choices"][0]["delta"].get("audio"):
                killed_at = time.perf_counter()
                os.kill(pid, signal.SIGKILL)
    return {"error": None, "delay_s": None}  # the answer ended without an error: not counted


def wait_healthy(url: str, timeout: float = 300.0) -> None:
    end = time.monotonic() + timeout
    while httpx.get(url + "/health").status_code != 200:
        if time.monotonic() > end:
            raise RuntimeError("the stage did not come back")
        time.sleep(0.5)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stage-config", type=Path, default=ROOT / "stage_configs" / "tiny_omni.yaml")
    ap.add_argument("--stage", default="talker", help="the stage to kill (default talker)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", type=Path, default=None, help="also write every figure here")
    args = ap.parse_args(argv)

    # A private copy of the config (own name, sockets, free port): runs beside a served pipeline.
    with ManagedServer(args.stage_config, prefix_cache=True, tag="failure") as srv:
        model = httpx.get(srv.url + "/v1/models").json()["data"][0]["id"]
        rounds = []
        for i in range(args.repeat):
            res = kill_mid_answer(srv.url, model, srv.stage_pids()[args.stage])
            rounds.append(res)
            print(
                f"round {i + 1}: {args.stage} killed, error after {res['delay_s'] * 1e3:.0f} ms: {res['error']}"
                if res["delay_s"] is not None
                else f"round {i + 1}: not counted ({res})",
                flush=True,
            )
            wait_healthy(srv.url)
            r = httpx.post(
                srv.url + "/v1/chat/completions",
                timeout=300,
                json={
                    "model": model,
                    "messages": [{"role": "user", "content": "back?"}],
                    "max_tokens": 4,
                    "modalities": ["text", "audio"],
                },
            )
            r.raise_for_status()
    delays = [r["delay_s"] for r in rounds if r["delay_s"] is not None]
    summary = {
        "stage": args.stage,
        "rounds": rounds,
        "machine": machine_info(),
        "median_delay_s": statistics.median(delays) if delays else None,
        "max_delay_s": max(delays) if delays else None,
    }
    if delays:
        print(
            f"kill -9 of {args.stage} -> error event: median {summary['median_delay_s'] * 1e3:.0f} ms, "
            f"max {summary['max_delay_s'] * 1e3:.0f} ms over {len(delays)} rounds "
            f"({summary['machine']['cpu_model']}, load {os.getloadavg()[0]:.1f})"
        )
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))
    return 0 if delays else 1


if __name__ == "__main__":
    raise SystemExit(main())
