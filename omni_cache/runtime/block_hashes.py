"""The block hashes vLLM's prefix cache gives a text prompt, computed in the orchestrator without
vLLM, so the router can ask which replica holds which prefix (omni_cache/runtime/routing.py).

vLLM 0.32 (``prefix_caching_hash_algo: sha256``, its default) names each full block of a prompt by
a chain: block i's hash is SHA-256 over the pickled tuple ``(hash of block i-1, the block's token
ids as a tuple, extra keys)``, block 0's parent being the hash of the seed string (the environment's
``PYTHONHASHSEED`` when set, else the fixed ``"vllm-none-hash"``, so independent processes agree).
A text prompt without LoRA, cache salt or prompt embeddings has no extra keys (None). vLLM's KV
events report a hash as the low 64 bits of the digest read big-endian
(``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``, on by default): that is the form returned here.

Prompts with images or audio (extra keys from the media's hashes and positions) and the other
hash algorithms are not computed here; the router treats them as holding no known prefix.
``tests/test_block_hashes.py`` checks these hashes against vLLM's own functions.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Sequence

#: The seed vLLM derives the first block's parent from when PYTHONHASHSEED is not set.
DEFAULT_SEED = "vllm-none-hash"
_LOW_64_BITS = (1 << 64) - 1


def _sha256(value: object) -> bytes:
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def prompt_block_hashes(token_ids: Sequence[int], block_size: int,
                        seed: str | None = None) -> list[int]:
    """The hash of every full block of ``token_ids`` (a partial last block has none), in the
    64-bit form vLLM's KV events carry. ``seed``: the engine's PYTHONHASHSEED, if it has one."""
    if block_size < 1:
        raise ValueError(f"block_size must be positive, got {block_size}")
    parent = _sha256(DEFAULT_SEED if seed is None else seed)
    out: list[int] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = _sha256((parent, tuple(int(t) for t in token_ids[start:start + block_size]), None))
        out.append(int.from_bytes(parent, "big") & _LOW_64_BITS)
    return out
