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
* ``prefix`` (the default): meant to pick the thinker replica whose prefix cache holds the
  longest prefix of the prompt. The replicas do not report the blocks they hold yet, so today it
  decides exactly as ``least_loaded`` does, and its decisions are counted as ``least_loaded``
  (policy ``prefix``): a fallback, not a prefix hit.

Every decision for a stage with more than one replica is counted by (stage, replica, policy,
decision) and exposed as ``omni_cache_routing_decisions_total``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

POLICIES = ("prefix", "round_robin", "least_loaded")


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

    def pick(self, stage: str, up: Sequence[int], load: Mapping[int, int]) -> int:
        """A replica of ``stage`` among ``up`` (the indices of its replicas that are up, not
        empty) given each one's ``load`` (requests in flight; missing = 0)."""
        if not up:
            raise ValueError(f"no replica of stage {stage!r} is up")
        if self._replicas.get(stage, 1) == 1:
            return up[0]  # nothing to choose, nothing to count
        if self.policy == "round_robin":
            choice, decision = self._round_robin(stage, up), "round_robin"
        else:  # least_loaded, and prefix until replicas report their blocks
            choice, decision = least_loaded(up, load), "least_loaded"
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
