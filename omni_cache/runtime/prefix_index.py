"""Which prompt prefixes each replica of the entry stage holds, from what the replicas report.

Each replica's engine reports the block hashes its prefix cache gained and lost
(``BlockEvents``, scheduler/block_events.py, vLLM's KV-cache events); this index keeps, per
replica, the set of hashes it holds. A prompt's prefix is held by a replica for as
many leading blocks as the replica holds the hash of (the hashes chain: block i's hash names the
whole prefix up to it, omni_cache/runtime/block_hashes.py). Nothing here is guessed from past
routing: a prefix the replica evicted stops counting once it reported the eviction, and a
replica that died holds nothing until it reports again.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


class PrefixIndex:
    def __init__(self) -> None:
        self._held: dict[int, set[int]] = {}  # replica -> the block hashes it holds
        #: replica -> the block size its hashes are for (from its reports)
        self.block_size: dict[int, int] = {}

    def apply(self, replica: int, stored: Iterable[int], removed: Iterable[int], *,
              cleared: bool = False, block_size: int = 0) -> None:
        """One report: ``cleared`` drops what the replica held before; then its changes (a hash
        is in ``stored`` or ``removed``, not both)."""
        if cleared:
            self.forget(replica)
        if block_size:
            self.block_size[replica] = block_size
        held = self._held.setdefault(replica, set())
        held.difference_update(removed)
        held.update(stored)

    def forget(self, replica: int) -> None:
        """The replica's cache is gone (it died, or it reset its prefix cache)."""
        self._held.pop(replica, None)

    def blocks(self, replica: int) -> int:
        """Distinct block hashes the replica holds."""
        return len(self._held.get(replica, ()))

    def matched_blocks(self, replica: int, chain: Sequence[int]) -> int:
        """How many leading blocks of a prompt (its hash chain) the replica holds."""
        held = self._held.get(replica)
        if not held:
            return 0
        n = 0
        for block_hash in chain:
            if block_hash not in held:
                break
            n += 1
        return n
