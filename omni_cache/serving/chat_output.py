"""One chat answer's choice as ``vllm serve`` writes it, in vLLM's own response types: its
log-probabilities, its tool calls (parsed by vLLM's tool parser for the model, named by
``server.tool_call_parser``), its finish reason. :class:`ChoiceWriter` is fed the text stage's
deltas, so a stream and a whole answer are written by the same rules
(omni_cache/serving/chat_stream.py).

The rules are vLLM's (``OpenAIServingChat``'s full and streaming generators): with ``tool_choice``
"required" or a named function the message has ``tool_calls`` (its content "" when there is no
other text); with "auto" it has them when the parser found a call; a call found ends the answer
with ``finish_reason`` "tool_calls", except a named function's ("stop"); ``parallel_tool_calls:
false`` keeps the first call.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from omni_cache.wire.messages import TokenLogprob

__all__ = ["ChoiceWriter", "chat_logprobs", "parser_class"]


def parser_class(tool_call_parser: str | None, model_name: str) -> Any:
    """vLLM's parser class for ``server.tool_call_parser`` (None: no tool parsing, as ``vllm
    serve`` without ``--tool-call-parser``). An unknown name raises vLLM's TypeError."""
    if not tool_call_parser:
        return None
    from vllm.parser import ParserManager

    return ParserManager.get_parser(tool_parser_name=tool_call_parser, enable_auto_tools=True, model_name=model_name)


def chat_logprobs(
    token_ids: Sequence[int],
    positions: Sequence[Sequence[TokenLogprob]],
    decode: Callable[[int], str],
    *,
    top_logprobs: int | None,
    return_all: bool,
    as_token_id: bool,
) -> Any:
    """vLLM's ``ChatCompletionLogProbs`` of these tokens: per token its entry (vLLM's decoded text
    of it, its log-probability, that text's UTF-8 bytes) and the first ``top_logprobs`` entries of
    its position in vLLM's order (every entry with ``return_all``: ``logprob_token_ids``).
    ``decode``: one token id -> its text, where vLLM did not decode one."""
    from vllm.entrypoints.openai.chat_completion.protocol import (
        ChatCompletionLogProb,
        ChatCompletionLogProbs,
        ChatCompletionLogProbsContent,
    )

    def token_text(entry: TokenLogprob) -> str:
        if as_token_id:
            return f"token_id:{entry.token_id}"
        return entry.token if entry.token is not None else decode(entry.token_id)

    content = []
    for token_id, position in zip(token_ids, positions):
        chosen = next((e for e in position if e.token_id == token_id), None)
        if chosen is None:
            text = f"token_id:{token_id}" if as_token_id else decode(token_id)
            content.append(
                ChatCompletionLogProbsContent(token=text, bytes=list(text.encode("utf-8", errors="replace")))
            )
            continue
        top = [
            ChatCompletionLogProb(
                token=(t := token_text(e)),
                logprob=max(e.logprob, -9999.0),
                bytes=list(t.encode("utf-8", errors="replace")),
            )
            for i, e in enumerate(position)
            if return_all or top_logprobs == -1 or (top_logprobs is not None and i < top_logprobs)
        ]
        content.append(
            ChatCompletionLogProbsContent(
                token=token_text(chosen),
                logprob=max(chosen.logprob, -9999.0),
                bytes=None if chosen.token is None else list(chosen.token.encode("utf-8", errors="replace")),
                top_logprobs=top,
            )
        )
    return ChatCompletionLogProbs(content=content)


