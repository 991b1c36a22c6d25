"""What a stage's prefix cache holds, as vLLM's KV-cache events say, for the orchestrator's router.

With ``kv_events_config.enable_kv_cache_events`` vLLM's block pool records a ``BlockStored`` when a
full block gets its hash (it can be hit from then on), a ``BlockRemoved`` when a cached block is
evicted (its hash is gone) and ``AllBlocksCleared`` when the prefix cache is reset, and the
scheduler hands each step's batch to its publisher. :func:`install` puts a
:class:`BlockEventCollector` in front of that publisher (in-process: the stage's engine core runs
in the stage), so the stage can send the orchestrator what changed since its last report
(``BlockEvents``; omni_cache/runtime/routing/prefix_index.py keeps it).

The hashes are vLLM's own, in the 64-bit form its events carry; the orchestrator computes the same
for a prompt (omni_cache/runtime/routing/block_hashes.py). What is reported is each hash's last state since
the previous report: held (``stored``) or gone (``removed``). vLLM also sends ``BlockStored`` again
for blocks a request hit (they were cached already), so a hash is a set member, not a count. In
the rare case of two blocks with one hash, the eviction of one drops the hash while the other
still holds it: the router then misses a preference, it never keeps a stale one.
A report lost on its way is made good by :meth:`BlockEventCollector.take` with ``snapshot``: every
hash held, after a reset (workers/block_reporter.py sends it after a failed send, or when the
router saw a gap in the reports' numbers).

Hybrid thinkers (Qwen3-Next, Qwen3.5: GatedDeltaNet + attention) have several KV-cache groups and
vLLM reports each group's blocks under the same hash. A hit there needs the attention KV of every
block up to the hit *and* a recurrent state at the hit's last block (vLLM's align mode keeps states
only at some boundaries: where a chunk ended, or, with block states, every boundary a prefill
crossed). So the collector keeps which groups hold each hash and reports two sets: ``stored``, the
hashes every attention group holds, and ``state_stored``, those every recurrent (Mamba) group holds;
the orchestrator's index combines them as the engine does (omni_cache/runtime/routing/prefix_index.py).
Merging the groups into one set would say "held" for every attention block although the engine
can only resume where a state is.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

_LOW_64_BITS = (1 << 64) - 1


@dataclass
class BlockChanges:
    """The changes since the last report, each hash in one list. ``cleared``: everything held
    before is gone (apply it first)."""

    stored: list[int] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)
    cleared: bool = False
    block_size: int = 0
    #: Recurrent (hybrid) engines: the hashes whose block has a state in every recurrent group.
    state_stored: list[int] = field(default_factory=list)
    state_removed: list[int] = field(default_factory=list)
    #: Whether the engine has recurrent groups (its hits need a state: ``state_*`` apply).
    recurrent: bool = False
    #: Tokens per hash step (vLLM's ``hash_block_size``: below ``block_size`` with
    #: ``prefix_match_unit``, where a full block's hash is the step chain's at the block's end).
    hash_block_size: int = 0

    def __bool__(self) -> bool:
        return bool(self.stored or self.removed or self.cleared or self.state_stored or self.state_removed)


def _as_int(block_hash: Any) -> int:
    # VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0 makes vLLM report the digest's bytes instead.
    if isinstance(block_hash, int):
        return block_hash
    return int.from_bytes(bytes(block_hash), "big") & _LOW_64_BITS


class BlockEventCollector:
    """Stands where the scheduler's KV-event publisher stood: keeps the block changes of the
    batches it is given and passes every batch on to that publisher.

    ``state_groups``: the KV-cache group ids of the engine's recurrent layers (none: every group
    is attention and a hash is held while any group holds it, as for a dense model)."""

    def __init__(
        self,
        inner: Any,
        state_groups: frozenset[int] = frozenset(),
        attention_groups: frozenset[int] = frozenset({0}),
        hash_block_size: int = 0,
    ) -> None:
        self.inner = inner
        self._state_groups = frozenset(state_groups)
        self._attention_groups = frozenset(attention_groups)
        self._hash_block_size = hash_block_size
        self._groups: dict[int, set[int]] = {}  # block hash -> the groups holding it
        self._dirty: set[int] = set()  # hashes changed since the last report
        self._cleared = False
        self._block_size = 0

    # the publisher interface the scheduler calls
    def publish(self, batch: Any) -> None:
        from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

        for event in batch.events:
            group = getattr(event, "group_idx", None) or 0  # None: a single-group engine
            if isinstance(event, BlockStored):
                # block_size: tokens per block of the event (fewer for a partial block, where
                # the pool caches those): the largest seen is the full blocks' size.
                self._block_size = max(self._block_size, event.block_size or 0)
                for h in map(_as_int, event.block_hashes):
                    self._groups.setdefault(h, set()).add(group)
                    self._dirty.add(h)
            elif isinstance(event, BlockRemoved):
                for h in map(_as_int, event.block_hashes):
                    held = self._groups.get(h)
                    if held is not None:
                        held.discard(group)
                        if not held:
                            del self._groups[h]
                    self._dirty.add(h)
            elif isinstance(event, AllBlocksCleared):
                self._groups.clear()
                self._dirty.clear()
                self._cleared = True
        if self.inner is not None:
            self.inner.publish(batch)

    def shutdown(self) -> None:
        if self.inner is not None:
            self.inner.shutdown()

    def get_publisher_config(self) -> Any:
        return self.inner.get_publisher_config() if self.inner is not None else None

    # what the stage reads
    def take(self, snapshot: bool = False) -> BlockChanges:
        """The changes since the last call (and forget them). ``snapshot``: instead, everything
        held now, as a reset followed by its blocks (the router's index is rebuilt from it)."""
        recurrent = bool(self._state_groups)
        if snapshot:
            self._dirty = set(self._groups)
            self._cleared = True
        out = BlockChanges(
            cleared=self._cleared,
            block_size=self._block_size,
            recurrent=recurrent,
            hash_block_size=self._hash_block_size or self._block_size,
        )
        for block_hash in self._dirty:
            groups = self._groups.get(block_hash, set())
            if not recurrent:
                (out.stored if groups else out.removed).append(block_hash)
                continue
            attention = self._attention_groups <= groups
            (out.stored if attention else out.removed).append(block_hash)
            (out.state_stored if self._state_groups <= groups else out.state_removed).append(block_hash)
        self._dirty.clear()
        self._cleared = False
        return out


def install(scheduler: Any) -> BlockEventCollector | None:
    """Put a collector in front of ``scheduler``'s KV-event publisher; None when the engine was
    not started with KV-cache events on (nothing would be recorded)."""
    config = getattr(scheduler, "kv_events_config", None)
    if config is None or not config.enable_kv_cache_events:
        return None
    from vllm.v1.kv_cache_interface import MambaSpec

    groups = scheduler.kv_cache_config.kv_cache_groups
    state = frozenset(i for i, g in enumerate(groups) if isinstance(g.kv_cache_spec, MambaSpec))
    collector = BlockEventCollector(
        scheduler.kv_event_publisher,
        state_groups=state,
        attention_groups=frozenset(range(len(groups))) - state,
        hash_block_size=getattr(scheduler, "hash_block_size", 0) or 0,
    )
    scheduler.kv_event_publisher = collector
    return collector
