"""vLLM Scheduler subclasses (loaded through the engine argument `scheduler_cls`).

The scheduler is where prefix-cache hits are decided, so it is where they are counted: every newly
admitted request records its prompt length (queried tokens) and the tokens vLLM's prefix cache let
it skip (hit tokens). It also counts the multimodal items whose encoder it scheduled: an image or
audio clip served from the prefix cache (or vLLM's encoder cache) is never encoded again. The counters are cumulative and read in-process by the stage (they feed
`/metrics`). `OmniScheduler` extends the synchronous scheduler, `AsyncOmniScheduler` the one vLLM
uses with async scheduling; the stage picks the one matching `async_scheduling`.

Both also turn on hybrid block states where the engine supports them (scheduler/mamba_block_states.py):
a recurrent-state checkpoint at every block boundary a prefill chunk crosses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from scheduler import mamba_block_states


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
        output = super().schedule(*args, **kwargs)  # type: ignore[misc]
        counters = self.__dict__.setdefault("prefix_counters", PrefixCacheCounters())
        for new in output.scheduled_new_reqs:
            request = self.requests[new.req_id]  # type: ignore[attr-defined]
            counters.record(request.num_prompt_tokens, new.num_computed_tokens)
        self.encoder_runs += sum(len(items) for items in output.scheduled_encoder_inputs.values())
        return output


class OmniScheduler(OmniSchedulerMixin, Scheduler):
    pass


class AsyncOmniScheduler(OmniSchedulerMixin, AsyncScheduler):
    pass
