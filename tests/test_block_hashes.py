"""The orchestrator's block hashes of a prompt (omni_cache/runtime/block_hashes.py) equal the ones
vLLM's prefix cache computes and its KV events report, with vLLM's default seed and with a
PYTHONHASHSEED (vLLM's own functions, no engine)."""

from __future__ import annotations

import random

import pytest

from omni_cache.runtime.block_hashes import prompt_block_hashes


def vllm_hashes(token_ids: list[int], block_size: int) -> list[int]:
    from vllm.utils.hashing import sha256
    from vllm.v1.core import kv_cache_utils

    kv_cache_utils.init_none_hash(sha256)  # reads PYTHONHASHSEED, as an engine does at start
    parent, out = None, []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = kv_cache_utils.hash_block_tokens(sha256, parent, token_ids[start:start + block_size])
        out.append(kv_cache_utils.maybe_convert_block_hash(parent))
    return out


@pytest.mark.parametrize("seed", [None, "1234"])
def test_prompt_block_hashes_are_vllms(monkeypatch: pytest.MonkeyPatch, seed: str | None) -> None:
    pytest.importorskip("vllm")
    if seed is None:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    else:
        monkeypatch.setenv("PYTHONHASHSEED", seed)
    rng = random.Random(0)
    try:
        for n, block_size in ((0, 32), (31, 32), (32, 32), (100, 32), (257, 16)):
            ids = [rng.randrange(512) for _ in range(n)]
            ours = prompt_block_hashes(ids, block_size, seed)
            assert len(ours) == n // block_size
            assert ours == vllm_hashes(ids, block_size)
    finally:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
        vllm_hashes([], 1)  # vLLM's global seed back to its default for later tests


def test_a_chain_names_the_whole_prefix() -> None:
    a = prompt_block_hashes(list(range(96)), 32)
    b = prompt_block_hashes(list(range(64)) + [7] * 32, 32)
    c = prompt_block_hashes([1] + list(range(1, 96)), 32)
    assert a[:2] == b[:2] and a[2] != b[2]  # same first two blocks, then they differ
    assert not set(a) & set(c)  # one token changed in block 0 changes every block after it
    with pytest.raises(ValueError):
        prompt_block_hashes([1, 2], 0)


def test_the_collector_reports_each_hash_by_its_last_event_and_passes_batches_on() -> None:
    pytest.importorskip("vllm")
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

    from scheduler.block_events import BlockEventCollector

    def stored(*hashes: int, size: int = 32) -> BlockStored:
        return BlockStored(block_hashes=list(hashes), parent_block_hash=None,
                           token_ids=[0] * size * len(hashes), block_size=size, lora_id=None,
                           medium="GPU", lora_name=None)

    class Inner:
        batches: list = []

        def publish(self, batch) -> None:
            self.batches.append(batch)

    inner = Inner()
    collector = BlockEventCollector(inner)
    collector.publish(KVEventBatch(ts=0.0, events=[stored(1, 2, 3), BlockRemoved(block_hashes=[2], medium="GPU")]))
    collector.publish(KVEventBatch(ts=1.0, events=[stored(3), stored(4, size=7),  # a hit, a partial block
                                                   BlockRemoved(block_hashes=[1], medium="GPU"),
                                                   stored(1), stored(b"\x00" * 24 + (9).to_bytes(8, "big"))]))
    changes = collector.take()
    assert sorted(changes.stored) == [1, 3, 4, 9] and changes.removed == [2]
    assert changes.block_size == 32 and not changes.cleared
    assert len(inner.batches) == 2  # the publisher it stands in for still gets everything
    assert not collector.take()  # nothing new
    collector.publish(KVEventBatch(ts=2.0, events=[stored(5), AllBlocksCleared(), stored(6)]))
    changes = collector.take()
    assert changes.cleared and changes.stored == [6] and changes.removed == []
