"""Offline Python API: run a whole pipeline from one process, no HTTP.

::

    from omni_cache import Pipeline

    with Pipeline.from_config("stage_configs/tiny_omni.yaml") as pipe:
        results = pipe.generate(["Hello!", "Tell me a story."], max_tokens=32)
        print(results[0].text, results[0].audio.shape, results[0].sample_rate)
        print(results[1].cached_tokens)          # {"thinker": ..., "talker": ..., "decoder": 0}
        print(pipe.stats()["thinker"])           # the stage's counters

The stage processes are the same ones ``omni-serve`` starts, run by the same
:class:`~omni_cache.runtime.orchestrator.Orchestrator`, whose asyncio loop runs in a background thread.
"""

from __future__ import annotations

import asyncio
import atexit
import os
import threading
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

from omni_cache.config import PipelineConfig, load_config
from omni_cache.runtime.orchestrator import Orchestrator
from omni_cache.runtime.request_path.results import GenerationResult, RequestError

__all__ = ["GenerationError", "GenerationResult", "Pipeline"]

_ALL = object()  # generate()'s default modalities: every output the pipeline has


class GenerationError(RuntimeError):
    """Some requests of one ``generate`` call failed.

    ``errors``: index -> :class:`RequestError`; ``results``: the per-prompt results (None where
    the request failed).
    """

    def __init__(self, errors: dict[int, RequestError], results: list[GenerationResult | None]):
        first = next(iter(errors.items()))
        super().__init__(
            f"{len(errors)} of {len(results)} request(s) failed; prompt {first[0]}: "
            f"({first[1].status}) {first[1].message}"
        )
        self.errors = errors
        self.results = results


def _normalize_prompts(prompts: Any) -> list[Any]:
    """A list of prompts, each a str, a list of chat messages or a list of token ids."""
    if isinstance(prompts, (str, Mapping)):
        return [prompts] if isinstance(prompts, str) else [[prompts]]
    prompts = list(prompts)
    if prompts and all(isinstance(p, int) for p in prompts):
        return [prompts]  # one prompt given as token ids
    if prompts and all(isinstance(p, Mapping) for p in prompts):
        return [prompts]  # one conversation
    return prompts


