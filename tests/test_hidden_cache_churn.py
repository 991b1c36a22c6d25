"""Eviction churn: the hidden-state cache under constant block reuse, dense and hybrid thinkers.

Its own module so that the engines of test_hidden_cache.py are shut down before these start (their
module-scoped fixture lives until that module ends). Tolerances: see test_hidden_cache.py.
"""

from __future__ import annotations

import random

import pytest
from thinker_pair import Thinker, tokens

pytestmark = pytest.mark.vllm

# ---- eviction churn ------------------------------------------------------------------------------
# A KV cache of a few dozen blocks, a few hundred requests over shared and unshared prefixes: blocks
# are evicted and refilled constantly, and a stale mirror row would show up as a mismatch.
# (The dense thinker runs in float32: 12 MiB hold as many blocks as 6 MiB did in bfloat16.)
CHURN = {
    "thinker": dict(block_size=32, max_model_len=512, kv_cache_memory_bytes=12 * 2**20),
    "thinker-hybrid": dict(max_model_len=4096, kv_cache_memory_bytes=24 * 2**20, prefix_cache_retention_interval=None),
}


@pytest.mark.parametrize("model", ["thinker", "thinker-hybrid"])
def test_eviction_churn_matches_recompute(model):
    t = Thinker(model, **CHURN[model])
    try:
        num_blocks = t.on.capture.store.num_blocks
        rng = random.Random(5)
        scale = t.block // 32  # hybrid blocks are 20x larger: fewer, longer prompts
        prefixes = [tokens(rng, rng.randrange(2, 6) * t.block + rng.randrange(t.block)) for _ in range(6)]
        num_requests, wave = (300, 6) if scale == 1 else (40, 3)
        hits = 0
        for first in range(0, num_requests, wave):
            prompts = {}
            for i in range(first, min(first + wave, num_requests)):
                if rng.random() < 0.7:
                    base = rng.choice(prefixes)
                else:
                    base = tokens(rng, rng.randrange(1, 4) * t.block)
                prompts[f"r{i}"] = base + tokens(rng, rng.randrange(1, 40) * max(1, scale // 4))
            on, off = t.both(prompts, max_tokens=2)
            for rid in prompts:
                t.close_to_off(on[rid], off[rid], f"churn {rid}")
                hits += on[rid].num_cached_tokens > 0
        counters = t.on.counters()
        assert hits > 0 and counters["latent_rows_served"] > 0
        # The workload queried more tokens than the whole block pool holds (the dense one ~10x;
        # the hybrid pool also holds the recurrent states), so blocks were evicted and reused.
        assert counters["prefix_cache_queried_tokens"] > num_blocks * t.block
        print(f"\nchurn {model}: worst row error against the cache-off engine {t.worst:.2e}")
    finally:
        t.close()
