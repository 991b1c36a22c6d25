"""Which stages a request passes, read once from the pipeline's shape.

The entry stage (the thinker) takes every request; the stages downstream of it take part only when
"audio" is among the request's modalities (the entry stage forwards to them only then). The text a
client reads comes from the stage whose ``final_output`` is "text" (else the entry stage), its audio
from the stage whose ``final_output`` is "audio".
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from omni_cache.config import PipelineConfig, StageConfig


@dataclass(frozen=True)
class Topology:
    #: Every stage's name, upstream before downstream.
    stage_names: tuple[str, ...]
    entry: StageConfig
    text_stage: StageConfig
    audio_stage: StageConfig | None
    #: The stages a request with audio passes after the entry stage.
    downstream_of_entry: frozenset[str]
    #: The stage that speaks the text stage's output (reads it directly), if any.
    speaker: str | None = None
    #: The speaker is an autoregressive stage (a talker: it has a prompt, so a prefill-only
    #: request can fill its prefix cache); a generation stage (a decoder) has none.
    speaker_prefills: bool = False

    @classmethod
    def of(cls, config: PipelineConfig) -> Topology:
        entry = config.entry_stage()
        text = [s for s in config.stages if s.final_output == "text"]
        audio = [s for s in config.stages if s.final_output == "audio"]
        text_stage = text[0] if text else entry
        speakers = config.downstream(text_stage.name)
        return cls(
            stage_names=tuple(s.name for s in config.topological_order()),
            entry=entry,
            text_stage=text_stage,
            audio_stage=audio[0] if audio else None,
            downstream_of_entry=frozenset(_reachable(config, entry.name)),
            speaker=speakers[0].name if speakers else None,
            speaker_prefills=bool(speakers) and speakers[0].kind == "autoregressive",
        )

    def participants(self, modalities: Iterable[str], prefill_only: bool = False) -> tuple[str, ...]:
        """The stages a request with these modalities needs, in topological order. A prefill-only
        request (wire ``Submit.prefill_only``) with "audio" goes only as far as the stage that
        speaks the text (the talker): the stages after it have no prompt to prefill."""
        names = {self.entry.name}
        if "audio" in modalities and prefill_only:
            if not self.speaker_prefills:
                raise ValueError("a prefill-only request asks for audio only where the speaker has a prompt")
            names.add(self.speaker)
        elif "audio" in modalities:
            names |= self.downstream_of_entry
        return tuple(n for n in self.stage_names if n in names)


def _reachable(config: PipelineConfig, name: str) -> set[str]:
    seen: set[str] = set()
    todo = [name]
    while todo:
        for d in config.downstream(todo.pop()):
            if d.name not in seen:
                seen.add(d.name)
                todo.append(d.name)
    return seen
