"""The server's tokenizer keeps a bounded word cache (omni_cache/runtime/request_path/tokenizer_cache.py).

The cache lives in ``tokenizers``' Rust code, outside Python's allocator, so it is measured where it
lives: glibc's bytes in use (``mallinfo2().uordblks``) before and after tokenizing prompts of words
never seen before. The unbounded control shows that the measurement sees the cache at all.
"""

from __future__ import annotations

import ctypes
import random
import string

import pytest

from omni_cache.runtime.request_path.tokenizer_cache import WORD_CACHE_WORDS, bound_word_cache, load_tokenizer
from omni_cache.tiny.checkpoints import write_checkpoint

MIB = 2**20


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def heap_in_use() -> int:
    """glibc's bytes in use by malloc (all arenas)."""
    try:
        mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        pytest.skip("needs glibc 2.33+ (mallinfo2)")
    mallinfo2.restype = _MallInfo2
    return mallinfo2().uordblks


def fresh_prompts(n: int, words: int = 15, length: int = 32) -> list[str]:
    """``n`` prompts of ``words`` random words each: every word new (as in the soak's prompts),
    long enough that the cache's size stands out from the allocator's noise."""
    rng = random.Random(0)
    return [" ".join("".join(rng.choices(string.ascii_lowercase, k=length)) for _ in range(words)) for _ in range(n)]


def growth(encode, prompts: list[str]) -> int:
    before = heap_in_use()
    for p in prompts:
        encode(p)
    return heap_in_use() - before


@pytest.fixture(scope="module")
def thinker_dir(tmp_path_factory: pytest.TempPathFactory):
    """The tiny thinker checkpoint the default pipeline serves (its byte-level BPE tokenizer)."""
    return write_checkpoint("thinker", tmp_path_factory.mktemp("ckpt") / "thinker")


def test_the_servers_tokenizer_stops_growing_after_its_word_cache_fills(thinker_dir) -> None:
    # 12,000 new words: more than tokenizers' default cache of 10,000.
    prompts = fresh_prompts(800)
    bounded = load_tokenizer(thinker_dir)
    unbounded = load_tokenizer(thinker_dir, words=10_000)  # tokenizers' default, as before
    grew_unbounded = growth(unbounded.backend_tokenizer.encode, prompts)
    grew_bounded = growth(bounded.backend_tokenizer.encode, prompts)
    # ~10,000 words of 32 characters: about 10 MiB that stays for the process's life.
    assert grew_unbounded > 5 * MIB, f"the unbounded control grew only {grew_unbounded / MIB:.2f} MiB"
    # WORD_CACHE_WORDS (1,000) words of that size: about 1 MiB.
    assert grew_bounded < 2.5 * MIB, f"the bounded tokenizer grew {grew_bounded / MIB:.2f} MiB"
    # Bounded, not merely slower to fill: as many new words again add nothing much.
    assert growth(bounded.backend_tokenizer.encode, fresh_prompts(800, length=31)) < 0.5 * MIB


def test_bounding_keeps_the_tokens(thinker_dir) -> None:
    text = "héllo wörld, the cache does not change tokens: \U0001f600 " * 3
    plain = load_tokenizer(thinker_dir, words=10_000)
    bounded = load_tokenizer(thinker_dir, words=WORD_CACHE_WORDS)
    assert bounded.encode(text) == plain.encode(text)


def test_a_tokenizer_without_a_word_cache_is_left_as_it_is() -> None:
    class Slow:  # a tokenizer with no tokenizers backend
        pass

    assert bound_word_cache(Slow()) is False
