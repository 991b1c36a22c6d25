"""Runner of an autoregressive (vLLM) stage: thinker or talker.

The entry stage (thinker) turns each `Submit` into one vLLM request. A downstream stage (talker)
opens a request on its upstream's `StreamStart`, turns that and the `StageOutput`s that follow into
jobs through the configured hand-off function, and runs a request's `GenerateJob`s one after the
other (`<request_id>/<k>` in vLLM), so their outputs stay in order; a `FeedJob`'s rows go to the
request's streaming job. Its own stream downstream opens with a `StreamStart` in turn.

With `pacing:` every streamed spoken answer gets a playback clock (scheduler/pacing.py) that all of
its vLLM requests carry; each output moves it by the tokens emitted times `token_audio_s`.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import msgspec
import torch

from omni_cache.cache.latent_rows import LatentBuffer, LatentChunk
from omni_cache.config import PipelineConfig, StageConfig, resolve_handoff
from omni_cache.handoff import CODES_FRAME, FeedJob, GenerateJob, HandoffContext, Upstream
from omni_cache.timeline import Timeline
from omni_cache.wire.messages import StageOutput, StreamStart, Submit
from scheduler.pacing import PlaybackClock
from workers.ar_request import ARRequest, resumed_as_undisturbed, sampling_params
from workers.engine_media import media_layout, mm_processor_kwargs, multi_modal_data, multi_modal_uuids
from workers.kv_cache_sizing import describe_pool, resolve_kv_cache_size
from workers.latent_capture import LatentOptions
from workers.llm_stage import LLMStage, StepOutput
from workers.runner import StageRunner, deadline_in, stage_pacer, time_left
from workers.video_input import video_input
from workers.warmup import no_warmup, warm_up

logger = logging.getLogger(__name__)

#: A request's first outputs (and upstream inputs) whose times its timeline records.
TIMELINE_OUTPUTS = 4


class ARRunner(StageRunner):
    def __init__(
        self,
        config: PipelineConfig,
        stage: StageConfig,
        model: str,
        outbox: Any,
        prefix_cache: bool,
        report_blocks: bool = False,
        timeline: Timeline | None = None,
    ) -> None:
        super().__init__(stage, outbox, tombstone_ttl_s=config.server.request_timeout_s, timeline=timeline)
        self.downstream = bool(config.downstream(stage.name))
        spec = stage.latents
        latents = None
        if spec.any():
            merged = (spec.merged.layer, spec.merged.media_layer) if spec.merged else None
            latents = LatentOptions(
                hidden=spec.hidden,
                layers=tuple(spec.layers),
                merged=merged,
                cache=prefix_cache,
                storage=stage.latent_cache_device,
            )
        engine_args = stage.engine_args.to_vllm_kwargs() if stage.engine_args else {}
        async_scheduling = bool(engine_args.pop("async_scheduling", False))
        kv_source = resolve_kv_cache_size(stage.name, engine_args, os.environ)
        self.pacer = stage_pacer(stage)
        self.llm = LLMStage(
            model,
            engine_args,
            prefix_cache=prefix_cache,
            latents=latents,
            async_scheduling=async_scheduling,
            submodel=stage.submodel,
            report_blocks=report_blocks,
            pacer=self.pacer,
        )
        logger.info(
            "stage %s: KV cache: %s (sized by %s)",
            stage.name,
            describe_pool(self.llm.engine.vllm_config.cache_config),
            kv_source,
        )
        self.warmup = warm_up(self.llm, stage.sampling, entry=not stage.inputs) if stage.warmup else no_warmup()
        if stage.warmup:
            logger.info(
                "stage %s: warmed up in %.1f s (%s)",
                stage.name,
                self.warmup.total_s,
                ", ".join(f"{p} {s:.2f} s" for p, s in self.warmup.seconds.items()),
            )
        self.max_model_len = self.llm.max_model_len
        self.video = video_input(self.llm.engine)
        self.handoff = resolve_handoff(stage.handoff) if stage.handoff else None
        self.handoff_ctx = HandoffContext(Path(model))
        self.requests: dict[str, ARRequest] = {}
        self.by_job: dict[str, str] = {}
        # vLLM's vllm:prompt_tokens / vllm:generation_tokens, summed over this stage's engine requests.
        self.prompt_tokens = 0
        self.generation_tokens = 0

    # ---- input -----------------------------------------------------------------------------
    def accept(self, msg: Submit | StageOutput, tensors: dict[str, torch.Tensor]) -> None:
        if isinstance(msg, Submit):
            self._submit(msg, tensors)
        else:
            self._from_upstream(msg, tensors)

    def _submit(self, msg: Submit, tensors: dict[str, torch.Tensor]) -> None:
        if not 0 <= msg.resumed_tokens < len(msg.prompt_token_ids):
            raise ValueError(
                f"resumed_tokens {msg.resumed_tokens} is not within the prompt ({len(msg.prompt_token_ids)} tokens)"
            )
        if msg.request_id in self.requests:
            raise ValueError(f"request id {msg.request_id!r} is already running")
        if self.is_dead(msg):
            return
        media = multi_modal_data(msg.media, tensors, self.video) if msg.media else None
        req = ARRequest(
            msg.request_id,
            list(msg.modalities),
            msg.sampling,
            deadline=deadline_in(msg.time_left_s),
            return_latents=msg.return_latents,
            route=dict(msg.route),
            stream=msg.stream,
            voice=msg.voice,
            prefill_only=msg.prefill_only,
        )
        req.clock = self._clock(req)
        if msg.resumed_tokens:
            req.resumed_tail = list(msg.prompt_token_ids[-msg.resumed_tokens :])
            req.answer_finished = msg.answer_finished
        self.requests[msg.request_id] = req
        self.total_requests += 1
        self.timeline.mark(req.request_id, "input")
        self._start(
            req,
            GenerateJob(
                prompt_token_ids=list(msg.prompt_token_ids),
                multi_modal_data=media,
                multi_modal_uuids=multi_modal_uuids(msg.media, self.video),
                mm_processor_kwargs=mm_processor_kwargs(msg.media, self.video),
                max_tokens=msg.sampling.max_tokens,
                last=True,
            ),
        )

    def _from_upstream(self, msg: StageOutput, tensors: dict[str, torch.Tensor]) -> None:
        req = self.requests.get(msg.request_id)
        if req is None:
            if self.is_dead(msg):
                return
            req = self._open(msg)  # a StreamStart: is_dead drops the rest of an unseen stream
        self.timeline.mark(req.request_id, "input")
        if msg.seq < TIMELINE_OUTPUTS:
            self.timeline.mark(req.request_id, f"input{msg.seq}")
        up = req.upstream
        # What an upstream sends for one request is bounded by what this stage can take in.
        if len(up.token_ids) + len(msg.token_ids) > self.max_model_len:
            raise ValueError(f"stage {msg.stage!r} sent more than max_model_len ({self.max_model_len}) tokens")
        up.token_ids.extend(msg.token_ids)
        req.upstream_text.append(msg.text)
        up.num_prompt_tokens = msg.num_prompt_tokens or up.num_prompt_tokens
        if tensors:
            if req.upstream_rows is None:
                req.upstream_rows = LatentBuffer(tuple(tensors), max_rows=self.max_model_len)
            # Appends only the new rows: the hand-off reads views, nothing already received is
            # copied again (see LatentBuffer).
            req.upstream_rows.add(LatentChunk(msg.latent_start, dict(tensors)))
            up.latents = req.upstream_rows.view()
        up.finished = msg.finished
        for job in self.handoff(self.handoff_ctx, up, req.handoff_state):
            if isinstance(job, FeedJob):
                self._feed(req, job)
            elif isinstance(job, GenerateJob):
                req.jobs.append(job)
            else:
                raise TypeError(
                    f"hand-off {self.stage.handoff} returned a {type(job).__name__}: "
                    "an autoregressive stage runs GenerateJob and FeedJob"
                )
        self._next_job(req)

    def _clock(self, req: ARRequest) -> PlaybackClock | None:
        """A playback clock for a spoken answer its client streams, when this stage paces."""
        if self.pacer is None or not req.stream or "audio" not in req.modalities:
            return None
        return self.pacer.clock()

    def _open(self, start: StreamStart) -> ARRequest:
        """A request from its upstream's first output, with the context that came with it."""
        req = ARRequest(
            start.request_id,
            list(start.modalities),
            start.sampling,
            deadline=deadline_in(start.time_left_s),
            return_latents=start.return_latents,
            route=dict(start.route),
            upstream=Upstream.opened_by(start),
            stream=start.stream,
            voice=start.voice,
            prefill_only=start.prefill_only,
        )
        req.clock = self._clock(req)
        self.requests[start.request_id] = req
        self.total_requests += 1
        return req

    def _feed(self, req: ARRequest, job: FeedJob) -> None:
        """Streamed rows for the request's streaming job: to vLLM if it runs, else into the job."""
        target = req.active_job if req.active is not None else (req.jobs[-1] if req.jobs else None)
        if target is None or target.stream is None:
            raise ValueError(f"hand-off fed rows to request {req.request_id!r}, which has no streaming job")
        if req.active is not None:
            self.llm.feed(req.active, job.rows, job.done)
            return
        target.stream.rows = torch.cat([target.stream.rows, job.rows])
        target.stream.done = target.stream.done or job.done

    def _next_job(self, req: ARRequest) -> None:
        """Start the request's next job, unless one runs. On a stage fed by a hand-off the
        stage's `sampling.max_tokens` caps the whole answer: once its jobs wrote that many
        tokens, the remaining jobs are skipped and the request ends with the last one."""
        while req.active is None and req.jobs:
            job = req.jobs.popleft()
            if self.handoff is None or req.generated < self.stage.sampling.max_tokens:
                self._start(req, job)
            elif job.last:
                req.active_job = job
                self._emit(
                    req,
                    StepOutput(
                        request_id="",
                        token_ids=[],
                        text="",
                        finished=True,
                        finish_reason="length",
                        num_prompt_tokens=0,
                        num_cached_tokens=0,
                    ),
                )
                return

    def _params(self, req: ARRequest, job: GenerateJob) -> Any:
        """vLLM's SamplingParams of a job: the client's (Submit.sampling) on the entry stage, the
        stage's configured sampling and the job's own rules on a stage fed by a hand-off."""
        from vllm import SamplingParams

        if self.handoff is None:
            return sampling_params(req.sampling)
        defaults = self.stage.sampling
        max_tokens = min(job.max_tokens or defaults.max_tokens, defaults.max_tokens - req.generated)
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=defaults.temperature,
            top_p=defaults.top_p,
            seed=defaults.seed,
            extra_args=job.extra_args,
            stop_token_ids=job.stop_token_ids,
            allowed_token_ids=job.allowed_token_ids,
        )

    def _start(self, req: ARRequest, job: GenerateJob) -> None:
        params = self._params(req, job)
        if job.prompt_embeds is not None:
            prompt = {"prompt_embeds": job.prompt_embeds}
        else:
            prompt = {"prompt_token_ids": job.prompt_token_ids}
        if job.multi_modal_data:
            prompt["multi_modal_data"] = job.multi_modal_data
            if job.multi_modal_uuids:
                prompt["multi_modal_uuids"] = job.multi_modal_uuids
            if job.mm_processor_kwargs:
                prompt["mm_processor_kwargs"] = job.mm_processor_kwargs
        vllm_id = req.request_id if self.handoff is None else f"{req.request_id}/{req.num_jobs}"
        req.num_jobs += 1
        streamed = None
        if job.stream is not None:
            from scheduler.streamed_rows import StreamedRows

            streamed = StreamedRows(job.stream.pad, max_rows=self.max_model_len)
            streamed.add(job.stream.rows, job.stream.done)
        # The entry stage hands downstream only what the client's text covers (spoken_tokens.py).
        spoken = self.handoff is None and self.downstream and "audio" in req.modalities
        self.llm.add(
            vllm_id, prompt, params, streamed=streamed, positions=job.positions, clock=req.clock, spoken=spoken
        )
        if req.held:  # its client stopped taking the answer before this job began
            self.llm.hold(vllm_id, True)
        self.timeline.mark(req.request_id, "job")
        req.active, req.active_job = vllm_id, job
        self.by_job[vllm_id] = req.request_id

    # ---- stepping --------------------------------------------------------------------------
    def has_work(self) -> bool:
        return self.llm.has_work()

    def step(self) -> None:
        # The step's outputs leave together at its end (workers/outbox.py).
        with self.outbox.one_step(self.fail):
            self._step_outputs()

    def _step_outputs(self) -> None:
        for out in self.llm.step():
            request_id = self.by_job.get(out.request_id)
            req = self.requests.get(request_id) if request_id else None
            if req is None:
                if out.error is not None:
                    self.llm.abort(out.request_id)  # nothing of it stays in the engine
                continue
            if out.error is not None:  # its output could not be assembled: it fails alone
                logger.error(
                    "stage %s: request %s: its step output failed: %s: %s",
                    self.stage.name,
                    req.request_id,
                    type(out.error).__name__,
                    out.error,
                    exc_info=out.error,
                )
                self.fail(req.request_id, out.error)
                continue
            # Starting its next job (vLLM may refuse it) or sending its output (too large for
            # max_message_bytes, or a peer that stopped reading) fails this request only.
            self.guarded(req.request_id, lambda req=req, out=out: self._emit(req, out))

    def _emit(self, req: ARRequest, out: StepOutput) -> None:
        if req.resumed_tail is not None:
            resumed_as_undisturbed(out, req.resumed_tail, req.answer_finished)
            req.resumed_tail = None
        job_done = out.finished
        finished = False
        if req.clock is not None:
            # A multi-codebook talker's audio is its code frames (its sampled end of speech is
            # none); any other stage's is its tokens.
            n = out.codes.shape[-1] if out.codes is not None else len(out.token_ids)
            req.clock.emit(n * self.stage.pacing.token_audio_s, time.monotonic())
        self.generation_tokens += len(out.token_ids)
        req.generated += len(out.token_ids)
        if job_done:
            self.prompt_tokens += out.num_prompt_tokens
            finished = req.active_job.last
            self.by_job.pop(out.request_id, None)
            req.num_cached_tokens += out.num_cached_tokens
            req.active, req.active_job = None, None  # until the next job (or more upstream input)
        req.num_prompt_tokens = req.num_prompt_tokens or out.num_prompt_tokens
        msg = StageOutput(
            request_id=req.request_id,
            stage=self.stage.name,
            seq=req.seq,
            # A multi-codebook talker's codes travel as frames (every codebook, known one step
            # after vLLM samples the first); its sampled ids are not output of their own.
            token_ids=[] if self.llm.talker is not None else out.token_ids,
            text=out.text,
            latent_start=out.latent_start,
            finished=finished,
            finish_reason=out.finish_reason if finished else None,
            stop_reason=out.stop_reason if finished else None,
            logprobs=out.logprobs,
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=req.num_cached_tokens if job_done else out.num_cached_tokens,
            input_text=self._input_text(req) if finished else "",
        )
        self._mark_output(req, out)
        req.seq += 1
        # The orchestrator hears first: when the downstream's final output reaches it, it has
        # already seen this stage's (so per-stage cached-token counts are complete).
        tensors = out.latents
        if out.codes is not None:  # a multi-codebook talker: every codebook, [G, k]
            tensors = {**tensors, CODES_FRAME: out.codes}
        if self.stage.final_output == "text" or req.return_latents:
            layout = media_layout(out) if msg.seq == 0 else None
            self.outbox.to_orchestrator(
                msg if layout is None else msgspec.structs.replace(msg, media_layout=layout),
                tensors if req.return_latents else None,
            )
        elif finished:
            # Non-final stages tell the orchestrator they are done with the request (and how much
            # their prefix cache saved), without the payload.
            self.outbox.to_orchestrator(
                StageOutput(
                    request_id=req.request_id,
                    stage=self.stage.name,
                    seq=msg.seq,
                    finished=True,
                    num_prompt_tokens=req.num_prompt_tokens,
                    num_cached_tokens=req.num_cached_tokens,
                    input_text=msg.input_text,
                )
            )
        # A prefill-only request ends at the stage fed by a hand-off (the talker: its prompt is
        # prefilled; the decoder has none, Topology.participants).
        if self.downstream and "audio" in req.modalities and not (req.prefill_only and self.handoff is not None):
            down = msg
            if out.spoken is not None:  # only the tokens whose text the client has
                down = msgspec.structs.replace(msg, token_ids=out.spoken.token_ids, text=out.spoken.text, logprobs=None)
            self.outbox.to_downstream(self._stream_start(req, down, out) if msg.seq == 0 else down, tensors)
        if finished:
            del self.requests[req.request_id]
        elif job_done:
            self._next_job(req)  # after this output: its seq comes first

    def _mark_output(self, req: ARRequest, out: StepOutput) -> None:
        """Timeline points of an output about to be sent (omni_cache/timeline.py)."""
        if not self.timeline.on:
            return
        for event, t in (out.engine_times or {}).items():
            self.timeline.mark(req.request_id, event, t)
        if req.seq < TIMELINE_OUTPUTS:
            self.timeline.mark(req.request_id, f"out{req.seq}")
        if out.codes is not None and out.codes.numel():
            self.timeline.mark(req.request_id, "codes_out")

    @staticmethod
    def _input_text(req: ARRequest) -> str:
        """The text of the tokens the upstream handed this request ("" on the entry stage)."""
        return "".join(req.upstream_text)

    @staticmethod
    def _stream_start(req: ARRequest, first: StageOutput, out: StepOutput) -> StreamStart:
        """The request's first output downstream, with its context and the prompt this stage's
        engine saw (vLLM reports it with a request's first output)."""
        return StreamStart.opening(
            first,
            modalities=req.modalities,
            sampling=req.sampling,
            time_left_s=time_left(req.deadline),
            return_latents=req.return_latents,
            route=req.route,
            prompt_token_ids=out.prompt_token_ids or [],
            image_grids=out.image_grids or [],
            video_grids=out.video_grids.grids if out.video_grids else [],
            video_seconds_per_grid=out.video_grids.seconds_per_grid if out.video_grids else [],
            stream=req.stream,
            voice=req.voice,
            prefill_only=req.prefill_only,
        )

    # ---- control ---------------------------------------------------------------------------
    def held_changed(self, req: ARRequest) -> None:
        if req.active is not None:  # a job that starts later is held from its start (_start)
            self.llm.hold(req.active, req.held)

    def drop(self, request_id: str) -> None:
        req = self.requests.pop(request_id, None)
        if req is not None and req.active is not None:
            self.by_job.pop(req.active, None)
            self.llm.abort(req.active)

    def take_block_changes(self, snapshot: bool = False) -> Any:
        return self.llm.block_events.take(snapshot) if self.llm.block_events is not None else None

    def counters(self) -> dict[str, float]:
        running, waiting = self.llm.scheduler.get_request_counts()
        return {
            **super().counters(),
            **self.llm.counters(),
            **(self.pacer.stats.counters() if self.pacer is not None else {}),
            **self.warmup.counters(),
            "num_requests_running": running,
            "num_requests_waiting": waiting,
            "prompt_tokens": self.prompt_tokens,
            "generation_tokens": self.generation_tokens,
        }
