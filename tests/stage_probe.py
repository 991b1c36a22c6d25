"""Send one Submit to a stage's socket as an outsider would, and report the handshake's outcome
(test helper for the stage-authentication tests)."""

from __future__ import annotations

import time

import zmq
import zmq.utils.monitor

from omni_cache.wire.messages import Submit
from omni_cache.wire.sampling import EngineSampling
from omni_cache.wire.stage_auth import StageAuth
from omni_cache.wire.transport import Codec

WAIT_S = 60.0  # as tests/test_external_stages.py waits


def inject(ctx: zmq.Context, address: str, codec: Codec, auth: StageAuth | None, request_id: str) -> int:
    """Connect to ``address`` (with ``auth``, or without any key), send one Submit, and return
    the connection's handshake outcome (a ZMQ monitor event)."""
    sock = ctx.socket(zmq.PUSH)
    sock.linger = 0
    mon = sock.get_monitor_socket()  # before connecting: the handshake can be over quickly
    if auth is not None:
        auth.secure(sock, bind=False)
    sock.connect(address)
    try:
        message = codec.encode(
            Submit(request_id=request_id, prompt_token_ids=list(b"INJECTED"), sampling=EngineSampling(max_tokens=4))
        )
        try:
            # Never blocking: a refused handshake can drop the connection's pipe between two
            # frames, and a PUSH socket without one waits for a peer forever (the suite hung
            # here once, in a two-worker run).
            sock.send_multipart(message, flags=zmq.NOBLOCK)
        except zmq.Again:
            pass  # nothing to queue it on: the stage already turned the connection away
        done = {
            zmq.EVENT_HANDSHAKE_SUCCEEDED,
            zmq.EVENT_HANDSHAKE_FAILED_AUTH,
            zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
            zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
        }
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            if mon.poll(100):
                ev = zmq.utils.monitor.recv_monitor_message(mon)["event"]
                if ev in done:
                    return ev
        raise AssertionError(f"no handshake outcome from {address}")
    finally:
        sock.disable_monitor()
        mon.close(0)
        sock.close(0)
