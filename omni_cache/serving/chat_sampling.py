"""A chat request's sampling for the thinker, made as ``vllm serve`` makes it: the context checks of
vLLM's ``TokenizeParams``, ``max_tokens`` clamped by vLLM's ``get_max_tokens``, and vLLM's
``ChatCompletionRequest.to_sampling_params`` (its range checks, its 400s), with the entry stage's
configured ``sampling`` as the server's defaults (vLLM's ``default_sampling_params``).

What ``to_sampling_params`` produced travels to the thinker stage as
:class:`~omni_cache.wire.sampling.EngineSampling`. A ``SamplingParams`` field it does not carry
must hold vLLM's default (:func:`wire_sampling` refuses the request otherwise, naming the field):
behind the per-field table of :mod:`omni_cache.serving.chat_fields`, nothing the client set can be
lost on the way to the engine, whatever a later vLLM pin derives from the request.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from types import SimpleNamespace
from typing import Any

import msgspec

from omni_cache.serving.errors import APIError
from omni_cache.wire.sampling import EngineSampling, StructuredOutputs

__all__ = ["CARRIED", "NOT_FROM_REQUESTS", "engine_sampling", "wire_sampling"]

#: SamplingParams fields that travel (EngineSampling's own fields).
CARRIED = frozenset(f.name for f in msgspec.structs.fields(EngineSampling))

#: StructuredOutputs' fields (those of vLLM's StructuredOutputsParams that travel).
_STRUCTURED_FIELDS = frozenset(f.name for f in msgspec.structs.fields(StructuredOutputs))

#: SamplingParams fields a request does not set, or the stage sets itself: the output kind (the
#: stage streams deltas), vLLM's internal state filled in when the engine takes the request, and
#: ``routed_experts_prompt_start``, which vLLM reads only when it returns routed experts (it does
#: not here, as by default under ``vllm serve``).
NOT_FROM_REQUESTS = frozenset(
    {
        "output_kind",
        "skip_clone",
        "output_text_buffer_length",
        "_eos_token_id",
        "_all_stop_token_ids",
        "_watermarking_skipped",
        "_bad_words_token_ids",
        "routed_experts_prompt_start",
    }
)


def engine_sampling(req: Any, *, prompt_len: int, max_model_len: int, defaults: EngineSampling) -> EngineSampling:
    """The thinker's sampling for ``req`` (vLLM's ``ChatCompletionRequest``, after the tool
    parser adjusted it) and a prompt of ``prompt_len`` tokens. vLLM's checks raise its
    ``VLLMValidationError`` (answered 400 naming the parameter, as vLLM answers it)."""
    from vllm.entrypoints.serve.utils.api_utils import get_max_tokens

    # build_tok_params reads only the model's context length.
    tok_params = req.build_tok_params(SimpleNamespace(max_model_len=max_model_len))
    tok_params.apply_post_tokenization(None, {"prompt_token_ids": [0] * prompt_len})
    with warnings.catch_warnings():  # vLLM reads the deprecated max_tokens as well
        warnings.simplefilter("ignore", DeprecationWarning)
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    max_tokens = get_max_tokens(max_model_len, requested, prompt_len, {"max_tokens": defaults.max_tokens})
    params = req.to_sampling_params(max_tokens, {"temperature": defaults.temperature, "top_p": defaults.top_p})
    if params.seed is None:
        params.seed = defaults.seed
    return wire_sampling(params)


def wire_sampling(params: Any) -> EngineSampling:
    """``params`` (vLLM's SamplingParams) as it travels; a field that does not travel and is not
    vLLM's default is refused (400 naming it)."""
    for name, default in _uncarried_defaults():
        if getattr(params, name) != default:
            raise APIError(
                400,
                f"{name}={getattr(params, name)!r} is not carried to the thinker stage by this server",
                param=name,
            )
    fields = {name: getattr(params, name) for name in CARRIED}
    stop = fields["stop"]
    fields["stop"] = [stop] if isinstance(stop, str) else (list(stop) if stop else None)
    if fields["logit_bias"] is not None:
        fields["logit_bias"] = {int(k): float(v) for k, v in fields["logit_bias"].items()}
    fields["structured_outputs"] = _structured(params.structured_outputs)
    return EngineSampling(**fields)


@functools.cache
def _uncarried_defaults() -> tuple[tuple[str, Any], ...]:
    """(name, vLLM's default) of each SamplingParams field that does not travel and that a
    request sets. Found once: ``msgspec.structs.fields`` evaluates the class's annotations
    (0.15 ms a call, on the event loop for every chat request)."""
    from vllm.sampling_params import SamplingParams

    default = SamplingParams()
    return tuple(
        (f.name, getattr(default, f.name))
        for f in msgspec.structs.fields(SamplingParams)
        if f.name not in CARRIED and f.name not in NOT_FROM_REQUESTS
    )


def _structured(params: Any) -> StructuredOutputs | None:
    """vLLM's StructuredOutputsParams as it travels (its public fields; the rest are the engine's
    own and set when it takes the request)."""
    if params is None:
        return None
    carried = _STRUCTURED_FIELDS
    out = {}
    for f in dataclasses.fields(params):
        value = getattr(params, f.name)
        if f.name in carried:
            out[f.name] = value
        elif not f.name.startswith("_") and value != f.default:
            raise APIError(
                400,
                f"structured_outputs.{f.name} is not carried to the thinker stage by this server",
                param=f"structured_outputs.{f.name}",
            )
    return StructuredOutputs(**out)
