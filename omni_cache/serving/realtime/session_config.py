"""A realtime session's effective configuration, what ``session.update`` may change in it, and how
it reads in ``session.created`` / ``session.updated`` (the SDK's ``RealtimeSessionCreateRequest``).

Served: ``instructions``, ``output_modalities`` (``["audio"]``: speech plus its transcript, or
``["text"]``), ``max_output_tokens``, ``audio.input.format`` / ``audio.output.format``
(``audio/pcm`` 24 kHz, ``audio/pcmu``, ``audio/pcma``), ``audio.input.turn_detection``
(``server_vad`` with ``threshold``, ``prefix_padding_ms``, ``silence_duration_ms``,
``create_response``, ``interrupt_response``; or ``null`` for manual commits) and
``audio.output.voice`` (``default`` or one of the checkpoint's speakers, omni_cache/models/voices.py)
and ``truncation``
(``auto``, the default; ``disabled``; ``retention_ratio``: :mod:`.truncation`). Everything else the
API defines (tools, transcription, noise reduction, semantic VAD, tracing, prompts) is refused with
an error naming the field: the update is then not applied.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from omni_cache.serving.realtime.audio_codecs import FORMATS, PCM, AudioFormat
from omni_cache.serving.realtime.protocol import EventError, refuse_unsupported
from omni_cache.serving.realtime.truncation import Truncation
from omni_cache.serving.realtime.truncation import parse as parse_truncation

__all__ = [
    "BETA_FIELDS",
    "MAX_OUTPUT_TOKENS",
    "SessionConfig",
    "TurnDetection",
    "VOICE",
    "audio_format",
    "describe",
    "max_output_tokens",
    "output_modalities",
    "refuse_beta_fields",
    "refuse_tools_and_prompts",
    "updated",
    "voice",
]

VOICE = "default"
#: The API's bound on max_output_tokens.
MAX_OUTPUT_TOKENS = 4096


@dataclass(frozen=True)
class TurnDetection:
    """``server_vad``: the API's names and defaults."""

    threshold: float = 0.5
    prefix_padding_ms: int = 300
    silence_duration_ms: int = 500
    create_response: bool = True
    interrupt_response: bool = True


@dataclass(frozen=True)
class SessionConfig:
    instructions: str = ""
    output_modalities: tuple[str, ...] = ("audio",)
    input_format: AudioFormat = PCM
    output_format: AudioFormat = PCM
    #: None: manual commits (``turn_detection: null``).
    turn_detection: TurnDetection | None = field(default_factory=TurnDetection)
    #: None: "inf" (the pipeline's default max_tokens).
    max_output_tokens: int | None = None
    #: How the oldest turns are dropped when the conversation outgrows the thinker's limits.
    truncation: Truncation = field(default_factory=Truncation)
    #: The speaker of the session's answers: ``default`` or one of the pipeline's voices.
    voice: str = VOICE


def updated(
    config: SessionConfig, session: Any, served_model: str, voices: tuple[str, ...] = (VOICE,)
) -> SessionConfig:
    """``config`` with the fields present in ``session`` (a validated ``session.update``'s
    ``session``) applied; EventError naming the first field that cannot be. ``voices``: the
    pipeline's (``Orchestrator.voices``)."""
    from openai.types.realtime import RealtimeSessionCreateRequest

    if not isinstance(session, RealtimeSessionCreateRequest):
        raise EventError(
            "only realtime sessions are served (session.type 'realtime'); transcription sessions are not",
            param="session.type",
            code="unsupported",
        )
    s = session
    given = s.model_fields_set
    refuse_beta_fields(s, "session")
    refuse_tools_and_prompts(s, "session")
    refuse_unsupported(
        [
            ("session.tracing", s.tracing is not None),
            ("session.include", bool(s.include)),
        ],
        "this server answers with speech and text from the conversation",
    )
    if s.model is not None and s.model != served_model:
        raise EventError(
            f"the model {s.model!r} is not served here; this server serves {served_model!r}",
            param="session.model",
            code="model_not_found",
        )
    out = config
    if "instructions" in given:
        out = replace(out, instructions=s.instructions or "")
    if "output_modalities" in given and s.output_modalities is not None:
        out = replace(out, output_modalities=output_modalities(s.output_modalities, "session.output_modalities"))
    if "max_output_tokens" in given:
        out = replace(out, max_output_tokens=max_output_tokens(s.max_output_tokens, "session.max_output_tokens"))
    if s.truncation is not None:
        out = replace(out, truncation=parse_truncation(s.truncation))
    if s.audio is not None:
        out = _audio_updated(out, s.audio, voices)
    return out


