"""``prefix`` routing's trade of the longest prefix against load (omni_cache/runtime/routing/replica_router.py),
and what the orchestrator feeds it: the prefix each replica holds, counting the prompts its
requests in flight are computing, and the prefill queued on it. Without processes: the router
alone, and an orchestrator that was built but not started."""

from __future__ import annotations

import pytest
from routing_orchestrator import two_replica_orchestrator

from omni_cache.runtime.orchestrator import Orchestrator
from omni_cache.runtime.routing.block_hashes import prompt_block_hashes
from omni_cache.runtime.routing.replica_router import LOAD_RATIO, ReplicaRouter
from omni_cache.wire.messages import StageOutput

BS = 32


def test_the_longest_prefix_wins_until_its_replica_waits_more_than_load_ratio_times_longer():
    assert LOAD_RATIO == 2.0  # the numbers below are written for it
    router = ReplicaRouter("prefix", {"thinker": 2})

    def pick(backlog: dict[int, int], matched: dict[int, int] | None = None) -> int:
        return router.pick(
            "thinker",
            [0, 1],
            {i: 1 for i in backlog},
            matched or {0: 62, 1: 0},
            backlog=backlog,
            prompt_tokens=2100,
            block_size=BS,
        )

    # Replica 0 holds 62 blocks (1,984 tokens) of the 2,100-token prompt: 116 tokens to compute
    # there, 2,100 on replica 1.
    assert pick({}) == 0
    assert pick({0: 2100}) == 0  # one miss queued there: 2,216 <= 2 x 2,100
    assert pick({0: 4084}) == 0  # 4,200 <= 4,200: still the prefix
    assert pick({0: 4085}) == 1  # 4,201 > 4,200: much busier, given up
    assert pick({0: 6000, 1: 2100}) == 0  # 6,116 <= 2 x 4,200: the other one is busy too
    assert pick({0: 500}, {0: 62, 1: 62}) == 1  # both hold it: the smaller wait
    assert router.decisions == {
        ("thinker", 0, "prefix", "prefix_hit"): 4,
        ("thinker", 1, "prefix", "load_over_prefix"): 1,
        ("thinker", 1, "prefix", "prefix_hit"): 1,
    }
    # A caller without a backlog: the longest prefix however busy its replica (as before).
    assert router.pick("thinker", [0, 1], {0: 9}, {0: 62, 1: 0}) == 0
    # Nothing held anywhere: the least loaded, backlog or not.
    assert (
        router.pick("thinker", [0, 1], {0: 1}, {0: 0, 1: 0}, backlog={1: 9000}, prompt_tokens=2100, block_size=BS) == 1
    )


@pytest.fixture
def orch(tmp_path):
    """A pipeline of two thinker replicas with prefix routing, built but not started: both
    replicas up, both reported blocks of 32 tokens."""
    return two_replica_orchestrator(tmp_path, "routing_unit", BS)


def _submit(o: Orchestrator, prompt: list[int]):
    """Route ``prompt`` as submit() does and record it in flight; the request."""
    from omni_cache.runtime.request_path.requests import Request

    chains = o.routes.prompt_chains(prompt)
    req = Request(
        request_id=f"r{len(o.requests)}",
        prompt_token_ids=prompt,
        modalities=("text",),
        participants=("thinker",),
        t0=0.0,
        deadline=1e9,
        timeout_s=1.0,
        return_latents=False,
    )
    req.route, req.prefill_backlog = o.routes.route(req.participants, len(prompt), chains)
    req.block_hashes = chains
    o.requests.add(req)
    return req


