"""vLLM Scheduler subclasses (loaded through the engine argument `scheduler_cls`).

The scheduler is where prefix-cache hits are decided, so it is where they are counted: every newly
admitted request records its prompt length (queried tokens) and the tokens vLLM's prefix cache let
it skip (hit tokens). It also counts the multimodal items whose encoder it scheduled: an image or
audio clip served from the prefix cache (or vLLM's encoder cache) is never encoded again. The counters are cumulative and read in-process by the stage (they feed
`/metrics`). `OmniScheduler` extends the synchronous scheduler, `AsyncOmniScheduler` the one vLLM
uses with async scheduling; the stage picks the one matching `async_scheduling`.

Both also hold back requests fed by streamed rows (the Qwen3-Omni talker) whose next row has not
arrived yet (scheduler/streamed_rows.py), and hand the worker each scheduled request's rows.

Both also turn on hybrid block states where the engine supports them (scheduler/mamba_block_states.py):
a recurrent-state checkpoint at every block boundary a prefill chunk crosses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from scheduler import mamba_block_states, streamed_rows


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

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[call-arg]
        if getattr(self, "has_mamba_layers", False):
            self.block_states = mamba_block_states.install(self)

    def _mamba_block_aligned_split(self, request: Any, num_new_tokens: int, *args: Any,
                                   **kwargs: Any) -> int:
        # vLLM's align mode ends prefill chunks where a state must be kept (the prompt's last block
        # boundary, a chunk started mid-block, a branch point), costing a forward pass per stop.
        # With block states every boundary inside a chunk gets its state, so no stop is needed.
        if self.block_states and not mamba_block_states.needs_aligned_chunks(self):
            return num_new_tokens
        return super()._mamba_block_aligned_split(  # type: ignore[misc]
            request, num_new_tokens, *args, **kwargs)

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        # A starved request sits this step out: out of the queues while vLLM schedules, back in
        # the same place after (it keeps its blocks; nothing else about it changes).
        running = self.running  # type: ignore[attr-defined]
        held = [r for r in running if streamed_rows.is_starved(r)]
        held_waiting = [r for r in self.waiting if streamed_rows.is_starved(r)]  # type: ignore[attr-defined]
        if held:
            self.running = [r for r in running if not streamed_rows.is_starved(r)]
        if held_waiting:
            self.waiting.remove_requests(held_waiting)  # type: ignore[attr-defined]
        try:
            output = super().schedule(*args, **kwargs)  # type: ignore[misc]
        finally:
            if held:
                self.running.extend(held)  # type: ignore[attr-defined]
            if held_waiting:
                self.waiting.prepend_requests(held_waiting)  # type: ignore[attr-defined]
        # The worker reads the rows of the positions it feeds (in-process: no copy).
        output.streamed_rows = {
            req_id: rows for req_id in output.num_scheduled_tokens
            if (rows := streamed_rows.of(self.requests[req_id])) is not None}  # type: ignore[attr-defined]
        output.prompt_positions = {
            new.req_id: pos for new in output.scheduled_new_reqs
            if (pos := streamed_rows.positions_of(self.requests[new.req_id])) is not None}  # type: ignore[attr-defined]
        counters = self.__dict__.setdefault("prefix_counters", PrefixCacheCounters())
        for new in output.scheduled_new_reqs:
            request = self.requests[new.req_id]  # type: ignore[attr-defined]
            counters.record(request.num_prompt_tokens, new.num_computed_tokens)
        self.encoder_runs += sum(len(items) for items in output.scheduled_encoder_inputs.values())
        return output


    def has_runnable_requests(self) -> bool:
        """Whether a step would do anything: False when every unfinished request is starved (the
        stage then waits for input instead of spinning through empty steps)."""
        if not self.has_unfinished_requests():  # type: ignore[attr-defined]
            return False
        queued = list(self.running) + list(self.waiting)  # type: ignore[attr-defined]
        if len(queued) < self.get_num_unfinished_requests():  # type: ignore[attr-defined]
            return True  # requests in queues this check does not know about: let vLLM decide
        return any(not streamed_rows.is_starved(r) for r in queued)


class OmniScheduler(OmniSchedulerMixin, Scheduler):
    pass


class AsyncOmniScheduler(OmniSchedulerMixin, AsyncScheduler):
    pass
