"""What each media item of a prompt becomes in the thinker's engine, learned from the thinker, so
the router can hash media prompts as vLLM does (omni_cache/runtime/routing/block_hashes.py).

vLLM hashes a media prompt over its *expanded* token ids: the thinker's multimodal processor
replaces each item's one placeholder token (``<|image_pad|>``, ``<|audio_pad|>``,
``<|video_pad|>``) by a run whose length depends on the item (an image's patch grid, a clip's
feature frames, a video's frames; with ``use_audio_in_video`` a video and its sound track share one
interleaved run), and keys the blocks over each run with the item's identifier (our content digest,
or vLLM's hash of it with the request's processor kwargs, e.g. a video's fps).

Design decision: the orchestrator does not compute the expansion; the thinker reports it. The
processor's counts depend on the model's processor config (resizing, patch and merge sizes, the
audio feature extractor, the interleaving of a video's sound track), and a copy of that logic in
the orchestrator would drift from the engine's the day a checkpoint or vLLM changes it, giving
hashes no replica ever holds. Instead the entry stage sends, with a media request's first output,
the prompt as its engine expanded it and each item's (modality, identifier, offset, length) as the
engine's request carries them (``MediaLayout``, workers/llm_stage.py). From that :meth:`learn`
keeps, per item, the run that replaced its placeholder and its identifier, after checking that
replacing the placeholders of the prompt the orchestrator sent by those runs gives exactly the
engine's prompt (else nothing is learned). A later prompt with the same item (same content digest,
same processor kwargs) is expanded from what was learned (:meth:`expand`) and hashed exactly.

What that leaves out: an item this orchestrator has not seen answered yet (its first request, or
the first after a restart) has no known run; such a prompt is hashed up to that item's placeholder
only (those blocks are exact: nothing before a run changes), which is all a replica can hold of it
anyway unless another orchestrator sent it there.
"""

from __future__ import annotations

import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from omni_cache.runtime.routing.block_hashes import MediaPosition

#: Items remembered (the least recently used are forgotten first). A run is stored at 4 bytes a
#: token: 4,096 items of 2,000 tokens (a long video) are 32 MiB.
MAX_ITEMS = 4096


@dataclass(frozen=True)
class MediaKey:
    """What decides an item's run and identifier: its content digest and kind, and the processor
    kwargs the thinker passes with the whole request (workers/engine_media.py: the first video's
    frame rate and ``use_audio_in_video``, which vLLM folds into every item's identifier)."""

    kind: str
    digest: str
    fps: float
    in_video: bool
    request_kwargs: tuple[float, bool] | None


def media_keys(media: Sequence[Any]) -> list[MediaKey]:
    """The keys of a request's media, in order: server MediaItems (``digest``) or the Submit's
    MediaRefs (``uuid``), which carry the same digest."""
    videos = [m for m in media if m.kind == "video"]
    kwargs = (float(videos[0].fps), any(m.in_video for m in media)) if videos else None
    return [
        MediaKey(m.kind, getattr(m, "digest", None) or getattr(m, "uuid", ""), float(m.fps), bool(m.in_video), kwargs)
        for m in media
    ]


@dataclass(frozen=True)
class Expansion:
    """One placeholder's replacement: the token it replaces, the run, and the items on the run
    as (identifier, offset in the run, length) in the engine's order."""

    placeholder: int
    run: array.array
    items: tuple[MediaPosition, ...]


@dataclass
class ExpandedPrompt:
    """A prompt as the engine will see it, as far as its items are known."""

    token_ids: list[int]
    media: list[MediaPosition]
    #: Every item was known: ``token_ids`` is the whole expanded prompt (else it stops where the
    #: first unknown item's run would start).
    complete: bool


def _groups(keys: Sequence[MediaKey]) -> list[tuple[MediaKey, ...]]:
    """Items by placeholder: a video's sound track (``in_video``) shares the video's run."""
    groups: list[list[MediaKey]] = []
    for key in keys:
        if key.in_video and groups and groups[-1][0].kind == "video":
            groups[-1].append(key)
        else:
            groups.append([key])
    return [tuple(g) for g in groups]


