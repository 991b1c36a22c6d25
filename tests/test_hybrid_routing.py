"""Prefix routing for hybrid (recurrent) thinkers, without engines (issue 43 item 4).

A hybrid engine (Qwen3-Next, Qwen3.5) resumes a prompt only where its attention KV covers every
block up to the hit *and* a recurrent state sits at the hit's last block. vLLM reports each
KV-cache group's blocks under the same hash, so counting a hash as held when any group holds it
would say "hit" for every attention block, although the engine (vLLM's align mode keeps states only
where a chunk ended) recomputes from zero there. These tests build the reports from vLLM's own
event classes and check that the index claims exactly what the engine's rule serves. The engine-level
check (index prediction == the engine's hit, align mode and block states) is in
tests/test_qwen3_5_block_states.py.
"""

from __future__ import annotations

import pytest

from omni_cache.runtime.routing.block_hashes import prompt_block_hashes
from omni_cache.runtime.routing.prefix_index import PrefixIndex

ATTENTION, GDN_A, GDN_B = 0, 1, 2  # a hybrid's groups: one attention group, two GDN groups


def stored(hashes: list[int], group: int, size: int = 4):
    from vllm.distributed.kv_events import BlockStored

    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=None,
        token_ids=[0] * size * len(hashes),
        block_size=size,
        lora_id=None,
        medium="CPU",
        lora_name=None,
        group_idx=group,
    )


def removed(hashes: list[int], group: int):
    from vllm.distributed.kv_events import BlockRemoved

    return BlockRemoved(block_hashes=hashes, medium="CPU", group_idx=group)


def report(collector, *events) -> object:
    from vllm.distributed.kv_events import KVEventBatch

    collector.publish(KVEventBatch(ts=0.0, events=list(events)))
    return collector.take()


def hybrid_collector():
    from scheduler.block_events import BlockEventCollector

    return BlockEventCollector(
        None, state_groups=frozenset({GDN_A, GDN_B}), attention_groups=frozenset({ATTENTION}), hash_block_size=4
    )


def test_a_hybrid_replica_reports_attention_blocks_and_states_apart():
    collector = hybrid_collector()
    # Align mode, one chunk of 3 blocks: attention caches all three, the GDN groups a state at the
    # chunk's end only.
    changes = report(collector, stored([11, 12, 13], ATTENTION), stored([13], GDN_A), stored([13], GDN_B))
    assert changes.recurrent and changes.hash_block_size == 4
    assert sorted(changes.stored) == [11, 12, 13] and changes.removed == []
    assert changes.state_stored == [13] and sorted(changes.state_removed) == [11, 12]
    # One GDN group loses the state: the engine cannot resume there any more.
    changes = report(collector, removed([13], GDN_B))
    assert changes.stored == [13] and changes.state_removed == [13] and changes.state_stored == []


def test_the_index_claims_only_hits_that_end_on_a_state():
    index, collector = PrefixIndex(), hybrid_collector()
    index.apply_report(0, report(collector, stored([11, 12, 13], ATTENTION), stored([13], GDN_A), stored([13], GDN_B)))
    assert index.recurrent == {0}
    assert index.matched_blocks(0, [11, 12, 13, 14]) == 3  # the state at block 3: a 3-block hit
    # A branch after block 2: attention holds 2 blocks, but there is no state at block 2 (nor 1)
    # and the engine recomputes everything. Counting attention blocks alone would say 2.
    assert index.matched_blocks(0, [11, 12, 99]) == 0
    index.apply_report(0, report(collector, stored([11], GDN_A), stored([11], GDN_B)))
    assert index.matched_blocks(0, [11, 12, 99]) == 1  # the best state at or below the KV match
    # A dense replica beside it keeps counting leading blocks.
    index.apply(1, stored=[11, 12], removed=[], block_size=4)
    assert index.matched_blocks(1, [11, 12, 99]) == 2


def test_a_prompt_is_never_matched_up_to_its_last_token():
    """vLLM computes at least a prompt's last token: a block-aligned prompt's last block cannot be
    hit, so the limit drops it (on a hybrid the state one block earlier decides)."""
    index = PrefixIndex()
    index.apply_report(
        0, report(hybrid_collector(), stored([11, 12], ATTENTION), stored([12], GDN_A), stored([12], GDN_B))
    )
    assert index.matched_blocks(0, [11, 12]) == 2
    assert index.matched_blocks(0, [11, 12], limit=(8 - 1) // 4) == 0  # an 8-token prompt
    assert index.matched_blocks(0, [11, 12], limit=(9 - 1) // 4) == 2  # a 9-token one


def test_hash_steps_below_the_block_match_whole_blocks_only():
    """With ``prefix_match_unit`` vLLM hashes in steps below the block and names a full block by
    the step chain's hash at its end; the index asks for step hashes and matches every block's."""
    step, block = 4, 12
    prompt = list(range(40))
    steps = prompt_block_hashes(prompt, step)
    blocks = steps[block // step - 1 :: block // step]
    index = PrefixIndex()
    index.apply(
        0,
        stored=blocks[:2] + [steps[7]],
        removed=[],
        block_size=block,  # + a partial entry
        hash_block_size=step,
        recurrent=True,
        state_stored=blocks[:2] + [steps[7]],
    )
    assert index.block_size == {0: step} and index.scale == {0: 3}
    assert index.matched_blocks(0, steps) == 6  # two whole blocks, in steps
    assert index.matched_blocks(0, steps, limit=(24 - 1) // step) == 3  # a 24-token prompt: one
    # Hashed in whole blocks instead, the chain would match nothing the replica reported.
    assert index.matched_blocks(0, prompt_block_hashes(prompt, block)) == 0


@pytest.mark.parametrize("cleared", [False, True])
def test_forgetting_a_hybrid_replica_drops_its_states(cleared):
    index = PrefixIndex()
    index.apply_report(0, report(hybrid_collector(), stored([11], ATTENTION), stored([11], GDN_A), stored([11], GDN_B)))
    if cleared:
        index.apply(0, stored=[11], removed=[], cleared=True, block_size=4)  # a dense report now
        assert index.matched_blocks(0, [11]) == 1 and 0 not in index.recurrent
    else:
        index.forget(0)
        assert index.matched_blocks(0, [11]) == 0
