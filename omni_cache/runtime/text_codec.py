"""Text in and out of the entry stage's vocabulary: chat messages -> prompt token ids through the
thinker's chat template, token ids -> text.

One tokenizer serves the server's threads (routes tokenize on the event loop's executor, the
orchestrator detokenizes resumed answers on the loop), so every use holds one lock. It is loaded
from the entry stage's model (resolving a ``tiny:*`` model writes its checkpoint first) with its
word cache bounded (:mod:`omni_cache.runtime.tokenizer_cache`).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

from omni_cache.runtime.tokenizer_cache import load_tokenizer


class TextCodec:
    """``tokenizer``: anything with ``apply_chat_template`` (and ``decode``), or None to load the
    entry model's with :meth:`load`."""

    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer
        self._lock = threading.Lock()

    def load(self, model_path: str) -> None:
        """Load ``model_path``'s tokenizer unless one was given (blocking)."""
        if self.tokenizer is None:
            self.tokenizer = load_tokenizer(model_path)

    def tokenize_messages(self, messages: Sequence[Mapping[str, Any]], *,
                          tools: list[dict[str, Any]] | None = None,
                          template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
        """Chat messages -> prompt token ids through the chat template, given ``tools`` and the
        template's other arguments (default: only the generation prompt added)."""
        if self.tokenizer is None:
            raise RuntimeError("the tokenizer is not loaded yet (start() has not run)")
        kwargs = {"add_generation_prompt": True} if template_kwargs is None else dict(template_kwargs)
        with self._lock:
            out = self.tokenizer.apply_chat_template(
                [dict(m) for m in messages], tools=tools, tokenize=True, **kwargs)
        if hasattr(out, "keys") and "input_ids" in out:  # transformers 5 returns a BatchEncoding
            out = out["input_ids"]
        if hasattr(out, "tolist"):
            out = out.tolist()
        if out and isinstance(out[0], (list, tuple)):
            out = out[0]
        return [int(t) for t in out]

    def decode_token(self, token_id: int) -> str:
        """One token's text, special tokens included (a log-probability's token)."""
        if self.tokenizer is None:
            return ""
        with self._lock:
            return str(self.tokenizer.decode([int(token_id)]))

    def detokenize(self, token_ids: Sequence[int]) -> str:
        """Token ids -> text, special tokens left out ("" without a tokenizer that decodes)."""
        if self.tokenizer is None or not hasattr(self.tokenizer, "decode"):
            return ""
        with self._lock:
            return str(self.tokenizer.decode(list(token_ids), skip_special_tokens=True))
