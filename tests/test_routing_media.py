"""Media prompts routed by content, without engines: what the thinker reports of a media prompt
(its expansion, ``MediaLayout``) is learned per item (omni_cache/runtime/routing/media_layouts.py), a later
prompt with the same items is expanded and hashed as the engine will, and the router sends it to
the replica that reported those blocks. The engine's expansion is played here by a stand-in that
replaces each placeholder by a run, as vLLM's processor does; tests/test_block_hashes.py checks
the hashes against vLLM's own, tests/test_prefix_routing_e2e.py the whole path with engines."""

from __future__ import annotations

import numpy as np
import pytest
from routing_orchestrator import two_replica_orchestrator

from omni_cache.runtime.orchestrator import Orchestrator
from omni_cache.runtime.request_path.requests import MediaItem, Request, submit_message
from omni_cache.runtime.routing.block_hashes import prompt_block_hashes
from omni_cache.runtime.routing.media_layouts import MediaLayouts, media_keys
from omni_cache.wire.messages import MediaLayout, MediaSpan, StageOutput
from omni_cache.wire.sampling import EngineSampling

BS = 32
AUDIO_PAD, IMAGE_PAD, VIDEO_PAD = 261, 264, 265
PAD = {"image": IMAGE_PAD, "audio": AUDIO_PAD, "video": VIDEO_PAD}
#: What the stand-in engine expands each digest to (a run's tokens); a video with its track: one
#: interleaved run for both.
RUNS = {
    "img": [IMAGE_PAD] * 70,
    "img2": [IMAGE_PAD] * 40,
    "aud": [AUDIO_PAD] * 45,
    "vid": [VIDEO_PAD] * 90,
    "vidav": [259] + [VIDEO_PAD, AUDIO_PAD] * 30 + [260],
}


def item(kind: str, digest: str, fps: float = 0.0, in_video: bool = False) -> MediaItem:
    return MediaItem(kind, np.zeros(1, np.uint8), digest=digest, fps=fps, in_video=in_video)


def prompt_of(parts: list) -> tuple[list[int], list[MediaItem]]:
    """Text tokens (a list) and items (a MediaItem: its placeholder; a sound track: none)."""
    ids: list[int] = []
    media: list[MediaItem] = []
    for part in parts:
        if isinstance(part, MediaItem):
            media.append(part)
            if not part.in_video:
                ids += [262, PAD[part.kind], 263]
        else:
            ids += part
    return ids, media


def engine_expand(prompt: list[int], media: list[MediaItem]) -> tuple[list[int], list[tuple]]:
    """The stand-in thinker: each placeholder replaced by its item's run (a video with its sound
    track by the pair's), the items as (modality, identifier, offset, length)."""
    out: list[int] = []
    spans: list[tuple] = []
    items = iter(media)
    pending = list(media)
    for tok in prompt:
        if tok not in PAD.values():
            out.append(tok)
            continue
        m = next(items)
        pending.remove(m)
        group = [m]
        if m.kind == "video" and pending and pending[0].in_video:
            group.append(next(items))
            pending.pop(0)
        run = RUNS[m.digest + ("av" if len(group) == 2 else "")]
        spans += [(g.kind, f"id-{g.digest}-{g.fps}", len(out), len(run)) for g in group]
        out += run
    return out, spans


def learned(parts: list) -> MediaLayouts:
    layouts = MediaLayouts()
    prompt, media = prompt_of(parts)
    assert layouts.learn(prompt, media_keys(media), *engine_expand(prompt, media))
    return layouts


