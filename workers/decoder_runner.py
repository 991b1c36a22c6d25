"""Runner of the generation stage: the codec decoder, batched across requests.

The hand-off (`talker_to_decoder`) cuts each request's stream of codes into windows of
`chunk_size` codes plus the decoder's receptive field on both sides. Each step decodes up to
`max_batch_size` queued windows, at most one per request so a request's audio leaves in order;
windows of equal length share one forward pass.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from omni_cache.models.codec_decoder import CodecDecoder
from omni_cache.config import PipelineConfig, StageConfig, resolve_handoff
from omni_cache.handoff import HandoffContext, Job, Upstream
from omni_cache.wire.messages import StageOutput
from workers.runner import StageRunner


@dataclass
class _Request:
    upstream: Upstream
    handoff_state: dict = field(default_factory=dict)
    jobs: deque[Job] = field(default_factory=deque)
    seq: int = 0


class DecoderRunner(StageRunner):
    def __init__(self, config: PipelineConfig, stage: StageConfig, model: str, outbox: Any) -> None:
        super().__init__(stage, outbox)
        self.args = stage.generation
        self.decoder = CodecDecoder.from_pretrained(model, device=self.args.device)
        self.handoff = resolve_handoff(stage.handoff)
        self.handoff_ctx = HandoffContext(Path(model), resources={
            "codebook_size": self.decoder.codebook_size, "chunk_size": self.args.chunk_size,
            "context": self.decoder.context})
        self.requests: OrderedDict[str, _Request] = OrderedDict()
        self.max_model_len = 0

    def accept(self, msg: StageOutput, tensors: dict[str, torch.Tensor]) -> None:
        if not isinstance(msg, StageOutput):
            raise ValueError(f"the decoder stage takes stage outputs, not {type(msg).__name__}")
        req = self.requests.get(msg.request_id)
        if req is None:
            if msg.seq != 0:
                return  # rest of a request that failed or was aborted here
            req = self.requests[msg.request_id] = _Request(
                Upstream(msg.stage, [], {}, msg.num_prompt_tokens, False))
            self.total_requests += 1
        req.upstream.token_ids.extend(msg.token_ids)
        req.upstream.finished = msg.finished
        req.jobs.extend(self.handoff(self.handoff_ctx, req.upstream, req.handoff_state))

    def has_work(self) -> bool:
        return any(r.jobs for r in self.requests.values())

    @torch.inference_mode()
    def step(self) -> None:
        batch = [(rid, r.jobs.popleft()) for rid, r in self.requests.items() if r.jobs]
        batch = batch[: self.args.max_batch_size]
        by_len: dict[int, list[tuple[str, Job]]] = {}
        for rid, job in batch:
            by_len.setdefault(len(job.codes), []).append((rid, job))
        spc = self.decoder.samples_per_code
        for length, group in by_len.items():
            if length:
                codes = torch.tensor([job.codes for _, job in group], dtype=torch.long)
                wavs = self.decoder(codes)
            for i, (rid, job) in enumerate(group):
                lo, hi = job.keep
                audio = wavs[i, lo * spc:hi * spc].contiguous() if length else torch.zeros(0)
                self._emit(rid, job, audio)

    def _emit(self, request_id: str, job: Job, audio: torch.Tensor) -> None:
        req = self.requests[request_id]
        self.outbox.to_orchestrator(StageOutput(
            request_id=request_id, stage=self.stage.name, seq=req.seq, finished=job.last,
            finish_reason="stop" if job.last else None, sample_rate=self.decoder.sample_rate),
            {"audio": audio.float()})
        req.seq += 1
        if job.last:
            del self.requests[request_id]

    def abort(self, request_id: str) -> None:
        self.requests.pop(request_id, None)