class Pipeline:
    """A running pipeline (stage processes + orchestrator); a context manager.

    Build it with :meth:`from_config`, which starts the stages and returns once every stage is
    ready. ``close()`` (or leaving the ``with`` block) stops them.
    """

    def __init__(
        self,
        config: PipelineConfig,
        *,
        prefix_cache: bool = True,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        **orchestrator_kwargs: Any,
    ) -> None:
        self.orchestrator = Orchestrator(
            config, checkpoint_dir=checkpoint_dir, prefix_cache=prefix_cache, **orchestrator_kwargs
        )
        #: The config it runs: ``config`` with the overrides applied (a copy).
        self.config = self.orchestrator.config
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="omni-cache-pipeline", daemon=True)
        self._started = False
        self._closed = False

    @classmethod
    def from_config(
        cls,
        path: str | os.PathLike[str] | PipelineConfig,
        prefix_cache: bool = True,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        **orchestrator_kwargs: Any,
    ) -> Pipeline:
        """Load (and validate) a stage config, start its stage processes, wait until they are
        ready. ``path`` may also be an already loaded :class:`PipelineConfig`.

        ``prefix_cache=False`` turns prefix caching off in every stage; ``checkpoint_dir``
        overrides where tiny checkpoints are generated. Other keyword arguments go to
        :class:`~omni_cache.runtime.orchestrator.Orchestrator` (e.g. ``start_timeout_s``,
        ``echo_stage_logs``).
        """
        config = path if isinstance(path, PipelineConfig) else load_config(path)
        pipe = cls(config, prefix_cache=prefix_cache, checkpoint_dir=checkpoint_dir, **orchestrator_kwargs)
        pipe.start()
        return pipe

    # ---- lifecycle -------------------------------------------------------------------------------

    def _run(self, coro: Any, timeout: float | None = None) -> Any:
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout)
        except BaseException:
            future.cancel()
            raise

    def start(self) -> Pipeline:
        """Start the stage processes and wait until every stage is ready."""
        if self._started:
            return self
        self._started = True
        self._thread.start()
        try:
            self._run(self.orchestrator.start())
        except BaseException:
            self._stop_loop()
            raise
        _live.add(self)
        return self

    def close(self) -> None:
        """Stop every stage process (Shutdown, then SIGTERM, then SIGKILL). Idempotent."""
        if self._closed or not self._started:
            self._closed = True
            return
        self._closed = True
        try:
            if self._loop.is_running():
                self._run(self.orchestrator.close(), timeout=60)
        except BaseException:
            self.orchestrator.kill_all_sync()
            raise
        finally:
            self._stop_loop()
            _live.discard(self)

    def _stop_loop(self) -> None:
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        if not self._loop.is_running():
            self._loop.close()

    def __enter__(self) -> Pipeline:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- use -------------------------------------------------------------------------------------

    def tokenize(self, prompt: str | Sequence[Mapping[str, Any]]) -> list[int]:
        """A prompt's token ids as the pipeline sees them (a string is one user message)."""
        if isinstance(prompt, str):
            prompt = [{"role": "user", "content": prompt}]
        return self.orchestrator.tokenize_messages(prompt)

    def generate(
        self,
        prompts: Any,
        *,
        max_tokens: int | None = None,
        temperature: float = 0.0,
        top_p: float | None = None,
        seed: int | None = None,
        modalities: Sequence[str] | Any = _ALL,
        return_latents: bool = False,
        timeout_s: float | None = None,
        media: Sequence[Sequence[Any]] | None = None,
        stream: bool = False,
        voice: str = "",
        prefill_only: bool = False,
    ) -> list[GenerationResult]:
        """Run prompts through the pipeline; one :class:`GenerationResult` per prompt, in order.

        A prompt is a string (one user message, through the chat template), a list of chat
        messages (``{"role", "content"}`` dicts) or a list of token ids (used as is). All prompts
        are submitted together, so the stages batch them (when the server's bounds on what is in
        flight are reached, the next prompt waits until one of these ended). ``modalities`` defaults to every
        output the pipeline has (``("text", "audio")`` for the default pipelines).
        ``return_latents`` adds the thinker's latents (name -> tensor, one row per token: prompt
        and generated), and a later autoregressive stage's as ``"<stage>.<name>"`` (Qwen3-Omni's
        talker: ``"talker.codes"``, every codebook, [num_code_groups, steps]; a one-codebook
        talker's codes are its token ids, ``"talker.token_ids"``, its end-of-speech id included).
        ``max_tokens=None`` uses the thinker's configured default. ``media``: per prompt, the
        decoded images and clips (``omni_cache.serving.media.MediaItem``) for its placeholders.
        ``stream=True`` submits them as answers a client streams (``Submit.stream``): stages with
        ``pacing`` then pace their audio to playback, as for an HTTP client with ``"stream":
        true``; the results are still whole answers. ``voice``: the speaker of the spoken answers,
        one of ``pipeline.orchestrator.voices`` ("" or ``default``: the checkpoint's default).
        ``prefill_only=True``: the prompts are only taken into the stages' prefix caches, as a
        realtime session listening to its user does (``Orchestrator.submit``'s ``prefill_only``).

        Raises :class:`GenerationError` if any request failed (after all of them ended).
        """
        if self._closed or not self._started:
            raise RuntimeError("the pipeline is not running")
        if modalities is _ALL:
            modalities = ("text", "audio") if self.orchestrator.topology.audio_stage is not None else ("text",)
        items = _normalize_prompts(prompts)
        token_lists = []
        for i, p in enumerate(items):
            if isinstance(p, str) or (isinstance(p, Sequence) and p and isinstance(p[0], Mapping)):
                token_lists.append(self.tokenize(p))
            elif isinstance(p, Sequence) and all(isinstance(t, int) for t in p):
                token_lists.append(list(p))
            else:
                raise TypeError(
                    f"prompt {i}: expected a str, a list of chat messages or a list of "
                    f"token ids, got {type(p).__name__}"
                )
        if media is not None and len(media) != len(token_lists):
            raise ValueError(f"media: {len(media)} lists for {len(token_lists)} prompts")
        kwargs = dict(
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            seed=seed,
            modalities=tuple(modalities),
            return_latents=return_latents,
            timeout_s=timeout_s,
            stream=stream,
            voice=_checked_voice(voice, self.orchestrator.voices),
            prefill_only=prefill_only,
        )
        outcomes = self._run(self._generate(token_lists, kwargs, media))
        errors = {i: o for i, o in enumerate(outcomes) if isinstance(o, BaseException)}
        if errors:
            for e in errors.values():
                if not isinstance(e, RequestError):
                    raise e
            results = [None if isinstance(o, BaseException) else o for o in outcomes]
            raise GenerationError(errors, results)  # type: ignore[arg-type]
        return outcomes

    async def _generate(
        self, token_lists: list[list[int]], kwargs: dict[str, Any], media: Sequence[Sequence[Any]] | None = None
    ) -> list[Any]:
        orch = self.orchestrator
        handles: list[Any] = []
        results: list[asyncio.Future] = []  # each accepted request's result, as it is awaited
        try:
            for i, ids in enumerate(token_lists):
                items = tuple(media[i]) if media is not None else ()
                while True:
                    try:
                        handles.append(await orch.submit(ids, media=items, **kwargs))
                        results.append(asyncio.ensure_future(handles[-1].result()))
                        break
                    except RequestError as e:
                        running = [r for r in results if not r.done()]
                        if e.status != 429 or not running:
                            handles.append(e)
                            break
                        # The server is full (server.max_requests_in_flight, or its media bound):
                        # one of these prompts' own requests ending makes room for the next.
                        await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            done = iter(await asyncio.gather(*results, return_exceptions=True))
            return [h if isinstance(h, RequestError) else next(done) for h in handles]
        except BaseException:
            for h in handles:
                if not isinstance(h, RequestError):
                    h.abort("generate() was interrupted")
            raise

    def stats(self, timeout: float = 1.0) -> dict[str, dict[str, float]]:
        """stage -> its counters (requests, errors, queue_depth, prefix_cache_queried_tokens,
        prefix_cache_hit_tokens, latent_rows_served, ...), plus ``up`` and ``restarts``."""
        snap = self._run(self.orchestrator.stage_stats(timeout))
        return {name: {**s.counters, "up": float(s.up), "restarts": float(s.restarts)} for name, s in snap.items()}

    def health(self) -> dict[str, str]:
        """stage -> why it is not serving, for the stages that are not (empty: all up)."""
        return self.orchestrator.not_ready()


_live: weakref.WeakSet[Pipeline] = weakref.WeakSet()


@atexit.register
def _close_forgotten() -> None:
    # A pipeline nobody closed must not leave stage processes behind.
    for pipe in list(_live):
        try:
            pipe.orchestrator.kill_all_sync()
        except Exception:  # noqa: BLE001
            pass


def _checked_voice(voice: str, voices: tuple[str, ...]) -> str:
    """The voice as the stages take it ("" = the default), or ValueError naming the valid ones."""
    if voice and voice.lower() not in voices:
        raise ValueError(f"voice {voice!r} is not available; this pipeline speaks with {', '.join(voices)}")
    return "" if not voice or voice.lower() == "default" else voice.lower()