def test_a_prefix_in_flight_counts_as_held_and_its_prefill_as_backlog(orch):
    tenant = [7] * 2000
    first = _submit(orch, tenant + [1] * 100)
    assert first.route == {"thinker": 0} and first.prefill_backlog == 2100  # nothing held: replica 0
    # Replica 0 has not reported the tenant's blocks yet (its step is still running), but the
    # request computing them is in flight there: the tenant's next request goes there too, and
    # counts only its own tail as backlog (62 blocks = 1,984 tokens hit).
    second = _submit(orch, tenant + [2] * 100)
    assert second.route == {"thinker": 0} and second.prefill_backlog == 2100 - 62 * BS
    assert orch.routes.prefill_backlog() == {0: 2100 + 116}
    # Another tenant: nobody holds it; least loaded (replica 1).
    other = _submit(orch, [9] * 2100)
    assert other.route == {"thinker": 1}
    # The first output of a request ends its backlog.
    orch.on_message(StageOutput(request_id=first.request_id, stage="thinker", seq=0, token_ids=[5], text="x"), {})
    assert orch.routes.prefill_backlog() == {0: 116, 1: 2100}
    assert orch.routes.router.decisions[("thinker", 0, "prefix", "prefix_hit")] == 1


def test_a_replica_much_busier_than_another_gives_up_its_prefix(orch):
    tenant = [7] * 2000
    chain = prompt_block_hashes(tenant, BS)
    orch.routes.prefix_index.apply(0, stored=chain, removed=[])  # replica 0 reported the tenant
    # Two other misses queued on replica 0 (4,200 tokens of prefill), replica 1 idle.
    for k in (3, 4):
        r = _submit(orch, [k] * 2100)
        r.route["thinker"] = 0
        r.prefill_backlog = 2100
    assert orch.routes.prefill_backlog() == {0: 4200}
    req = _submit(orch, tenant + [1] * 100)
    assert req.route == {"thinker": 1} and req.prefill_backlog == 2100  # 4,316 > 2 x 2,100
    assert orch.routes.router.decisions[("thinker", 1, "prefix", "load_over_prefix")] == 1
    # Once that request is answered (its blocks on replica 1 unreported here) and one of the
    # two misses is done with its prefill, the tenant stays where its prefix is.
    orch.requests.answered(req)
    orch.on_message(StageOutput(request_id="r0", stage="thinker", seq=0, token_ids=[5], text="x"), {})
    again = _submit(orch, tenant + [2] * 100)
    assert again.route == {"thinker": 0}


def test_prompts_with_media_and_other_policies_do_not_hash(orch, tmp_path):
    assert orch.routes.prompt_chains(None) == {}
    orch.routes.prefix_routing = False
    assert orch.routes.prompt_chains([1] * 64) == {}


def test_a_session_stays_on_its_replicas_while_they_are_up(orch):
    """Requests of one session (a realtime conversation: prompts with audio, not prefix-hashed)
    go where its first request went, though least_loaded would send them elsewhere."""
    import numpy as np

    from omni_cache.runtime.request_path.requests import MediaItem, Request

    def route(session: str | None) -> Request:
        req = Request(
            request_id=f"r{len(orch.requests)}",
            prompt_token_ids=[1] * 64,
            modalities=("text",),
            participants=("thinker",),
            t0=0.0,
            deadline=1e9,
            timeout_s=1.0,
            return_latents=False,
        )
        orch.routes.assign(req, req.prompt_token_ids, [MediaItem("audio", np.zeros(1, np.float32))], session_id=session)
        orch.requests.add(req)
        return req

    assert route("s1").route == {"thinker": 0}
    assert route("s1").route == {"thinker": 0}  # replica 0 has 1 in flight, replica 1 none
    assert route("s2").route == {"thinker": 1}
    assert route(None).route == {"thinker": 1}  # 2 in flight on 0, 1 on 1
    assert orch.routes.router.decisions[("thinker", 0, "prefix", "session")] == 1
    orch.supervisor.up_replicas = lambda stage: [1]  # type: ignore[method-assign]
    assert route("s1").route == {"thinker": 1}  # its replica died: it moves, and stays there
    orch.supervisor.up_replicas = lambda stage: [0, 1]  # type: ignore[method-assign]
    assert route("s1").route == {"thinker": 1}
    orch.routes.end_session("s1")
    assert route("s1").route == {"thinker": 0}  # a new session: the least loaded again