def test_a_learned_item_expands_as_the_engine_does_in_another_prompt():
    video, track = item("video", "vid", fps=2.0), item("audio", "trk", in_video=True)
    # One request taught an image and a clip, another a video with its sound track and an image
    # (keyed apart from the first one's: vLLM names it with the request's video kwargs).
    layouts = learned([[1] * 20, item("image", "img"), [2] * 5, item("audio", "aud"), [3] * 7])
    prompt, media = prompt_of([[1] * 3, item("image", "img"), video, track, [4] * 9])
    assert layouts.learn(prompt, media_keys(media), *engine_expand(prompt, media))
    assert len(layouts) == 4
    # Other prompts with those items, in another order, with other text around them.
    for parts in (
        [[5] * 33, item("image", "img"), [6] * 40],
        [[7] * 3, video, track, [8] * 10, item("image", "img"), [9] * 2],
        [item("audio", "aud"), item("audio", "aud"), [1] * 50],
    ):
        prompt, media = prompt_of(parts)
        got = layouts.expand(prompt, media_keys(media))
        want_ids, want_spans = engine_expand(prompt, media)
        assert got.complete and got.token_ids == want_ids
        assert got.media == [(i, o, n) for _, i, o, n in want_spans]


def test_an_unknown_item_cuts_the_prompt_at_its_placeholder_and_is_learned_once_answered():
    layouts = learned([[1] * 10, item("image", "img"), [2] * 10])
    prompt, media = prompt_of([[3] * 50, item("image", "img"), [4] * 20, item("image", "img2"), [5] * 30])
    first = layouts.expand(prompt, media_keys(media))
    want_ids, want_spans = engine_expand(prompt, media)
    # Known up to the second image's placeholder: the first image's run and the text after it
    # (<|vision_start|> 70-token run <|vision_end|>, 20 tokens, <|vision_start|>).
    assert not first.complete and first.token_ids == want_ids[: 50 + 1 + 70 + 1 + 20 + 1]
    assert first.media == [(i, o, n) for _, i, o, n in want_spans[:1]]
    assert layouts.learn(prompt, media_keys(media), want_ids, want_spans)  # its answer came
    again = layouts.expand(prompt, media_keys(media))
    assert again.complete and again.token_ids == want_ids
    # A kind never seen: where its placeholder stands is not known, so nothing is hashed.
    prompt, media = prompt_of([[3] * 50, item("video", "vid", 2.0), [5] * 9])
    assert layouts.expand(prompt, media_keys(media)).token_ids == []


def test_processor_kwargs_and_digests_are_part_of_an_items_key():
    layouts = learned([[1] * 4, item("video", "vid", fps=2.0), [2] * 4])
    prompt, media = prompt_of([[1] * 4, item("video", "vid", fps=1.0), [2] * 4])
    assert not layouts.expand(prompt, media_keys(media)).complete  # another frame rate
    # An image beside a video is keyed with the request's video kwargs (vLLM hashes it with them).
    layouts = learned([[1] * 4, item("image", "img"), item("video", "vid", fps=2.0)])
    prompt, media = prompt_of([[1] * 4, item("image", "img")])
    assert not layouts.expand(prompt, media_keys(media)).complete


def test_a_report_that_does_not_fit_the_prompt_teaches_nothing():
    layouts = MediaLayouts()
    prompt, media = prompt_of([[1] * 10, item("image", "img"), [2] * 10])
    ids, spans = engine_expand(prompt, media)
    keys = media_keys(media)
    assert not layouts.learn(prompt[:-1], keys, ids, spans)  # not the prompt that was expanded
    assert not layouts.learn(prompt, keys, ids[:5] + [9] + ids[6:], spans)  # text before differs
    assert not layouts.learn(prompt, keys, ids[:-3] + [9] + ids[-2:], spans)  # text after differs
    assert not layouts.learn(prompt, keys, ids, [("audio", *spans[0][1:])])  # another modality
    assert not layouts.learn(prompt, keys, ids, spans + spans)  # more runs than placeholders
    assert not layouts.learn(prompt, media_keys([item("image", "")]), ids, spans)  # no digest
    assert len(layouts) == 0
    assert layouts.learn(prompt, keys, ids, spans) and len(layouts) == 1


