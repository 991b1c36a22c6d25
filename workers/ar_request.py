"""One request on an autoregressive (vLLM) stage, as workers/ar_runner.py keeps it: its state, the
vLLM ``SamplingParams`` it runs with, and, when it was resumed on this replica after another died,
its first output rewritten as the one an undisturbed run would have sent."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from omni_cache.cache.latent_rows import LatentBuffer
from omni_cache.handoff import GenerateJob, Upstream
from omni_cache.wire.sampling import EngineSampling
from scheduler.pacing import PlaybackClock
from workers.spoken_tokens import SpokenDelta

if TYPE_CHECKING:  # annotations only
    from workers.llm_stage import StepOutput

__all__ = ["ARRequest", "resumed_as_undisturbed", "sampling_params"]


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
    prefill_only: bool = False  # Submit.prefill_only (or the StreamStart's), forwarded likewise
    held: bool = False  # its streaming client takes nothing now (wire Hold; scheduler/client_hold.py)


def sampling_params(sampling: EngineSampling) -> Any:
    """The entry stage's vLLM ``SamplingParams`` for a request, from the fields its ``Submit``
    carries (omni_cache/wire/sampling.py: what the server's ``to_sampling_params`` produced):
    exactly those fields, the rest vLLM's defaults. vLLM checks them again here; a value it
    refuses fails the request with a 400."""
    from vllm.sampling_params import SamplingParams, StructuredOutputsParams

    fields = msgspec.structs.asdict(sampling)
    structured = fields.pop("structured_outputs")
    if structured is not None:
        fields["structured_outputs"] = StructuredOutputsParams(**msgspec.structs.asdict(structured))
    return SamplingParams(**fields)


def resumed_as_undisturbed(out: StepOutput, tail: list[int], answer_finished: str) -> None:
    """A request whose replica died starts again on a live one with the answer its client already
    has at the end of its prompt (omni_cache/runtime/request_path/resume.py); its first output
    passes through here, so downstream stages and the client see one stream, as if nothing had
    happened.

    Rewrite that first output as the output an undisturbed run would have sent by now: its prompt
    is the client's, and the answer tokens at the end of the resumed prompt are generated ones,
    sent with the new token. vLLM outputs nothing before the first token, so this first output
    holds the whole prefill's rows: one per position fed, as an undisturbed run has after
    sampling as many tokens.

    ``answer_finished``: the answer was complete; the token vLLM sampled now is not part of it,
    and neither is the row of the answer's last token, which an undisturbed run never feeds."""
    k = len(tail)
    out.num_prompt_tokens -= k
    if out.prompt_token_ids:
        out.prompt_token_ids = out.prompt_token_ids[:-k]
    if answer_finished:
        out.token_ids, out.text = list(tail), ""
        out.finished, out.finish_reason = True, answer_finished
        out.latents = {name: rows[:-1] for name, rows in out.latents.items()}
        if out.spoken is not None:
            # The token that stopped the answer is not spoken (its text the client never got).
            out.spoken = SpokenDelta(list(tail[:-1] if answer_finished == "stop" else tail))
    else:
        out.token_ids = [*tail, *out.token_ids]
        if out.spoken is not None:
            out.spoken = SpokenDelta([*tail, *out.spoken.token_ids], out.spoken.text)
