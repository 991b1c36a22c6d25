"""Routing state: what each replica holds and is busy with, turned into one route per request.

:class:`RoutePlanner` owns what routing knows and the policy that decides
(:class:`~omni_cache.runtime.routing.replica_router.ReplicaRouter`, module routing.py says how it trades prefix
against load):

* the entry replicas' prefix caches, as they report them (:class:`PrefixIndex`, from
  ``BlockEvents``), plus the prompts their requests in flight are computing now;
* the prefill queued on each entry replica (its requests that have not produced a first output);
* for later stages with a prefix cache of their own, where each thinker prompt prefix's work went
  (:class:`PrefixAffinity`);
* sessions: requests that name the same ``session_id`` (a realtime conversation) stay on the
  replicas their session's first request was routed to while those are up;
* what each media item becomes in the thinker's prompt (:class:`MediaLayouts`, learned from the
  thinker's first output of a media request), so a prompt with images, audio or video is hashed
  as its engine will hash it, as far as its items are known.

It reads the in-flight requests (:class:`RequestTable`) and which replicas are up (the supervisor)
and writes nothing but its own state and the route fields of the request it routes.

Hashing a prompt (SHA-256 per block, for every block size the entry replicas report, and for the
later stages' affinity) grows with its length: the orchestrator runs it in a worker thread
(:meth:`RoutePlanner.hasher` gives a function that reads nothing the event loop changes) and
hands the result to :meth:`RoutePlanner.assign`.
"""

from __future__ import annotations

import functools
import os
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from omni_cache.config import PipelineConfig
from omni_cache.config.replicas import Replica, reports_blocks
from omni_cache.runtime.metrics.prometheus import RoutingSnapshot
from omni_cache.runtime.request_path.requests import Request, RequestTable
from omni_cache.runtime.request_path.topology import Topology
from omni_cache.runtime.routing.affinity import AFFINITY_BLOCK_SIZE, PrefixAffinity
from omni_cache.runtime.routing.block_hashes import MediaPosition, prompt_block_hashes
from omni_cache.runtime.routing.media_layouts import MediaLayouts, media_keys
from omni_cache.runtime.routing.prefix_index import PrefixIndex
from omni_cache.runtime.routing.replica_router import ReplicaRouter
from omni_cache.runtime.supervision.supervisor import StageSupervisor
from omni_cache.wire.messages import BlockEvents, MediaLayout

#: Sessions remembered (the least recently routed are forgotten first).
MAX_SESSIONS = 65536


@dataclass(frozen=True)
class PromptHashes:
    """What routing reads of a prompt's content (for a prompt with media: as far as its items'
    runs are known; nothing when the first item's place is not known either)."""

    #: block size -> the hashes of the prompt's full blocks (prefix routing).
    chains: dict[int, list[int]]
    #: Its hashes in AFFINITY_BLOCK_SIZE blocks (later stages that follow a prefix); None: none.
    affinity: list[int] | None = None
    #: Its length in the engine's tokens as far as known (media expanded; a lower bound when an
    #: item is not known); 0: the length of the prompt sent.
    prompt_tokens: int = 0


def hash_prompt(
    prompt: Sequence[int] | None,
    block_sizes: Sequence[int],
    seed: str | None,
    affinity: bool,
    media: Sequence[MediaPosition] = (),
    length: int = 0,
) -> PromptHashes:
    """``prompt``'s hashes in each of ``block_sizes`` (vLLM's, with the entry engines' ``seed``)
    and, with ``affinity``, in AFFINITY_BLOCK_SIZE blocks; nothing for None. ``prompt`` is the
    expanded prompt of a media request (as far as known), ``media`` its items
    (omni_cache/runtime/routing/media_layouts.py), ``length`` the engine's prompt length, if known."""
    if not prompt:
        return PromptHashes({}, prompt_tokens=length)
    return PromptHashes(
        {size: prompt_block_hashes(prompt, size, seed, media) for size in block_sizes},
        prompt_block_hashes(prompt, AFFINITY_BLOCK_SIZE, None, media) if affinity else None,
        length,
    )


