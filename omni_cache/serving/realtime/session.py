"""One realtime session's state and what each client event does to it.

The session owns its configuration (:mod:`.session_config`), input audio buffer
(:mod:`.input_buffer`), speech detector (:mod:`.vad`), conversation (:mod:`.conversation`) and at
most one response in flight (:mod:`.response`). It talks to the pipeline only through the
orchestrator's public face: ``tokenize_messages``, ``submit(..., media=, modalities=)``, the
handle's ``events()`` / ``abort()``, and ``audio_input_rate`` (the audio encoder's rate, what
input audio is resampled to).

Turn taking: with ``turn_detection: server_vad`` every append is scored by the input worker
(:mod:`.input_worker`, off the event loop, within a tick of its arrival); speech
start (``input_audio_buffer.speech_started``) cancels a response in flight when
``interrupt_response`` (barge-in: its assistant item keeps the text of the audio already sent),
and speech stop commits the speech (with ``prefix_padding_ms`` before it) as a user item and
starts a response when ``create_response``. With ``turn_detection: null`` the client commits
(``input_audio_buffer.commit``) and asks for responses (``response.create``) itself.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable
from typing import Any

from omni_cache.config.server_schema import RealtimeConfig
from omni_cache.serving.realtime import client_items, input_worker, listening, session_config, vad
from omni_cache.serving.realtime.conversation import Conversation, Item, ItemPart, SpokenText, audio_parts
from omni_cache.serving.realtime.conversation_bounds import ConversationBounds
from omni_cache.serving.realtime.input_buffer import InputAudioBuffer
from omni_cache.serving.realtime.protocol import EventError, error_event, make_event, new_id, refuse_unsupported
from omni_cache.serving.realtime.response import ResponseOptions, ResponseRun
from omni_cache.serving.realtime.session_config import SessionConfig
from omni_cache.tasks import wait_ended
from omni_cache.thread_pools import ThreadPools

__all__ = ["MIN_COMMIT_MS", "RealtimeSession"]

#: The shortest audio a commit takes (OpenAI's rule: less is an error).
MIN_COMMIT_MS = 100


class RealtimeSession:
    def __init__(
        self,
        pipeline: Any,
        send: Callable[[Any], None],
        *,
        limits: RealtimeConfig,
        served_model: str,
        threads: ThreadPools,
        images: client_items.ImageSource | None = None,
        watch: Callable[[Callable[[], None], Callable[[], None]], Any] | None = None,
    ) -> None:
        self.id = new_id("sess")
        # Watches the client's connection while a response streams (connection.serve_realtime).
        self.watch = watch
        self.pipeline, self.send = pipeline, send
        # The server's worker threads: client items read and decoded on its media threads, a
        # prompt's tokens counted on its request threads, large events parsed on its own.
        self.threads = threads
        self.served_model = served_model
        # How input_image parts are read and decoded (server.media's limits, the server's
        # decoded-item cache); None: images are refused.
        self.images = images
        self.config = SessionConfig()
        self.rate = int(pipeline.audio_input_rate)
        self.buffer = InputAudioBuffer(self.rate, limits.max_buffer_s)
        self.conversation = Conversation(limits.max_items)
        # Its share of the server's memory bound and the thinker's limits (truncation).
        self.bounds = ConversationBounds(
            pipeline, limits.max_items, limits.max_sessions, self.rate, limits.max_buffer_s, threads.request
        )
        # Input audio is decoded, resampled and scored for speech on the input worker's thread.
        self.audio_in = input_worker.InputStream(
            input_worker.shared(), self.config.input_format, self.rate, self._heard
        )
        self.speech_item_id: str | None = None  # the user item the speech in progress becomes
        self.response: ResponseRun | None = None
        self._response_task: asyncio.Task | None = None
        self.pace: float | None = None  # ms of audio per answer token, measured (SpokenText)
        # A turn's audio is cut at the thinker's audio-encoder windows (None: kept whole) and
        # prefilled window by window while it is spoken (issue 51).
        self.audio_window: int | None = getattr(pipeline, "audio_window_samples", None)
        self.listener = listening.Listener(
            self, self.audio_window, limits.listen_while_speaking, limits.max_listening_requests
        )

    @property
    def detector(self) -> vad.SpeechDetector | None:
        return self.audio_in.detector

    # ---- lifecycle -------------------------------------------------------------------------------

    async def open(self) -> None:
        from openai.types.realtime import SessionCreatedEvent

        self.bounds.open()  # EventError: no room for one more session's buffer
        self._configure_detector()
        self.send(make_event(SessionCreatedEvent, session=self._describe()))

    async def close(self) -> None:
        """Cancel the response in flight (its pipeline request is aborted) and wait for it."""
        self.audio_in.close()
        await self.listener.close()  # its request in flight aborted
        if self.response is not None:
            self.response.cancel("client_disconnected", truncate=False)
        if self._response_task is not None:
            await wait_ended([self._response_task])  # its failure logged; ours raised
        self.buffer.clear()
        self.conversation.items.clear()
        self.bounds.close()  # the session's bytes are free for others
        self.pipeline.end_session(self.id)  # its replicas are no longer kept for it

    @property
    def responding(self) -> bool:
        return self.response is not None and not self.response.done

    async def handle(self, event: Any) -> None:
        """Carry out one validated client event; EventError when it cannot be."""
        handler = getattr(self, "on_" + event.type.replace(".", "_"))
        if event.type != "input_audio_buffer.append":
            await self.audio_in.drained()  # every append before this event is in the buffer
        result = handler(event)
        if asyncio.iscoroutine(result):
            await result

    # ---- session ---------------------------------------------------------------------------------

    async def on_session_update(self, event: Any) -> None:
        from openai.types.realtime import SessionUpdatedEvent

        new = session_config.updated(self.config, event.session, self.served_model, self.pipeline.voices)
        old, self.config = self.config, new
        if new.input_format != old.input_format:
            self.audio_in.set_format(new.input_format)
        if new.turn_detection != old.turn_detection:
            self._configure_detector()
        self.send(make_event(SessionUpdatedEvent, session=self._describe()))

    def _configure_detector(self) -> None:
        td = self.config.turn_detection
        if td is None:
            self.audio_in.set_detector(None)
            self.speech_item_id = None
            return
        if self.detector is None:
            self.audio_in.set_detector(vad.SpeechDetector(td.threshold, td.silence_duration_ms))
        else:
            self.detector.configure(td.threshold, td.silence_duration_ms)

    def _describe(self) -> Any:
        return session_config.describe(self.config, self.served_model, self.id)

    # ---- input audio -----------------------------------------------------------------------------

    def on_input_audio_buffer_append(self, event: Any) -> None:
        # Only bytes move on the loop: the input worker decodes, resamples and scores the audio
        # in its thread, with every session's, and hands back what it heard (_heard), in order.
        self.buffer.check_room(self.audio_in.pending_samples + self.audio_in.bound(event.audio))
        self.audio_in.append(event.audio, event.event_id)

    async def _heard(self, heard: input_worker.Heard) -> None:
        for err, event_id in heard.errors:
            self.send(error_event(err, event_id))
        # Several appends may come at once: each event is taken where it happened in the audio
        # (a stop commits the speech up to it, not the next speech heard in the same tick).
        samples, done, base = heard.samples, 0, self.buffer.appended
        try:
            for ev in heard.events:
                cut = min(len(samples), max(done, ev.at_ms * self.rate // 1000 - base))
                self.buffer.append(samples[done:cut])
                done = cut
                if ev.kind == "start":
                    self._speech_started(ev.at_ms)
                    await self._barge_in_done()
                else:
                    self._speech_stopped(ev.at_ms)
            self.buffer.append(samples[done:])
        except EventError as e:  # check_room's bound is an estimate: a last guard
            self.send(error_event(e, None))
            return
        if heard.in_speech is False:
            self.buffer.keep_last(self.config.turn_detection.prefix_padding_ms)
        self.listener.poke()

    async def _barge_in_done(self) -> None:
        """When speech cancelled the response in flight, its response.done goes out before
        anything heard after the speech started (a stop heard in the same tick waits)."""
        task = self._response_task
        if task is not None and not task.done() and self.response.reason == "turn_detected":
            await asyncio.wait({task})  # not cancelled with this task (close() awaits it)

    def _speech_started(self, at_ms: int) -> None:
        from openai.types.realtime import InputAudioBufferSpeechStartedEvent

        td = self.config.turn_detection
        start_ms = max(self.buffer.start_ms, at_ms - td.prefix_padding_ms)
        self.listener.forget()  # nothing is listened to outside speech; a new turn starts here
        self.buffer.keep_last(self.buffer.end_ms - start_ms)
        self.speech_item_id = new_id("item")
        if td.interrupt_response and self.responding:
            self.response.cancel("turn_detected", truncate=True)  # barge-in
        self.send(make_event(InputAudioBufferSpeechStartedEvent, audio_start_ms=start_ms, item_id=self.speech_item_id))

    def _speech_stopped(self, at_ms: int) -> None:
        from openai.types.realtime import InputAudioBufferSpeechStoppedEvent

        item_id = self.speech_item_id or new_id("item")
        self.speech_item_id = None
        self.send(make_event(InputAudioBufferSpeechStoppedEvent, audio_end_ms=at_ms, item_id=item_id))
        try:
            self._commit(item_id)
        except EventError as e:  # no room for the speech (the session's bounds): said, not answered
            self.send(error_event(e, None))
            return
        if self.config.turn_detection.create_response and not self.responding:
            self._start_response(None)

    def on_input_audio_buffer_commit(self, event: Any) -> None:
        if self.buffer.duration_ms < MIN_COMMIT_MS:
            raise EventError(
                f"the input audio buffer holds {self.buffer.duration_ms} ms; a commit "
                f"needs at least {MIN_COMMIT_MS} ms of audio",
                code="input_audio_buffer_commit_empty",
            )
        item_id = self.speech_item_id or new_id("item")
        self.speech_item_id = None
        if self.detector is not None:
            self.detector.reset()
        self._commit(item_id)

    def _commit(self, item_id: str) -> None:
        from openai.types.realtime import ConversationItemAdded, ConversationItemDone, InputAudioBufferCommittedEvent

        # Room first (EventError keeps the buffer): a float32 sample is 4 bytes.
        dropped = self._room(self.buffer.size * 4)
        item = Item("user", audio_parts(self.buffer.take(), self.rate, self.audio_window), id=item_id)
        self.listener.turn_ended()
        previous = self._add(item, None, dropped)
        self.send(make_event(InputAudioBufferCommittedEvent, item_id=item.id, previous_item_id=previous))
        self.send(make_event(ConversationItemAdded, item=item.sdk(), previous_item_id=previous))
        self.send(make_event(ConversationItemDone, item=item.sdk(), previous_item_id=previous))

    def on_input_audio_buffer_clear(self, event: Any) -> None:
        from openai.types.realtime import InputAudioBufferClearedEvent

        self.listener.forget()  # what was prefilled of it is abandoned
        self.buffer.clear()
        self.speech_item_id = None
        if self.detector is not None:
            self.detector.reset()
        self.send(make_event(InputAudioBufferClearedEvent))

    def on_output_audio_buffer_clear(self, event: Any) -> None:
        raise EventError(
            "output_audio_buffer.clear is for WebRTC/SIP sessions; over WebSocket the "
            "client owns its playback buffer (use response.cancel and "
            "conversation.item.truncate)",
            param="type",
            code="unsupported",
        )

    # ---- conversation ----------------------------------------------------------------------------

    async def on_conversation_item_create(self, event: Any) -> None:
        from openai.types.realtime import ConversationItemAdded, ConversationItemDone

        # Read and checked first (images from their headers), room made for what decoding will
        # hold, then decoded: the bytes are in the server's bound before they exist.
        fmt = self.config.input_format
        if self.images is not None:  # its image URLs downloaded here, on the loop, not in the thread
            await self.images.fetch(client_items.image_urls(event.item))
        try:
            pending = await self.threads.media(client_items.read, event.item, fmt, self.rate, self.images)
        finally:
            if self.images is not None:
                self.images.forget()
        dropped = self._room(pending.nbytes)
        try:
            item = await self.threads.media(client_items.decode, pending, fmt, self.rate, self.images)
        except BaseException:
            self.bounds.done(self.conversation)  # the room is given back; nothing was dropped
            raise
        previous = self._add(item, event.previous_item_id, dropped)
        self.send(make_event(ConversationItemAdded, item=item.sdk(), previous_item_id=previous))
        self.send(make_event(ConversationItemDone, item=item.sdk(), previous_item_id=previous))

    def on_conversation_item_delete(self, event: Any) -> None:
        from openai.types.realtime import ConversationItemDeletedEvent

        if self.responding and self.response.item.id == event.item_id:
            raise EventError(
                "the item is being answered; cancel the response first", param="item_id", code="item_in_progress"
            )
        self.conversation.delete(event.item_id)
        self.bounds.settle(self.conversation)
        self.send(make_event(ConversationItemDeletedEvent, item_id=event.item_id))

    def on_conversation_item_retrieve(self, event: Any) -> None:
        from openai.types.realtime.realtime_server_event import ConversationItemRetrieved

        self.send(make_event(ConversationItemRetrieved, item=self.conversation.get(event.item_id).sdk()))

    def on_conversation_item_truncate(self, event: Any) -> None:
        from openai.types.realtime import ConversationItemTruncatedEvent

        item = self.conversation.get(event.item_id)
        if (
            item.role != "assistant"
            or item.spoken is None
            or not item.content
            or item.content[0].type != "output_audio"
        ):
            raise EventError(
                "only an assistant item with audio can be truncated", param="item_id", code="invalid_value"
            )
        if event.content_index != 0:
            raise EventError("the item's audio is content part 0", param="content_index", code="invalid_value")
        sent = item.audio_end_ms if item.audio_end_ms is not None else item.sent_audio_ms
        if not 0 <= event.audio_end_ms <= sent:
            raise EventError(
                f"audio_end_ms {event.audio_end_ms} is beyond the item's audio ({int(sent)} ms)",
                param="audio_end_ms",
                code="invalid_value",
            )
        run = self.response if self.responding and self.response.item is item else None
        if run is not None:
            run.cancel("client_cancelled", truncate=False)
        item.audio_end_ms = float(event.audio_end_ms)
        item.content[0].text = item.spoken.heard(event.audio_end_ms, self.pace)
        self.bounds.settle(self.conversation)
        self.send(
            make_event(
                ConversationItemTruncatedEvent, item_id=item.id, content_index=0, audio_end_ms=event.audio_end_ms
            )
        )

    # ---- responses -------------------------------------------------------------------------------

    def on_response_create(self, event: Any) -> None:
        self._start_response(event.response)

    def on_response_cancel(self, event: Any) -> None:
        if not self.responding:
            raise EventError("there is no response in progress to cancel", code="response_cancel_not_active")
        if event.response_id and event.response_id != self.response.id:
            raise EventError(
                f"response {event.response_id!r} is not in progress", param="response_id", code="invalid_value"
            )
        self.response.cancel("client_cancelled", truncate=False)

    def _options(self, params: Any) -> ResponseOptions:
        c = self.config
        modality, max_tokens, instructions = c.output_modalities[0], c.max_output_tokens, c.instructions
        fmt, metadata, voice = c.output_format, None, c.voice
        if params is not None:
            session_config.refuse_beta_fields(params, "response")
            session_config.refuse_tools_and_prompts(params, "response")
            refuse_unsupported(
                [
                    ("response.input", params.input is not None),
                    ("response.conversation", params.conversation not in (None, "auto")),
                ],
                "a response answers the session's conversation",
            )
            given = params.model_fields_set
            if params.output_modalities is not None:
                modality = session_config.output_modalities(params.output_modalities, "response.output_modalities")[0]
            if "max_output_tokens" in given:
                max_tokens = session_config.max_output_tokens(params.max_output_tokens, "response.max_output_tokens")
            if params.instructions is not None:
                instructions = params.instructions
            if params.audio is not None and params.audio.output is not None:
                out = params.audio.output
                voice = session_config.voice(out.voice, "response.audio.output.voice", self.pipeline.voices) or voice
                if "format" in out.model_fields_set:
                    fmt = session_config.audio_format(out.format, "response.audio.output.format")
            metadata = params.metadata
        return ResponseOptions(modality, max_tokens, instructions, fmt, metadata, voice)

    def _start_response(self, params: Any) -> None:
        if self.responding:
            raise EventError(
                f"response {self.response.id} is in progress; cancel it or wait for response.done",
                code="conversation_already_has_active_response",
            )
        options = self._options(params)
        if not any(i.role != "system" and i.message() is not None for i in self.conversation.items):
            raise EventError("the conversation has no user or assistant item to answer", code="conversation_empty")
        kind = "output_audio" if options.modality == "audio" else "output_text"
        item = Item("assistant", [ItemPart(kind)], status="in_progress", spoken=SpokenText())
        self._add(item, None, self._room(0))
        # The prompt: the conversation as it is now, fitted to the thinker's limits when the run
        # starts (truncation tokenizes it off the loop).
        prompt = functools.partial(
            self.bounds.fit,
            self.conversation.items[:-1],
            options.instructions,
            options.max_tokens,
            self.config.truncation,
        )
        self.response = run = ResponseRun(
            self.pipeline,
            self.send,
            item,
            options,
            prompt,
            pace=self.pace,
            received_at=time.monotonic(),
            session_id=self.id,
            on_prompt=self._drop,
            watch=self.watch,
        )
        self._response_task = asyncio.create_task(self._run(run), name=f"realtime-{run.id}")

    def _room(self, nbytes: int) -> list[Item]:
        """Room for one more item of ``nbytes``: the turns truncation drops for it; EventError
        when there is none (conversation_bounds). The answer in progress is never dropped."""
        keep = self.response.item if self.responding else None
        return self.bounds.make_room(self.conversation, nbytes, self.config.truncation, keep=keep)

    def _add(self, item: Item, previous_item_id: str | None, dropped: list[Item]) -> str | None:
        """Add ``item`` (after ``previous_item_id``) once the turns dropped for it are gone."""
        self._drop(dropped)
        try:
            return self.conversation.add(item, previous_item_id)
        finally:
            self.bounds.done(self.conversation)  # held as it is now, the item's room included

    def _drop(self, items: list[Item]) -> None:
        """Truncation: these oldest turns leave the conversation and the client is told."""
        from openai.types.realtime import ConversationItemDeletedEvent

        for item in self.conversation.drop(items):
            self.send(make_event(ConversationItemDeletedEvent, item_id=item.id))
        self.bounds.settle(self.conversation)

    async def _run(self, run: ResponseRun) -> None:
        await run.run()
        if run.usage is not None and run.prompt is not None:  # what its media expanded to
            self.bounds.learn(run.prompt.media, run.usage.input_tokens, len(run.prompt.token_ids))
        self.bounds.settle(self.conversation)  # its answer's text
        spoken = run.item.spoken
        if spoken.finished and run.audio and spoken.tokens and spoken.audio_ms:
            self.pace = spoken.audio_ms / spoken.tokens
