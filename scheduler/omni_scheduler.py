"""vLLM Scheduler subclasses (loaded through the engine argument `scheduler_cls`).

The scheduler is where prefix-cache hits are decided, so it is where they are counted: every newly
admitted request records its prompt length (queried tokens) and the tokens vLLM's prefix cache let
it skip (hit tokens). It also counts the multimodal items whose encoder it scheduled: an image or
audio clip served from the prefix cache (or vLLM's encoder cache) is never encoded again. The counters are
cumulative and read in-process by the stage (they feed
`/metrics`). `OmniScheduler` extends the synchronous scheduler, `AsyncOmniScheduler` the one vLLM
uses with async scheduling; the stage picks the one matching `async_scheduling`.

Both also hold back requests fed by streamed rows (the Qwen3-Omni talker) whose next row has not
arrived yet (scheduler/streamed_rows.py), and hand the worker each scheduled request's rows. With a
`pacer` (scheduler/pacing.py, the stage's `pacing:`), streamed spoken answers more than the lead
ahead of their playback sit a step out the same way while other work is due (an answer that is due
but starved counts: the stage then waits for its row), and the running requests go in pacing's order (no
audio yet first, then least slack). A request held back stays in
`running` and keeps its slot: vLLM skips it this step (`next_decode_eligible_step`, the hook vLLM's
own schedulers use to skip a running request), so no new request is admitted past `max_num_seqs`.

Both also skip, the same way, the requests whose streaming client has stopped taking its answer
(scheduler/client_hold.py) until it takes again.

Both also turn on hybrid block states where the engine supports them (scheduler/mamba_block_states.py):
a recurrent-state checkpoint at every block boundary a prefill chunk crosses.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from scheduler import client_hold, mamba_block_states, pacing, streamed_rows


@dataclass
class PrefixCacheCounters:
    requests: int = 0
    queried_tokens: int = 0
    hit_tokens: int = 0

    def record(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        self.requests += 1
        self.queried_tokens += num_prompt_tokens
        self.hit_tokens += num_hit_tokens


class OmniSchedulerMixin:
    """What both schedulers add to vLLM's: prefix-cache counters and hybrid block states."""

    prefix_counters: PrefixCacheCounters
    #: Multimodal items (images, audio clips) whose encoder ran, over all steps.
    encoder_runs: int = 0
    block_states: bool = False  # hybrid thinkers: a state at every block boundary crossed
    #: The stage's pacing (scheduler/pacing.py), set by the stage after the engine is built.
    pacer: pacing.Pacer | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[call-arg]
        if getattr(self, "has_mamba_layers", False):
            self.block_states = mamba_block_states.install(self)

    def _mamba_block_aligned_split(self, request: Any, num_new_tokens: int, *args: Any, **kwargs: Any) -> int:
        # vLLM's align mode ends prefill chunks where a state must be kept (the prompt's last block
        # boundary, a chunk started mid-block, a branch point), costing a forward pass per stop.
        # With block states every boundary inside a chunk gets its state, so no stop is needed.
        if self.block_states and not mamba_block_states.needs_aligned_chunks(self):
            return num_new_tokens
        return super()._mamba_block_aligned_split(  # type: ignore[misc]
            request, num_new_tokens, *args, **kwargs
        )

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        # A held request sits this step out: a running one is skipped by vLLM (it keeps its slot
        # and blocks), a waiting one is out of the queue while vLLM schedules and back in the
        # same place after. Nothing else about it changes.
        now = time.monotonic()
        held, held_waiting = self._held(now)
        skipped = {id(r): r.next_decode_eligible_step for r in held}
        for request in held:
            # schedule() advances current_step before it checks eligibility: + 2 skips this call.
            request.next_decode_eligible_step = max(request.next_decode_eligible_step, self.current_step + 2)  # type: ignore[attr-defined]
        if held_waiting:
            self.waiting.remove_requests(held_waiting)  # type: ignore[attr-defined]
        try:
            output = super().schedule(*args, **kwargs)  # type: ignore[misc]
        finally:
            for request in held:
                request.next_decode_eligible_step = skipped[id(request)]
            if held_waiting:
                self.waiting.prepend_requests(held_waiting)  # type: ignore[attr-defined]
        if self.pacer is not None:
            self.pacer.note_step(
                (
                    pacing.of(self.requests[rid])  # type: ignore[attr-defined]
                    for rid in output.num_scheduled_tokens
                ),
                now,
            )
        # The worker reads the rows of the positions it feeds (in-process: no copy).
        output.streamed_rows = {
            req_id: rows
            for req_id in output.num_scheduled_tokens
            if (rows := streamed_rows.of(self.requests[req_id])) is not None
        }  # type: ignore[attr-defined]
        output.prompt_positions = {
            new.req_id: pos
            for new in output.scheduled_new_reqs
            if (pos := streamed_rows.positions_of(self.requests[new.req_id])) is not None
        }  # type: ignore[attr-defined]
        counters = self.__dict__.setdefault("prefix_counters", PrefixCacheCounters())
        for new in output.scheduled_new_reqs:
            request = self.requests[new.req_id]  # type: ignore[attr-defined]
            counters.record(request.num_prompt_tokens, new.num_computed_tokens)
        self.encoder_runs += sum(len(items) for items in output.scheduled_encoder_inputs.values())
        return output

    def _held(self, now: float) -> tuple[list[Any], list[Any]]:
        """The running and the waiting requests that sit this step out: those starved of a
        streamed row, and with a pacer the answers that yield (Pacer.hold). With pacing on, the
        running list is put in pacing's order first."""
        running, waiting = list(self.running), list(self.waiting)  # type: ignore[attr-defined]
        starved = {id(r) for r in running + waiting if streamed_rows.is_starved(r)}
        # Held for its client (scheduler/client_hold.py): out of this step, and no due work that
        # others yield to (its client is not waiting for it).
        client_held = {id(r) for r in running + waiting if client_hold.is_held(r)}
        yielding: set[int] = set()
        if self.pacer is not None:
            # A waiting request can run only if a slot is free: with none, it is not due work
            # that the running answers could yield to (they would sit out for nothing). A
            # starved one (blocked) is due work if its answer is due (Pacer.hold).
            candidates = running + waiting if self._free_slots() > 0 else running
            sitting_out, blocking = starved | client_held, starved - client_held
            runnable = [(r, pacing.of(r)) for r in candidates if id(r) not in sitting_out]
            blocked = [pacing.of(r) for r in running + waiting if id(r) in blocking]
            yielding = {id(r) for r in self.pacer.hold(runnable, now, blocked)}
            if self.pacer.policy.enabled:
                self.running[:] = self.pacer.order(  # type: ignore[attr-defined]
                    running, pacing.of, lambda r: r.num_output_tokens > 0, now
                )
        out = starved | yielding | client_held
        return (
            [r for r in self.running if id(r) in out],  # type: ignore[attr-defined]
            [r for r in waiting if id(r) in out],
        )

    def has_runnable_requests(self) -> bool:
        """Whether a step would do anything: False when every unfinished request is starved or
        yields to an answer that waits for its input (the stage then waits for input instead of
        spinning through empty steps)."""
        if not self.has_unfinished_requests():  # type: ignore[attr-defined]
            return False
        queued = list(self.running) + list(self.waiting)  # type: ignore[attr-defined]
        if len(queued) < self.get_num_unfinished_requests():  # type: ignore[attr-defined]
            return True  # requests in queues this check does not know about: let vLLM decide
        held, held_waiting = self._held(time.monotonic())
        out = {id(r) for r in held + held_waiting}
        candidates = list(self.running)  # type: ignore[attr-defined]
        if self._free_slots() > 0:
            candidates += list(self.waiting)  # type: ignore[attr-defined]
        return any(id(r) not in out for r in candidates)

    def _free_slots(self) -> int:
        """Requests vLLM would still admit from the waiting queue this step."""
        return (
            self.max_num_active_reqs
            - len(self.running)  # type: ignore[attr-defined]
            - self.num_waiting_for_streaming_input
        )  # type: ignore[attr-defined]


class OmniScheduler(OmniSchedulerMixin, Scheduler):
    pass


class AsyncOmniScheduler(OmniSchedulerMixin, AsyncScheduler):
    pass
