"""Every field of vLLM's ``ChatCompletionRequest`` and what this server does with it: supported
(it behaves as under ``vllm serve``), refused (a 400 naming it and why, when it is set to anything
but its default) or ignored (only where ``vllm serve`` ignores it too). Nothing is accepted and
then ignored: ``tests/test_chat_fields.py`` checks that this table names exactly the model's
fields, so a field a later vLLM pin adds fails the test until it is placed here.

The fields that are not vLLM's (:data:`EXTRA_FIELDS`): this API's own ``modalities`` and ``audio``,
and OpenAI's ``metadata``, which vLLM ignores. Any other field is refused by name (``vllm serve``
would ignore it: a misspelt ``temprature`` would silently sample at the default temperature).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["EXTRA_FIELDS", "FIELDS", "IGNORED", "REFUSED", "SUPPORTED", "FieldRule", "refusal"]

SUPPORTED, REFUSED, IGNORED = "supported", "refused", "ignored"


@dataclass(frozen=True)
class FieldRule:
    """What the server does with one request field; ``note`` says how (supported), why
    (refused) or why vLLM ignores it too (ignored)."""

    kind: str
    note: str
    #: A supported field's limit: (request, wants audio) -> why this value is refused, or None.
    limit: Callable[[Any, bool], str | None] | None = None


def _n(req: Any, audio: bool) -> str | None:
    if req.n not in (None, 1):
        return "only n=1: the stages run one answer per request"
    return None


def _tools(req: Any, audio: bool) -> str | None:
    if audio and req.tools and req.tool_choice not in (None, "none"):
        return "tool calls cannot be spoken: ask for modalities ['text'] when the model may call a tool"
    return None


def _new_turn(field: str, spoken_default: bool) -> Callable[[Any, bool], str | None]:
    def limit(req: Any, audio: bool) -> str | None:
        if audio and getattr(req, field) != spoken_default:
            return f"{field}={getattr(req, field)!r} with audio: the talker speaks a new assistant turn"
        return None

    return limit


def _mm_processor_kwargs(req: Any, audio: bool) -> str | None:
    kwargs = req.mm_processor_kwargs or {}
    if set(kwargs) - {"use_audio_in_video"} or not isinstance(kwargs.get("use_audio_in_video", True), bool):
        return (
            'only {"use_audio_in_video": true|false} is taken (a video\'s sound track with its '
            "frames); the thinker's processor runs with its checkpoint's settings"
        )
    return None


def _include_reasoning(req: Any, audio: bool) -> str | None:
    if req.include_reasoning is False:
        return "the thinker has no reasoning parser: there is no reasoning to leave out"
    return None


_SAMPLING = "vLLM's SamplingParams field, applied by the thinker's engine"

#: vLLM 0.32's ChatCompletionRequest fields -> what this server does with them.
FIELDS: dict[str, FieldRule] = {
    "messages": FieldRule(
        SUPPORTED, "rendered by the thinker checkpoint's chat template; content parts text, image_url, input_audio"
    ),
    "model": FieldRule(SUPPORTED, "the served model name (404 otherwise, as vLLM)"),
    "frequency_penalty": FieldRule(SUPPORTED, _SAMPLING),
    "logit_bias": FieldRule(SUPPORTED, _SAMPLING),
    "logprobs": FieldRule(SUPPORTED, "choices[].logprobs, in the answer and in every chunk"),
    "top_logprobs": FieldRule(SUPPORTED, "up to 20 (vLLM's max_logprobs)"),
    "max_tokens": FieldRule(SUPPORTED, "clamped to the context left, as vLLM does"),
    "max_completion_tokens": FieldRule(SUPPORTED, "as max_tokens, and wins over it"),
    "n": FieldRule(SUPPORTED, "1", limit=_n),
    "presence_penalty": FieldRule(SUPPORTED, _SAMPLING),
    "response_format": FieldRule(
        SUPPORTED, "text, json_object, json_schema, structural_tag: vLLM's structured outputs"
    ),
    "seed": FieldRule(SUPPORTED, _SAMPLING),
    "stop": FieldRule(SUPPORTED, "cut by vLLM's detokenizer in the thinker stage; never spoken"),
    "stream": FieldRule(SUPPORTED, "server-sent events"),
    "stream_options": FieldRule(SUPPORTED, "include_usage, continuous_usage_stats"),
    "temperature": FieldRule(SUPPORTED, _SAMPLING),
    "top_p": FieldRule(SUPPORTED, _SAMPLING),
    "tools": FieldRule(
        SUPPORTED,
        "rendered by the chat template; calls parsed by vLLM's tool parser (server.tool_call_parser)",
        limit=_tools,
    ),
    "tool_choice": FieldRule(
        SUPPORTED, "none, auto, required, a named function; required and named through vLLM's structured outputs"
    ),
    "reasoning_effort": FieldRule(SUPPORTED, "passed to the chat template, as vLLM passes it"),
    "thinking_token_budget": FieldRule(REFUSED, "the thinker has no reasoning parser"),
    "include_reasoning": FieldRule(SUPPORTED, "true", limit=_include_reasoning),
    "parallel_tool_calls": FieldRule(SUPPORTED, "false keeps the first call"),
    "user": FieldRule(IGNORED, "vLLM ignores it too"),
    "use_beam_search": FieldRule(REFUSED, "beam search is not run: one sampled answer per request"),
    "top_k": FieldRule(SUPPORTED, _SAMPLING),
    "min_p": FieldRule(SUPPORTED, _SAMPLING),
    "repetition_penalty": FieldRule(SUPPORTED, _SAMPLING),
    "watermarking": FieldRule(REFUSED, "no watermarking is applied"),
    "length_penalty": FieldRule(REFUSED, "a beam search parameter (beam search is not run)"),
    "stop_token_ids": FieldRule(SUPPORTED, _SAMPLING),
    "include_stop_str_in_output": FieldRule(SUPPORTED, _SAMPLING),
    "ignore_eos": FieldRule(SUPPORTED, _SAMPLING),
    "min_tokens": FieldRule(SUPPORTED, _SAMPLING),
    "skip_special_tokens": FieldRule(SUPPORTED, "applied by vLLM's detokenizer in the thinker stage"),
    "spaces_between_special_tokens": FieldRule(SUPPORTED, "applied by vLLM's detokenizer in the thinker stage"),
    "truncate_prompt_tokens": FieldRule(REFUSED, "prompts are not truncated"),
    "truncation_side": FieldRule(REFUSED, "prompts are not truncated"),
    "prompt_logprobs": FieldRule(REFUSED, "prompt log-probabilities are not brought back from the thinker stage"),
    "logprob_token_ids": FieldRule(SUPPORTED, _SAMPLING),
    "allowed_token_ids": FieldRule(SUPPORTED, _SAMPLING),
    "bad_words": FieldRule(SUPPORTED, _SAMPLING),
    "echo": FieldRule(REFUSED, "the answer does not repeat the last message"),
    "add_generation_prompt": FieldRule(
        SUPPORTED, "a chat template argument", limit=_new_turn("add_generation_prompt", True)
    ),
    "continue_final_message": FieldRule(
        SUPPORTED, "a chat template argument", limit=_new_turn("continue_final_message", False)
    ),
    "add_special_tokens": FieldRule(REFUSED, "the chat template writes the prompt's special tokens"),
    "documents": FieldRule(SUPPORTED, "a chat template argument"),
    "chat_template": FieldRule(
        REFUSED,
        "chat templates from requests are not trusted (vllm serve "
        "refuses them too unless --trust-request-chat-template)",
    ),
    "chat_template_kwargs": FieldRule(SUPPORTED, "chat template arguments"),
    "media_io_kwargs": FieldRule(REFUSED, "media are decoded by the server's own rules (server.media)"),
    "mm_processor_kwargs": FieldRule(
        SUPPORTED,
        "only {\"use_audio_in_video\": true|false}: the thinker's processor runs with its checkpoint's settings",
        limit=_mm_processor_kwargs,
    ),
    "structured_outputs": FieldRule(
        SUPPORTED, "vLLM's structured outputs: json, regex, choice, grammar, structural_tag"
    ),
    "priority": FieldRule(IGNORED, "the thinker schedules first come, first served, where vLLM ignores it too"),
    "request_id": FieldRule(SUPPORTED, "the answer's id is chatcmpl-<request_id>"),
    "session_id": FieldRule(SUPPORTED, "a session's requests stay on the replicas its first one went to"),
    "return_tokens_as_token_ids": FieldRule(SUPPORTED, "log-probability tokens as token_id:<id>"),
    "return_token_ids": FieldRule(SUPPORTED, "prompt_token_ids and choices[].token_ids"),
    "routed_experts_prompt_start": FieldRule(
        IGNORED, "only read when routed experts are returned, which they are not (vLLM's default)"
    ),
    "return_token_offsets": FieldRule(IGNORED, "vLLM reads it on its render endpoints only"),
    "return_prompt_text": FieldRule(REFUSED, "the rendered prompt is not returned"),
    "mm_payload": FieldRule(IGNORED, "vLLM reads it on its render endpoints only"),
    "return_mm_kwargs": FieldRule(IGNORED, "vLLM reads it on its render endpoints only"),
    "cache_salt": FieldRule(REFUSED, "prefix-cache salts are not carried to the stages"),
    "kv_transfer_params": FieldRule(REFUSED, "no disaggregated prefill"),
    "ec_transfer_params": FieldRule(REFUSED, "no disaggregated encoders"),
    "vllm_xargs": FieldRule(REFUSED, "no custom extensions read them"),
    "repetition_detection": FieldRule(REFUSED, "not carried to the thinker stage"),
    "stream_interval": FieldRule(REFUSED, "chunks go out as the thinker's outputs arrive"),
}

#: Fields that are not vLLM's request fields.
EXTRA_FIELDS: dict[str, FieldRule] = {
    "modalities": FieldRule(SUPPORTED, '["text"] (default) or ["text", "audio"]'),
    "audio": FieldRule(SUPPORTED, "{voice, format} of the spoken answer"),
    "metadata": FieldRule(IGNORED, "OpenAI's labels for stored completions; vLLM ignores it too"),
}


def _default(model_field: Any) -> Any:
    return model_field.get_default(call_default_factory=True)


def refusal(req: Any, extras: dict[str, Any], wants_audio: bool) -> tuple[str, str] | None:
    """(field, why) for the first field of ``req`` (a vLLM ``ChatCompletionRequest``) this server
    refuses, ``extras`` its fields that are not vLLM's; None when it takes them all."""
    for name in extras:
        if name not in EXTRA_FIELDS:
            return name, "not a chat-completions parameter this server knows"
    model_fields = type(req).model_fields
    for name in sorted(req.model_fields_set & model_fields.keys()):
        rule = FIELDS.get(name)
        if rule is None:
            return name, "not a parameter this server knows (a newer vLLM's?)"
        with warnings.catch_warnings():  # deprecated fields (max_tokens) are read all the same
            warnings.simplefilter("ignore", DeprecationWarning)
            value = getattr(req, name)
        if rule.kind == REFUSED and value != _default(model_fields[name]):
            return name, rule.note
        if rule.limit is not None:
            why = rule.limit(req, wants_audio)
            if why is not None:
                return name, why
    return None
