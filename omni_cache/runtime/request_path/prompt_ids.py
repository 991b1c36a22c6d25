"""A prompt's token ids, checked once, where they are made.

The entry stage takes non-negative integer ids. Checking 20,000 of them costs 1.4 ms on a quiet
2-vCPU Zen 3 guest and about twice that under load; done by admission on the event loop, a burst
of 16 such prompts held every other request (``/health``, a short chat's first text) for tens of
milliseconds (benchmarks/results/hostile.md, twentieth session). So the tokenizer's worker thread
makes its ids a :class:`PromptIds` (:mod:`omni_cache.runtime.request_path.text_codec`), and
admission takes a PromptIds as already checked: the loop only checks ids a caller of the Python
API made itself.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from omni_cache.runtime.request_path.results import RequestError


class PromptIds(list[int]):
    """Token ids known to be non-negative Python ints: made by :func:`prompt_ids` only, and not
    changed afterwards (they are what the entry stage is sent)."""


def prompt_ids(ids: Sequence[int]) -> PromptIds:
    """``ids`` checked (400 for anything but non-negative integers), as a PromptIds; a
    PromptIds is returned as it is, unchecked again."""
    if type(ids) is PromptIds:
        return ids
    checked = PromptIds(ids)  # the one copy: the caller's list may change afterwards
    # A tokenizer's list of plain ints (the common case) is checked by C-level passes (~0.8 ms
    # for 20,000 ids; the per-id checks below take ~2.4 ms).
    if set(map(type, checked)) == {int}:  # bool is a subclass of int, not of type int: not here
        if min(checked) < 0:
            raise RequestError(400, "prompt token ids must be non-negative integers")
        return checked
    if not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) and t >= 0 for t in checked):
        raise RequestError(400, "prompt token ids must be non-negative integers")
    return PromptIds(int(t) for t in checked)