#: The beta Realtime API's session and response fields -> their GA place (None: none). The SDK's
#: models keep a field they do not define without a word, so a beta client's update was answered
#: ``session.updated`` with none of it applied (its G.711 audio then read as PCM, VAD left on).
BETA_FIELDS = {
    "modalities": "output_modalities",
    "voice": "audio.output.voice",
    "speed": "audio.output.speed",
    "input_audio_format": "audio.input.format",
    "output_audio_format": "audio.output.format",
    "turn_detection": "audio.input.turn_detection",
    "input_audio_transcription": "audio.input.transcription",
    "input_audio_noise_reduction": "audio.input.noise_reduction",
    "max_response_output_tokens": "max_output_tokens",
    "temperature": None,
}


def refuse_beta_fields(obj: Any, prefix: str) -> None:
    """EventError (``unknown_parameter``) for a field of the beta API in a session or response,
    naming where the GA API this server speaks has it."""
    extra = obj.model_extra or {}
    for name, ga in BETA_FIELDS.items():
        if name in extra:
            where = f"set {prefix}.{ga} instead" if ga else "the GA API has no such field"
            raise EventError(
                f"{prefix}.{name} is a field of the beta Realtime API; this server speaks the GA API: {where}",
                param=f"{prefix}.{name}",
                code="unknown_parameter",
            )


def refuse_tools_and_prompts(obj: Any, prefix: str) -> None:
    """What a session and a response may both ask for and this server does not serve."""
    refuse_unsupported(
        [
            (f"{prefix}.tools", bool(obj.tools)),
            (f"{prefix}.tool_choice", obj.tool_choice not in (None, "auto", "none")),
            (f"{prefix}.prompt", obj.prompt is not None),
            (f"{prefix}.reasoning", obj.reasoning is not None),
        ],
        "this server answers with speech and text from the conversation",
    )


def output_modalities(mods: list[str], param: str) -> tuple[str, ...]:
    if len(mods) != 1:
        raise EventError(
            'output_modalities is either ["audio"] (speech and its transcript) or ["text"]',
            param=param,
            code="invalid_value",
        )
    return (mods[0],)


def max_output_tokens(value: Any, param: str) -> int | None:
    if value is None or value == "inf":
        return None
    if not isinstance(value, int) or not 1 <= value <= MAX_OUTPUT_TOKENS:
        raise EventError(
            f"max_output_tokens must be an integer from 1 to {MAX_OUTPUT_TOKENS} or 'inf'",
            param=param,
            code="invalid_value",
        )
    return value


def audio_format(fmt: Any, param: str) -> AudioFormat:
    if fmt is None or fmt.type is None:
        return PCM
    found = FORMATS.get(fmt.type)
    if found is None:
        raise EventError(f"unsupported audio format {fmt.type!r}", param=param, code="invalid_value")
    return found


def voice(value: Any, param: str, voices: tuple[str, ...] = (VOICE,)) -> str | None:
    """The voice named (lower case), None when none is; EventError when the pipeline has no such
    voice (matched without case, as the chat API's ``audio.voice``)."""
    name = getattr(value, "id", value)
    if name is None:
        return None
    if not isinstance(name, str) or name.lower() not in voices:
        raise EventError(
            f"voice {name!r} is not available; this pipeline speaks with {', '.join(map(repr, voices))}",
            param=param,
            code="invalid_value",
        )
    return name.lower()


