"""What stage authentication (CURVE) costs one stage-to-stage connection: the same StageOutput
with a latent tensor frame sent over tcp://127.0.0.1 through omni_cache.wire.transport, with and without
``server.stage_auth_key_file``'s CURVE keys; reports MB/s and messages/s for each, interleaved.

    .venv/bin/python -m benchmarks.transport_auth [--rows 4100] [--dim 1024] [--messages 50] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import threading
import time

import torch
import zmq

from omni_cache.wire.messages import MESSAGE_TYPES, StageOutput
from omni_cache.wire.stage_auth import StageAuth
from omni_cache.wire.transport import Codec, Receiver, Sender


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_run(auth: StageAuth | None, rows: int, dim: int, messages: int) -> dict[str, float]:
    ctx = zmq.Context()
    if auth is not None:
        auth.guard(ctx)
    codec = Codec(MESSAGE_TYPES, max_message_bytes=1 << 31)
    address = f"tcp://127.0.0.1:{_free_port()}"
    inbox = Receiver(ctx, address, codec, auth=auth)
    out = Sender(ctx, address, codec, auth=auth)
    hidden = torch.randn(rows, dim)
    msg = StageOutput(request_id="r", stage="thinker", seq=0)
    try:
        out.send(msg, {"hidden": hidden})  # connect + handshake outside the timing
        assert inbox.recv(timeout_ms=60_000) is not None

        def send_all() -> None:
            for _ in range(messages):
                out.send(msg, {"hidden": hidden})

        t0 = time.perf_counter()
        sender = threading.Thread(target=send_all)
        sender.start()
        for _ in range(messages):
            got = inbox.recv(timeout_ms=60_000)
            assert got is not None and got[1]["hidden"].shape == hidden.shape
        elapsed = time.perf_counter() - t0
        sender.join()
    finally:
        out.close()
        inbox.close()
        if auth is not None:
            auth.stop()
        ctx.term()
    mb = hidden.numel() * hidden.element_size() * messages / 1e6
    return {"seconds": elapsed, "MB_per_s": mb / elapsed, "messages_per_s": messages / elapsed}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.transport_auth", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=4100, help="latent rows per message (tokens)")
    ap.add_argument("--dim", type=int, default=1024, help="latent width (float32)")
    ap.add_argument("--messages", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    auth = StageAuth("benchmark secret, not for use: " + "x" * 32)
    runs: dict[str, list[dict[str, float]]] = {"off": [], "on": []}
    for _ in range(args.rounds):
        for side in ("off", "on"):
            runs[side].append(one_run(auth if side == "on" else None, args.rows, args.dim, args.messages))
    summary = {side: max(r["MB_per_s"] for r in rs) for side, rs in runs.items()}
    report = {
        "rows": args.rows,
        "dim": args.dim,
        "messages": args.messages,
        "runs": runs,
        "best_MB_per_s": summary,
        "on_over_off": summary["on"] / summary["off"],
    }
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
