"""The block hashes vLLM's prefix cache gives a prompt, computed in the orchestrator without
vLLM, so the router can ask which replica holds which prefix (omni_cache/runtime/routing.py).

vLLM 0.32 (``prefix_caching_hash_algo: sha256``, its default) names each full block of a prompt by
a chain: block i's hash is SHA-256 over the pickled tuple ``(hash of block i-1, the block's token
ids as a tuple, extra keys)``, block 0's parent being the hash of the seed string (the environment's
``PYTHONHASHSEED`` when set, else the fixed ``"vllm-none-hash"``, so independent processes agree).
A text prompt without LoRA, cache salt or prompt embeddings has no extra keys (None). vLLM's KV
events report a hash as the low 64 bits of the digest read big-endian
(``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``, on by default): that is the form returned here.

A prompt with images, audio or video is hashed over its *expanded* token ids (each item's
placeholder replaced by the run the thinker's processor made of it), and every block that overlaps
an item's run gets the extra key ``("mm", identifier, run offset - block start)``: the item's
multimodal identifier as the engine names it (our content digest, or vLLM's hash of it with the
request's processor kwargs) and where its run starts relative to the block. The items are walked
in the engine's order with one cursor, as vLLM's ``_gen_mm_extra_hash_keys`` does: a block that
ends inside an item's run stops there, so of two items on the same run (a video and its sound
track) only the first is keyed in the blocks before the run's last one. Where those runs and
identifiers come from: omni_cache/runtime/media_layouts.py.

Other hash algorithms, LoRA and cache salts are not computed here (the router does not route
those prompts by prefix). ``tests/test_block_hashes.py`` checks these hashes against vLLM's own
functions, text and media prompts alike.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Sequence

#: The seed vLLM derives the first block's parent from when PYTHONHASHSEED is not set.
DEFAULT_SEED = "vllm-none-hash"
_LOW_64_BITS = (1 << 64) - 1

#: One media item of an expanded prompt: (identifier, offset of its run, length of its run).
MediaPosition = tuple[str, int, int]


def _sha256(value: object) -> bytes:
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def prompt_block_hashes(
    token_ids: Sequence[int], block_size: int, seed: str | None = None, media: Sequence[MediaPosition] = ()
) -> list[int]:
    """The hash of every full block of ``token_ids`` (a partial last block has none), in the
    64-bit form vLLM's KV events carry. ``seed``: the engine's PYTHONHASHSEED, if it has one.
    ``media``: the prompt's media items in the engine's order (``token_ids`` expanded)."""
    if block_size < 1:
        raise ValueError(f"block_size must be positive, got {block_size}")
    parent = _sha256(DEFAULT_SEED if seed is None else seed)
    out: list[int] = []
    cursor = 0  # the first item a later block can still overlap
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        keys, cursor = _media_keys(media, start, start + block_size, cursor)
        parent = _sha256((parent, tuple(int(t) for t in token_ids[start : start + block_size]), keys))
        out.append(int.from_bytes(parent, "big") & _LOW_64_BITS)
    return out


def _media_keys(media: Sequence[MediaPosition], start: int, end: int, cursor: int) -> tuple[tuple | None, int]:
    """The extra keys of block [start, end) and the cursor for the next block."""
    keys = []
    while cursor < len(media):
        identifier, offset, length = media[cursor]
        if end <= offset:
            break  # the item starts in a later block
        if start >= offset + length:
            cursor += 1  # the item ended before this block
            continue
        keys.append(("mm", identifier, offset - start))
        if end < offset + length:
            break  # the item goes on past this block: later items are not looked at here
        cursor += 1
    return (tuple(keys) if keys else None), cursor
