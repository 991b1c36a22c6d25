"""The wire messages' ranges are declared in their types (omni_cache/wire/messages.py, msgspec
``Meta``): a frame with a value out of range does not decode, the receiver drops and counts it and
takes the next frame. The frames are written as a broken or hostile peer would write them (the
message as a plain map with one value changed, msgpack-encoded), sent over real ZMQ sockets.

Last, the case that made this necessary: a peer's ``BlockEvents`` with ``block_size: -1`` sent
to a running orchestrator (two fake thinker replicas routed by prefix) was stored and made every
later request a 500; now it is dropped and requests are answered."""

from __future__ import annotations

import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import torch
import yaml
import zmq
from fake_pipeline import FAKE_STAGE, ByteTokenizer, fake_pipeline_config

from omni_cache.config import load_config
from omni_cache.runtime.orchestrator import Orchestrator
from omni_cache.serving.server import ServerThread
from omni_cache.wire.messages import (
    MAX_ERROR_MESSAGE,
    MAX_SAMPLE_RATE,
    MESSAGE_TYPES,
    Abort,
    BlockEvents,
    MediaRef,
    Shutdown,
    StageError,
    StageOutput,
    StageReady,
    StageStats,
    StreamStart,
    Submit,
)
from omni_cache.wire.sampling import EngineSampling
from omni_cache.wire.transport import Codec, Receiver

CODEC = Codec(MESSAGE_TYPES, max_message_bytes=1 << 20)

#: One valid message of each kind; each bad case changes one field of one of them.
GOOD: dict[str, msgspec.Struct] = {
    "submit": Submit(
        request_id="r1",
        prompt_token_ids=[1, 2, 3],
        sampling=EngineSampling(),
        modalities=["text", "audio"],
        time_left_s=30.0,
        route={"thinker": 1},
        media=[MediaRef(kind="audio", tensor="media.0", sample_rate=16000)],
    ),
    "output": StageOutput(
        request_id="r1",
        stage="thinker",
        seq=1,
        token_ids=[5],
        latent_start=3,
        num_prompt_tokens=3,
        sample_rate=24000,
        finish_reason="stop",
    ),
    "start": StreamStart(
        request_id="r1",
        stage="thinker",
        seq=0,
        token_ids=[5],
        modalities=["text", "audio"],
        sampling=EngineSampling(),
        time_left_s=12.5,
        route={"talker": 0},
        prompt_token_ids=[1, 2],
        image_grids=[[1, 4, 4]],
    ),
    "error": StageError(request_id="r1", stage="talker", message="bad", status=400),
    "abort": Abort(request_id="r1"),
    "ready": StageReady(stage="thinker", pid=123, replica=1, max_model_len=8192, host="h"),
    "stats": StageStats(stage="thinker", counters={"requests": 3.0}, replica=0),
    "blocks": BlockEvents(stage="thinker", replica=1, stored=[2**64 - 1, 0], removed=[7], block_size=32),
    "shutdown": Shutdown(reason="bye"),
}

#: (case, message kind, field, bad value); ``MISSING`` drops the field.
MISSING = object()
BAD: list[tuple[str, str, str, Any]] = [
    ("empty request id", "submit", "request_id", ""),
    ("over-long request id", "output", "request_id", "r" * 129),
    ("no prompt", "submit", "prompt_token_ids", []),
    ("negative token id", "submit", "prompt_token_ids", [1, -1]),
    ("token id past int32", "output", "token_ids", [2**31]),
    ("unknown modality", "submit", "modalities", ["text", "video"]),
    ("negative time left", "submit", "time_left_s", -1.0),
    ("NaN time left", "start", "time_left_s", float("nan")),
    ("negative time left downstream", "start", "time_left_s", -0.5),
    ("negative prompt token", "start", "prompt_token_ids", [3, -3]),
    ("negative replica downstream", "start", "route", {"talker": -1}),
    ("negative resumed tokens", "submit", "resumed_tokens", -2),
    ("negative replica in a route", "submit", "route", {"thinker": -1}),
    ("not a stage name in a route", "submit", "route", {"Thinker!": 0}),
    ("unknown media kind", "submit", "media", [{"kind": "file", "tensor": "m", "sample_rate": 0}]),
    ("video rate out of range", "submit", "media", [{"kind": "video", "tensor": "m", "fps": 1001.0}]),
    (
        "media sample rate out of range",
        "submit",
        "media",
        [{"kind": "audio", "tensor": "m", "sample_rate": MAX_SAMPLE_RATE + 1}],
    ),
    ("over-long finish reason", "submit", "answer_finished", "x" * 33),
    ("not a stage name", "output", "stage", "Thinker!"),
    ("over-long stage name", "output", "stage", "s" * 65),
    ("negative seq", "output", "seq", -1),
    ("negative stop token id", "output", "stop_reason", -1),
    ("over-long stop string", "output", "stop_reason", "s" * (2**16 + 1)),
    ("negative token id in logprobs", "output", "logprobs", [[[-1, -0.5, "x"]]]),
    ("negative latent start", "output", "latent_start", -1),
    ("negative prompt length", "output", "num_prompt_tokens", -5),
    ("negative cached tokens", "output", "num_cached_tokens", -1),
    ("negative sample rate", "output", "sample_rate", -24000),
    ("sample rate out of range", "output", "sample_rate", 10**9),
    ("patch grid of two", "start", "image_grids", [[1, 2]]),
    ("negative patch grid", "start", "image_grids", [[1, -2, 3]]),
    ("status below 100", "error", "status", 0),
    ("status above 599", "error", "status", 700),
    ("over-long error message", "error", "message", "e" * (MAX_ERROR_MESSAGE + 1)),
    ("empty abort id", "abort", "request_id", ""),
    ("negative pid", "ready", "pid", -1),
    ("negative replica", "ready", "replica", -1),
    ("negative context length", "ready", "max_model_len", -8192),
    ("over-long host name", "ready", "host", "h" * 256),
    ("negative stats replica", "stats", "replica", -1),
    ("over-long counter name", "stats", "counters", {"c" * 129: 1.0}),
    ("block size -1", "blocks", "block_size", -1),
    ("block size 0", "blocks", "block_size", 0),
    ("no block size", "blocks", "block_size", MISSING),
    ("negative block hash", "blocks", "stored", [-1]),
    ("over-long shutdown reason", "shutdown", "reason", "x" * 1025),
]


