"""A stage's outbox over real ZMQ (no stage process): a downstream peer that dies and comes back
gets nothing that was queued for its predecessor, and no tail of a request whose start it never
saw; requests that start after the restart reach it."""

from __future__ import annotations

import time

import pytest
import torch
import zmq

from omni_cache.wire.messages import MESSAGE_TYPES, StageOutput, StreamStart
from omni_cache.wire.sampling import EngineSampling
from omni_cache.wire.transport import Codec, Receiver
from workers.outbox import Outbox


def out(rid: str, seq: int, finished: bool = False) -> StageOutput:
    cls = StreamStart if seq == 0 else StageOutput  # a stream opens with its StreamStart
    return cls(request_id=rid, stage="thinker", seq=seq, token_ids=[seq], finished=finished)


def test_restarted_peer_gets_nothing_meant_for_its_predecessor(tmp_path):
    ctx, codec = zmq.Context(), Codec(MESSAGE_TYPES)
    address = f"ipc://{tmp_path}/talker.sock"
    talker = Receiver(ctx, address, codec)
    outbox = Outbox(ctx, codec, {"talker": [address]}, None)
    try:
        outbox.to_downstream(out("old", 0))
        got, _ = talker.recv(timeout_ms=5000)
        assert (got.request_id, got.seq) == ("old", 0)
        talker.close()  # the talker process dies
        outbox.to_downstream(out("old", 1))  # queued while the peer is gone
        deadline = time.monotonic() + 10
        while outbox.peer_resets == 0:  # the disconnect is reported asynchronously
            assert time.monotonic() < deadline, "the outbox never noticed the peer went away"
            outbox.check_peers()
            time.sleep(0.01)
        outbox.to_downstream(out("old", 2, finished=True))  # the rest of a stream it never began
        outbox.to_downstream(out("new", 0))
        talker = Receiver(ctx, address, codec)  # the restarted talker
        got, _ = talker.recv(timeout_ms=5000)
        assert (got.request_id, got.seq) == ("new", 0)
        assert talker.recv(timeout_ms=200) is None
    finally:
        outbox.close()
        talker.close()
        ctx.term()


def test_forgotten_request_sends_nothing_more(tmp_path):
    ctx, codec = zmq.Context(), Codec(MESSAGE_TYPES)
    address = f"ipc://{tmp_path}/decoder.sock"
    decoder = Receiver(ctx, address, codec)
    outbox = Outbox(ctx, codec, {"decoder": [address]}, None)
    try:
        outbox.to_downstream(out("a", 0))
        outbox.forget("a")  # failed or aborted here
        outbox.to_downstream(out("a", 1))
        outbox.to_downstream(out("b", 0))
        seen = [(m.request_id, m.seq) for m in drain(decoder, 2, quiet_ms=500)]
        assert seen == [("a", 0), ("b", 0)]
    finally:
        outbox.close()
        decoder.close()
        ctx.term()


def test_a_stream_goes_to_the_replica_its_route_names_and_stays_there(tmp_path):
    """Two talker replicas: each request's first message goes where its route says, the rest of
    its stream follows (later messages carry no route), and a route past the replicas is refused."""
    ctx, codec = zmq.Context(), Codec(MESSAGE_TYPES)
    addresses = [f"ipc://{tmp_path}/talker.sock", f"ipc://{tmp_path}/talker.sock.1"]
    replicas = [Receiver(ctx, a, codec) for a in addresses]
    outbox = Outbox(ctx, codec, {"talker": addresses}, None)

    def first(rid: str, replica: int) -> StreamStart:
        return StreamStart(request_id=rid, stage="thinker", seq=0, token_ids=[0], route={"talker": replica})

    try:
        outbox.to_downstream(first("a", 1))
        outbox.to_downstream(first("b", 0))
        outbox.to_downstream(out("a", 1))
        outbox.to_downstream(out("b", 1))
        outbox.to_downstream(out("a", 2, finished=True))
        want = [[("b", 0), ("b", 1)], [("a", 0), ("a", 1), ("a", 2)]]
        seen = [[(m.request_id, m.seq) for m in drain(r, len(w), quiet_ms=500)] for r, w in zip(replicas, want)]
        assert seen == want
        with pytest.raises(ValueError, match="replica 2 of stage 'talker', which has 2"):
            outbox.to_downstream(first("c", 2))
    finally:
        outbox.close()
        for r in replicas:
            r.close()
        ctx.term()


def test_a_stream_start_and_a_delta_arrive_as_their_own_types():
    """The codec tells a stream's first output from its continuations by tag: a StreamStart keeps
    its context, a StageOutput carries none."""
    codec = Codec(MESSAGE_TYPES)
    delta = StageOutput(request_id="r", stage="thinker", seq=0, token_ids=[5], text="x", num_prompt_tokens=3)
    start = StreamStart.opening(
        delta,
        modalities=["text", "audio"],
        sampling=EngineSampling(max_tokens=4),
        time_left_s=12.5,
        return_latents=True,
        route={"talker": 1},
        prompt_token_ids=[1, 2, 3],
        image_grids=[[1, 2, 2]],
    )
    got, _ = codec.decode(codec.encode(start))
    assert type(got) is StreamStart and got == start
    assert (got.token_ids, got.num_prompt_tokens, got.route) == ([5], 3, {"talker": 1})
    assert got.sampling.max_tokens == 4
    got, _ = codec.decode(codec.encode(delta))
    assert type(got) is StageOutput and got == delta


