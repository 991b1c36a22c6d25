"""Block reports lost on purpose, and the router's index equal to the replica's blocks again
within one snapshot (issue 52).

A stage numbers its block reports (``BlockEvents.seq``, workers/block_reporter.py). A report whose
send fails is gone with its changes: the stage's next report is a snapshot (every hash it holds).
A report lost where the stage cannot see it (a server restarted, a message dropped on the way)
shows as a gap in the numbers: the router drops that replica's hashes at once (it never prefers a
replica for a block it may have lost) and asks for a snapshot (``BlockSnapshotQuery``). Before,
a lost report was logged and its hashes stayed in the router's index for good.

The replica here is vLLM's event stream into the real collector (scheduler/block_events.py), the
router the real index (omni_cache/runtime/routing/prefix_index.py); only the socket between them is a list."""

from __future__ import annotations

import contextlib
import random

import pytest

from omni_cache.runtime.routing.prefix_index import PrefixIndex
from omni_cache.wire.transport import SendTimeout
from scheduler.block_events import BlockEventCollector
from workers.block_reporter import BlockReporter

STEPS = 300


def _stored(hashes: list[int]):
    from vllm.distributed.kv_events import BlockStored

    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=None,
        token_ids=[0] * 32 * len(hashes),
        block_size=32,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )


class Replica:
    """A prefix cache that stores and evicts blocks at random, and the hashes it truly holds."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.collector = BlockEventCollector(None)
        self.held: set[int] = set()

    def step(self) -> None:
        from vllm.distributed.kv_events import BlockRemoved, KVEventBatch

        new = [self.rng.randrange(1, 500) for _ in range(self.rng.randrange(0, 4))]
        gone = self.rng.sample(sorted(self.held), min(len(self.held), self.rng.randrange(0, 3)))
        # Evictions first, then new blocks (a hash may be evicted and stored again in one step).
        events = ([BlockRemoved(block_hashes=gone, medium="GPU")] if gone else []) + ([_stored(new)] if new else [])
        self.held.difference_update(gone)
        self.held.update(new)
        self.collector.publish(KVEventBatch(ts=0.0, events=events))


class Router:
    def __init__(self) -> None:
        self.index = PrefixIndex()
        self.asked = 0

    def receive(self, msg, reporter: BlockReporter) -> None:
        if not self.index.in_sequence(msg.replica, msg.seq, msg.cleared):
            reporter.request_snapshot()  # what the orchestrator's BlockSnapshotQuery does
            self.asked += 1
        self.index.apply_report(msg.replica, msg)  # what the orchestrator's RoutePlanner does

    def held(self) -> set[int]:
        return set(self.index._held.get(0, set()))


@pytest.mark.parametrize("loss", ["send_fails", "lost_on_the_way"])
def test_lost_block_reports_are_made_good_by_one_snapshot(loss):
    pytest.importorskip("vllm")
    replica, router = Replica(seed=7), Router()
    reporter = BlockReporter("thinker", 0, replica.collector.take)
    lost_at = set(random.Random(3).sample(range(10, STEPS - 20), 25))
    # The report after a failed send is the snapshot; after a loss the stage did not see, the next
    # report shows the gap and the one after it is the snapshot the router asked for.
    reports_to_snapshot = 1 if loss == "send_fails" else 2
    checked = 0
    for step in range(STEPS):
        replica.step()
        lose = step in lost_at

        def send(msg, lose=lose):
            if lose and loss == "send_fails":
                raise SendTimeout("the orchestrator's queue stayed full")
            if not lose:
                router.receive(msg, reporter)

        with contextlib.suppress(SendTimeout):
            reporter.report(send)
        if lose:
            continue
        # Never a hash the replica dropped, once a report came after the loss.
        assert router.held() <= replica.held, step
        recent = [s for s in range(step - reports_to_snapshot, step) if s in lost_at]
        if (
            recent
            and all(s not in lost_at for s in range(recent[-1] + 1, step))
            and step - recent[-1] == reports_to_snapshot
        ):
            assert router.held() == replica.held, f"step {step}: not equal one snapshot after the loss at {recent[-1]}"
            checked += 1
    assert checked >= 10
    reporter.report(lambda msg: router.receive(msg, reporter))  # one more step: a pending snapshot
    assert router.held() == replica.held
    assert reporter.snapshots >= 1
    if loss == "lost_on_the_way":
        assert router.asked >= 1


def test_the_index_equals_the_replica_right_after_the_snapshot():
    """Step by step: a failed send; the very next report is a snapshot and the index equals the
    replica's blocks; deltas go on from there."""
    pytest.importorskip("vllm")
    replica, router = Replica(seed=11), Router()
    reporter = BlockReporter("thinker", 0, replica.collector.take)
    for _ in range(20):
        replica.step()
        reporter.report(lambda msg: router.receive(msg, reporter))
    assert router.held() == replica.held
    replica.step()
    with pytest.raises(SendTimeout):
        reporter.report(lambda msg: (_ for _ in ()).throw(SendTimeout("full")))
    assert reporter.snapshot_due
    replica.step()
    reporter.report(lambda msg: router.receive(msg, reporter))
    assert reporter.snapshots == 1 and router.held() == replica.held
    for _ in range(20):
        replica.step()
        reporter.report(lambda msg: router.receive(msg, reporter))
        assert router.held() == replica.held


def test_a_gap_drops_the_replicas_hashes_until_its_snapshot():
    index = PrefixIndex()
    assert index.in_sequence(0, 1, False)
    index.apply(0, [1, 2, 3], [], block_size=32)
    assert index.in_sequence(0, 2, False)
    assert not index.in_sequence(0, 4, False)  # report 3 was lost
    assert index.blocks(0) == 0  # nothing it may have dropped is kept
    assert index.in_sequence(0, 5, True)  # the snapshot
    assert index.in_sequence(1, 0, False)  # unnumbered (older stage code): never a gap
    assert not index.in_sequence(2, 9, False)  # the first report the router sees is not 1


def test_one_mapping_carries_a_replicas_block_changes_to_the_message_and_the_index():
    """``BLOCK_REPORT_FIELDS`` is every field of a stage's ``BlockChanges``, every field of a
    ``BlockEvents`` but who sent it and its number, and every keyword of ``PrefixIndex.apply``:
    a field added to one and not the others would be dropped on the way without a word."""
    import dataclasses
    import inspect

    from omni_cache.wire.messages import BLOCK_REPORT_FIELDS, BlockEvents, block_report
    from scheduler.block_events import BlockChanges

    fields = set(BLOCK_REPORT_FIELDS)
    assert {f.name for f in dataclasses.fields(BlockChanges)} == fields
    assert set(BlockEvents.__struct_fields__) - {"stage", "replica", "seq"} == fields
    assert set(inspect.signature(PrefixIndex.apply).parameters) - {"self", "replica"} == fields
    changes = BlockChanges(stored=[1, 2], removed=[3], block_size=32, hash_block_size=16)
    msg = BlockEvents(stage="thinker", replica=1, seq=4, **block_report(changes))
    assert block_report(msg) == block_report(changes)
    index = PrefixIndex()
    index.apply_report(1, msg)
    assert index.blocks(1) == 2 and index.block_size[1] == 16 and index.scale[1] == 2