def frame(msg: msgspec.Struct, field: str | None = None, value: Any = None) -> bytes:
    """``msg``'s header frame as a peer could write it, with ``field`` set to ``value``."""
    fields = msgspec.to_builtins(msg)
    if field is not None:
        if value is MISSING:
            del fields[field]
        else:
            fields[field] = value
    return msgspec.msgpack.encode({"msg": fields, "tensors": []})


def test_the_good_messages_decode():
    for kind, msg in GOOD.items():
        decoded, tensors = CODEC.decode([frame(msg)])
        assert decoded == msg and tensors == {}, kind


@pytest.mark.parametrize("case, kind, field, value", BAD, ids=[b[0] for b in BAD])
def test_a_frame_with_a_value_out_of_range_is_dropped_and_the_receiver_goes_on(case, kind, field, value):
    ctx = zmq.Context()
    address = f"inproc://wire-{uuid.uuid4().hex}"
    try:
        with Receiver(ctx, address, CODEC) as receiver:
            peer = ctx.socket(zmq.PUSH)
            peer.connect(address)
            peer.send_multipart([frame(GOOD[kind], field, value)])
            peer.send_multipart(CODEC.encode(GOOD[kind], {}))  # the next frame, a good one
            got = receiver.recv(timeout_ms=5000)
            assert got is not None and got[0] == GOOD[kind]
            assert receiver.dropped == 1
            peer.close(linger=0)
    finally:
        ctx.destroy(linger=0)


def test_a_tensor_frame_with_a_negative_dimension_is_dropped():
    good = CODEC.encode(GOOD["output"], {"hidden": torch.zeros(2, 2)})
    header = msgspec.msgpack.decode(good[0])
    header["tensors"][0][2] = [-2, -2]  # TensorMeta is a list: name, dtype, shape
    ctx = zmq.Context()
    try:
        with Receiver(ctx, "inproc://wire-shape", CODEC) as receiver:
            peer = ctx.socket(zmq.PUSH)
            peer.connect("inproc://wire-shape")
            peer.send_multipart([msgspec.msgpack.encode(header), bytes(good[1])])
            peer.send_multipart(good)
            msg, tensors = receiver.recv(timeout_ms=5000)
            assert msg == GOOD["output"] and tensors["hidden"].shape == (2, 2)
            assert receiver.dropped == 1
            peer.close(linger=0)
    finally:
        ctx.destroy(linger=0)


# ---- a running orchestrator ----------------------------------------------------------------------


def test_a_peers_block_size_of_minus_one_is_dropped_and_requests_are_answered():
    data = yaml.safe_load(
        fake_pipeline_config(Path(tempfile.mkdtemp(prefix="ocw")), f"wire_{uuid.uuid4().hex[:8]}").read_text()
    )
    data["server"]["routing"] = "prefix"
    data["stages"] = [{**data["stages"][0], "replicas": 2}]  # two thinkers, no decoder
    path = Path(tempfile.mkdtemp(prefix="ocw")) / "pipeline.yaml"
    path.write_text(yaml.safe_dump(data))
    orch = Orchestrator(
        load_config(path),
        tokenizer=ByteTokenizer(),
        stage_argv=[sys.executable, str(FAKE_STAGE)],
        start_timeout_s=60,
        shutdown_grace_s=2,
        echo_stage_logs=False,
    )
    server = ServerThread(orch).start()
    ctx = zmq.Context()
    try:
        server.wait_ready(60)
        assert orch.routes.prefix_routing  # prompts are hashed by the block sizes reported
        peer = ctx.socket(zmq.PUSH)
        peer.connect(orch.fleet.control_address)
        bad = BlockEvents(stage="thinker", replica=0, stored=[1, 2], block_size=32)
        peer.send_multipart([frame(bad, "block_size", -1)])
        peer.send_multipart(CODEC.encode(BlockEvents(stage="thinker", replica=1, stored=[3], block_size=4)))
        body = {"model": orch.served_model_name, "messages": [{"role": "user", "content": "hello after a bad frame"}]}
        end = time.monotonic() + 10
        while orch.routes.prefix_index.block_size.get(1) != 4:  # the good report, sent after it
            assert time.monotonic() < end, orch.routes.prefix_index.block_size
            time.sleep(0.02)
        assert 0 not in orch.routes.prefix_index.block_size  # the bad report never arrived
        for _ in range(3):
            r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
            assert r.status_code == 200, r.text
        peer.close(linger=0)
    finally:
        ctx.destroy(linger=0)
        server.stop()
