"""The server's tokenizer, loaded with its word cache bounded.

A BPE model of HF ``tokenizers`` remembers every word it has split (the pre-tokenized word -> its
symbols) in a cache of 10,000 words by default; entries are never evicted: once it is full, new
words are simply not added. In ``tokenizers`` 0.23 that cache is per thread (a thread-local map in
``BPE::tokenize_with_cache``), and the server tokenizes from its request threads
(``server.threads.request``: ``min(32, CPUs + 4)`` of them by default), so each of those threads
fills a cache of its own. An entry costs tens of bytes per character of its word (a vector of
symbols) plus the key. The server process tokenizes every prompt, so its heap grew with every new
word until every thread's cache was full: under the soak's random-text prompts (~25 new words
each) that was ~19 MiB of glibc heap on this 2-CPU machine, outside Python's allocator
(tracemalloc saw nothing grow), reached only after ~2,000 requests, about an hour at the ~30
requests a minute of the AVX2-only test machine. That was the server's "leak" of ~0.5 MiB a minute
(benchmarks/results/soak.md); heaptrack put the peak of that backtrace at 2.7 MB after ~250
requests. With more CPUs there are more such threads (up to 32), each with a cache of its own.

Natural text repeats its words (a few thousand of them make up most of any text), so a small
cache keeps most of the hits. :data:`WORD_CACHE_WORDS` words per thread bound the cache to ~1 MiB
a thread even for long random words, and a cache that small fills within the first minutes of
traffic, so the server's memory is flat from then on. Encoding is microseconds a word either way;
the prompt's chat template costs more.

``_resize_cache`` is the ``tokenizers`` Python binding's own method for this (the model has no
public setter); it sets the capacity every thread's cache checks. A tokenizer without it (a slow
Python tokenizer, another model type, an older ``tokenizers``) is used as it is, with a log line.
"""

from __future__ import annotations

import logging
import os
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["WORD_CACHE_WORDS", "bound_word_cache", "load_tokenizer"]

#: Words the server's tokenizer remembers, per thread (HF tokenizers' default: 10,000).
WORD_CACHE_WORDS = 1000


def bound_word_cache(tokenizer: Any, words: int = WORD_CACHE_WORDS) -> bool:
    """Cap the word cache of ``tokenizer`` (a transformers tokenizer backed by ``tokenizers``, or
    a ``tokenizers.Tokenizer``) at ``words`` words, emptying it. False when it has no such cache."""
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    resize = getattr(getattr(backend, "model", None), "_resize_cache", None)
    if not callable(resize):
        logger.info("tokenizer %s has no word cache to bound; its memory is its own", type(tokenizer).__name__)
        return False
    resize(words)
    return True


def load_tokenizer(path: str | os.PathLike[str], words: int = WORD_CACHE_WORDS) -> Any:
    """``AutoTokenizer.from_pretrained(path)`` with its word cache bounded to ``words``."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    bound_word_cache(tokenizer, words)
    return tokenizer