def drain(receiver: Receiver, expected: int, quiet_ms: int = 300) -> list:
    """The messages ``receiver`` gets: the ``expected`` ones however late they come (ZMQ's I/O
    thread delivers in its own time, on a loaded machine later than a quiet window of a few
    hundred ms: 30 s bound), then any more that come before ``quiet_ms`` of quiet."""
    got = []
    deadline = time.monotonic() + 30
    while len(got) < expected:
        item = receiver.recv(timeout_ms=1000)
        if item is not None:
            got.append(item[0])
        assert time.monotonic() < deadline, f"{len(got)} of {expected} messages came: {got}"
    return got + [m for m, _ in iter(lambda: receiver.recv(timeout_ms=quiet_ms), None)]


def plain(rid: str, seq: int) -> StageOutput:
    return StageOutput(request_id=rid, stage="thinker", seq=seq, token_ids=[seq], text=str(seq))


def test_one_steps_outputs_go_to_the_orchestrator_as_one_message_before_anything_downstream(tmp_path):
    """Within ``one_step`` the outputs without tensors wait and leave as one StageOutputs in
    their order; an output with tensors, or any other message, first sends what waits (the order
    per request is kept); what goes downstream leaves after the orchestrator's, so the
    orchestrator has every output before a downstream stage can answer it. Outside a step each
    message goes at once, as before."""
    ctx, codec = zmq.Context(), Codec(MESSAGE_TYPES)
    orch = Receiver(ctx, f"ipc://{tmp_path}/orch.sock", codec)
    talker = Receiver(ctx, f"ipc://{tmp_path}/talker.sock", codec)
    outbox = Outbox(ctx, codec, {"talker": [f"ipc://{tmp_path}/talker.sock"]}, f"ipc://{tmp_path}/orch.sock")
    failed = []
    try:
        with outbox.one_step(lambda rid, exc: failed.append(rid)):
            outbox.to_orchestrator(plain("a", 1))
            outbox.to_downstream(out("a", 0))
            outbox.to_orchestrator(plain("b", 1))
            assert orch.recv(timeout_ms=200) is None and talker.recv(timeout_ms=50) is None  # all wait
            outbox.to_orchestrator(plain("c", 1), {"hidden": torch.zeros(1, 4)})  # sends a and b first
            outbox.to_orchestrator(plain("d", 1))
        got = drain(orch, 3)
        assert [type(m).__name__ for m in got] == ["StageOutputs", "StageOutput", "StageOutput"]
        assert [(o.request_id, o.seq) for o in got[0].outputs] == [("a", 1), ("b", 1)]
        assert [m.request_id for m in got[1:]] == ["c", "d"]  # d alone: a step of one output
        assert [(m.request_id, m.seq) for m in drain(talker, 1)] == [("a", 0)]
        outbox.to_orchestrator(plain("e", 1))  # outside a step: at once
        assert orch.recv(timeout_ms=5000)[0].request_id == "e"
        assert failed == []
    finally:
        outbox.close()
        orch.close()
        talker.close()
        ctx.term()


def test_a_request_forgotten_within_the_step_sends_nothing_downstream_and_a_failed_send_fails_its_requests(tmp_path):
    """A request that fails during the step (``forget``) has none of its waiting messages sent
    downstream; a downstream peer that stopped reading fails, at the step's end, the request whose
    message could not go, through the callback (the runner's ``fail``), and only that one."""
    ctx, codec = zmq.Context(), Codec(MESSAGE_TYPES)
    address = f"ipc://{tmp_path}/talker.sock"
    talker = Receiver(ctx, address, codec)
    outbox = Outbox(ctx, codec, {"talker": [address]}, None, send_timeout_s=0.2)
    failed = []
    try:
        with outbox.one_step(lambda rid, exc: failed.append((rid, type(exc).__name__))):
            outbox.to_downstream(out("a", 0))
            outbox.to_downstream(out("b", 0))
            outbox.forget("a")
        assert [m.request_id for m in drain(talker, 1)] == ["b"]
        assert failed == []
        # Nobody reads from here on: zmq's queues (1,000 messages at each end) fill.
        with outbox.one_step(lambda rid, exc: failed.append((rid, type(exc).__name__))):
            for i in range(1, 5000):
                outbox.to_downstream(out("b", i))
        assert failed == [("b", "SendTimeout")]  # its stream is broken: the rest of it is not sent
    finally:
        outbox.close()
        talker.close()
        ctx.term()