class RoutePlanner:
    def __init__(
        self, config: PipelineConfig, topology: Topology, supervisor: StageSupervisor, requests: RequestTable
    ) -> None:
        self._config = config
        self._entry = topology.entry
        self._supervisor = supervisor
        self._requests = requests
        self.router = ReplicaRouter(config.server.routing, {s.name: s.replicas for s in config.stages})
        #: What each entry replica's prefix cache holds, as it reports (prefix routing only).
        self.prefix_index = PrefixIndex()
        #: Whether the entry replicas report their blocks (and prompts are hashed to match them).
        self.prefix_routing = reports_blocks(
            config.server.routing, self._entry.name, self._entry.name, self._entry.replicas, self._entry.prefix_cache
        )
        self._affinity = {
            s.name: PrefixAffinity()
            for s in config.stages
            if config.server.routing == "prefix"
            and s.name != self._entry.name
            and s.replicas > 1
            and s.is_autoregressive
            and s.prefix_cache
        }
        self._sessions: OrderedDict[str, dict[str, int]] = OrderedDict()
        self._hash_seed = self._entry.env.get("PYTHONHASHSEED", os.environ.get("PYTHONHASHSEED"))
        #: What media items become in the entry stage's prompt, as its replicas reported.
        self.media_layouts = MediaLayouts()

    # ---- routing a request -----------------------------------------------------------------------

    def hasher(self, prompt: Sequence[int], media: Sequence[Any] = ()) -> Callable[[], PromptHashes]:
        """The hashing :meth:`assign` needs for ``prompt`` with ``media`` (its MediaItems or the
        Submit's MediaRefs), as a function a worker thread can run: the block sizes it hashes by
        and what its items expand to are read now (on the caller's thread, which owns the media
        layouts)."""
        sizes = sorted(set(self.prefix_index.block_size.values())) if self.prefix_routing else []
        if not sizes and not self._affinity:
            return functools.partial(PromptHashes, {})
        items: list[MediaPosition] = []
        tokens = list(prompt)
        length = 0
        if media:
            expanded = self.media_layouts.expand(prompt, media_keys(media))
            tokens, items = expanded.token_ids, expanded.media
            # Unknown items expand to at least one token each: past the known part, one more.
            length = len(tokens) if expanded.complete else len(tokens) + 1
        return functools.partial(hash_prompt, tokens, sizes, self._hash_seed, bool(self._affinity), items, length)

    def assign(
        self,
        req: Request,
        prompt: Sequence[int],
        media: Sequence[Any] = (),
        *,
        session_id: str | None = None,
        hashes: PromptHashes | None = None,
    ) -> None:
        """Route ``req``, whose entry stage is sent ``prompt`` with ``media`` (MediaItems or
        MediaRefs): its replicas, the prefill it queues on its entry replica, and the prompt's
        block hashes (prefix routing). ``hashes``: what :meth:`hasher` computed (else it is
        computed here)."""
        hashed = None if media else prompt
        if hashes is None:
            hashes = self.hasher(prompt, media)()
        pinned = self._sessions.get(session_id) if session_id is not None else None
        # The engine's length: media expanded where known (prefix and backlog count its tokens).
        length = max(len(prompt), hashes.prompt_tokens)
        req.route, req.prefill_backlog = self.route(
            req.participants, length, hashes.chains, hashed, pinned=pinned, affinity_chain=hashes.affinity
        )
        req.block_hashes = hashes.chains
        if session_id is not None:
            self._remember_session(session_id, req.route)

    def route(
        self,
        participants: Sequence[str],
        prompt_tokens: int,
        chains: dict[int, list[int]],
        prompt: Sequence[int] | None = None,
        *,
        pinned: Mapping[str, int] | None = None,
        affinity_chain: list[int] | None = None,
    ) -> tuple[dict[str, int], int]:
        """A replica of every participant (among those up: admission saw one of each), and the
        prompt tokens the chosen entry replica is expected to compute (its prefill backlog while
        the request waits there). ``chains``: the prompt's block hashes per block size (empty: a
        prompt with media, or no prefix routing); ``prompt``: its token ids (None: it has media),
        for the later stages that follow a prefix (``affinity_chain``: its hashes for them, when
        already computed); ``pinned``: the session's replicas."""
        route: dict[str, int] = {}
        uncached = prompt_tokens
        for stage in participants:
            up = self._supervisor.up_replicas(stage)
            load = self._requests.load(stage)
            if pinned is not None and pinned.get(stage) in up:
                route[stage] = self.router.keep(stage, pinned[stage])
                continue
            affinity = self._affinity.get(stage)
            if affinity is not None and (prompt is not None or affinity_chain is not None):
                chain = (
                    affinity_chain
                    if affinity_chain is not None
                    else prompt_block_hashes(prompt, AFFINITY_BLOCK_SIZE, None)
                )
                route[stage] = self.router.follow(stage, up, load, affinity.lookup(chain, up))
                affinity.record(chain, route[stage])
                continue
            if stage != self._entry.name or not self.prefix_routing:
                route[stage] = self.router.pick(stage, up, load)
                continue
            matched, sizes = self.matched_blocks(up, chains, prompt_tokens)
            # One block size per pipeline in practice (the replicas are identical); a replica
            # that reported none holds nothing known and has matched 0.
            size = max(sizes.values(), default=0)
            route[stage] = choice = self.router.pick(
                stage,
                up,
                load,
                matched if chains else None,
                backlog=self.prefill_backlog(),
                prompt_tokens=prompt_tokens,
                block_size=size,
            )
            uncached = max(1, prompt_tokens - matched.get(choice, 0) * sizes.get(choice, 0))
        return route, uncached

    def prompt_chains(self, prompt: Sequence[int] | None) -> dict[int, list[int]]:
        """block size -> the hashes of ``prompt``'s full blocks, for every block size an entry
        replica reported (prefix routing, prompts without media)."""
        if not self.prefix_routing or prompt is None:
            return {}
        return self.hasher(prompt)().chains

    def matched_blocks(
        self, up: Sequence[int], chains: Mapping[int, list[int]], prompt_tokens: int | None = None
    ) -> tuple[dict[int, int], dict[int, int]]:
        """(entry replica -> leading blocks of the prompt it holds, replica -> its block size).

        Held is what the replica reported (the prefix index) and also what the requests in
        flight there are computing: vLLM caches a prompt's full blocks when it schedules them and
        cannot evict them while their request runs, so a request routed there now hits them (in
        the same step, even), though the replica reports them only after its step. Without this,
        a tenant's second request that arrives during its first one's prefill would see nothing
        held and be sent away, copying the prefix into the other replica's pool as well. Not on a
        hybrid (recurrent) replica: there a hit needs a state at its last block, which a request in
        flight may not leave there (vLLM's align mode keeps few), so only what it reported counts.
        ``prompt_tokens``: the length of the prompt sent (vLLM computes at least its last token,
        so the last block of a block-aligned prompt cannot be hit). A media prompt's chain is of
        its expanded prompt, longer than the prompt sent: no limit is known for it."""
        matched: dict[int, int] = {}
        sizes: dict[int, int] = {}
        running = self._requests.served_by(self._entry.name)
        for replica in up:
            size = self.prefix_index.block_size.get(replica)
            chain = chains.get(size or 0)
            if not size or chain is None:
                continue
            sizes[replica] = size
            aligned = prompt_tokens is not None and len(chain) * size == prompt_tokens
            limit = len(chain) - 1 if aligned else None
            n = self.prefix_index.matched_blocks(replica, chain, limit)
            recurrent = replica in self.prefix_index.recurrent
            for r in running if not recurrent else ():
                if r.route.get(self._entry.name, 0) == replica and n < len(chain):
                    n = max(n, common_prefix(chain, r.block_hashes.get(size, ())))
            matched[replica] = n
        return matched, sizes

    def prefill_backlog(self) -> dict[int, int]:
        """entry replica -> the prompt tokens queued there: what its requests in flight that have
        not produced their first output found uncached when they were routed."""
        out: dict[int, int] = {}
        for r in self._requests.served_by(self._entry.name):
            if r.prefill_backlog:
                i = r.route.get(self._entry.name, 0)
                out[i] = out.get(i, 0) + r.prefill_backlog
        return out

    def _remember_session(self, session_id: str, route: Mapping[str, int]) -> None:
        known = self._sessions.setdefault(session_id, {})
        known.update(route)
        self._sessions.move_to_end(session_id)
        while len(self._sessions) > MAX_SESSIONS:
            self._sessions.popitem(last=False)

    def end_session(self, session_id: str) -> None:
        """The session is over: its replicas are no longer kept for it."""
        self._sessions.pop(session_id, None)

    # ---- what the replicas report ----------------------------------------------------------------

    def output_seen(self, req: Request, stage: str, layout: MediaLayout | None = None) -> None:
        """``req``'s stage ``stage`` sent an output: once the entry stage did, its prefill is done
        and no longer queued work there. ``layout``: how the entry stage's engine expanded the
        prompt's media (its first output of a media request)."""
        if stage == self._entry.name:
            req.prefill_backlog = 0
            # (Every media request's first output has one, for its client: only a router that
            # hashes media prompts keeps what it says.)
            if layout is not None and self.prefix_routing:
                self.learn_media(req, layout)

    def learn_media(self, req: Request, layout: MediaLayout) -> None:
        """The entry stage's engine expanded ``req``'s prompt as ``layout`` says: remember what
        its media items became (checked against the prompt sent; a mismatch teaches nothing)."""
        submit = req.submit
        if submit is None or not submit.media:
            return
        self.media_layouts.learn(
            submit.prompt_token_ids,
            media_keys(submit.media),
            layout.prompt_token_ids,
            [(s.modality, s.identifier, s.offset, s.length) for s in layout.spans],
        )

    def on_block_events(self, msg: BlockEvents) -> bool:
        """Apply one replica's report; False when it followed a gap (the replica should send a
        snapshot: omni_cache/runtime/stage_messages.py asks it)."""
        sp = self._supervisor.replica(msg.stage, msg.replica)
        if msg.stage != self._entry.name or sp is None or not sp.up:
            return True  # a replica that is down holds nothing (a late report from its old process)
        in_sequence = self.prefix_index.in_sequence(msg.replica, msg.seq, msg.cleared)
        self.prefix_index.apply_report(msg.replica, msg)
        return in_sequence

    def forget(self, replica: Replica) -> None:
        """``replica`` went down: its caches died with it."""
        if replica.stage == self._entry.name:
            self.prefix_index.forget(replica.index)
        if replica.stage in self._affinity:
            self._affinity[replica.stage].forget(replica.index)

    def use_policy(self, policy: str) -> None:
        """A fresh router with ``policy``: its round-robin turn and decision counts start over;
        what the replicas reported stays (benchmarks compare policies on one running pipeline)."""
        self.router = ReplicaRouter(policy, {s.name: s.replicas for s in self._config.stages})

    def snapshot(self) -> RoutingSnapshot:
        """What /metrics shows of routing: decisions, load and held blocks per replica."""
        in_flight = {}
        for stage in self._config.stages:
            if stage.replicas > 1:
                load = self._requests.load(stage.name)
                in_flight.update({(stage.name, i): load.get(i, 0) for i in range(stage.replicas)})
        blocks = (
            {(self._entry.name, i): self.prefix_index.blocks(i) for i in range(self._entry.replicas)}
            if self.prefix_routing
            else {}
        )
        return RoutingSnapshot(decisions=dict(self.router.decisions), in_flight=in_flight, prefix_blocks=blocks)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading items ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
