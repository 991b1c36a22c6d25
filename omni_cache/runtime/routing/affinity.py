"""Where a prompt prefix's downstream work went: the talker replica for a shared prompt.

A talker's prompt is embeddings it builds from the thinker's hidden states, so two requests that
share a thinker prompt prefix share a talker prompt prefix, and the talker's own prefix cache
pays only if both go to the same talker replica. Unlike the thinker's blocks (PrefixIndex, from
the replicas' own reports), the talker's block hashes are hashes of those embeddings, which the
orchestrator cannot compute. What it does know is where it sent each prefix: this index maps the
thinker prompt's block hashes (omni_cache/runtime/routing/block_hashes.py) to the replica of a downstream
stage that last took a request with that prefix. It is a memory of routing, not of the talker's
cache: a prefix the talker evicted still points at it (the request then computes its talker
prompt there as it would anywhere), and a replica that died is forgotten.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

#: Tokens per hashed block of the thinker prompt: the orchestrator's own key (it need not be the
#: thinker's KV block size; a prefix shorter than one block has no affinity).
AFFINITY_BLOCK_SIZE = 32
#: Hashes remembered per stage (the least recently routed are forgotten first): 64k blocks is
#: about 2M prompt tokens at block size 32, more than a talker's pool holds.
MAX_HASHES = 65536


class PrefixAffinity:
    def __init__(self, max_hashes: int = MAX_HASHES) -> None:
        self._where: OrderedDict[int, int] = OrderedDict()  # block hash -> replica
        self._max = max_hashes

    def __len__(self) -> int:
        return len(self._where)

    def lookup(self, chain: Sequence[int], up: Sequence[int]) -> int | None:
        """The replica (among ``up``) that last took the longest prefix of ``chain``, else None."""
        for block_hash in reversed(chain):  # a hash names the whole prefix up to its block
            replica = self._where.get(block_hash)
            if replica is not None and replica in up:
                return replica
        return None

    def record(self, chain: Sequence[int], replica: int) -> None:
        """A request whose prompt has ``chain`` was routed to ``replica``."""
        for block_hash in chain:
            self._where[block_hash] = replica
            self._where.move_to_end(block_hash)
        while len(self._where) > self._max:
            self._where.popitem(last=False)

    def forget(self, replica: int) -> None:
        """The replica died: its cache went with it."""
        for block_hash in [h for h, r in self._where.items() if r == replica]:
            del self._where[block_hash]
