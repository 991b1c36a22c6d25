"""Admission: everything that can refuse a request before it is sent, in the order the client
learns of it (the server shutting down, its modalities, its prompt, its sampling, the context
length, the stages it needs being up).

A refusal is a :class:`~omni_cache.runtime.results.RequestError` with the HTTP status the client
sees: 400 for what the request asked, 503 for what the pipeline cannot do now. What passes is an
:class:`AdmittedRequest`, which the orchestrator routes and sends.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from omni_cache.config import PipelineConfig
from omni_cache.runtime.requests import MediaItem
from omni_cache.runtime.results import RequestError
from omni_cache.runtime.supervisor import StageSupervisor
from omni_cache.runtime.topology import Topology
from omni_cache.wire.sampling import EngineSampling

#: Admission's states: before every stage was ready once, serving, shutting down.
STARTING, OPEN, CLOSED = "starting", "open", "closed"


@dataclass
class AdmittedRequest:
    """A request that passed every check, ready to be routed and sent."""

    prompt_token_ids: list[int]
    modalities: tuple[str, ...]
    sampling: EngineSampling
    participants: tuple[str, ...]
    media: tuple[MediaItem, ...] = ()


class Admission:
    """The checks, with what they read: the entry stage's defaults and context length, and which
    stages are up (``supervisor``, read only)."""

    def __init__(self, config: PipelineConfig, topology: Topology,
                 supervisor: StageSupervisor) -> None:
        self._config = config
        self._topology = topology
        self._supervisor = supervisor
        self.state = STARTING
        #: The entry stage's context length as its engine reported it (StageReady); None before.
        self.context_len: int | None = None

    @property
    def max_model_len(self) -> int | None:
        """The entry stage's context length: what it reported, else its engine_args."""
        if self.context_len:
            return self.context_len
        ea = self._topology.entry.engine_args
        return ea.max_model_len if ea is not None else None

    def default_sampling(self) -> EngineSampling:
        """The entry stage's configured ``sampling`` (the server hands the same values to vLLM's
        ``to_sampling_params`` as its defaults: omni_cache/serving/chat_sampling.py)."""
        d = self._topology.entry.sampling
        return EngineSampling(temperature=d.temperature, top_p=d.top_p, max_tokens=d.max_tokens,
                              seed=d.seed)

    def check(self, prompt_token_ids: Sequence[int], *, sampling: EngineSampling | None = None,
              max_tokens: int | None = None, temperature: float | None = None,
              top_p: float | None = None, seed: int | None = None,
              modalities: Iterable[str] = ("text",),
              media: Sequence[MediaItem] = ()) -> AdmittedRequest:
        """The admitted request, or :class:`RequestError` for the first check it fails.
        ``sampling``: the request's, as the server resolved it; without it the entry stage's
        defaults with ``max_tokens``, ``temperature``, ``top_p`` and ``seed`` where given."""
        if self.state == CLOSED:
            raise RequestError(503, "the server is shutting down")
        mods = self._modalities(modalities)
        ids = _prompt(prompt_token_ids)
        if sampling is None:
            sampling = self.sampling(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                     seed=seed)
        elif (max_tokens, temperature, top_p, seed) != (None, None, None, None):
            raise TypeError("check() takes sampling= or its fields, not both")
        if sampling.max_tokens < 1:
            raise RequestError(400, f"max_tokens must be at least 1, got {sampling.max_tokens}")
        self._context_length(len(ids), sampling.max_tokens)
        participants = self._topology.participants(mods)
        self._available(participants)
        return AdmittedRequest(ids, mods, sampling, participants, tuple(media))

    def _modalities(self, modalities: Iterable[str]) -> tuple[str, ...]:
        mods = tuple(dict.fromkeys(["text", *[str(m) for m in modalities]]))
        bad = [m for m in mods if m not in ("text", "audio")]
        if bad:
            raise RequestError(400, f"unknown modality {bad[0]!r} (supported: 'text', 'audio')")
        if "audio" in mods and self._topology.audio_stage is None:
            raise RequestError(400, f"pipeline {self._config.name!r} has no audio output stage")
        return mods

    def sampling(self, *, max_tokens: int | None = None, temperature: float | None = None,
                 top_p: float | None = None, seed: int | None = None) -> EngineSampling:
        """The entry stage's defaults with these overrides (the Python API's sampling)."""
        sampling = self.default_sampling()
        if max_tokens is not None:
            sampling.max_tokens = int(max_tokens)
        if temperature is not None:
            sampling.temperature = float(temperature)
        if top_p is not None:
            sampling.top_p = float(top_p)
        if seed is not None:
            sampling.seed = int(seed)
        return sampling

    def _context_length(self, n_prompt: int, max_tokens: int) -> None:
        limit = self.max_model_len
        if limit and n_prompt + max_tokens > limit:
            raise RequestError(
                400,
                f"this model's maximum context length is {limit} tokens; the prompt has {n_prompt} "
                f"tokens and max_tokens is {max_tokens} ({n_prompt + max_tokens} "
                "in total): shorten the prompt or lower max_tokens",
            )

    def _available(self, participants: Sequence[str]) -> None:
        if self.state == STARTING:
            raise RequestError(503, "the pipeline is still starting: "
                               + ", ".join(f"{n} ({r})" for n, r in self.not_ready().items()))
        down = [n for n in participants if not self._supervisor.is_up(n)]
        if down:
            reasons = self.not_ready()
            raise RequestError(
                503, "stage(s) not available: "
                + ", ".join(f"{n} ({reasons.get(n, 'down')})" for n in down) + "; retry shortly",
                stage=down[0])

    def not_ready(self) -> dict[str, str]:
        """stage -> why it is not serving (see :meth:`StageSupervisor.not_ready`)."""
        return self._supervisor.not_ready(self._topology.stage_names, entry=self._topology.entry.name,
                                          starting=self.state == STARTING)


def _prompt(prompt_token_ids: Sequence[int]) -> list[int]:
    ids = list(prompt_token_ids)
    if not ids:
        raise RequestError(400, "the prompt is empty")
    if not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise RequestError(400, "prompt token ids must be non-negative integers")
    return [int(t) for t in ids]
