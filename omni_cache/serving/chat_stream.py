"""One request's events as an OpenAI chat answer: SSE chunks (streamed) or one message (not).

Both forms are built from the same events by the same rule, so the text of a streamed answer is
exactly the text of the same answer not streamed:

* the text is the concatenation of the text stage's deltas, as its detokenizer wrote them (vLLM's
  incremental detokenizer holds back bytes that do not yet form valid UTF-8 and writes U+FFFD for
  invalid ones once later text follows; bytes still held back when the answer ends are not text);
  there is no second decoding of the token ids;
* a delta with no new text (bytes held back) sends no chunk.

Streams send nothing before the first real content: the first chunk carries the first text (or
the first audio, when audio comes first) with ``role: "assistant"`` in the same delta, as vLLM's
server does. Load generators such as ``vllm bench serve`` time the first chunk that has
``choices`` as the first token; a role-only chunk sent on acceptance would make that time
meaningless.
"""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from starlette.requests import Request

from omni_cache.runtime.results import AudioDelta, Completed, Failed, RequestError, RequestHandle, TextDelta
from omni_cache.serving.wav import PcmStream

__all__ = ["Answer", "collect_answer", "collect_unless_disconnected", "sse", "stream_chunks", "usage"]


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n"


def usage(prompt_tokens: int, completion_tokens: int, cached: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


@dataclass
class Answer:
    """A whole answer, from the same events a stream is made of."""

    text: str = ""
    num_tokens: int = 0
    audio: list[np.ndarray] = field(default_factory=list)
    sample_rate: int = 0
    completed: Completed | None = None

    def samples(self) -> np.ndarray:
        return np.concatenate(self.audio) if self.audio else np.zeros(0, np.float32)


async def collect_answer(handle: RequestHandle) -> Answer:
    """Every event of ``handle`` into one :class:`Answer`; raises the request's RequestError."""
    answer, texts = Answer(), []
    try:
        async for event in handle.events():
            if isinstance(event, TextDelta):
                texts.append(event.text)
                answer.num_tokens += len(event.token_ids)
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


async def stream_chunks(handle: RequestHandle, base: dict[str, Any], *, entry_stage: str,
                        include_usage: bool, error_body: Callable[[RequestError], dict[str, Any]]
                        ) -> AsyncIterator[str]:
    """The SSE lines of a streamed answer, ending with ``data: [DONE]``.

    ``base`` holds the fields every chunk repeats (id, object, created, model). Audio deltas are
    base64 ``pcm16`` (24 kHz mono 16-bit little-endian), resampled by one stream for the whole
    answer; what its filter still holds goes out before the finishing chunk.
    """
    audio_id = f"audio_{handle.request_id}"
    pcm_stream = PcmStream()
    sent_role = False
    completion_tokens = 0

    def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> str:
        nonlocal sent_role
        if not sent_role:
            delta = {"role": "assistant", **delta}
            sent_role = True
        return sse({**base, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                          "finish_reason": finish_reason}]})

    def audio(pcm: bytes) -> str:
        return chunk({"audio": {"id": audio_id, "data": base64.b64encode(pcm).decode("ascii"),
                                "transcript": ""}})

    try:
        async for event in handle.events():
            if isinstance(event, TextDelta):
                completion_tokens += len(event.token_ids)
                if event.text:
                    yield chunk({"content": event.text})
            elif isinstance(event, AudioDelta):
                pcm = pcm_stream.chunk(event.audio, event.sample_rate)
                if pcm:
                    yield audio(pcm)
            elif isinstance(event, Completed):
                tail = pcm_stream.flush()
                if tail:
                    yield audio(tail)
                yield chunk({}, event.finish_reason)
                if include_usage:
                    yield sse({**base, "choices": [], "usage": usage(
                        event.num_prompt_tokens, completion_tokens, event.cached_tokens.get(entry_stage, 0))})
            elif isinstance(event, Failed):
                yield sse(error_body(event.error))
        yield "data: [DONE]\n\n"
    finally:
        if not handle.done:
            handle.abort("the client disconnected from the stream")