def test_the_least_recently_used_items_are_forgotten():
    layouts = MediaLayouts(max_items=2)
    for digest in ("img", "img2", "aud"):
        kind = "audio" if digest == "aud" else "image"
        prompt, media = prompt_of([[1], item(kind, digest), [2]])
        layouts.learn(prompt, media_keys(media), *engine_expand(prompt, media))
    assert len(layouts) == 2
    prompt, media = prompt_of([[1], item("image", "img"), [2]])
    assert not layouts.expand(prompt, media_keys(media)).complete


@pytest.fixture
def orch(tmp_path):
    """Two thinker replicas with prefix routing, built but not started, both up, both reported
    blocks of 32 tokens (as tests/test_routing.py's)."""
    return two_replica_orchestrator(tmp_path, "routing_media", BS)


def routed(o: Orchestrator, parts: list) -> Request:
    """Route a prompt with media as submit() does and keep it in flight."""
    prompt, media = prompt_of(parts)
    req = Request(
        request_id=f"r{len(o.requests)}",
        prompt_token_ids=prompt,
        modalities=("text",),
        participants=("thinker",),
        t0=0.0,
        deadline=1e9,
        timeout_s=1.0,
        return_latents=False,
    )
    o.routes.assign(req, prompt, media, hashes=o.routes.hasher(prompt, media)())
    req.submit = submit_message(req, EngineSampling(max_tokens=4), media)
    o.requests.add(req)
    return req


def test_a_repeated_image_goes_to_the_replica_that_reported_it(orch):
    image = item("image", "img")
    # Two requests nobody holds anything of: least loaded puts the second on replica 1.
    routed(orch, [[5] * 40])
    first = routed(orch, [[1] * 40, image, [2] * 10])
    assert first.route == {"thinker": 1}
    # No image was ever answered: which token is its placeholder is not known, nothing is hashed.
    assert first.block_hashes == {}
    # Replica 1's first output tells how its engine expanded the prompt; it reports its blocks.
    ids, spans = engine_expand(*prompt_of([[1] * 40, image, [2] * 10]))
    orch.on_message(
        StageOutput(
            request_id=first.request_id,
            stage="thinker",
            seq=0,
            token_ids=[7],
            media_layout=MediaLayout(prompt_token_ids=ids, spans=[MediaSpan(*s) for s in spans]),
        ),
        {},
    )
    assert len(orch.routes.media_layouts) == 1
    media = [(i, o, n) for _, i, o, n in spans]
    orch.routes.prefix_index.apply(1, stored=prompt_block_hashes(ids, BS, None, media), removed=[])
    for r in list(orch.requests.served_by("thinker")):
        orch.requests.answered(r)
    # The same image with another question: hashed as the engine will, sent to replica 1 though a
    # load tie would pick replica 0.
    again = routed(orch, [[1] * 40, image, [3] * 30])
    want, want_spans = engine_expand(*prompt_of([[1] * 40, image, [3] * 30]))
    assert again.block_hashes[BS] == prompt_block_hashes(want, BS, None, [(i, o, n) for _, i, o, n in want_spans])
    assert again.route == {"thinker": 1}
    assert orch.routes.router.decisions[("thinker", 1, "prefix", "prefix_hit")] == 1
    # Another image after the same text: its run is not known, the text before it is (one block).
    other = routed(orch, [[1] * 40, item("image", "img2"), [3] * 30])
    assert other.block_hashes[BS] == prompt_block_hashes([1] * 40, BS)


def test_a_known_media_prompt_counts_its_expanded_length(orch):
    """Prefix and backlog are in the engine's tokens: an image's run counts, not its placeholder."""
    image = item("image", "img")
    prompt, media = prompt_of([[1] * 3, image, [2] * 10])
    ids, spans = engine_expand(prompt, media)
    orch.routes.media_layouts.learn(prompt, media_keys(media), ids, spans)
    req = routed(orch, [[1] * 3, image, [2] * 10])
    assert req.prefill_backlog == len(ids) == 3 + 1 + 70 + 1 + 10
    assert orch.routes.hasher(*prompt_of([[1] * 3, item("image", "new"), [2] * 10]))().prompt_tokens == 5
