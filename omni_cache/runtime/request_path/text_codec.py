"""Text in and out of the entry stage's vocabulary: chat messages -> prompt token ids through the
thinker's chat template, token ids -> text.

A tokenizer is not safe to use from two threads at once, so each use holds a lock. Tokenizing runs
in worker threads (a long prompt takes milliseconds behind the lock); detokenizing also runs on
the event loop (a resumed answer's few new tokens, omni_cache/runtime/request_path/resume.py), so it has a copy
of the tokenizer and a lock of its own: the event loop never waits for a tokenization. The
tokenizer is loaded from the entry stage's model (resolving a ``tiny:*`` model writes its
checkpoint first) with its word cache bounded (:mod:`omni_cache.runtime.request_path.tokenizer_cache`).

A prompt too long for the model is refused before it is tokenized, as `vllm serve` refuses it: no
token of the vocabulary stands for more than its longest entry's characters, so a rendered prompt
of more than ``max_tokens`` times that many characters has more than ``max_tokens`` tokens.
Tokenizing 20 MB of text takes ~40 s (2-vCPU AMD EPYC Zen 4) with the lock held, and every other
request's prompt waited behind it; the count takes microseconds.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from omni_cache.runtime.request_path.prompt_ids import PromptIds, prompt_ids
from omni_cache.runtime.request_path.results import RequestError
from omni_cache.runtime.request_path.tokenizer_cache import load_tokenizer

T = TypeVar("T")


class TextCodec:
    """``tokenizer``: anything with ``apply_chat_template`` (and ``decode``), or None to load the
    entry model's with :meth:`load`."""

    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer
        self._lock = threading.Lock()
        self._decoder: Any = None  # the copy detokenizing uses (load())
        self._decode_lock = threading.Lock()
        #: The folder the tokenizer came from ("" before load()): ``/v1/models``' ``root``.
        self.model_path = ""
        #: The most characters one token stands for (load(); None: a tokenizer without a
        #: vocabulary to read, whose prompts are not bounded before tokenizing).
        self.max_chars_per_token: int | None = None

    def load(self, model_path: str) -> None:
        """Load ``model_path``'s tokenizer unless one was given, and its copy for detokenizing
        (blocking)."""
        self.model_path = str(model_path)
        if self.tokenizer is None:
            self.tokenizer = load_tokenizer(model_path)
        self.max_chars_per_token = max_chars_per_token(self.tokenizer)
        try:
            self._decoder = copy.deepcopy(self.tokenizer)
        except Exception:  # noqa: BLE001 -- one that cannot be copied shares the tokenize lock
            self._decoder, self._decode_lock = self.tokenizer, self._lock

    def call_locked(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` holding the tokenizer's lock (blocking; for a worker thread): vLLM code
        that reads the tokenizer, such as a tool parser built with it (its vocabulary: tens of
        milliseconds for a real one)."""
        with self._lock:
            return fn(*args)

    def tokenize_messages(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
        max_tokens: int | None = None,
    ) -> PromptIds:
        """Chat messages -> prompt token ids through the chat template, given ``tools`` and the
        template's other arguments (default: only the generation prompt added); checked here, on
        the caller's worker thread, so admission does not check them on the event loop.
        ``max_tokens``: a prompt whose text is too long for that many tokens is a
        :class:`PromptTooLong`, found before tokenizing it (:func:`check_length`)."""
        if self.tokenizer is None:
            raise RuntimeError("the tokenizer is not loaded yet (start() has not run)")
        kwargs = {"add_generation_prompt": True} if template_kwargs is None else dict(template_kwargs)
        conversation = [dict(m) for m in messages]
        with self._lock:
            if max_tokens is None or self.max_chars_per_token is None:
                out = self.tokenizer.apply_chat_template(conversation, tools=tools, tokenize=True, **kwargs)
            else:
                # What apply_chat_template(tokenize=True) does, with the length counted between.
                text = self.tokenizer.apply_chat_template(conversation, tools=tools, tokenize=False, **kwargs)
                check_length(text, max_tokens, self.max_chars_per_token)
                out = self.tokenizer(text, add_special_tokens=False)
        if hasattr(out, "keys") and "input_ids" in out:  # transformers 5 returns a BatchEncoding
            out = out["input_ids"]
        if hasattr(out, "tolist"):
            out = out.tolist()
        if out and isinstance(out[0], (list, tuple)):
            out = out[0]
        return prompt_ids([int(t) for t in out])

    def decode_token(self, token_id: int) -> str:
        """One token's text, special tokens included (a log-probability's token); on the
        detokenizing copy, so the event loop does not wait for a tokenization."""
        decoder = self._decoder if self._decoder is not None else self.tokenizer
        if decoder is None:
            return ""
        with self._decode_lock:
            return str(decoder.decode([int(token_id)]))

    def detokenize(self, token_ids: Sequence[int]) -> str:
        """Token ids -> text, special tokens left out ("" without a tokenizer that decodes)."""
        decoder = self._decoder if self._decoder is not None else self.tokenizer
        if decoder is None or not hasattr(decoder, "decode"):
            return ""
        lock = self._decode_lock if self._decoder is not None else self._lock
        with lock:
            return str(decoder.decode(list(token_ids), skip_special_tokens=True))


class PromptTooLong(RequestError):
    """A 400: a prompt whose text is longer than ``max_tokens`` tokens can hold, vLLM's
    ``VLLMValidationError`` as `vllm serve` answers it (its message; ``param`` ``input_text``)."""

    def __init__(self, refusal: Exception, max_tokens: int) -> None:
        super().__init__(400, str(refusal), param=getattr(refusal, "parameter", None))
        #: Fewer tokens than this the prompt cannot have (a count for truncation to compare).
        self.tokens_at_least = max_tokens + 1


def check_length(text: str, max_tokens: int, per_token: int) -> None:
    """PromptTooLong when ``text`` has more characters than ``max_tokens`` tokens of at most
    ``per_token`` characters each can hold: vLLM's own check (``TokenizeParams``, before it
    tokenizes), so the bound and the refusal are `vllm serve`'s."""
    from types import SimpleNamespace

    from vllm.exceptions import VLLMValidationError
    from vllm.renderers.params import TokenizeParams

    params = TokenizeParams(max_total_tokens=max_tokens, max_total_tokens_param="max_model_len")
    try:
        params.apply_pre_tokenization(SimpleNamespace(max_chars_per_token=per_token), {"prompt": text})
    except VLLMValidationError as e:
        raise PromptTooLong(e, max_tokens) from None


def max_chars_per_token(tokenizer: Any) -> int | None:
    """The most characters one token of ``tokenizer``'s vocabulary stands for: its longest entry
    (a byte-level BPE entry has a character per byte, an added token is its text), as vLLM
    bounds a prompt's text. None without ``get_vocab``."""
    get_vocab = getattr(tokenizer, "get_vocab", None)
    if not callable(get_vocab):
        return None
    vocab = get_vocab()
    return max(map(len, vocab), default=0) or None
