"""Runner of the generation stage: the decoder, batched across requests.

The decoder is whatever the stage's checkpoint holds (`load_window_decoder`: Qwen3-Omni's code2wav,
Qwen2.5-Omni's token2wav or the tiny codec), used only through `WindowDecoder`. A request's codes arrive as the talker's
token ids (one codebook) or as `codes` tensor frames ([num_quantizers, k] per output, collected
into one [num_quantizers, N] tensor per request); the hand-off (`talker_to_decoder`) cuts them into
windows of `chunk_size` codes with the decoder's receptive field of context. Each step decodes up
to `max_batch_size` queued windows in one `decode_windows` call, at most one per request so a
request's audio leaves in order, taking requests round-robin: the windows that do not fit stay
queued for the next steps, and a request served now goes behind those that were not; first windows
(a request's first audio) go before all others, in batches of their own. Every window
is checked (shape, each codebook's code range) before the batch runs; if a batched pass fails,
each window of it is decoded alone, so only the request whose window fails is failed. Every window
carries its request's sampling seed (`CodeWindow.seed`, from the StreamStart's sampling; 0 when the
client gave none): a decoder that samples (Qwen2.5-Omni's token2wav) draws its noise from it.

With `pacing:` (scheduler/pacing.py) every streamed answer has a playback clock moved by the samples
the stage emits: an answer more than the lead ahead of its playback yields its turn while another
answer's window is due, and the others go by least slack instead of round-robin; when every ready
answer is ahead, they all run, `pacing.ahead_batch_size` windows a batch (a batch cannot be
interrupted: a small one lets the next due window, a new answer's first audio, start soon).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from omni_cache.cache.latent_rows import LatentBuffer, LatentChunk
from omni_cache.config import PipelineConfig, StageConfig, resolve_handoff
from omni_cache.handoff import CODES_FRAME, DecodeJob, HandoffContext, Upstream
from omni_cache.models.code_windows import CodeWindow, check_window
from omni_cache.models.window_decoders import load_window_decoder
from omni_cache.timeline import Timeline
from omni_cache.wire.messages import StageOutput, StreamStart
from scheduler.pacing import PlaybackClock
from workers.runner import StageRunner, deadline_in, stage_pacer

logger = logging.getLogger(__name__)


@dataclass
class _DecodeRequest:
    upstream: Upstream
    deadline: float = 0.0  # time.monotonic(); 0 = none
    handoff_state: dict = field(default_factory=dict)
    jobs: deque[DecodeJob] = field(default_factory=deque)
    seq: int = 0
    frames: LatentBuffer | None = None  # the talker's code frames, one row [num_quantizers] per code
    clock: PlaybackClock | None = None  # a streamed answer's playback as this stage emits it
    seed: int = 0  # the request's sampling seed (0: none given), copied onto its windows
    held: bool = False  # its streaming client takes nothing now (wire Hold; scheduler/client_hold.py)


class DecoderRunner(StageRunner):
    def __init__(
        self, config: PipelineConfig, stage: StageConfig, model: str, outbox: Any, timeline: Timeline | None = None
    ) -> None:
        super().__init__(stage, outbox, tombstone_ttl_s=config.server.request_timeout_s, timeline=timeline)
        self.args = stage.generation
        self.decoder = load_window_decoder(model, device=self.args.device)
        self.handoff = resolve_handoff(stage.handoff)
        self.handoff_ctx = HandoffContext(
            Path(model),
            resources={
                "receptive_field": self.decoder.receptive_field,
                "chunk_size": self.args.chunk_size,
                "samples_per_code": self.decoder.samples_per_code,
                "num_quantizers": self.decoder.num_quantizers,
                "codebook_size": self.decoder.codebook_size,
            },
        )
        self.requests: OrderedDict[str, _DecodeRequest] = OrderedDict()
        self.max_model_len = 0
        self.pacer = stage_pacer(stage)

    def accept(self, msg: StageOutput, tensors: dict[str, torch.Tensor]) -> None:
        if not isinstance(msg, StageOutput):
            raise ValueError(f"the decoder stage takes stage outputs, not {type(msg).__name__}")
        req = self.requests.get(msg.request_id)
        if req is None:
            if self.is_dead(msg):
                return
            # A StreamStart: is_dead drops the rest of a stream whose start this stage never saw.
            req = self.requests[msg.request_id] = _DecodeRequest(
                Upstream.opened_by(msg), deadline=deadline_in(msg.time_left_s)
            )
            if self.pacer is not None and msg.stream:
                req.clock = self.pacer.clock()
            sampling = msg.sampling if isinstance(msg, StreamStart) else None
            if sampling is not None and sampling.seed is not None:
                req.seed = sampling.seed
            self.total_requests += 1
        bad = [c for c in msg.token_ids if c < 0]
        if bad:
            raise ValueError(f"code {bad[0]} from stage {msg.stage!r} is negative")
        if tensors:
            self._add_frame(req, tensors)
        req.upstream.token_ids.extend(msg.token_ids)
        if msg.token_ids or (req.frames is not None and req.frames.num_rows):
            self.timeline.mark(msg.request_id, "codes_in")
        req.upstream.finished = msg.finished
        for job in self.handoff(self.handoff_ctx, req.upstream, req.handoff_state):
            if not isinstance(job, DecodeJob):
                raise TypeError(
                    f"hand-off {self.stage.handoff} returned a {type(job).__name__}: the decoder stage runs DecodeJob"
                )
            if job.window is not None and (req.seed or req.upstream.voice):
                # The request's seed and voice go with each window (a speaker-conditioned decoder
                # reads them; others ignore them).
                job.window = replace(job.window, seed=req.seed, speaker=req.upstream.voice or None)
            req.jobs.append(job)

    def _add_frame(self, req: _DecodeRequest, tensors: dict[str, torch.Tensor]) -> None:
        """Append a `codes` frame to the request's codes, checked whole on arrival: integers
        [num_quantizers, k], every code in its codebook."""
        if set(tensors) != {CODES_FRAME}:
            raise ValueError(f"the decoder stage takes one tensor frame, {CODES_FRAME!r}; got {sorted(tensors)}")
        codes = tensors[CODES_FRAME]
        check_window(self.decoder, CodeWindow(codes, 0, codes.shape[-1] if codes.dim() else 0))
        if codes.shape[-1] == 0:
            return
        if req.frames is None:
            req.frames = LatentBuffer((CODES_FRAME,))
        req.frames.add(LatentChunk(req.frames.num_rows, {CODES_FRAME: codes.long().T}))
        # The hand-off reads all codes so far as [num_quantizers, N]: a view, no copy.
        req.upstream.latents = {CODES_FRAME: req.frames.view()[CODES_FRAME].T}

    def has_work(self) -> bool:
        return bool(self._runnable(time.monotonic())[0])

    @torch.inference_mode()
    def step(self) -> None:
        batch = []
        for rid, job in self._take_batch():
            if job.window is not None:
                self.guarded(rid, lambda job=job: check_window(self.decoder, job.window))
            if rid in self.requests:
                batch.append((rid, job))
        empty = [(rid, job) for rid, job in batch if job.window is None]
        group = [(rid, job) for rid, job in batch if job.window is not None]
        self._emit_all(empty, [torch.zeros(0)] * len(empty))
        if not group:
            return
        try:
            wavs = self._decode(group)
        except Exception:  # noqa: BLE001 -- decode each window alone: fail only its request
            if len(group) == 1:
                self.guarded(group[0][0], lambda: self._decode_and_emit(group))
                return
            logger.warning(
                "stage %s: a batch of %d windows failed; decoding them one by one",
                self.stage.name,
                len(group),
                exc_info=True,
            )
            for one in group:
                self.guarded(one[0], lambda one=one: self._decode_and_emit([one]))
            return
        self._emit_all(group, wavs)

    def _take_batch(self) -> list[tuple[str, DecodeJob]]:
        """Up to max_batch_size windows, one per request, oldest-served requests first; the
        requests served go to the back of the line, the others keep their windows queued.
        First windows (of requests with no audio out yet) go alone, ahead of the rest: they are
        a few codes each, and a batch takes as long as its longest window, so a new request's
        first audio does not wait behind other requests' full chunks. With pacing, answers far
        ahead of their playback yield while others are due, and the rest go by least slack."""
        now = time.monotonic()
        ready, size = self._runnable(now)
        first = [(rid, req) for rid, req in ready if req.seq == 0]
        batch = []
        for rid, req in first or ready:
            if len(batch) == size:
                break
            batch.append((rid, req.jobs.popleft()))
        for rid, _ in batch:
            self.requests.move_to_end(rid)
        if self.pacer is not None:
            self.pacer.note_step((self.requests[rid].clock for rid, _ in batch), now)
        return batch

    def _runnable(self, now: float) -> tuple[list[tuple[str, _DecodeRequest]], int]:
        """The requests whose next window may run now, in the order they go, and the batch size.
        With pacing on: no answer far ahead while another is due (one waiting for codes too:
        Pacer.hold), by least slack, and ahead-of-time work ahead_batch_size windows a batch."""
        ready = [(rid, req) for rid, req in self.requests.items() if req.jobs and not req.held]
        if self.pacer is None:
            return ready, self.args.max_batch_size
        waiting = [req.clock for req in self.requests.values() if not req.jobs and not req.held]
        held = set(self.pacer.hold([(rid, req.clock) for rid, req in ready], now, waiting))
        ready = [(rid, req) for rid, req in ready if rid not in held]
        if not self.pacer.policy.enabled:
            return ready, self.args.max_batch_size
        ready = self.pacer.order(ready, lambda item: item[1].clock, lambda item: item[1].seq > 0, now)
        ahead_only = all(self.pacer.is_ahead(req.clock, now) for _, req in ready)
        return ready, (
            self.stage.pacing.ahead_batch_size or self.args.max_batch_size if ahead_only else self.args.max_batch_size
        )

    def _decode(self, group: list[tuple[str, DecodeJob]]) -> list[torch.Tensor]:
        first = [rid for rid, _ in group if self.requests[rid].seq == 0] if self.timeline.on else []
        for rid in first:
            self.timeline.mark(rid, "window_start")
        wavs = self.decoder.decode_windows([job.window for _, job in group])
        for rid in first:
            self.timeline.mark(rid, "window_end")
        return wavs

    def _decode_and_emit(self, group: list[tuple[str, DecodeJob]]) -> None:
        self._emit_all(group, self._decode(group))

    def _emit_all(self, group: list[tuple[str, DecodeJob]], wavs: list[torch.Tensor]) -> None:
        for (rid, job), wav in zip(group, wavs):
            # The transport sends host memory: a decoder on CUDA hands over a CPU copy.
            audio = wav.float().cpu().contiguous()
            self.guarded(rid, lambda rid=rid, job=job, audio=audio: self._emit(rid, job, audio))

    def _emit(self, request_id: str, job: DecodeJob, audio: torch.Tensor) -> None:
        req = self.requests[request_id]
        if req.clock is not None:
            req.clock.emit(audio.shape[0] / self.decoder.sample_rate, time.monotonic())
        if audio.numel():
            self.timeline.mark(request_id, "audio_out")
        self.outbox.to_orchestrator(
            StageOutput(
                request_id=request_id,
                stage=self.stage.name,
                seq=req.seq,
                finished=job.last,
                finish_reason="stop" if job.last else None,
                sample_rate=self.decoder.sample_rate,
            ),
            {"audio": audio},
        )
        req.seq += 1
        if job.last:
            del self.requests[request_id]

    def drop(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def counters(self) -> dict[str, float]:
        return {**super().counters(), **(self.pacer.stats.counters() if self.pacer is not None else {})}
