"""The block hashes vLLM's prefix cache gives a prompt, computed in the orchestrator before the
request reaches an engine, so the router can ask which replica holds which prefix
(omni_cache/runtime/routing/replica_router.py).

The hashing is vLLM's own (``vllm.v1.core.kv_cache_utils``, ``prefix_caching_hash_algo: sha256``,
its default): each full block's extra keys come from ``generate_block_hash_extra_keys`` and its
hash from ``hash_block_tokens`` with ``vllm.utils.hashing.sha256``, chained from block to block as
the engine's ``get_request_block_hasher`` chains them. What stays ours:

* the first block's parent. vLLM derives it from the engine process's seed (``init_none_hash``:
  its ``PYTHONHASHSEED`` when set, else ``DEFAULT_NONE_HASH_SEED``) into a global of the process
  that calls it; the router hashes for engines in other processes, whose seed it is told, so it
  derives the parent the same way (the hash function over the seed) without touching that global;
* the prompt as a request: the expanded token ids and the media items (identifier, offset and
  length of each item's run, in the engine's order; omni_cache/runtime/routing/media_layouts.py), handed
  to vLLM's extra-key function as a request with those features and no LoRA, cache salt or
  prompt embeddings (the router does not route those prompts by prefix);
* the 64-bit form. vLLM's KV events report a hash as the low 64 bits of the digest read
  big-endian (``maybe_convert_block_hash`` with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``, on by
  default); the stages report that form whatever the variable says (scheduler/block_events.py),
  and so does this.

``tests/test_block_hashes.py`` checks these hashes against an engine-side vLLM ``Request`` hashed
by ``get_request_block_hasher``, text and media prompts alike.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

_LOW_64_BITS = (1 << 64) - 1

#: One media item of an expanded prompt: (identifier, offset of its run, length of its run).
MediaPosition = tuple[str, int, int]


@functools.cache
def _vllm() -> SimpleNamespace:
    """vLLM's hashing functions, imported on first use (the module loads without vLLM)."""
    from vllm.multimodal.inputs import PlaceholderRange
    from vllm.utils.hashing import sha256
    from vllm.v1.core import kv_cache_utils

    return SimpleNamespace(
        sha256=sha256,
        default_seed=kv_cache_utils.DEFAULT_NONE_HASH_SEED,
        extra_keys=kv_cache_utils.generate_block_hash_extra_keys,
        hash_block=kv_cache_utils.hash_block_tokens,
        PlaceholderRange=PlaceholderRange,
    )


def _as_request(v: SimpleNamespace, media: Sequence[MediaPosition]) -> Any:
    """What ``generate_block_hash_extra_keys`` reads of a vLLM ``Request``: its multimodal
    features (identifier and run), LoRA, cache salt and prompt embeddings (none here)."""
    features = [
        SimpleNamespace(identifier=identifier, mm_position=v.PlaceholderRange(offset=offset, length=length))
        for identifier, offset, length in media
    ]
    return SimpleNamespace(mm_features=features, lora_request=None, cache_salt=None, prompt_embeds=None)


def prompt_block_hashes(
    token_ids: Sequence[int], block_size: int, seed: str | None = None, media: Sequence[MediaPosition] = ()
) -> list[int]:
    """The hash of every full block of ``token_ids`` (a partial last block has none), in the
    64-bit form vLLM's KV events carry. ``seed``: the engine's PYTHONHASHSEED, if it has one.
    ``media``: the prompt's media items in the engine's order (``token_ids`` expanded)."""
    if block_size < 1:
        raise ValueError(f"block_size must be positive, got {block_size}")
    v = _vllm()
    request = _as_request(v, media)
    parent = v.sha256(v.default_seed if seed is None else seed)  # vLLM's NONE_HASH for that seed
    out: list[int] = []
    cursor = 0  # the first media item a later block can still overlap (vLLM's curr_mm_idx)
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        end = start + block_size
        keys, cursor = v.extra_keys(request, start, end, cursor)
        parent = v.hash_block(v.sha256, parent, [int(t) for t in token_ids[start:end]], keys)
        out.append(int.from_bytes(parent, "big") & _LOW_64_BITS)
    return out
