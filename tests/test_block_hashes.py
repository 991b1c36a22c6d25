"""The orchestrator's block hashes of a prompt (omni_cache/runtime/routing/block_hashes.py, which calls
vLLM's hashing functions with its own first parent and request stand-in) equal the ones an engine
computes and its KV events report, with vLLM's default seed and with a PYTHONHASHSEED, for text
prompts and for prompts with images, audio and video: the reference is the engine's path, no
engine started (``init_none_hash`` reading the seed as an engine does at start, then a vLLM
``Request`` with the items' features hashed by ``get_request_block_hasher``)."""

from __future__ import annotations

import random

import pytest

from omni_cache.runtime.routing.block_hashes import prompt_block_hashes


def vllm_hashes(token_ids: list[int], block_size: int) -> list[int]:
    from vllm.utils.hashing import sha256
    from vllm.v1.core import kv_cache_utils

    kv_cache_utils.init_none_hash(sha256)  # reads PYTHONHASHSEED, as an engine does at start
    parent, out = None, []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = kv_cache_utils.hash_block_tokens(sha256, parent, token_ids[start : start + block_size])
        out.append(kv_cache_utils.maybe_convert_block_hash(parent))
    return out


@pytest.mark.parametrize("seed", [None, "1234"])
def test_prompt_block_hashes_are_vllms(monkeypatch: pytest.MonkeyPatch, seed: str | None) -> None:
    pytest.importorskip("vllm")
    if seed is None:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    else:
        monkeypatch.setenv("PYTHONHASHSEED", seed)
    rng = random.Random(0)
    try:
        for n, block_size in ((0, 32), (31, 32), (32, 32), (100, 32), (257, 16)):
            ids = [rng.randrange(512) for _ in range(n)]
            ours = prompt_block_hashes(ids, block_size, seed)
            assert len(ours) == n // block_size
            assert ours == vllm_hashes(ids, block_size)
            assert ours == vllm_request_hashes(ids, block_size, [])  # the engine's request path
    finally:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
        vllm_hashes([], 1)  # vLLM's global seed back to its default for later tests


def vllm_request_hashes(token_ids: list[int], block_size: int, media: list[tuple[str, str, int, int]]) -> list[int]:
    """What vLLM's block hasher gives a request of ``token_ids`` (expanded) whose multimodal
    features are ``media``: (modality, identifier, offset, length), in the engine's order."""
    from vllm import SamplingParams
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.utils.hashing import sha256
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.request import Request

    kv_cache_utils.init_none_hash(sha256)
    features = [
        MultiModalFeatureSpec(data=None, modality=m, identifier=i, mm_position=PlaceholderRange(offset=o, length=n))
        for m, i, o, n in media
    ]
    req = Request(
        "r",
        list(token_ids),
        SamplingParams(max_tokens=1),
        None,
        mm_features=features or None,
        block_hasher=kv_cache_utils.get_request_block_hasher(block_size, sha256),
    )
    return [kv_cache_utils.maybe_convert_block_hash(h) for h in req.block_hashes]


# Qwen3-Omni's tokens around a run (omni_cache/tiny/qwen3_omni.py).
AUDIO_START, AUDIO_END, AUDIO_PAD, VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = (259, 260, 261, 262, 263, 264, 265)


def media_prompt(parts: list, rng: random.Random) -> tuple[list[int], list[tuple[str, str, int, int]]]:
    """An expanded prompt of ``parts``: an int is that many text tokens; (modality, identifier,
    run) an item whose run replaced its placeholder; (("audio", a), ("video", v), run) a video and
    its sound track on one interleaved run (use_audio_in_video), in the engine's order."""
    ids: list[int] = []
    media: list[tuple[str, str, int, int]] = []
    for part in parts:
        if isinstance(part, int):
            ids += [rng.randrange(256) for _ in range(part)]
            continue
        *items, run = part
        items = items if isinstance(items[0], tuple) else [tuple(items)]
        alone_audio = [m for m, _ in items] == ["audio"]
        ids.append(AUDIO_START if alone_audio else VISION_START)
        media += [(m, identifier, len(ids), len(run)) for m, identifier in items]
        ids += run
        ids.append(AUDIO_END if alone_audio else VISION_END)
    return ids, media


def interleaved(video: int, audio: int) -> list[int]:
    """A video's and its sound track's tokens interleaved by time, between the audio markers."""
    out = [AUDIO_START]
    for i in range(max(video, audio)):
        out += [VIDEO_PAD] * (i < video) + [AUDIO_PAD] * (i < audio)
    return out + [AUDIO_END]