class ChoiceWriter:
    """The choice of one request (vLLM's ``ChatCompletionRequest`` ``req``), from the text stage's
    deltas. ``parser``: vLLM's parser for this request (None without a tool parser);
    ``decode``: one token id -> its text (log-probabilities vLLM did not decode)."""

    def __init__(self, req: Any, parser: Any, decode: Callable[[int], str], prompt_token_ids: list[int]) -> None:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionNamedToolChoiceParam

        self.req = req
        self.parser = parser
        self._decode = decode
        self._prompt_token_ids = prompt_token_ids
        self._named = isinstance(req.tool_choice, ChatCompletionNamedToolChoiceParam)
        self._required = req.tool_choice == "required"
        self.num_tokens = 0
        self._tools_streamed = False
        self._parsed_last = False
        if parser is not None:
            parser.set_prompt_token_ids(prompt_token_ids)

    def logprobs(self, token_ids: Sequence[int], positions: Sequence[Sequence[TokenLogprob]] | None) -> Any:
        req = self.req
        if not req.logprobs:
            return None
        return chat_logprobs(
            token_ids,
            positions or [],
            self._decode,
            top_logprobs=req.top_logprobs,
            return_all=bool(req.logprob_token_ids),
            as_token_id=bool(req.return_tokens_as_token_ids),
        )

    # ---- streamed ----------------------------------------------------------------------------
    def delta(
        self, text: str, token_ids: list[int], positions: Sequence[Sequence[TokenLogprob]] | None, *, last: bool
    ) -> Any:
        """The stream choice of one text delta (``last``: the text stage's final one), or None
        when vLLM sends no chunk for it."""
        from vllm.entrypoints.generate.base.protocol import DeltaMessage
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionResponseStreamChoice

        logprobs = self.logprobs(token_ids, positions)
        if not text and not token_ids and not self.num_tokens and not last:
            return None
        message = self._parse_delta(text, token_ids, last)
        self.num_tokens += len(token_ids)
        if message is None:
            if logprobs is None and not self.req.return_token_ids:
                return None
            message = DeltaMessage()
        return self._filtered(
            ChatCompletionResponseStreamChoice(
                index=0,
                delta=message,
                logprobs=logprobs,
                finish_reason=None,
                token_ids=list(token_ids) if self.req.return_token_ids else None,
            )
        )

    def finish(self, finish_reason: str, stop_reason: int | str | None) -> Any:
        """The stream's finishing choice (the text stage's last delta was sent before it)."""
        from vllm.entrypoints.generate.base.protocol import DeltaMessage
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionResponseStreamChoice

        message = DeltaMessage()
        if not self._parsed_last:  # the text stage's last output had no new text or tokens
            message = self._parse_delta("", [], True) or message
        if self._tools_streamed and not self._named and finish_reason == "stop":
            finish_reason = "tool_calls"
        return self._filtered(
            ChatCompletionResponseStreamChoice(
                index=0, delta=message, logprobs=None, finish_reason=finish_reason or "stop", stop_reason=stop_reason
            )
        )

    def _parse_delta(self, text: str, token_ids: list[int], last: bool) -> Any:
        from vllm.entrypoints.generate.base.protocol import DeltaMessage

        self._parsed_last = self._parsed_last or last
        if self.parser is None:
            # No chunk for tokens without text yet (bytes held back until they form UTF-8): every
            # chunk carries text, tool calls, logprobs or token ids.
            return DeltaMessage(content=text) if text else None
        message = self.parser.parse_delta(
            delta_text=text,
            delta_token_ids=list(token_ids),
            request=self.req,
            prompt_token_ids=self._prompt_token_ids,
            finished=last,
        )
        if message is not None and message.tool_calls:
            self._tools_streamed = True
        return message

    def _filtered(self, choice: Any) -> Any:
        from vllm.entrypoints.serve.utils.tool_calls_utils import maybe_filter_parallel_tool_calls

        return maybe_filter_parallel_tool_calls(choice, self.req)

    # ---- whole -------------------------------------------------------------------------------
    def choice(
        self,
        text: str,
        token_ids: list[int],
        positions: Sequence[Sequence[TokenLogprob]] | None,
        finish_reason: str,
        stop_reason: int | str | None,
        audio: Any = None,
    ) -> Any:
        """The whole answer's choice (``audio``: its ``message.audio``, OpenAI's type)."""
        from vllm.entrypoints.generate.base.protocol import ToolCall
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionResponseChoice, ChatMessage
        from vllm.renderers.chat_utils import make_tool_call_id

        content, tool_calls = text, []
        if self.parser is not None:
            _, content, tool_calls = self.parser.parse(
                text, self.req, enable_auto_tools=True, model_output_token_ids=token_ids
            )
        calls = [ToolCall(id=tc.id or make_tool_call_id(), function=tc) for tc in tool_calls or []]
        auto_called = False
        if self._named or self._required:
            message = ChatMessage(role="assistant", content=content or "", tool_calls=calls)
        elif self.req.tools and self.req.tool_choice in ("auto", None) and calls:
            auto_called = True
            message = ChatMessage(role="assistant", content=content, tool_calls=calls)
        else:
            message = ChatMessage(role="assistant", content=content)
        message.audio = audio
        if auto_called or (self._required and finish_reason == "stop"):
            finish_reason = "tool_calls"
        return self._filtered(
            ChatCompletionResponseChoice(
                index=0,
                message=message,
                logprobs=self.logprobs(token_ids, positions),
                finish_reason=finish_reason or "stop",
                stop_reason=stop_reason,
                token_ids=list(token_ids) if self.req.return_token_ids else None,
            )
        )
