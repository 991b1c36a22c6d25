"""A pipeline whose stages are started by hand, and how fast their death reaches the clients.

:class:`HandStartedPipeline` does what docs/external-stages.md tells a user
to do, on one machine with tcp://127.0.0.1 standing in for the hosts: a copy of a stage config
with tcp addresses, a control address and a stage key file (stage_configs/tiny_omni_hosts.yaml,
on free ports); ``omni-serve``;
``python -m workers --stage-config FILE --stage NAME`` once per stage. Each is its own OS process
(tests/test_external_stages_e2e.py drives it too).

Run as a probe, it measures the failover figure: with N streaming requests in flight it kills a
stage with SIGKILL and reports, per request, the seconds from the kill until its error event::

    .venv/bin/python -m benchmarks.hand_started --kill talker --requests 4 --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

REPO = Path(__file__).resolve().parents[1]
#: tiny_omni with every stage external, tcp addresses, bind 0.0.0.0 and a stage key file.
HOSTS = REPO / "stage_configs" / "tiny_omni_hosts.yaml"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _with_port(address: str, port: int) -> str:
    return f"{address.rpartition(':')[0]}:{port}"


class HandStartedPipeline:
    """``base`` (stage_configs/tiny_omni_hosts.yaml) as docs/external-stages.md runs it, on free ports (each
    address keeps its host) and, with ``auth``, a fresh stage key file (else none); a server and
    stages started as separate processes. ``warmup=False``: the vLLM stages start without their
    start-up warm-up (``stages[].warmup``; for tests that do not test first use)."""

    def __init__(
        self, base: Path = HOSTS, *, auth: bool = True, workdir: Path | None = None, warmup: bool = True
    ) -> None:
        self.dir = Path(workdir or tempfile.mkdtemp(prefix="omni_hosts_"))
        data = yaml.safe_load(base.read_text())
        data["name"] = f"{data['name']}_{os.getpid()}"
        server = data["server"]
        port = free_port()
        for key in ("control_address", "control_bind_address"):
            server[key] = _with_port(server[key], port)
        server["port"] = self.http_port = free_port()
        server["stage_auth_key_file"] = None
        if auth:
            key = self.dir / "stage.key"
            subprocess.run(
                [sys.executable, "-m", "omni_cache.wire.stage_auth", "new-key", str(key)],
                check=True,
                capture_output=True,
            )
            server["stage_auth_key_file"] = str(key)
        for stage in data["stages"]:
            port = free_port()
            stage["address"] = _with_port(stage["address"], port)
            stage["bind_address"] = _with_port(stage["bind_address"], port)
            if not warmup and stage["kind"] == "autoregressive":
                stage["warmup"] = False
        self.config_path = self.dir / "pipeline.yaml"
        self.config_path.write_text(yaml.safe_dump(data, sort_keys=False))
        self.config = data
        self.url = f"http://{server['host']}:{self.http_port}"
        self.model = data["name"]
        self.server: subprocess.Popen | None = None
        self.stages: dict[str, subprocess.Popen] = {}

    # ---- processes -------------------------------------------------------------------------------

    def _spawn(self, argv: list[str], log_name: str) -> subprocess.Popen:
        log = open(self.dir / log_name, "ab")  # noqa: SIM115 -- the child keeps it open
        return subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=REPO
        )

    def start_server(self) -> None:
        self.server = self._spawn(
            [str(Path(sys.executable).with_name("omni-serve")), "--stage-config", str(self.config_path)], "server.log"
        )

    def stop_server(self, timeout: float = 60.0) -> int:
        assert self.server is not None
        self.server.send_signal(signal.SIGINT)  # Ctrl-C
        code = self.server.wait(timeout)
        self.server = None
        return code

    def start_stage(self, name: str) -> None:
        self.stages[name] = self._spawn(
            [sys.executable, "-m", "workers", "--stage-config", str(self.config_path), "--stage", name], f"{name}.log"
        )

    def kill_stage(self, name: str) -> float:
        """SIGKILL the stage's process; returns the monotonic time of the kill."""
        proc = self.stages.pop(name)
        t = time.monotonic()
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(60)
        return t

    def close(self) -> None:
        if self.server is not None and self.server.poll() is None:
            self.server.send_signal(signal.SIGTERM)
            try:
                self.server.wait(30)
            except subprocess.TimeoutExpired:
                self.server.kill()
        for proc in self.stages.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.stages.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        self.stages.clear()

    def log(self, name: str, lines: int = 30) -> str:
        path = self.dir / f"{name}.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    # ---- HTTP ------------------------------------------------------------------------------------

    def health(self) -> httpx.Response | None:
        try:
            return httpx.get(self.url + "/health", timeout=10)
        except httpx.TransportError:
            return None

    def wait_health(self, status: int, timeout: float) -> httpx.Response:
        deadline = time.monotonic() + timeout
        while True:
            resp = self.health()
            if resp is not None and resp.status_code == status:
                return resp
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"/health not {status} within {timeout:g} s: "
                    f"{resp.text if resp is not None else 'no answer'}\n"
                    f"server log:\n{self.log('server')}"
                )
            if self.server is not None and self.server.poll() is not None:
                raise RuntimeError(f"omni-serve exited {self.server.returncode}:\n{self.log('server')}")
            time.sleep(0.2)

    def chat(self, content: str, *, max_tokens: int = 16, audio: bool = True, timeout: float = 300.0) -> httpx.Response:
        return httpx.post(
            self.url + "/v1/chat/completions",
            timeout=timeout,
            json={
                "model": self.model,
                "max_tokens": max_tokens,
                "modalities": ["text", "audio"] if audio else ["text"],
                "messages": [{"role": "user", "content": content}],
            },
        )

    def stream(
        self, content: str, *, max_tokens: int, started: threading.Event, timeout: float = 300.0
    ) -> dict[str, Any]:
        """One streaming request with audio: ``{'error': message or None, 'error_at': monotonic
        time the error arrived, 'done': bool}``; sets ``started`` at its first chunk."""
        out: dict[str, Any] = {"error": None, "error_at": None, "done": False, "status": None}
        body = {
            "model": self.model,
            "max_tokens": max_tokens,
            "stream": True,
            "modalities": ["text", "audio"],
            "messages": [{"role": "user", "content": content}],
        }
        with httpx.stream("POST", self.url + "/v1/chat/completions", json=body, timeout=timeout) as r:
            out["status"] = r.status_code
            if r.status_code != 200:
                out["error"], out["error_at"] = r.read().decode(errors="replace"), time.monotonic()
                started.set()
                return out
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                started.set()
                data = line[len("data: ") :]
                if data == "[DONE]":
                    out["done"] = True
                    break
                event = json.loads(data)
                if "error" in event:
                    out["error"], out["error_at"] = event["error"].get("message"), time.monotonic()
                    break
        started.set()
        return out


