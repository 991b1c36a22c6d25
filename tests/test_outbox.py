"""A stage's outbox over real ZMQ (no stage process): a downstream peer that dies and comes back
gets nothing that was queued for its predecessor, and no tail of a request whose start it never
saw; requests that start after the restart reach it."""

from __future__ import annotations

import time

import pytest
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
        seen = [(m.request_id, m.seq) for m, _ in iter(lambda: decoder.recv(timeout_ms=500), None)]
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
        seen = [[(m.request_id, m.seq) for m, _ in iter(lambda r=r: r.recv(timeout_ms=500), None)] for r in replicas]
        assert seen == [[("b", 0), ("b", 1)], [("a", 0), ("a", 1), ("a", 2)]]
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
