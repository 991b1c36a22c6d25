"""Output assembly: what the stages send for a request, turned into what its client receives.

For each ``StageOutput`` of a request the assembler puts the client's events on the request's
queue: text (and token ids) from the text stage, audio from the audio stage, the latents asked
for (``return_latents``), first-token and first-audio latencies; a resumed attempt's output skips
what its client already has (:mod:`omni_cache.runtime.request_path.resume`). It says when every stage the
request needs has finished (:meth:`OutputAssembler.add` returns True); :meth:`completed` then
builds the terminal event. Failing a request is the orchestrator's, which also tells the stages.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from omni_cache.config import StageConfig
from omni_cache.runtime.metrics.prometheus import STAGE_DONE, TTFA, TTFT, OrchestratorMetrics
from omni_cache.runtime.request_path.requests import Request
from omni_cache.runtime.request_path.results import AudioDelta, Completed, TextDelta
from omni_cache.runtime.request_path.resume import new_samples, new_tokens
from omni_cache.runtime.request_path.topology import Topology
from omni_cache.timeline import Timeline
from omni_cache.wire.messages import CODES_FRAME, StageOutput

#: Sample rates accepted on a stage's audio output (telephone to studio rates).
MIN_SAMPLE_RATE, MAX_SAMPLE_RATE = 8000, 192000
#: The audio stage's rate until it sent audio (24 kHz: Qwen3-Omni's code2wav).
DEFAULT_SAMPLE_RATE = 24000


class BadOutput(ValueError):
    """A stage output that cannot be passed on (the request fails with 500)."""


class OutputAssembler:
    def __init__(self, topology: Topology, metrics: OrchestratorMetrics, timeline: Timeline | None = None) -> None:
        self._topology = topology
        self._metrics = metrics
        #: The server's request timeline: its ``text_in`` / ``audio_in`` are marked where the
        #: first-token and first-audio latencies are observed (omni_cache/timeline.py).
        self._timeline = timeline if timeline is not None else Timeline("server", directory="")  # off
        #: The rate of the audio stage's last audio (a result with no audio reports it).
        self.audio_sample_rate = DEFAULT_SAMPLE_RATE

    def add(self, req: Request, stage: StageConfig, msg: StageOutput, tensors: dict[str, Any], now: float) -> bool:
        """Pass ``msg`` (from ``stage``) on to ``req``'s client; whether every stage the request
        needs has now finished. Raises :class:`BadOutput` for audio at an impossible rate."""
        if msg.sample_rate and not MIN_SAMPLE_RATE <= msg.sample_rate <= MAX_SAMPLE_RATE:
            # Resampling audio at a peer's rate of 1 Hz to 24 kHz would allocate 24,000 samples
            # per sample it sent; a rate like that is a broken or hostile stage.
            raise BadOutput(
                f"stage {msg.stage!r} sent audio at {msg.sample_rate} Hz "
                f"(accepted: {MIN_SAMPLE_RATE}..{MAX_SAMPLE_RATE})"
            )
        if msg.media_layout is not None and req.attempt == 0 and stage.name == self._topology.entry.name:
            # (A resumed attempt's prompt holds the answer so far: not the client's prompt.)
            req.engine_prompt_token_ids = list(msg.media_layout.prompt_token_ids)
        self._text(req, stage, msg, now)
        if stage.final_output == "audio":
            self._audio(req, stage, msg, tensors, now)
        if req.return_latents and stage.is_autoregressive:
            self._latents(req, stage, msg, tensors)
        if msg.finished:
            if stage.name not in req.finished:
                self._metrics.observe(STAGE_DONE, stage.name, now - req.t0)
            req.finished[stage.name] = msg
            return all(p in req.finished for p in req.participants)
        return False

    def _text(self, req: Request, stage: StageConfig, msg: StageOutput, now: float) -> None:
        # A resumed attempt sends again what its client has (omni_cache.runtime.request_path.resume).
        token_ids = new_tokens(req, msg.token_ids) if stage.final_output == "text" else []
        text = msg.text if req.resumed_text is None else req.resumed_text.add(token_ids)
        if text:
            req.text_tokens = len(req.answer_tokens)
        last = stage.final_output == "text" and msg.finished
        if token_ids or (stage.final_output == "text" and text) or last:
            if not req.got_token and (token_ids or text):
                req.got_token = True
                self._metrics.observe(TTFT, stage.name, now - req.t0)
                self._timeline.mark(req.request_id, "text_in", now)
            # The log-probabilities of the tokens passed on (a resumed attempt's first ones are
            # the client's already).
            logprobs = msg.logprobs[len(msg.logprobs) - len(token_ids) :] if msg.logprobs else None
            req.queue.put_nowait(
                TextDelta(text, token_ids, logprobs, last=last, num_prompt_tokens=msg.num_prompt_tokens)
            )

    def _audio(self, req: Request, stage: StageConfig, msg: StageOutput, tensors: dict[str, Any], now: float) -> None:
        audio = tensors.get("audio")
        if audio is None or audio.numel() == 0:
            return
        if not req.got_audio:
            req.got_audio = True
            self._metrics.observe(TTFA, stage.name, now - req.t0)
            self._timeline.mark(req.request_id, "audio_in", now)
        import torch

        samples = new_samples(req, audio.detach().to(torch.float32).reshape(-1).numpy())
        rate = msg.sample_rate or self.audio_sample_rate
        self.audio_sample_rate = rate
        if len(samples):
            req.queue.put_nowait(AudioDelta(np.array(samples, copy=True), rate))

    def _latents(self, req: Request, stage: StageConfig, msg: StageOutput, tensors: dict[str, Any]) -> None:
        # The entry stage's latents by their own names, a later stage's as "<stage>.<name>"
        # (e.g. "talker.codes").
        prefix = "" if stage.name == self._topology.entry.name else f"{stage.name}."
        for name, t in tensors.items():
            if name != "audio":
                req.latents.setdefault(prefix + name, []).append((msg.latent_start, t.clone()))
        if prefix and msg.token_ids and CODES_FRAME not in tensors:
            # A one-codebook talker's codes are its token ids (Qwen2.5-Omni): "talker.token_ids",
            # in the order the stage sent them (its end-of-speech id included).
            import torch

            req.latents.setdefault(prefix + TOKEN_IDS, []).append((msg.seq, torch.tensor(msg.token_ids)))

    def completed(self, req: Request) -> Completed:
        """The terminal event of ``req``, every participant finished."""
        text_out = req.finished.get(self._topology.text_stage.name) or req.finished.get(self._topology.entry.name)
        entry_out = req.finished.get(self._topology.entry.name)
        return Completed(
            finish_reason=(text_out.finish_reason if text_out else None) or "stop",
            num_prompt_tokens=(entry_out.num_prompt_tokens if entry_out else 0) or len(req.prompt_token_ids),
            cached_tokens={n: m.num_cached_tokens for n, m in req.finished.items()},
            latents=joined_latents(req.latents),
            stop_reason=text_out.stop_reason if text_out else None,
            transcript=self._transcript(req),
        )

    def _transcript(self, req: Request) -> str | None:
        """What the stage that speaks the text stage's output was given to speak (its final
        output says), or None when the request has no audio."""
        speaker = self._topology.speaker
        if "audio" not in req.modalities or speaker is None or speaker not in req.finished:
            return None
        return req.finished[speaker].input_text


#: A later stage's generated token ids among a request's latents (``"<stage>.token_ids"``).
TOKEN_IDS = "token_ids"


def joined_latents(parts_by_name: dict[str, list[tuple[int, Any]]]) -> dict[str, Any]:
    """name -> one tensor of a request's latent pieces (``(start, tensor)``, in start order)."""
    if not parts_by_name:
        return {}
    import torch

    out: dict[str, Any] = {}
    for name, parts in parts_by_name.items():
        parts.sort(key=lambda p: p[0])
        # Codes frames are [num_code_groups, k]: steps run along the last dimension.
        dim = -1 if name.endswith("." + CODES_FRAME) else 0
        out[name] = parts[0][1] if len(parts) == 1 else torch.cat([p[1] for p in parts], dim=dim)
    return out
