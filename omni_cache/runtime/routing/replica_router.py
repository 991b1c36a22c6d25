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
  the longest prefix of the prompt (decision ``prefix_hit``), unless it is much busier (below:
  decision ``load_over_prefix``); when no replica holds any block of it, or for a stage other
  than the entry, or the replicas cannot report (see below), as ``least_loaded`` (decision
  ``least_loaded``).

Trading the prefix against load (``prefix``). What a request waits for before its first token is
mostly prefill: the prompt tokens its replica must compute, its own and those of the requests
queued there before it. So each candidate replica ``i`` gets an estimate in tokens,

    wait_i = backlog_i + max(1, prompt_tokens - matched_blocks_i * block_size)

where ``backlog_i`` is the prefill still queued on ``i``: for each request in flight there that
has not produced its first output yet, the prompt tokens it did not find cached when it was
routed (decode steps are not counted: one token per request per step, small beside a prefill;
vLLM recomputes at least a prompt's last token, hence the 1). Let P be the replica with the
longest prefix (ties: the smaller wait, then the fewer requests, then the lower index) and F the
replica with the smallest wait (same ties). The request goes to P unless
``wait_P > LOAD_RATIO * wait_F``: then to F. With ``LOAD_RATIO`` 2, a replica holding a 2,000-token
prefix keeps its tenant while one other 2,000-token miss is queued on it (wait 2,100 + 100 against
an idle replica's 2,100), and gives the request up when two are (4,300 > 2 x 2,100). The factor is
above 1 on purpose: moving a request to F copies its prefix into F's pool as well, which evicts
something there and splits the tenant between replicas, so a plain minimum of the wait would win
one request's latency and lose later hits. Without a backlog (a caller that passes none) the
longest prefix wins however busy its replica.

How ``prefix`` knows what a replica holds (nothing is guessed from past routing):

1. Each entry replica's engine runs with vLLM's KV-cache events on (``kv_events_config``, the
   ``null`` publisher): its block pool records a ``BlockStored`` when a full block gets its hash,
   a ``BlockRemoved`` when a cached block is evicted, ``AllBlocksCleared`` on a reset.
   scheduler/block_events.py stands in front of the scheduler's publisher (the engine core runs
   in the stage process) and keeps each hash's net change; after every step the stage sends them
   to the orchestrator (``BlockEvents``).
2. The orchestrator keeps, per replica, the hashes it holds (omni_cache/runtime/routing/prefix_index.py),
   forgets a replica's when it dies, and for each prompt computes the same chain of block
   hashes vLLM computes (omni_cache/runtime/routing/block_hashes.py: SHA-256 over the pickled
   ``(parent hash, block tokens, extra keys)``, the first parent from ``PYTHONHASHSEED`` or vLLM's
   fixed seed, reported as the digest's low 64 bits; tests/test_block_hashes.py checks them
   against vLLM's functions). A replica holds a prompt's prefix for as many leading blocks as it
   holds the hashes of, or as one of its requests in flight shares with the prompt: vLLM caches
   a prompt's blocks when it schedules them and cannot evict them while their request runs, but
   the replica reports them only after its step, and a tenant's second request that arrives
   during the first one's prefill would otherwise be sent away from it.
3. Prompts with images, audio or video are hashed over the prompt the thinker's engine will see
   (each placeholder expanded to its item's run, each item's key in the blocks over its run):
   the thinker reports how it expanded a media request (with its first output), the orchestrator
   learns each item's run from that (omni_cache/runtime/routing/media_layouts.py) and hashes a later
   prompt with the same items exactly; an item not answered yet cuts the chain at its
   placeholder. Not covered yet: hash algorithms other than vLLM's default ``sha256``,
   the talker's own prefix (its prompt is embeddings; its segments follow the request instead).
4. Hybrid thinkers (Qwen3-Next, Qwen3.5: several KV-cache groups) hit only where a recurrent state
   sits at the hit's last block. Their replicas report attention blocks and states apart, and the
   index counts the longest held prefix that ends on a state, in whole blocks of the engine (its
   hash steps may be finer, with ``prefix_match_unit``) and short of the prompt's last token
   (omni_cache/runtime/routing/prefix_index.py); requests in flight there add nothing (a prefill in
   flight may leave no state where the next request would need one).

Under every policy, the requests of one session (``Orchestrator.submit(session_id=...)``: a
realtime conversation) stay on the replicas its earlier requests went to while those are up
(decision ``session``; omni_cache/runtime/routing/route_planner.py).

Every decision for a stage with more than one replica is counted by (stage, replica, policy,
decision) and exposed as ``omni_cache_routing_decisions_total``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

POLICIES = ("prefix", "round_robin", "least_loaded")

#: ``prefix`` sends a request away from the replica with the longest prefix only when the prefill
#: it would wait for there is more than this many times the one at the replica with the least.
LOAD_RATIO = 2.0

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

    def pick(
        self,
        stage: str,
        up: Sequence[int],
        load: Mapping[int, int],
        matched: Mapping[int, int] | None = None,
        *,
        backlog: Mapping[int, int] | None = None,
        prompt_tokens: int = 0,
        block_size: int = 0,
    ) -> int:
        """A replica of ``stage`` among ``up`` (the indices of its replicas that are up, not
        empty) given each one's ``load`` (requests in flight; missing = 0) and, for ``prefix``,
        ``matched``: how many leading blocks of the prompt each replica holds (None: unknown),
        ``backlog``: prefill tokens queued on each replica (None: the load is not traded against
        the prefix), the prompt's length and the blocks' size in tokens."""
        if not up:
            raise ValueError(f"no replica of stage {stage!r} is up")
        if self._replicas.get(stage, 1) == 1:
            return up[0]  # nothing to choose, nothing to count
        best = max((matched.get(i, 0) for i in up), default=0) if matched else 0
        if self.policy == "round_robin":
            choice, decision = self._round_robin(stage, up), "round_robin"
        elif self.policy == "prefix" and best > 0:
            assert matched is not None
            if backlog is None or block_size < 1:
                holding = [i for i in up if matched.get(i, 0) == best]
                choice, decision = least_loaded(holding, load), "prefix_hit"
            else:

                def wait(i: int) -> int:
                    return backlog.get(i, 0) + max(1, prompt_tokens - matched.get(i, 0) * block_size)

                def order(i: int) -> tuple[int, int, int]:
                    return wait(i), load.get(i, 0), i

                longest = min((i for i in up if matched.get(i, 0) == best), key=order)
                quickest = min(up, key=order)
                if wait(longest) > LOAD_RATIO * wait(quickest):
                    choice, decision = quickest, "load_over_prefix"
                else:
                    choice, decision = longest, "prefix_hit"
        else:  # least_loaded, and prefix when no replica holds any of the prompt
            choice, decision = least_loaded(up, load), "least_loaded"
        self.decisions[(stage, choice, self.policy, decision)] += 1
        return choice

    def follow(self, stage: str, up: Sequence[int], load: Mapping[int, int], preferred: int | None) -> int:
        """A replica of a later stage under ``prefix`` (omni_cache.runtime.routing.affinity):
        ``preferred``, the replica that took the longest prefix of this prompt before, unless it
        has more than ``AFFINITY_LOAD_RATIO`` times the requests of the least loaded, plus one
        (decision ``prefix_affinity``); else the least loaded (decision ``least_loaded``)."""
        if not up:
            raise ValueError(f"no replica of stage {stage!r} is up")
        if self._replicas.get(stage, 1) == 1:
            return up[0]
        quickest = least_loaded(up, load)
        if (
            preferred is not None
            and preferred in up
            and load.get(preferred, 0) <= AFFINITY_LOAD_RATIO * load.get(quickest, 0) + 1
        ):
            choice, decision = preferred, "prefix_affinity"
        else:
            choice, decision = quickest, "least_loaded"
        self.decisions[(stage, choice, self.policy, decision)] += 1
        return choice

    def keep(self, stage: str, replica: int) -> int:
        """``replica``, which a session's earlier requests went to and which is up (decision
        ``session``): a conversation's caches are there."""
        if self._replicas.get(stage, 1) > 1:
            self.decisions[(stage, replica, self.policy, "session")] += 1
        return replica

    def _round_robin(self, stage: str, up: Sequence[int]) -> int:
        turn = self._turn.get(stage, 0)
        ordered = sorted(up)
        choice = next((i for i in ordered if i >= turn), ordered[0])
        self._turn[stage] = choice + 1
        return choice


def least_loaded(up: Sequence[int], load: Mapping[int, int]) -> int:
    """The replica in ``up`` with the fewest requests in flight; ties to the lowest index."""
    return min(up, key=lambda i: (load.get(i, 0), i))
