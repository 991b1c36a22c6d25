"""Eviction churn: the hidden-state cache under constant block reuse, on the dense thinker.

Its own module so that the engines of test_hidden_cache.py are shut down before these start (their
module-scoped fixture lives until that module ends). Tolerances: see test_hidden_cache.py.

The hybrid thinker's churn runs on the real hybrid, Qwen3.5, through a whole pipeline:
tests/test_qwen3_5_pipeline_cache.py (100 branching requests in a pool that evicts, every row a next
stage received bitwise equal to cache off). The invented Qwen3-Next hybrid's run here (40 requests,
rows within tolerance) checked less and cost about a minute of the suite, so it went.
"""

from __future__ import annotations

import random

import pytest
from thinker_pair import Thinker, tokens

pytestmark = pytest.mark.vllm

# ---- eviction churn ------------------------------------------------------------------------------
# A KV cache of a few dozen blocks (24 of 32 tokens), a hundred requests over shared and unshared
# prefixes: blocks are evicted and refilled constantly (about 200 evictions, the first in the first
# waves; every hit comes after one), and a stale mirror row would show up as a mismatch. (It was
# 300 requests: the same paths, three times the time.)
# (The dense thinker runs in float32: 12 MiB hold as many blocks as 6 MiB did in bfloat16.)
CHURN = dict(block_size=32, max_model_len=512, kv_cache_memory_bytes=12 * 2**20)


def test_eviction_churn_matches_recompute(monkeypatch):
    from vllm.v1.core.block_pool import BlockPool

    evictions = []  # vLLM's prefix cache dropping a cached block to reuse it
    evict = BlockPool._maybe_evict_cached_block

    def counted(pool, block):
        evicted = evict(pool, block)
        evictions.append(evicted)
        return evicted

    monkeypatch.setattr(BlockPool, "_maybe_evict_cached_block", counted)
    t = Thinker("thinker", **CHURN)
    try:
        num_blocks = t.on.capture.store.num_blocks
        rng = random.Random(5)
        prefixes = [tokens(rng, rng.randrange(2, 6) * t.block + rng.randrange(t.block)) for _ in range(6)]
        num_requests, wave = 100, 6
        hits = hits_after_eviction = 0
        for first in range(0, num_requests, wave):
            prompts = {}
            for i in range(first, min(first + wave, num_requests)):
                if rng.random() < 0.7:
                    base = rng.choice(prefixes)
                else:
                    base = tokens(rng, rng.randrange(1, 4) * t.block)
                prompts[f"r{i}"] = base + tokens(rng, rng.randrange(1, 40))
            on, off = t.both(prompts, max_tokens=2)
            for rid in prompts:
                t.close_to_off(on[rid], off[rid], f"churn {rid}")
                hits += on[rid].num_cached_tokens > 0
                hits_after_eviction += on[rid].num_cached_tokens > 0 and any(evictions)
        counters = t.on.counters()
        assert hits > 0 and counters["latent_rows_served"] > 0
        # The workload queried ~17x more tokens than the whole block pool holds, so blocks were
        # evicted and reused, and prefixes computed again after an eviction were hit.
        assert counters["prefix_cache_queried_tokens"] > num_blocks * t.block
        assert sum(evictions) > num_blocks and hits_after_eviction > 0, (sum(evictions), hits_after_eviction)
        print(f"\nchurn: worst row error against the cache-off engine {t.worst:.2e}")
    finally:
        t.close()
