"""One response of a realtime session: the conversation submitted to the pipeline, its answer
streamed back as the Realtime API's response events, and its cancellation.

Events, in the order the API sends them: ``response.created``, ``response.output_item.added``,
``conversation.item.added``, ``response.content_part.added``; then per answer chunk
``response.output_audio.delta`` (audio, in the session's output format) and
``response.output_audio_transcript.delta`` (its text), or ``response.output_text.delta`` for a
text response; then ``response.output_audio.done`` / ``..._transcript.done`` (or
``response.output_text.done``), ``response.content_part.done``, ``response.output_item.done``,
``conversation.item.done`` and ``response.done`` with the usage (``cached_tokens``: prompt tokens
the thinker's prefix cache served). A cancelled response sends nothing after its cancellation
but these closing events (status ``cancelled``); the pipeline request is aborted at once.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from omni_cache.runtime.request_path.results import AudioDelta, Completed, Failed, RequestError, TextDelta
from omni_cache.serving.realtime import listening
from omni_cache.serving.realtime.audio_codecs import AudioFormat, StreamResampler
from omni_cache.serving.realtime.conversation import Item
from omni_cache.serving.realtime.conversation_bounds import Prompt
from omni_cache.serving.realtime.protocol import make_event, new_id
from omni_cache.tasks import cancel_and_wait

logger = logging.getLogger("omni_cache.serving.realtime")

__all__ = ["ResponseOptions", "ResponseRun"]


@dataclass(frozen=True)
class ResponseOptions:
    modality: str  # "audio" (speech and its transcript) | "text"
    max_tokens: int | None
    instructions: str
    output_format: AudioFormat
    metadata: dict[str, str] | None = None
    voice: str = "default"  # the session's, or the response's own ``audio.output.voice``

    @property
    def pipeline_modalities(self) -> tuple[str, ...]:
        return ("text", "audio") if self.modality == "audio" else ("text",)


class ResponseRun:
    """Streams one response; ``send`` queues a server event on the session's socket."""

    def __init__(
        self,
        pipeline: Any,
        send: Callable[[Any], None],
        item: Item,
        options: ResponseOptions,
        prompt: Callable[[], Awaitable[Prompt]],
        *,
        pace: float | None,
        received_at: float,
        session_id: str,
        on_prompt: Callable[[list[Item]], None] = lambda dropped: None,
        watch: Callable[[Callable[[], None], Callable[[], None]], Any] | None = None,
    ) -> None:
        self.id = new_id("resp")
        # The client's connection, watched while this response streams: a client that takes
        # none of it has its request held at the stages until it takes again.
        self._watch = watch
        self._client_held = False
        self.session_id = session_id
        self.pipeline, self.send, self.item, self.options = pipeline, send, item, options
        # The session's prompt of the conversation (truncated to the thinker's limits), and what
        # it is told of the turns truncation dropped.
        self._make_prompt, self._on_prompt = prompt, on_prompt
        self.prompt: Prompt | None = None
        self.pace = pace  # the session's measured ms per token (conversation.SpokenText)
        self.received_at = received_at
        self.status = "in_progress"
        self.reason: str | None = None
        self.error: RequestError | None = None
        self.usage: Any = None
        self.handle: Any = None
        self.done = False
        self.first_audio_at: float | None = None
        self._resampler: StreamResampler | None = None
        self._starting = False  # counted in listening.STARTING: submitted, no first delta yet

    @property
    def audio(self) -> bool:
        return self.options.modality == "audio"

    # ---- control ---------------------------------------------------------------------------------

    def cancel(self, reason: str, *, truncate: bool) -> None:
        """Stop now: nothing more is sent but the closing events. ``truncate``: the item keeps
        only the text of the audio already sent (barge-in: what the user heard)."""
        if self.done or self.reason is not None:
            return
        self.status, self.reason = "cancelled", reason
        if truncate and self.audio:
            self.truncate(self.item.sent_audio_ms)
        if self.handle is not None and not self.handle.done:
            self.handle.abort(f"realtime response cancelled ({reason})")

    def truncate(self, audio_end_ms: float) -> None:
        """Keep the audio up to ``audio_end_ms`` and the text spoken in it."""
        spoken = self.item.spoken
        self.item.audio_end_ms = audio_end_ms
        self.item.content[0].text = spoken.heard(audio_end_ms, self.pace)

    # ---- the stream ------------------------------------------------------------------------------

    async def run(self) -> None:
        from openai.types.realtime import (
            ConversationItemAdded,
            ResponseContentPartAddedEvent,
            ResponseCreatedEvent,
            ResponseOutputItemAddedEvent,
        )

        self.send(make_event(ResponseCreatedEvent, response=self._sdk()))
        self.send(make_event(ResponseOutputItemAddedEvent, response_id=self.id, output_index=0, item=self.item.sdk()))
        self.send(make_event(ConversationItemAdded, item=self.item.sdk()))
        self.send(
            make_event(
                ResponseContentPartAddedEvent,
                response_id=self.id,
                item_id=self.item.id,
                output_index=0,
                content_index=0,
                part=self._part(),
            )
        )
        watching = (
            asyncio.ensure_future(self._watch(lambda: self._hold(True), lambda: self._hold(False)).stalled())
            if self._watch is not None
            else None
        )
        try:
            await self._stream()
        except RequestError as e:  # refused (context length, a stage down) or failed in a stage
            self.status, self.error = "failed", e
        except Exception as e:  # noqa: BLE001 -- e.g. a chat template refusing the conversation
            logger.exception("realtime response %s failed", self.id)
            self.status, self.error = "failed", RequestError(500, f"{type(e).__name__}: {e}")
        finally:
            await cancel_and_wait(watching)
            if self.handle is not None and not self.handle.done:
                self.handle.abort("the realtime session stopped waiting")
            if self._starting:
                self._settled()
            self._finish()

    async def _stream(self) -> None:
        self.prompt = prompt = await self._make_prompt()
        self._on_prompt(prompt.dropped)
        if self.reason is not None:
            return
        # The session holds the prompt's media in the server's bounds already: the request's
        # place does not reserve them again.
        ticket = self.pipeline.admission.enter()
        ticket.prepaid = sum(m.array.nbytes for m in prompt.media)
        # session_id: every turn of a session goes to the replicas that hold its prefix (prompts
        # with media are not prefix-hashed, so prefix routing alone cannot follow them).
        # stream: the client plays the audio deltas as they come, so stages pace them to playback.
        self.handle = await self.pipeline.submit(
            prompt.token_ids,
            max_tokens=self.options.max_tokens,
            modalities=self.options.pipeline_modalities,
            media=prompt.media,
            received_at=self.received_at,
            session_id=self.session_id,
            ticket=ticket,
            stream=True,
            voice=self.options.voice,
        )
        if self.reason is not None:
            self.handle.abort(f"realtime response cancelled ({self.reason})")
        elif self._client_held:  # its client stopped taking events before the request existed
            self.handle.hold(True)
        listening.answer_starting(self.pipeline)  # listening requests wait for its first delta
        self._starting = True
        async for ev in self.handle.events():
            if self.reason is not None:
                return
            if self._starting and (isinstance(ev, AudioDelta) or (isinstance(ev, TextDelta) and not self.audio)):
                self._settled()
            if isinstance(ev, TextDelta):
                self._on_text(ev)
            elif isinstance(ev, AudioDelta):
                self._on_audio(ev.audio, ev.sample_rate)
            elif isinstance(ev, Completed):
                self._on_completed(ev)
            elif isinstance(ev, Failed):
                raise ev.error

    def _hold(self, held: bool) -> None:
        """Its client takes none of the events sent (``held``) or takes again: the request's
        stages hold its work meanwhile (scheduler/client_hold.py)."""
        self._client_held = held
        if self.handle is not None and not self.handle.done:
            self.handle.hold(held)

    def _settled(self) -> None:
        self._starting = False
        listening.answer_settled(self.pipeline)

    def _on_text(self, ev: TextDelta) -> None:
        from openai.types.realtime import ResponseAudioTranscriptDeltaEvent, ResponseTextDeltaEvent

        self.item.spoken.add_text(ev.text, len(ev.token_ids))
        self.item.content[0].text = self.item.spoken.text
        if ev.text:
            cls = ResponseAudioTranscriptDeltaEvent if self.audio else ResponseTextDeltaEvent
            self.send(
                make_event(
                    cls, response_id=self.id, item_id=self.item.id, output_index=0, content_index=0, delta=ev.text
                )
            )

    def _on_audio(self, samples: Any, rate: int, last: bool = False) -> None:
        from openai.types.realtime import ResponseAudioDeltaEvent

        if not self.audio:
            return
        fmt = self.options.output_format
        if self._resampler is None:
            self._resampler = StreamResampler(rate, fmt.rate)
        out = self._resampler(samples, last=last)
        if not len(out):
            return
        if self.first_audio_at is None:
            self.first_audio_at = time.monotonic()
        self.item.spoken.audio_ms += len(out) * 1000 / fmt.rate
        self.send(
            make_event(
                ResponseAudioDeltaEvent,
                response_id=self.id,
                item_id=self.item.id,
                output_index=0,
                content_index=0,
                delta=base64.b64encode(fmt.encode(out)).decode("ascii"),
            )
        )

    def _on_completed(self, ev: Completed) -> None:
        from openai.types.realtime import RealtimeResponseUsage
        from openai.types.realtime.realtime_response_usage_input_token_details import (
            RealtimeResponseUsageInputTokenDetails,
        )
        from openai.types.realtime.realtime_response_usage_output_token_details import (
            RealtimeResponseUsageOutputTokenDetails,
        )

        if self._resampler is not None:  # the resampler's tail
            self._on_audio(np.zeros(0, np.float32), self._resampler.in_rate, last=True)
        self.item.spoken.finished = True
        cached = ev.cached_tokens.get(self.pipeline.topology.entry.name, 0)
        out_tokens = self.item.spoken.tokens
        self.usage = RealtimeResponseUsage(
            input_tokens=ev.num_prompt_tokens,
            output_tokens=out_tokens,
            total_tokens=ev.num_prompt_tokens + out_tokens,
            input_token_details=RealtimeResponseUsageInputTokenDetails(cached_tokens=cached),
            output_token_details=RealtimeResponseUsageOutputTokenDetails(text_tokens=out_tokens),
        )
        self.status = "completed" if ev.finish_reason != "length" else "incomplete"
        if ev.finish_reason == "length":
            self.reason = "max_output_tokens"

    def _finish(self) -> None:
        from openai.types.realtime import (
            ConversationItemDone,
            ResponseAudioDoneEvent,
            ResponseAudioTranscriptDoneEvent,
            ResponseContentPartDoneEvent,
            ResponseDoneEvent,
            ResponseOutputItemDoneEvent,
            ResponseTextDoneEvent,
        )

        self.done = True
        self.item.status = "completed" if self.status == "completed" else "incomplete"
        part = self.item.content[0]
        if self.item.audio_end_ms is None:
            part.text = self.item.spoken.text
        ids = {"response_id": self.id, "item_id": self.item.id, "output_index": 0, "content_index": 0}
        if self.audio:
            self.send(make_event(ResponseAudioDoneEvent, **ids))
            self.send(make_event(ResponseAudioTranscriptDoneEvent, transcript=part.text, **ids))
        else:
            self.send(make_event(ResponseTextDoneEvent, text=part.text, **ids))
        self.send(make_event(ResponseContentPartDoneEvent, part=self._part(), **ids))
        self.send(make_event(ResponseOutputItemDoneEvent, response_id=self.id, output_index=0, item=self.item.sdk()))
        self.send(make_event(ConversationItemDone, item=self.item.sdk()))
        self.send(make_event(ResponseDoneEvent, response=self._sdk()))

    # ---- what the events carry -------------------------------------------------------------------

    def _part(self) -> dict[str, Any]:
        text = self.item.content[0].text
        return {"type": "audio", "transcript": text} if self.audio else {"type": "text", "text": text}

    def _sdk(self) -> Any:
        from openai.types.realtime import RealtimeResponse
        from openai.types.realtime.realtime_response_status import Error, RealtimeResponseStatus

        details = None
        if self.status != "in_progress":
            err = None
            if self.error is not None:
                err = Error(
                    type="invalid_request_error" if self.error.status < 500 else "server_error",
                    code=str(self.error.status),
                    message=self.error.message,
                )
            details = RealtimeResponseStatus(type=self.status, reason=_REASONS.get(self.reason or ""), error=err)
        return RealtimeResponse(
            id=self.id,
            object="realtime.response",
            status=self.status,
            status_details=details,
            output_modalities=[self.options.modality],
            max_output_tokens=self.options.max_tokens or "inf",
            metadata=self.options.metadata,
            output=[self.item.sdk()] if self.status != "in_progress" else [],
            usage=self.usage,
        )


# Our reasons -> the API's status_details.reason.
_REASONS = {
    "turn_detected": "turn_detected",
    "client_cancelled": "client_cancelled",
    "max_output_tokens": "max_output_tokens",
}
