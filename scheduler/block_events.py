"""What a stage's prefix cache holds, as vLLM's KV-cache events say, for the orchestrator's router.

With ``kv_events_config.enable_kv_cache_events`` vLLM's block pool records a ``BlockStored`` when a
full block gets its hash (it can be hit from then on), a ``BlockRemoved`` when a cached block is
evicted (its hash is gone) and ``AllBlocksCleared`` when the prefix cache is reset, and the
scheduler hands each step's batch to its publisher. :func:`install` puts a
:class:`BlockEventCollector` in front of that publisher (in-process: the stage's engine core runs
in the stage), so the stage can send the orchestrator what changed since its last report
(``BlockEvents``; omni_cache/runtime/prefix_index.py keeps it).

The hashes are vLLM's own, in the 64-bit form its events carry; the orchestrator computes the same
for a prompt (omni_cache/runtime/block_hashes.py). What is reported is each hash's last state since
the previous report: held (``stored``) or gone (``removed``). vLLM also sends ``BlockStored`` again
for blocks a request hit (they were cached already), so a hash is a set member, not a count. In
the rare case of two blocks with one hash, the eviction of one drops the hash while the other
still holds it: the router then misses a preference, it never keeps a stale one.
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

    def __bool__(self) -> bool:
        return bool(self.stored or self.removed or self.cleared)


def _as_int(block_hash: Any) -> int:
    # VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0 makes vLLM report the digest's bytes instead.
    if isinstance(block_hash, int):
        return block_hash
    return int.from_bytes(bytes(block_hash), "big") & _LOW_64_BITS


class BlockEventCollector:
    """Stands where the scheduler's KV-event publisher stood: keeps the block changes of the
    batches it is given and passes every batch on to that publisher."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self._last: dict[int, bool] = {}  # block hash -> held after its last event
        self._cleared = False
        self._block_size = 0

    # the publisher interface the scheduler calls
    def publish(self, batch: Any) -> None:
        from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

        for event in batch.events:
            if isinstance(event, BlockStored):
                # block_size: tokens per block of the event (fewer for a partial block, where
                # the pool caches those): the largest seen is the full blocks' size.
                self._block_size = max(self._block_size, event.block_size or 0)
                self._last.update((_as_int(h), True) for h in event.block_hashes)
            elif isinstance(event, BlockRemoved):
                self._last.update((_as_int(h), False) for h in event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                self._last.clear()
                self._cleared = True
        if self.inner is not None:
            self.inner.publish(batch)

    def shutdown(self) -> None:
        if self.inner is not None:
            self.inner.shutdown()

    def get_publisher_config(self) -> Any:
        return self.inner.get_publisher_config() if self.inner is not None else None

    # what the stage reads
    def take(self) -> BlockChanges:
        """The changes since the last call (and forget them)."""
        out = BlockChanges(cleared=self._cleared, block_size=self._block_size)
        for block_hash, held in self._last.items():
            (out.stored if held else out.removed).append(block_hash)
        self._last.clear()
        self._cleared = False
        return out


def install(scheduler: Any) -> BlockEventCollector | None:
    """Put a collector in front of ``scheduler``'s KV-event publisher; None when the engine was
    not started with KV-cache events on (nothing would be recorded)."""
    config = getattr(scheduler, "kv_events_config", None)
    if config is None or not config.enable_kv_cache_events:
        return None
    collector = BlockEventCollector(scheduler.kv_event_publisher)
    scheduler.kv_event_publisher = collector
    return collector
