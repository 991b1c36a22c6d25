"""Runner of the generation stage: the codec decoder, batched across requests.

The hand-off (`talker_to_decoder`) cuts each request's stream of codes into windows of
`chunk_size` codes plus the decoder's receptive field on both sides. Each step decodes up to
`max_batch_size` queued windows, at most one per request so a request's audio leaves in order,
taking requests round-robin: the windows that do not fit stay queued for the next steps, and a
request served now goes behind those that were not. Windows of equal length share one forward
pass; if a batched pass fails, each window of it is decoded alone, so only the request whose
window fails is failed.
"""

from __future__ import annotations

import logging
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

logger = logging.getLogger("omni_cache.stage")


@dataclass
class _Request:
    upstream: Upstream
    deadline: float = 0.0
    handoff_state: dict = field(default_factory=dict)
    jobs: deque[Job] = field(default_factory=deque)
    seq: int = 0


class DecoderRunner(StageRunner):
    def __init__(self, config: PipelineConfig, stage: StageConfig, model: str, outbox: Any) -> None:
        super().__init__(stage, outbox, tombstone_ttl_s=config.server.request_timeout_s)
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
            if self.is_dead(msg.request_id, msg.seq == 0, msg.deadline):
                return
            req = self.requests[msg.request_id] = _Request(
                Upstream(msg.stage, [], {}, msg.num_prompt_tokens, False), deadline=msg.deadline)
            self.total_requests += 1
        bad = [c for c in msg.token_ids if c < 0]
        if bad:
            raise ValueError(f"code {bad[0]} from stage {msg.stage!r} is negative")
        req.upstream.token_ids.extend(msg.token_ids)
        req.upstream.finished = msg.finished
        req.jobs.extend(self.handoff(self.handoff_ctx, req.upstream, req.handoff_state))

    def has_work(self) -> bool:
        return any(r.jobs for r in self.requests.values())

    @torch.inference_mode()
    def step(self) -> None:
        by_len: dict[int, list[tuple[str, Job]]] = {}
        for rid, job in self._take_batch():
            ok = self.requests.get(rid) is not None
            if ok:
                self.guarded(rid, lambda job=job: self._check_codes(job))
                ok = rid in self.requests
            if ok:
                by_len.setdefault(len(job.codes), []).append((rid, job))
        for length, group in by_len.items():
            if length == 0:
                self._emit_all(group, None)
                continue
            try:
                wavs = self._decode([job for _, job in group])
            except Exception:  # noqa: BLE001 -- decode each window alone: fail only its request
                if len(group) == 1:
                    self.guarded(group[0][0], lambda group=group: self._decode_and_emit(group))
                    continue
                logger.warning("stage %s: a batch of %d windows failed; decoding them one by one",
                               self.stage.name, len(group), exc_info=True)
                for one in group:
                    self.guarded(one[0], lambda one=one: self._decode_and_emit([one]))
                continue
            self._emit_all(group, wavs)

    def _take_batch(self) -> list[tuple[str, Job]]:
        """Up to max_batch_size windows, one per request, oldest-served requests first; the
        requests served go to the back of the line, the others keep their windows queued."""
        batch = []
        for rid, req in self.requests.items():
            if len(batch) == self.args.max_batch_size:
                break
            if req.jobs:
                batch.append((rid, req.jobs.popleft()))
        for rid, _ in batch:
            self.requests.move_to_end(rid)
        return batch

    def _check_codes(self, job: Job) -> None:
        """A code outside the codebook would index past the codec's embedding table."""
        codebook = self.decoder.codebook_size
        bad = [c for c in job.codes if not 0 <= c < codebook]
        if bad:
            raise ValueError(f"code {bad[0]} is outside the codebook (0..{codebook - 1})")

    def _decode(self, jobs: list[Job]) -> torch.Tensor:
        return self.decoder(torch.tensor([job.codes for job in jobs], dtype=torch.long))

    def _decode_and_emit(self, group: list[tuple[str, Job]]) -> None:
        self._emit_all(group, self._decode([job for _, job in group]))

    def _emit_all(self, group: list[tuple[str, Job]], wavs: torch.Tensor | None) -> None:
        spc = self.decoder.samples_per_code
        for i, (rid, job) in enumerate(group):
            lo, hi = job.keep
            # The transport sends host memory: a decoder on CUDA hands over a CPU copy.
            audio = torch.zeros(0) if wavs is None else \
                wavs[i, lo * spc:hi * spc].float().cpu().contiguous()
            self.guarded(rid, lambda rid=rid, job=job, audio=audio: self._emit(rid, job, audio))

    def _emit(self, request_id: str, job: Job, audio: torch.Tensor) -> None:
        req = self.requests[request_id]
        self.outbox.to_orchestrator(StageOutput(
            request_id=request_id, stage=self.stage.name, seq=req.seq, finished=job.last,
            finish_reason="stop" if job.last else None, sample_rate=self.decoder.sample_rate),
            {"audio": audio})
        req.seq += 1
        if job.last:
            del self.requests[request_id]

    def drop(self, request_id: str) -> None:
        self.requests.pop(request_id, None)