class MediaLayouts:
    def __init__(self, max_items: int = MAX_ITEMS) -> None:
        self._known: OrderedDict[tuple[MediaKey, ...], Expansion] = OrderedDict()
        self._max = max_items
        #: kind -> its placeholder token, as learned (an unknown item's placeholder is found by it)
        self._placeholders: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._known)

    def learn(
        self,
        prompt: Sequence[int],
        keys: Sequence[MediaKey],
        expanded: Sequence[int],
        spans: Sequence[tuple[str, str, int, int]],
    ) -> bool:
        """Learn the runs of a request's items: ``prompt`` as sent to the thinker (one placeholder
        per item), ``expanded`` as its engine expanded it, ``spans`` its engine's items as
        (modality, identifier, offset, length), in the engine's order. False (nothing learned)
        when they do not fit together: the prompt was not the one expanded, an item had no digest,
        or the runs are not one per placeholder."""
        groups = _groups(keys)
        runs = _runs(spans)
        if not groups or len(runs) != len(groups) or any(not k.digest for k in keys):
            return False
        learned: list[tuple[tuple[MediaKey, ...], Expansion]] = []
        shift = 0  # tokens the runs before this one added
        src = 0  # where the prompt's text before this run starts
        for group, (offset, length, items) in zip(groups, runs):
            pos = offset - shift  # the placeholder's position in the prompt
            if pos < src or pos >= len(prompt) or list(expanded[src + shift : offset]) != list(prompt[src:pos]):
                return False  # the text before the run is not the prompt's
            if sorted(k.kind for k in group) != sorted(m for m, _, _, _ in items):
                return False
            run = array.array("i", expanded[offset : offset + length])
            learned.append((group, Expansion(int(prompt[pos]), run, tuple((i, o - offset, n) for _, i, o, n in items))))
            shift += length - 1
            src = pos + 1
        if list(expanded[src + shift :]) != list(prompt[src:]):
            return False
        for group, expansion in learned:
            self._placeholders[group[0].kind] = expansion.placeholder
            self._known[group] = expansion
            self._known.move_to_end(group)
        while len(self._known) > self._max:
            self._known.popitem(last=False)
        return True

    def expand(self, prompt: Sequence[int], keys: Sequence[MediaKey]) -> ExpandedPrompt:
        """``prompt`` (one placeholder per item of ``keys``) as the engine will expand it, up to
        the first item whose run is not known."""
        out: list[int] = []
        media: list[MediaPosition] = []
        seen: dict[int, int] = {}  # placeholder token -> occurrences used so far
        src = 0
        for group in _groups(keys):
            expansion = self._known.get(group)
            token = expansion.placeholder if expansion else self._placeholders.get(group[0].kind)
            # vLLM gives a modality's n-th item the n-th occurrence of its placeholder token.
            pos = None if token is None else _nth(prompt, token, seen.get(token, 0))
            if pos is None or pos < src:
                return ExpandedPrompt(out, media, False)  # where it stands is not known
            if expansion is None:
                # Its run is not known: the text before it is exact, nothing after it is.
                out.extend(prompt[src:pos])
                return ExpandedPrompt(out, media, False)
            self._known.move_to_end(group)
            seen[token] = seen.get(token, 0) + 1
            out.extend(prompt[src:pos])
            media.extend((i, len(out) + o, n) for i, o, n in expansion.items)
            out.extend(expansion.run)
            src = pos + 1
        out.extend(prompt[src:])
        return ExpandedPrompt(out, media, True)


def _runs(spans: Sequence[tuple[str, str, int, int]]) -> list[tuple[int, int, list]]:
    """The engine's items grouped by run: (offset, length, items). Items on one run share it
    exactly (a video and its sound track); runs do not overlap otherwise."""
    runs: list[tuple[int, int, list]] = []
    for span in spans:
        _, _, offset, length = span
        if runs and (offset, length) == runs[-1][:2]:
            runs[-1][2].append(span)
        elif runs and offset < runs[-1][0] + runs[-1][1]:
            return []  # overlapping runs: not a layout this module understands
        else:
            runs.append((offset, length, [span]))
    return runs


def _nth(tokens: Sequence[int], token: int, n: int) -> int | None:
    """Position of the ``n``-th (from 0) occurrence of ``token``, None if there are fewer."""
    for i, t in enumerate(tokens):
        if t == token:
            if n == 0:
                return i
            n -= 1
    return None
