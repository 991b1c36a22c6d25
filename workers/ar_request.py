"""One request's state on an autoregressive (vLLM) stage, as workers/ar_runner.py keeps it."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from omni_cache.cache.latent_rows import LatentBuffer
from omni_cache.handoff import GenerateJob, Upstream
from omni_cache.wire.sampling import EngineSampling
from scheduler.pacing import PlaybackClock

__all__ = ["ARRequest"]


@dataclass
class ARRequest:
    """One request on an autoregressive stage: what it came with, its upstream's stream so far (a
    stage fed by a hand-off), its jobs (one runs at a time, in order) and what it produced."""

    request_id: str
    modalities: list[str]
    sampling: EngineSampling | None
    deadline: float = 0.0  # time.monotonic(); 0 = none
    return_latents: bool = False
    route: dict[str, int] = field(default_factory=dict)  # forwarded with the StreamStart
    seq: int = 0
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    upstream: Upstream | None = None
    upstream_rows: LatentBuffer | None = None
    upstream_text: list[str] = field(default_factory=list)  # the text of the upstream's tokens
    handoff_state: dict = field(default_factory=dict)
    jobs: deque[GenerateJob] = field(default_factory=deque)
    active: str | None = None  # vLLM request id of the job running now
    active_job: GenerateJob | None = None
    num_jobs: int = 0
    generated: int = 0  # tokens this stage wrote for the request, over all its jobs
    #: A resumed request (Submit.resumed_tokens): the answer tokens at the end of its prompt,
    #: sent again with its first output; None once sent.
    resumed_tail: list[int] | None = None
    answer_finished: str = ""  # Submit.answer_finished
    stream: bool = False  # Submit.stream, forwarded downstream in the StreamStart
    voice: str = ""  # Submit.voice (or the upstream's StreamStart.voice), forwarded likewise
    clock: PlaybackClock | None = None  # a paced answer's playback as this stage emits it
