"""Which replica of a stage serves a request (``server.routing``), and the count of those choices.

The orchestrator picks, when it accepts a request, one replica of every stage the request will
pass (the thinker, and with audio the talker and the decoder). The choice travels with the request
(``Submit.route``, forwarded downstream with each stage's first output), so every message of a
request to a stage goes to one replica: the talker's per-request state and its own prefix hits
stay in one process (affinity; workers/outbox.py keeps a stream where it started).

Policies, among the replicas that are up:

* ``round_robin``: in turn, per stage (the replica after the one chosen last; a replica that is
  down is skipped, and rejoins the turn once it is back);
* ``least_loaded``: the fewest of this orchestrator's requests in flight on the replica (routed
  there and not yet finished by that stage); ties go to the lowest index;
* ``prefix`` (the default): the replica of the entry stage (the thinker) whose prefix cache holds
  the longest prefix of the prompt, ties to the least loaded (decision ``prefix_hit``); when no
  replica holds any block of it, or for a stage other than the entry, the prompt has media, or
  the replicas cannot report (see below), as ``least_loaded`` (decision ``least_loaded``). The
  load is not traded against the prefix yet: a longer prefix wins however busy its replica.

How ``prefix`` knows what a replica holds (nothing is guessed from past routing):

1. Each entry replica's engine runs with vLLM's KV-cache events on (``kv_events_config``, the
   ``null`` publisher): its block pool records a ``BlockStored`` when a full block gets its hash,
   a ``BlockRemoved`` when a cached block is evicted, ``AllBlocksCleared`` on a reset.
   scheduler/block_events.py stands in front of the scheduler's publisher (the engine core runs
   in the stage process) and keeps each hash's net change; after every step the stage sends them
   to the orchestrator (``BlockEvents``).
2. The orchestrator keeps, per replica, the hashes it holds (omni_cache/runtime/prefix_index.py),
   forgets a replica's when it dies, and for each text prompt computes the same chain of block
   hashes vLLM computes (omni_cache/runtime/block_hashes.py: SHA-256 over the pickled
   ``(parent hash, block tokens, extra keys)``, the first parent from ``PYTHONHASHSEED`` or vLLM's
   fixed seed, reported as the digest's low 64 bits; tests/test_block_hashes.py checks them
   against vLLM's functions). A replica holds a prompt's prefix for as many leading blocks as it
   holds the hashes of.
3. Not covered yet: prompts with images or audio (vLLM adds the media's hashes as extra keys),
   hash algorithms other than vLLM's default ``sha256``, hybrid thinkers (several KV-cache groups),
   the talker's own prefix (its prompt is embeddings; its segments follow the request instead).

Every decision for a stage with more than one replica is counted by (stage, replica, policy,
decision) and exposed as ``omni_cache_routing_decisions_total``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

POLICIES = ("prefix", "round_robin", "least_loaded")

#: A later stage's replica that took a prompt's prefix before keeps it while it has at most this
#: many times the requests of the least loaded replica, plus one.
AFFINITY_LOAD_RATIO = 2


class ReplicaRouter:
    """Picks replicas by one policy; remembers each stage's round-robin turn and counts decisions.

    ``replicas``: stage -> how many replicas it is configured with."""

    def __init__(self, policy: str, replicas: Mapping[str, int]) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown routing policy {policy!r} (known: {', '.join(POLICIES)})")
        self.policy = policy
        self._replicas = dict(replicas)
        self._turn: dict[str, int] = {}  # stage -> the lowest index whose turn it is (round_robin)
        #: (stage, replica, policy, decision) -> times chosen (stages with several replicas)
        self.decisions: Counter[tuple[str, int, str, str]] = Counter()

    def pick(self, stage: str, up: Sequence[int], load: Mapping[int, int],
             matched: Mapping[int, int] | None = None) -> int:
        """A replica of ``stage`` among ``up`` (the indices of its replicas that are up, not
        empty) given each one's ``load`` (requests in flight; missing = 0) and, for ``prefix``,
        ``matched``: how many leading blocks of the prompt each replica holds (None: unknown)."""
        if not up:
            raise ValueError(f"no replica of stage {stage!r} is up")
        if self._replicas.get(stage, 1) == 1:
            return up[0]  # nothing to choose, nothing to count
        best = max((matched.get(i, 0) for i in up), default=0) if matched else 0
        if self.policy == "round_robin":
            choice, decision = self._round_robin(stage, up), "round_robin"
        elif self.policy == "prefix" and best > 0:
            holding = [i for i in up if matched.get(i, 0) == best]  # type: ignore[union-attr]
            choice, decision = least_loaded(holding, load), "prefix_hit"
        else:  # least_loaded, and prefix when no replica holds any of the prompt
            choice, decision = least_loaded(up, load), "least_loaded"
        self.decisions[(stage, choice, self.policy, decision)] += 1
        return choice

    def follow(self, stage: str, up: Sequence[int], load: Mapping[int, int],
               preferred: int | None) -> int:
        """A replica of a later stage under ``prefix`` (omni_cache.runtime.affinity):
        ``preferred``, the replica that took the longest prefix of this prompt before, unless it
        has more than ``AFFINITY_LOAD_RATIO`` times the requests of the least loaded, plus one
        (decision ``prefix_affinity``); else the least loaded (decision ``least_loaded``)."""
        if not up:
            raise ValueError(f"no replica of stage {stage!r} is up")
        if self._replicas.get(stage, 1) == 1:
            return up[0]
        quickest = least_loaded(up, load)
        if preferred is not None and preferred in up and \
                load.get(preferred, 0) <= AFFINITY_LOAD_RATIO * load.get(quickest, 0) + 1:
            choice, decision = preferred, "prefix_affinity"
        else:
            choice, decision = quickest, "least_loaded"
        self.decisions[(stage, choice, self.policy, decision)] += 1
        return choice

    def _round_robin(self, stage: str, up: Sequence[int]) -> int:
        turn = self._turn.get(stage, 0)
        ordered = sorted(up)
        choice = next((i for i in ordered if i >= turn), ordered[0])
        self._turn[stage] = choice + 1
        return choice


def least_loaded(up: Sequence[int], load: Mapping[int, int]) -> int:
    """The replica in ``up`` with the fewest requests in flight; ties to the lowest index."""
    return min(up, key=lambda i: (load.get(i, 0), i))


def reports_blocks(policy: str, stage: str, entry: str, replicas: int, prefix_cache: bool) -> bool:
    """Whether a replica of ``stage`` reports the blocks its prefix cache holds: the entry stage
    with several replicas, prefix caching on and ``prefix`` routing (nobody else reads them)."""
    return policy == "prefix" and stage == entry and replicas > 1 and prefix_cache