MEDIA_PROMPTS = {
    "image": [40, ("image", "img-a", [IMAGE_PAD] * 100), 30],
    # its run starts on a block boundary and ends on one
    "audio": [63, ("audio", "aud-a", [AUDIO_PAD] * 64), 70],
    "video": [10, ("video", "vid-a:fps=2:av=0", [VIDEO_PAD] * 150), 45],
    "video with its sound track": [20, (("audio", "aud-v"), ("video", "vid-v:fps=2:av=1"), interleaved(60, 45)), 50],
    "same items, engine order swapped": [
        20,
        (("video", "vid-v:fps=2:av=1"), ("audio", "aud-v"), interleaved(60, 45)),
        50,
    ],
    # two items inside one block, then one spanning several, the same image twice
    "mixed": [
        5,
        ("image", "img-a", [IMAGE_PAD] * 4),
        3,
        ("audio", "aud-a", [AUDIO_PAD] * 5),
        2,
        ("video", "vid-b", [VIDEO_PAD] * 90),
        12,
        ("image", "img-a", [IMAGE_PAD] * 4),
        40,
    ],
}


@pytest.mark.parametrize("name", list(MEDIA_PROMPTS))
@pytest.mark.parametrize("seed", [None, "77"])
def test_media_prompt_block_hashes_are_vllms(monkeypatch: pytest.MonkeyPatch, name: str, seed: str | None) -> None:
    pytest.importorskip("vllm")
    if seed is None:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    else:
        monkeypatch.setenv("PYTHONHASHSEED", seed)
    ids, media = media_prompt(MEDIA_PROMPTS[name], random.Random(name))
    try:
        for block_size in (32, 16):
            ours = prompt_block_hashes(ids, block_size, seed, [(i, o, n) for _, i, o, n in media])
            assert len(ours) == len(ids) // block_size
            assert ours == vllm_request_hashes(ids, block_size, media)
            # the media keys matter: the same tokens without them hash otherwise from the first
            # block that overlaps an item on
            first = media[0][2] // block_size
            plain = prompt_block_hashes(ids, block_size, seed)
            assert plain[:first] == ours[:first] and plain[first] != ours[first]
    finally:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
        vllm_hashes([], 1)


def test_a_chain_names_the_whole_prefix() -> None:
    a = prompt_block_hashes(list(range(96)), 32)
    b = prompt_block_hashes(list(range(64)) + [7] * 32, 32)
    c = prompt_block_hashes([1] + list(range(1, 96)), 32)
    assert a[:2] == b[:2] and a[2] != b[2]  # same first two blocks, then they differ
    assert not set(a) & set(c)  # one token changed in block 0 changes every block after it
    with pytest.raises(ValueError):
        prompt_block_hashes([1, 2], 0)


def test_the_collector_reports_each_hash_by_its_last_event_and_passes_batches_on() -> None:
    pytest.importorskip("vllm")
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

    from scheduler.block_events import BlockEventCollector

    def stored(*hashes: int, size: int = 32) -> BlockStored:
        return BlockStored(
            block_hashes=list(hashes),
            parent_block_hash=None,
            token_ids=[0] * size * len(hashes),
            block_size=size,
            lora_id=None,
            medium="GPU",
            lora_name=None,
        )

    class Inner:
        batches: list = []

        def publish(self, batch) -> None:
            self.batches.append(batch)

    inner = Inner()
    collector = BlockEventCollector(inner)
    collector.publish(KVEventBatch(ts=0.0, events=[stored(1, 2, 3), BlockRemoved(block_hashes=[2], medium="GPU")]))
    collector.publish(
        KVEventBatch(
            ts=1.0,
            events=[
                stored(3),
                stored(4, size=7),  # a hit, a partial block
                BlockRemoved(block_hashes=[1], medium="GPU"),
                stored(1),
                stored(b"\x00" * 24 + (9).to_bytes(8, "big")),
            ],
        )
    )
    changes = collector.take()
    assert sorted(changes.stored) == [1, 3, 4, 9] and changes.removed == [2]
    assert changes.block_size == 32 and not changes.cleared
    assert len(inner.batches) == 2  # the publisher it stands in for still gets everything
    assert not collector.take()  # nothing new
    collector.publish(KVEventBatch(ts=2.0, events=[stored(5), AllBlocksCleared(), stored(6)]))
    changes = collector.take()
    assert changes.cleared and changes.stored == [6] and changes.removed == []
