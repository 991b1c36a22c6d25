"""Which of a request's generated tokens a downstream stage may speak: those whose text the client
has.

vLLM's output processor (which runs in the stage: workers/llm_stage.py) writes the client's text.
It leaves out the text of the token that stopped the request (end of sequence, a
``stop_token_ids`` id) unless ``include_stop_str_in_output``, cuts the text before a stop string
(after it, with ``include_stop_str_in_output``), and while a stop string may still be forming it
holds back the last ``len(longest stop) - 1`` characters. The token ids it reports are every token
sampled, the ones that spelled the stop string included. A talker fed those tokens would speak
text the client never receives, so the stage hands downstream only the tokens whose text lies
within the text the client has so far:

* without stop strings, every token as it comes, except a stopping token whose text vLLM left out;
* with stop strings, the tokens up to the last one that added text within the client's text
  (a token that added none yet, such as a character's first bytes, waits: it may start a stop
  string), and every token once the answer ended other than by a stop string. Where each token's
  text ends comes from vLLM's own incremental detokenizer, run on the same tokens without the stop
  strings (so nothing is cut or held back): the same class, tokenizer and prompt the output
  processor uses, so its text is the client's text up to where vLLM cut it. A token the cut falls
  inside is not spoken.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class SpokenDelta:
    """Tokens newly handed downstream, and their text."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""


class SpokenTokens:
    """One request's spoken prefix of its generated tokens (see the module docstring)."""

    def __init__(self, params: Any, tokenizer: Any) -> None:
        """``params``: the request's vLLM ``SamplingParams``; ``tokenizer``: the engine's."""
        self._params = params
        self._tokenizer = tokenizer
        self._keep_stop_token = bool(params.include_stop_str_in_output)
        self._stop_strings = bool(params.stop)
        self._detokenizer: Any = None  # made with the first output (it needs vLLM's prompt)
        self._tokens: list[int] = []  # every generated token (with stop strings)
        self._ends: list[int] = []  # text length after each of them
        self._client_chars = 0  # length of the client's text so far
        self.count = 0  # tokens spoken so far

    def add(
        self,
        prompt_token_ids: list[int] | None,
        token_ids: list[int],
        text: str,
        finish_reason: str | None,
        stop_reason: int | str | None,
    ) -> SpokenDelta:
        """What one output of vLLM (new ``token_ids`` and client ``text``) adds to the spoken
        tokens. ``prompt_token_ids``: the prompt as vLLM saw it (the first output has it)."""
        stop_token = finish_reason == "stop" and not isinstance(stop_reason, str)
        if not self._stop_strings:
            spoken = list(token_ids)
            if stop_token and spoken and not self._keep_stop_token:
                spoken.pop()
            self.count += len(spoken)
            return SpokenDelta(spoken, text)
        if self._detokenizer is None:
            self._detokenizer = self._shadow_detokenizer(prompt_token_ids or [])
        for token in token_ids:
            self._detokenizer.update([token], False)
            self._tokens.append(token)
            self._ends.append(len(self._detokenizer.output_text))
        self._client_chars += len(text)
        speakable = len(self._tokens)
        if stop_token and not self._keep_stop_token:
            speakable -= 1
        start = count = self.count
        if finish_reason is not None and not isinstance(stop_reason, str):
            count = speakable  # the client has all the text there is
        else:
            # Up to the last token that added text within the client's: one that added none yet
            # (a character's first bytes) may still turn out to start a stop string.
            for i in range(start, speakable):
                if self._ends[i] > self._client_chars:
                    break
                if self._ends[i] > (self._ends[i - 1] if i else 0):
                    count = i + 1
        self.count = count
        begin = self._ends[start - 1] if start else 0
        end = self._ends[count - 1] if count else 0
        return SpokenDelta(self._tokens[start:count], self._detokenizer.output_text[begin:end])

    def _shadow_detokenizer(self, prompt_token_ids: list[int]) -> Any:
        """vLLM's incremental detokenizer for this request, without its stop strings."""
        from vllm.sampling_params import SamplingParams
        from vllm.v1.engine import EngineCoreRequest
        from vllm.v1.engine.detokenizer import IncrementalDetokenizer

        p = self._params
        params = SamplingParams(
            skip_special_tokens=p.skip_special_tokens, spaces_between_special_tokens=p.spaces_between_special_tokens
        )
        request = EngineCoreRequest(
            request_id="spoken-text",
            prompt_token_ids=list(prompt_token_ids),
            mm_features=None,
            sampling_params=params,
            pooling_params=None,
            arrival_time=0.0,
            lora_request=None,
            cache_salt=None,
            data_parallel_rank=None,
        )
        return IncrementalDetokenizer.from_new_request(self._tokenizer, request)
