"""One request's events as an OpenAI chat answer: SSE chunks (streamed) or one message (not), in
vLLM's response types, its choice written by :class:`~omni_cache.serving.chat_output.ChoiceWriter`.

Both forms are built from the same events by the same rules, so the text of a streamed answer is
exactly the text of the same answer not streamed:

* the text is the concatenation of the text stage's deltas, as its detokenizer wrote them (vLLM's
  incremental detokenizer holds back bytes that do not yet form valid UTF-8 and writes U+FFFD for
  invalid ones once later text follows; bytes still held back when the answer ends are not text;
  with stop strings it holds back what may still become one and cuts the text before it); there
  is no second decoding of the token ids;
* a delta that vLLM's server would not send (no new text or tool call, no log-probabilities, no
  token ids asked for) sends no chunk.

Streams send nothing before the first real content: the first chunk carries the first text (or
the first audio, when audio comes first) with ``role: "assistant"`` in the same delta. Load
generators such as ``vllm bench serve`` time the first chunk that has ``choices`` as the first
token; a role-only chunk sent on acceptance (as ``vllm serve`` sends) would make that time
meaningless.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from starlette.requests import Request

from omni_cache.pcm import PcmStream
from omni_cache.runtime.request_path.results import (
    AudioDelta,
    Completed,
    Failed,
    RequestError,
    RequestHandle,
    TextDelta,
)
from omni_cache.serving.chat_output import ChoiceWriter
from omni_cache.wire.messages import TokenLogprob

__all__ = ["Answer", "collect_answer", "collect_unless_disconnected", "sse", "stream_chunks", "usage"]


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n"


def usage(prompt_tokens: int, completion_tokens: int, cached: int) -> Any:
    """vLLM's ``UsageInfo``; ``prompt_tokens_details.cached_tokens``: the prompt tokens the
    thinker's prefix cache served."""
    from vllm.entrypoints.serve.engine.protocol import PromptTokenUsageInfo, UsageInfo

    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokenUsageInfo(cached_tokens=cached),
    )


@dataclass
class Answer:
    """A whole answer, from the same events a stream is made of."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    #: Per token, its log-probabilities (empty when none were asked for).
    logprobs: list[list[TokenLogprob]] = field(default_factory=list)
    audio: list[np.ndarray] = field(default_factory=list)
    sample_rate: int = 0
    completed: Completed | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def samples(self) -> np.ndarray:
        return np.concatenate(self.audio) if self.audio else np.zeros(0, np.float32)


async def collect_answer(handle: RequestHandle) -> Answer:
    """Every event of ``handle`` into one :class:`Answer`; raises the request's RequestError."""
    answer, texts = Answer(), []
    try:
        async for event in handle.events():
            if isinstance(event, TextDelta):
                texts.append(event.text)
                answer.token_ids.extend(event.token_ids)
                answer.logprobs.extend(event.logprobs or [])
            elif isinstance(event, AudioDelta):
                answer.audio.append(event.audio)
                answer.sample_rate = event.sample_rate
            elif isinstance(event, Failed):
                raise event.error
            elif isinstance(event, Completed):
                answer.completed = event
    finally:
        if not handle.done:
            handle.abort("the caller stopped waiting")
    if answer.completed is None:
        raise RequestError(500, "request ended without a result", request_id=handle.request_id)
    answer.text = "".join(texts)
    return answer


async def collect_unless_disconnected(handle: RequestHandle, request: Request) -> Answer:
    """:func:`collect_answer`, aborting the request if the HTTP client goes away first."""
    task = asyncio.ensure_future(collect_answer(handle))
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.5)
            if done:
                return task.result()
            if await request.is_disconnected():
                handle.abort("the client disconnected")
                return await task  # raises the 499 RequestError
    finally:
        if not task.done():
            task.cancel()
            handle.abort("the request handler was cancelled")


async def _called_here(fn: Callable[..., Any], *args: Any) -> Any:
    return fn(*args)


@dataclass
class StreamOptions:
    """What a stream adds besides its choices (vLLM's ``stream_options``, ``return_token_ids``)."""

    include_usage: bool = False
    continuous_usage: bool = False  # usage on every chunk (continuous_usage_stats)
    #: The prompt's token ids on the first chunk, media placeholders expanded as vLLM's engine
    #: saw them (the chunk goes out after the entry stage's first output, which says).
    return_token_ids: bool = False


async def stream_chunks(
    handle: RequestHandle,
    base: dict[str, Any],
    writer: ChoiceWriter,
    *,
    entry_stage: str,
    options: StreamOptions,
    error_body: Callable[[RequestError], dict[str, Any]],
    parse: Callable[..., Awaitable[Any]] | None = None,
) -> AsyncIterator[str]:
    """The SSE lines of a streamed answer, ending with ``data: [DONE]``.

    ``base`` holds the fields every chunk repeats (id, created, model). Audio deltas are base64
    ``pcm16`` (24 kHz mono 16-bit little-endian), resampled by one stream for the whole answer;
    what its filter still holds goes out before the finishing chunk.
    """
    from vllm.entrypoints.generate.base.protocol import DeltaMessage
    from vllm.entrypoints.openai.chat_completion.protocol import (
        ChatCompletionResponseStreamChoice,
        ChatCompletionStreamResponse,
    )

    parse = parse or _called_here
    audio_id = f"audio_{handle.request_id}"
    pcm_stream = PcmStream()
    sent_first = False
    prompt_tokens = len(handle.prompt_token_ids)

    def chunk(choice: Any) -> str:
        nonlocal sent_first
        response = ChatCompletionStreamResponse(**base, choices=[choice])
        if not sent_first:
            choice.delta.role = "assistant"
            if options.return_token_ids:
                response.prompt_token_ids = handle.engine_prompt_token_ids
            sent_first = True
        if options.continuous_usage:
            response.usage = usage(prompt_tokens, writer.num_tokens, 0)
            response.usage.prompt_tokens_details = None
        return f"data: {response.model_dump_json(exclude_unset=True)}\n\n"

    def audio(pcm: bytes) -> str:
        delta = DeltaMessage(audio={"id": audio_id, "data": base64.b64encode(pcm).decode("ascii"), "transcript": ""})
        return chunk(ChatCompletionResponseStreamChoice(index=0, delta=delta, logprobs=None, finish_reason=None))

    try:
        async for event in handle.events():
            if isinstance(event, TextDelta):
                prompt_tokens = event.num_prompt_tokens or prompt_tokens
                delta = functools.partial(writer.delta, last=event.last)
                choice = await parse(delta, event.text, event.token_ids, event.logprobs)
                if choice is not None:
                    yield chunk(choice)
            elif isinstance(event, AudioDelta):
                pcm = pcm_stream.chunk(event.audio, event.sample_rate)
                if pcm:
                    yield audio(pcm)
            elif isinstance(event, Completed):
                tail = pcm_stream.flush()
                if tail:
                    yield audio(tail)
                prompt_tokens = event.num_prompt_tokens
                yield chunk(await parse(writer.finish, event.finish_reason, event.stop_reason))
                if options.include_usage:
                    final = ChatCompletionStreamResponse(
                        **base,
                        choices=[],
                        usage=usage(
                            event.num_prompt_tokens, writer.num_tokens, event.cached_tokens.get(entry_stage, 0)
                        ),
                    )
                    yield f"data: {final.model_dump_json(exclude_unset=True, exclude_none=True)}\n\n"
            elif isinstance(event, Failed):
                yield sse(error_body(event.error))
        yield "data: [DONE]\n\n"
    finally:
        if not handle.done:
            handle.abort("the client disconnected from the stream")