def _audio_updated(config: SessionConfig, audio: Any, voices: tuple[str, ...]) -> SessionConfig:
    out = config
    inp, outp = audio.input, audio.output
    if inp is not None:
        refuse_unsupported(
            [
                ("session.audio.input.transcription", inp.transcription is not None),
                ("session.audio.input.noise_reduction", inp.noise_reduction is not None),
            ],
            "the model hears the audio itself",
        )
        if "format" in inp.model_fields_set:
            out = replace(out, input_format=audio_format(inp.format, "session.audio.input.format"))
        if "turn_detection" in inp.model_fields_set:
            out = replace(out, turn_detection=_turn_detection(inp.turn_detection))
    if outp is not None:
        refuse_unsupported(
            [("session.audio.output.speed", outp.speed not in (None, 1.0))], "speech is played at the model's pace"
        )
        chosen = voice(outp.voice, "session.audio.output.voice", voices)
        if chosen is not None:
            out = replace(out, voice=chosen)
        if "format" in outp.model_fields_set:
            out = replace(out, output_format=audio_format(outp.format, "session.audio.output.format"))
    return out


def _turn_detection(td: Any) -> TurnDetection | None:
    param = "session.audio.input.turn_detection"
    if td is None:
        return None
    if td.type != "server_vad":
        raise EventError(
            f"turn_detection type {td.type!r} is not supported (server_vad or null)",
            param=param + ".type",
            code="unsupported",
        )
    refuse_unsupported(
        [(param + ".idle_timeout_ms", td.idle_timeout_ms is not None)], "the server does not prompt a silent user"
    )
    d = TurnDetection()
    if td.threshold is not None and not 0.0 <= td.threshold <= 1.0:
        raise EventError("threshold must be from 0.0 to 1.0", param=param + ".threshold", code="invalid_value")
    for name in ("prefix_padding_ms", "silence_duration_ms"):
        v = getattr(td, name)
        if v is not None and not 0 <= v <= 10_000:
            raise EventError(f"{name} must be from 0 to 10000", param=f"{param}.{name}", code="invalid_value")
    return TurnDetection(
        threshold=d.threshold if td.threshold is None else float(td.threshold),
        prefix_padding_ms=d.prefix_padding_ms if td.prefix_padding_ms is None else td.prefix_padding_ms,
        silence_duration_ms=d.silence_duration_ms if td.silence_duration_ms is None else td.silence_duration_ms,
        create_response=d.create_response if td.create_response is None else td.create_response,
        interrupt_response=d.interrupt_response if td.interrupt_response is None else td.interrupt_response,
    )


def _format_model(fmt: AudioFormat) -> Any:
    from openai.types.realtime.realtime_audio_formats import AudioPCM, AudioPCMA, AudioPCMU

    if fmt is PCM:
        return AudioPCM(type="audio/pcm", rate=24000)
    return AudioPCMU(type="audio/pcmu") if fmt.type == "audio/pcmu" else AudioPCMA(type="audio/pcma")


def describe(config: SessionConfig, served_model: str, session_id: str) -> Any:
    """The session as ``session.created`` / ``session.updated`` carry it."""
    from openai.types.realtime import (
        RealtimeAudioConfig,
        RealtimeAudioConfigInput,
        RealtimeAudioConfigOutput,
        RealtimeSessionCreateRequest,
    )
    from openai.types.realtime.realtime_audio_input_turn_detection import ServerVad

    td = config.turn_detection
    turn = (
        None
        if td is None
        else ServerVad(
            type="server_vad",
            threshold=td.threshold,
            prefix_padding_ms=td.prefix_padding_ms,
            silence_duration_ms=td.silence_duration_ms,
            create_response=td.create_response,
            interrupt_response=td.interrupt_response,
        )
    )
    return RealtimeSessionCreateRequest(
        type="realtime",
        id=session_id,
        object="realtime.session",
        model=served_model,
        instructions=config.instructions,
        output_modalities=list(config.output_modalities),
        max_output_tokens="inf" if config.max_output_tokens is None else config.max_output_tokens,
        tools=[],
        tool_choice="auto",
        truncation=config.truncation.sdk(),
        audio=RealtimeAudioConfig(
            input=RealtimeAudioConfigInput(
                format=_format_model(config.input_format), turn_detection=turn, transcription=None, noise_reduction=None
            ),
            output=RealtimeAudioConfigOutput(format=_format_model(config.output_format), voice=config.voice, speed=1.0),
        ),
    )
