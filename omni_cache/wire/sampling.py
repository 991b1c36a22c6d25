"""How the entry stage samples one request: the fields of vLLM's ``SamplingParams`` a request
carries over the wire (``Submit.sampling``).

The server fills it from what vLLM's own ``ChatCompletionRequest.to_sampling_params`` produced
(omni_cache/serving/chat_sampling.py), the Python API from the entry stage's defaults; the entry
stage builds vLLM's ``SamplingParams`` from it again (workers/ar_request.py). Field names and
defaults are vLLM's, so a field left out means what vLLM's default means. msgspec only: the
orchestrator side and the stages decode it without importing vLLM, and nothing here is unpickled.

The structs are not constrained here (ranges, lengths): vLLM's ``SamplingParams`` checks them when
the server builds it, and again in the stage; a bad value comes back as a 400 naming it instead of
being dropped as a malformed message.
"""

from __future__ import annotations

from typing import Any

import msgspec


class StructuredOutputs(msgspec.Struct, kw_only=True, omit_defaults=True):
    """vLLM's ``StructuredOutputsParams`` (one constraint at a time, as vLLM requires): the
    grammar the sampled text must follow (``response_format``, ``structured_outputs``, and the
    structural tag vLLM's tool parser writes for ``tool_choice`` "required" or a named function)."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None


class EngineSampling(msgspec.Struct, kw_only=True, omit_defaults=True):
    """The entry stage's ``SamplingParams`` for one request, as vLLM names and defaults them."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    #: Top log-probabilities per generated token (0: only the sampled one's); None: none.
    logprobs: int | None = None
    #: Log-probabilities of exactly these ids at every position (instead of the top ones).
    logprob_token_ids: list[int] | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    structured_outputs: StructuredOutputs | None = None

    @property
    def has_stop_strings(self) -> bool:
        return bool(self.stop)
