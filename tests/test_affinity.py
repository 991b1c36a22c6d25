"""Talker replicas for a shared prompt (omni_cache.runtime.routing.affinity): the replica that took a
prompt prefix before takes the next request with it, unless it is much busier; a dead replica is
forgotten; the memory is bounded."""

from __future__ import annotations

from omni_cache.runtime.routing.affinity import AFFINITY_BLOCK_SIZE, PrefixAffinity
from omni_cache.runtime.routing.block_hashes import prompt_block_hashes
from omni_cache.runtime.routing.replica_router import ReplicaRouter


def chain(tokens: list[int]) -> list[int]:
    return prompt_block_hashes(tokens, AFFINITY_BLOCK_SIZE)


SHARED = list(range(1000, 1000 + 4 * AFFINITY_BLOCK_SIZE))


def test_the_longest_shared_prefix_decides():
    index = PrefixAffinity()
    index.record(chain(SHARED[:64] + [1] * 64), 0)
    index.record(chain(SHARED), 1)  # the whole shared prefix went to replica 1 last
    assert index.lookup(chain(SHARED + [7] * 40), [0, 1]) == 1
    assert index.lookup(chain(SHARED[:64] + [1] * 64), [0, 1]) == 0
    assert index.lookup(chain([5] * 200), [0, 1]) is None
    assert index.lookup(chain(SHARED[:10]), [0, 1]) is None  # shorter than one block
    # the replica that took the longest prefix is down: the one that took a shorter one
    assert index.lookup(chain(SHARED[:64] + [1] * 64), [1]) == 1  # SHARED's first 2 blocks
    assert index.lookup(chain(SHARED), [0]) is None  # 0 took SHARED's blocks, then 1 took them


def test_a_dead_replica_is_forgotten_and_the_memory_is_bounded():
    index = PrefixAffinity(max_hashes=8)
    index.record(chain(SHARED), 1)
    index.forget(1)
    assert len(index) == 0 and index.lookup(chain(SHARED), [0, 1]) is None
    index.record(chain(SHARED), 0)
    index.record(chain([3] * 6 * AFFINITY_BLOCK_SIZE), 1)
    assert len(index) == 8  # 4 + 6 hashes, the 2 least recently routed forgotten
    assert index.lookup(chain(SHARED), [0, 1]) == 0  # its last 2 blocks are still known


def test_the_router_follows_the_prefix_unless_its_replica_is_much_busier():
    router = ReplicaRouter("prefix", {"talker": 2})
    assert router.follow("talker", [0, 1], {}, 1) == 1
    assert router.follow("talker", [0, 1], {1: 3, 0: 1}, 1) == 1  # 3 <= 2 x 1 + 1
    assert router.follow("talker", [0, 1], {1: 4, 0: 1}, 1) == 0  # too busy: least loaded
    assert router.follow("talker", [0, 1], {0: 2}, None) == 1  # nothing known: least loaded
    assert router.follow("talker", [0], {}, 1) == 0  # its replica is down
    assert router.decisions[("talker", 1, "prefix", "prefix_affinity")] == 2
    assert router.decisions[("talker", 0, "prefix", "least_loaded")] == 2
