"""An autoregressive stage: one vLLM engine, run in this process, that also returns latents.

vLLM's engine core, scheduler and worker all run inside the stage process
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`, one worker through UniProcExecutor). That is what lets the
worker's LatentCapture hand latents to this loop without serializing them: the stage reads them
after each `engine.step()`. Stages are separate processes anyway, so nothing is lost by not having
vLLM's own front-end/engine-core split inside a stage.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch

from omni_cache.cache.latent_rows import LatentRows
from omni_cache.wire.messages import TokenLogprob
from workers.latent_capture import LatentOptions
from workers.spoken_tokens import SpokenDelta, SpokenTokens
from workers.video_input import VideoGrids, video_grids

# Must be set before vLLM is imported in this process.
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
# The worker extension is written against the V1 model runner (see latent_worker.py).
os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")


#: Why a request vLLM's engine ended with finish_reason "error" failed (its log says more).
ENGINE_ERROR = "the engine ended the request with an error (vLLM's finish_reason \"error\"; the stage's log says why)"


@dataclass
class StepOutput:
    """What one engine step produced for one request."""

    request_id: str
    token_ids: list[int]  # new tokens of this step
    text: str  # new text of this step ("" without a tokenizer)
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens vLLM's prefix cache let this request skip
    latent_start: int = 0  # position of the first row in `latents`
    latents: dict[str, torch.Tensor] = field(default_factory=dict)
    # A multi-codebook talker: every codebook of the codes fed since the last output, [G, k].
    codes: torch.Tensor | None = None
    # The prompt as vLLM tokenized it (media placeholders expanded); first output only.
    prompt_token_ids: list[int] | None = None
    # Per image of the prompt, its (t, h, w) patch grid; first output only.
    image_grids: list[list[int]] | None = None
    # The prompt's videos (patch grids, seconds per grid); first output only.
    video_grids: VideoGrids | None = None
    # Its media items as (modality, identifier, offset, length), in the engine's order; first
    # output of a media prompt only.
    media_spans: list[tuple[str, str, int, int]] | None = None
    # vLLM's stop reason with a "stop" finish: the stop string, or the stop token id.
    stop_reason: int | str | None = None
    # Per new token, its log-probabilities as vLLM ranked them (the sampled token first); only
    # when the request's SamplingParams asked for `logprobs`.
    logprobs: list[list[TokenLogprob]] | None = None
    # A request whose tokens a downstream stage speaks: the tokens of this step's output whose
    # text the client now has, and that text (workers/spoken_tokens.py).
    spoken: SpokenDelta | None = None
    # vLLM's timestamps of the request (time.monotonic()): queued, first scheduled, first token;
    # first output only (omni_cache/timeline.py).
    engine_times: dict[str, float] | None = None
    # Assembling this request's output failed (its latent rows, its codes): the request must
    # fail alone; the other fields are not to be used then.
    error: Exception | None = None


@dataclass
class _Tracked:
    internal_id: str
    rows: LatentRows
    num_prompt_tokens: int = 0
    num_generated: int = 0
    sent_prompt: bool = False
    image_grids: list[list[int]] = field(default_factory=list)
    video_grids: VideoGrids | None = None
    media_spans: list[tuple[str, str, int, int]] | None = None
    # Set for a request a downstream stage speaks: its latent rows go out only as far as the
    # spoken tokens reach.
    spoken: SpokenTokens | None = None


class LLMStage:
    def __init__(
        self,
        model: str,
        engine_args: dict[str, Any],
        *,
        prefix_cache: bool = True,
        latents: LatentOptions | None = None,
        async_scheduling: bool = False,
        block_states: bool = True,
        submodel: str | None = None,
        report_blocks: bool = False,
        pacer: Any = None,
    ) -> None:
        """block_states=False keeps vLLM's plain align mode on a hybrid thinker (states only where a
        chunk ends; benchmarks compare against it). It changes nothing for other models.
        submodel="talker" runs the talker of the checkpoint folder's omni family (StageConfig.submodel).
        report_blocks=True turns vLLM's KV-cache events on and keeps the block hashes its prefix
        cache gains and loses in `block_events` (scheduler/block_events.py), for prefix routing.
        pacer: the stage's scheduler/pacing.py Pacer; its scheduler then paces the requests `add`
        gives a playback clock."""
        from vllm import EngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.llm_engine import LLMEngine

        worker = "CPULatentWorker" if current_platform.is_cpu() else "GPULatentWorker"
        scheduler = "AsyncOmniScheduler" if async_scheduling else "OmniScheduler"
        kwargs = dict(engine_args)
        if not prefix_cache:
            # A prefix-cache setting; without prefix caching vLLM validates it against another
            # block size and refuses it, so the same config works with the cache on and off.
            kwargs.pop("prefix_cache_retention_interval", None)
        if latents is not None:
            kwargs["additional_config"] = {
                **kwargs.get("additional_config", {}),
                "omni_cache": {
                    "hidden": latents.hidden,
                    "layers": list(latents.layers),
                    "merged": list(latents.merged) if latents.merged else None,
                    "cache": latents.cache and prefix_cache,
                    "storage": latents.storage,
                },
            }
        kwargs["additional_config"] = {**kwargs.get("additional_config", {}), "omni_cache_block_states": block_states}
        if submodel == "talker":
            from workers.models import talker_module

            # The checkpoint's family picks the talker (workers/models/__init__.py TALKER_MODULES).
            # A talker reads embeddings and writes codes: no tokenizer. Its decode steps wait
            # for the thinker's text (scheduler/streamed_rows.py), which async scheduling's
            # one-step-ahead planning cannot do.
            family = talker_module(model)
            kwargs.update(
                hf_overrides=family.talker_hf_overrides,
                skip_tokenizer_init=True,
                enable_prompt_embeds=True,
                logits_processors=["workers.codec_logits:CodecLogits"],
                **family.talker_engine_kwargs(),
            )
            if async_scheduling:
                raise ValueError("the talker stage cannot use async_scheduling")
        if report_blocks and prefix_cache and "kv_events_config" not in kwargs:
            from vllm.config import KVEventsConfig

            # The null publisher: the events go nowhere but through our collector.
            kwargs["kv_events_config"] = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
        args = EngineArgs(
            model=model,
            enable_prefix_caching=prefix_cache,
            async_scheduling=async_scheduling,
            worker_cls=f"workers.latent_worker.{worker}",
            scheduler_cls=f"scheduler.omni_scheduler.{scheduler}",
            **kwargs,
        )
        self.engine = LLMEngine.from_engine_args(args)
        self.latent_options = latents
        self._names = latents.names if latents is not None else ()
        self._tracked: dict[str, _Tracked] = {}
        core = self.engine.engine_core.engine_core  # in-process EngineCore
        self.scheduler = core.scheduler
        self.scheduler.pacer = pacer
        from scheduler import block_events

        self.block_events = block_events.install(self.scheduler) if report_blocks else None
        worker = core.model_executor.driver_worker.worker
        self.capture = worker.latents
        # TalkerSteps of a multi-codebook talker (its codes travel as frames, `StepOutput.codes`),
        # else None: a one-codebook talker's codes are its sampled token ids, as any stage's.
        steps = worker.talker
        self.talker = steps if steps is not None and steps.residual else None
        self.max_model_len = self.engine.vllm_config.model_config.max_model_len

    # ---- requests --------------------------------------------------------------------------
    def add(
        self,
        request_id: str,
        prompt: dict[str, Any],
        params: Any,
        streamed: Any = None,
        positions: tuple[torch.Tensor, int] | None = None,
        clock: Any = None,
        spoken: bool = False,
    ) -> None:
        """prompt: {"prompt_token_ids": [...]}, {"prompt": "text"} or {"prompt_embeds": tensor}.
        streamed: the request's StreamedRows (scheduler/streamed_rows.py), for a talker whose
        decode steps consume rows that keep arriving (`feed`). positions: M-RoPE prompt positions
        [3, L] and decode delta, when not plain text positions (a talker prompt with an image).
        clock: the PlaybackClock of the streamed answer the request belongs to (scheduler/pacing.py),
        for the scheduler's pacer. spoken: a downstream stage speaks its tokens (each output then
        says which it may speak, `StepOutput.spoken`, and its latent rows stop where those do)."""
        from vllm.sampling_params import RequestOutputKind

        if request_id in self._tracked:
            raise ValueError(f"request id {request_id!r} is already running")
        params = params.clone()
        params.output_kind = RequestOutputKind.DELTA
        internal = self.engine.add_request(request_id, prompt, params)
        tracked = self._tracked[request_id] = _Tracked(internal, LatentRows(self._names))
        if spoken:
            tracked.spoken = SpokenTokens(params, self.engine.tokenizer)
        if prompt.get("multi_modal_data"):
            tracked.image_grids = _image_grids(self.scheduler.requests[internal])
            tracked.video_grids = video_grids(self.scheduler.requests[internal])
            # Where the media went: the client's prompt_token_ids are the expanded prompt (as
            # vLLM answers them) and the router learns the items' runs (prefix routing).
            tracked.media_spans = [
                (f.modality, f.identifier, f.mm_position.offset, f.mm_position.length)
                for f in self.scheduler.requests[internal].mm_features or ()
            ]
        if streamed is not None or positions is not None:
            from scheduler import streamed_rows

            # In-process engine core: the request vLLM just queued is right there. The rows hang
            # on it, so vLLM's lifecycle frees them.
            request = self.scheduler.requests[internal]
            if streamed is not None:
                streamed_rows.attach(request, streamed)
            if positions is not None:
                streamed_rows.attach_positions(request, *positions)
        if clock is not None:
            from scheduler import pacing

            pacing.attach(self.scheduler.requests[internal], clock)

    def feed(self, request_id: str, rows: torch.Tensor | None, done: bool) -> None:
        """More streamed rows for a running request (its scheduler lets it step again)."""
        from scheduler import streamed_rows

        tracked = self._tracked.get(request_id)
        request = self.scheduler.requests.get(tracked.internal_id) if tracked else None
        stream = streamed_rows.of(request) if request is not None else None
        if stream is None:
            raise ValueError(f"request {request_id!r} takes no streamed rows")
        stream.add(rows, done)

    def hold(self, request_id: str, held: bool) -> None:
        """Hold a running request out of the steps while its client takes nothing (or let it go
        on): scheduler/client_hold.py. An unknown request is ignored (it ended meanwhile)."""
        from scheduler import client_hold

        tracked = self._tracked.get(request_id)
        request = self.scheduler.requests.get(tracked.internal_id) if tracked else None
        if request is not None:
            client_hold.set_held(request, held)

    def abort(self, request_id: str) -> None:
        tracked = self._tracked.pop(request_id, None)
        if tracked is not None:
            self.engine.abort_request([request_id])
            if self.capture is not None:
                self.capture.discard(tracked.internal_id)
            if self.talker is not None:
                self.talker.discard(tracked.internal_id)

    def has_work(self) -> bool:
        """Whether stepping would do anything (not: are there requests; a talker request waiting
        for the thinker's text is not work)."""
        return self.scheduler.has_runnable_requests()

    def step(self) -> list[StepOutput]:
        """One engine step: each request's output. A request whose output cannot be assembled
        (its latent rows, its codes) gets one with ``error`` set and fails alone: the caller
        aborts it (:meth:`abort`); the others of the step are unaffected."""
        results = []
        for out in self.engine.step():
            tracked = self._tracked.get(out.request_id)
            if tracked is None:
                continue
            try:
                result = self._output_of(out, tracked)
            except Exception as exc:  # noqa: BLE001 -- this request's rows, not the engine
                results.append(
                    StepOutput(
                        request_id=out.request_id,
                        token_ids=[],
                        text="",
                        finished=False,
                        finish_reason=None,
                        num_prompt_tokens=tracked.num_prompt_tokens,
                        num_cached_tokens=0,
                        error=exc,
                    )
                )
                continue
            if out.finished:
                self._forget(out.request_id, tracked)
            results.append(result)
        return results

    def _output_of(self, out: Any, tracked: _Tracked) -> StepOutput:
        """What one request's engine output means for the stage: its new tokens, latents and
        codes."""
        completion = out.outputs[0]
        if completion.finish_reason == "error":
            # vLLM's engine ended the request itself (its grammar rejected a token it had
            # allowed, an encoder cache mismatch, ...): what it sampled last is no answer, and
            # `vllm serve` answers the request as a 500, not as text with finish_reason "error".
            from vllm.exceptions import GenerationError

            raise GenerationError(ENGINE_ERROR)
        tracked.num_prompt_tokens = len(out.prompt_token_ids or ()) or tracked.num_prompt_tokens
        if out.prompt_token_ids is None and out.prompt_embeds is not None:
            tracked.num_prompt_tokens = out.prompt_embeds.shape[0]
        tracked.num_generated += len(completion.token_ids)
        result = StepOutput(
            request_id=out.request_id,
            token_ids=list(completion.token_ids),
            text=completion.text or "",
            finished=out.finished,
            finish_reason=completion.finish_reason,
            num_prompt_tokens=tracked.num_prompt_tokens,
            num_cached_tokens=out.num_cached_tokens or 0,
            stop_reason=completion.stop_reason,
            logprobs=_ranked_logprobs(completion.logprobs),
        )
        if tracked.spoken is not None:
            result.spoken = tracked.spoken.add(
                None if tracked.sent_prompt else list(out.prompt_token_ids or ()),
                result.token_ids,
                result.text,
                result.finish_reason,
                result.stop_reason,
            )
        if not tracked.sent_prompt:
            result.prompt_token_ids = list(out.prompt_token_ids or ())
            result.image_grids = tracked.image_grids
            result.video_grids = tracked.video_grids
            result.media_spans = tracked.media_spans
            result.engine_times = _engine_times(out.metrics)
            tracked.sent_prompt = True
        if self.capture is not None:
            self._attach_latents(tracked, result)
        if self.talker is not None:
            result.codes = self.talker.drain(tracked.internal_id, finished=out.finished)
        return result

    def _forget(self, request_id: str, tracked: _Tracked) -> None:
        """A finished request: nothing of it stays in the capture or the talker's steps."""
        del self._tracked[request_id]
        if self.capture is not None:
            self.capture.discard(tracked.internal_id)
        if self.talker is not None:
            self.talker.discard(tracked.internal_id)

    def _attach_latents(self, tracked: _Tracked, result: StepOutput) -> None:
        for chunk in self.capture.drain(tracked.internal_id):
            tracked.rows.add(chunk)
        # Every token but the last sampled one has been fed through the model.
        processed = tracked.num_prompt_tokens + tracked.num_generated - 1
        if tracked.spoken is not None:
            processed = min(processed, tracked.num_prompt_tokens + tracked.spoken.count)
        result.latent_start, result.latents = tracked.rows.take_new(upto=processed)

    # ---- counters --------------------------------------------------------------------------
    def reset_counters(self) -> None:
        """Start the counters below from zero (after the warm-up: its requests are no client's)."""
        from scheduler.omni_scheduler import PrefixCacheCounters
        from workers.latent_capture import LatentCounters

        self.scheduler.prefix_counters = PrefixCacheCounters()
        self.scheduler.encoder_runs = 0
        if self.capture is not None:
            self.capture.counters = LatentCounters()

    def counters(self) -> dict[str, int]:
        prefix = getattr(self.scheduler, "prefix_counters", None)
        out = {
            "prefix_cache_requests": prefix.requests if prefix else 0,
            "prefix_cache_queried_tokens": prefix.queried_tokens if prefix else 0,
            "prefix_cache_hit_tokens": prefix.hit_tokens if prefix else 0,
            "latent_rows_served": 0,
            "latent_rows_computed": 0,
            "encoder_runs": getattr(self.scheduler, "encoder_runs", 0),
        }
        if self.capture is not None:
            out["latent_rows_served"] = self.capture.counters.rows_served
            out["latent_rows_computed"] = self.capture.counters.rows_computed
        return out


def _image_grids(request: Any) -> list[list[int]]:
    """(t, h, w) patch grid of each image of a request, in prompt order, from vLLM's processed
    inputs (a downstream talker places its M-RoPE positions by them)."""
    grids = []
    for feature in sorted(request.mm_features or (), key=lambda f: f.mm_position.offset):
        if feature.modality == "image" and feature.data is not None:
            grid = feature.data.get_data().get("image_grid_thw")
            if grid is not None:
                grids.append([int(x) for x in torch.as_tensor(grid).reshape(-1)[:3]])
    return grids


def _engine_times(stats: Any) -> dict[str, float] | None:
    """vLLM's per-request timestamps (RequestStateStats, kept while it logs stats) by name."""
    names = {"queued": "queued_ts", "scheduled": "scheduled_ts", "first_token": "first_token_ts"}
    times = {k: float(getattr(stats, a, 0.0) or 0.0) for k, a in names.items()}
    return {k: t for k, t in times.items() if t > 0} or None


def _ranked_logprobs(logprobs: Any) -> list[list[TokenLogprob]] | None:
    """vLLM's per-token {id: Logprob} mappings, in their order (the sampled token first, then the
    top ones: the order vLLM's server reads `top_logprobs` in), with vLLM's decoded text of each
    (None when not requested)."""
    if logprobs is None:
        return None
    return [[TokenLogprob(tid, lp.logprob, lp.decoded_token) for tid, lp in position.items()] for position in logprobs]
