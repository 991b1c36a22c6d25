"""Which prompt prefixes each replica of the entry stage holds, from what the replicas report.

Each replica's engine reports the block hashes its prefix cache gained and lost
(``BlockEvents``, scheduler/block_events.py, vLLM's KV-cache events); this index keeps, per
replica, the set of hashes it holds. A prompt's prefix is held by a replica for as
many leading blocks as the replica holds the hash of (the hashes chain: block i's hash names the
whole prefix up to it, omni_cache/runtime/routing/block_hashes.py). Nothing here is guessed from past
routing: a prefix the replica evicted stops counting once it reported the eviction, and a
replica that died holds nothing until it reports again.

Hybrid (recurrent) thinkers hit only where the engine can resume: the attention KV of every
block up to the hit and a recurrent state at its last block (vLLM's align mode). Such a replica
also reports which hashes have a state, and :meth:`PrefixIndex.matched_blocks` counts the
longest held prefix that *ends on a state*, never more than the engine can serve (the attention
blocks alone would say "held" where, without a state, the engine recomputes from zero).

Granularity: a replica hashes in steps of its hash block size (vLLM's ``hash_block_size``; below
the block size with ``prefix_match_unit``) and a full block's hash is the step chain's at the
block's end. The index is told both, asks the router for prompt hashes in steps
(``block_size`` below is the step), and matches only whole blocks, every ``scale``-th step, which
is where the engine's full-block hits are; the count it returns is in steps.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from omni_cache.wire.messages import block_report


class PrefixIndex:
    def __init__(self) -> None:
        self._held: dict[int, set[int]] = {}  # replica -> the block hashes it holds
        self._states: dict[int, set[int]] = {}  # recurrent replica -> hashes with a state
        #: replica -> the tokens per hash step its hashes are for (from its reports): the router
        #: hashes prompts in steps of it.
        self.block_size: dict[int, int] = {}
        #: replica -> hash steps per block (1 unless the engine hashes below its block size).
        self.scale: dict[int, int] = {}
        #: Replicas whose hits need a recurrent state (hybrid thinkers).
        self.recurrent: set[int] = set()
        #: replica -> the number of its last report applied (BlockEvents.seq).
        self._seq: dict[int, int] = {}

    def in_sequence(self, replica: int, seq: int, cleared: bool) -> bool:
        """Whether a report numbered ``seq`` follows the last one applied. A gap (a report lost
        on the way) leaves the index unsure of what the replica holds: its hashes are dropped
        now (the router never prefers a replica for a block it may have lost) until a snapshot
        (``cleared``) comes, which is always in sequence. ``seq`` 0: unnumbered, never a gap."""
        last = self._seq.get(replica)
        if seq:
            self._seq[replica] = seq
        if not seq or cleared or (last is not None and seq == last + 1) or (last is None and seq == 1):
            return True
        self._drop_blocks(replica)
        return False

    def apply(
        self,
        replica: int,
        stored: Iterable[int],
        removed: Iterable[int],
        *,
        cleared: bool = False,
        block_size: int = 0,
        hash_block_size: int = 0,
        recurrent: bool = False,
        state_stored: Iterable[int] = (),
        state_removed: Iterable[int] = (),
    ) -> None:
        """One report: ``cleared`` drops what the replica held before; then its changes (a hash
        is in ``stored`` or ``removed``, not both; likewise for the ``state_*`` pair)."""
        if cleared:
            self._drop_blocks(replica)
        if block_size:
            step = hash_block_size or block_size
            if block_size % step:
                step = block_size  # not vLLM's layout: hash whole blocks (matches nothing finer)
            self.block_size[replica] = step
            self.scale[replica] = block_size // step
        if recurrent:
            self.recurrent.add(replica)
            states = self._states.setdefault(replica, set())
            states.difference_update(state_removed)
            states.update(state_stored)
        held = self._held.setdefault(replica, set())
        held.difference_update(removed)
        held.update(stored)

    def apply_report(self, replica: int, report: Any) -> None:
        """:meth:`apply` one block report of ``replica``: a ``BlockEvents`` from the wire or a
        stage's ``BlockChanges`` (scheduler/block_events.py), read by the fields they share
        (omni_cache/wire/messages.py ``BLOCK_REPORT_FIELDS``)."""
        self.apply(replica, **block_report(report))

    def forget(self, replica: int) -> None:
        """The replica is gone (it died): its cache, and the numbering of its reports."""
        self._drop_blocks(replica)
        self._seq.pop(replica, None)

    def _drop_blocks(self, replica: int) -> None:
        self._held.pop(replica, None)
        self._states.pop(replica, None)
        self.recurrent.discard(replica)

    def blocks(self, replica: int) -> int:
        """Distinct block hashes the replica holds."""
        return len(self._held.get(replica, ()))

    def matched_blocks(self, replica: int, chain: Sequence[int], limit: int | None = None) -> int:
        """How many leading hash steps of a prompt (its hash chain, in the replica's steps) the
        replica can serve as a hit: whole blocks only, ending on a state on a recurrent replica,
        at most ``limit`` steps (vLLM computes at least a prompt's last token)."""
        held = self._held.get(replica)
        if not held:
            return 0
        scale = self.scale.get(replica, 1)
        steps = chain if limit is None else chain[: max(0, limit)]
        blocks = steps[scale - 1 :: scale]  # a full block's hash: the step chain's at its end
        n = 0
        for block_hash in blocks:
            if block_hash not in held:
                break
            n += 1
        if replica in self.recurrent:
            states = self._states.get(replica, set())
            while n and blocks[n - 1] not in states:
                n -= 1  # the engine resumes only where a state is
        return n * scale