def kill_under_load(p: HandStartedPipeline, stage: str, n: int, max_tokens: int) -> dict[str, Any]:
    """Start ``n`` streaming requests, kill ``stage`` once all of them streamed something, and
    collect each request's outcome with the seconds from the kill to its error."""
    results: list[dict[str, Any]] = [{} for _ in range(n)]
    started = [threading.Event() for _ in range(n)]

    def run(i: int) -> None:
        results[i] = p.stream(f"request {i}: tell me a long story", max_tokens=max_tokens, started=started[i])

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for ev in started:
        ev.wait(300)
    killed_at = p.kill_stage(stage)
    for t in threads:
        t.join(300)
    hung = sum(t.is_alive() for t in threads)
    for r in results:
        if r.get("error_at") is not None:
            r["seconds_to_error"] = round(r["error_at"] - killed_at, 3)
    return {
        "killed": stage,
        "requests": n,
        "hung": hung,
        "results": results,
        "seconds_to_error": [r["seconds_to_error"] for r in results if "seconds_to_error" in r],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.hand_started", description=__doc__.split("\n\n")[0])
    ap.add_argument("--kill", default="talker", help="the stage to kill (default: talker)")
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=1, help="kill/restart rounds")
    ap.add_argument("--no-auth", action="store_true", help="no stage key file")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    p = HandStartedPipeline(auth=not args.no_auth)
    report: dict[str, Any] = {"config": str(p.config_path), "rounds": []}
    try:
        p.start_server()
        for name in [s["name"] for s in p.config["stages"]]:
            p.start_stage(name)
        p.wait_health(200, 900)
        assert p.chat("warm up").status_code == 200
        for _ in range(args.rounds):
            rnd = kill_under_load(p, args.kill, args.requests, args.max_tokens)
            p.start_stage(args.kill)
            p.wait_health(200, 900)
            rnd["next_request_status"] = p.chat("after the restart").status_code
            report["rounds"].append(rnd)
            print(json.dumps({k: v for k, v in rnd.items() if k != "results"}), flush=True)
    finally:
        p.close()
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
