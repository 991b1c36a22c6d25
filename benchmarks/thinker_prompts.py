"""The thinker cache benchmark's prompts: seeded token ids, the image and clip of the multimodal
workloads, each round's workloads, a retry's spare prompt, and a prompt as `LLMStage.add` takes it."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from benchmarks.thinker_specs import (
    AUDIO_RATE,
    AUDIO_SECONDS,
    IMAGE_SIDE,
    MM_CONTEXT_TOKENS,
    MM_TAIL_TOKENS,
    SHARED_TOKENS,
    SHARED_WORKLOADS,
    UNIQUE_TOKENS,
    VOCAB,
    WORKLOADS,
)


@dataclass(frozen=True)
class Prompt:
    """One request's prompt: token ids (an image / audio clip as its one placeholder token between
    start and end markers; vLLM expands it to the encoder's output length), the media for the
    placeholder (vLLM's `multi_modal_data`), and how many leading ids all requests of the workload
    share (0: none)."""

    token_ids: list[int]
    media: dict[str, Any] | None = None
    shared: int = 0


def random_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


def make_image(seed: str) -> Any:
    """A seeded noise image (the vision encoder's cost does not depend on what it shows)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(list(seed.encode()))
    return Image.fromarray(rng.integers(0, 256, (IMAGE_SIDE, IMAGE_SIDE, 3), dtype=np.uint8))


def make_audio(seed: str) -> tuple[Any, int]:
    """A seeded clip (a tone in noise, float32 in [-1, 1]) at 16 kHz, vLLM's `(samples, rate)`."""
    import numpy as np

    rng = np.random.default_rng(list(seed.encode()))
    t = np.arange(int(AUDIO_SECONDS * AUDIO_RATE)) / AUDIO_RATE
    clip = 0.3 * np.sin(2 * np.pi * rng.uniform(200, 800) * t) + 0.05 * rng.standard_normal(t.size)
    return clip.astype(np.float32), AUDIO_RATE


def media_placeholder(modality: str) -> list[int]:
    from omni_cache.tiny.qwen3_omni import TOKEN_ID

    names = {
        "image": ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>"),
        "audio": ("<|audio_start|>", "<|audio_pad|>", "<|audio_end|>"),
    }[modality]
    return [TOKEN_ID[n] for n in names]


def make_workloads(
    seed: int, round_index: int, num_requests: int, workloads: tuple[str, ...] = WORKLOADS
) -> dict[str, list[Prompt]]:
    """Prompts of one round: [warm-up, measured...] per workload. Fresh per round (so no round hits
    an earlier round's blocks), identical across modes. shared_image / shared_audio: a text context
    and one image / clip (the same object, so the same bytes and vLLM multimodal hash, in every
    request) and a shared instruction, then unique text."""
    rng = random.Random(f"thinker_cache/{seed}/{round_index}")
    total = SHARED_TOKENS + UNIQUE_TOKENS
    out: dict[str, list[Prompt]] = {}
    for wl in workloads:
        if wl == "shared_prefix":
            shared, media = random_tokens(rng, SHARED_TOKENS), None
        elif wl in ("shared_image", "shared_audio"):
            modality = SHARED_WORKLOADS[wl]
            shared = (
                random_tokens(rng, MM_CONTEXT_TOKENS) + media_placeholder(modality) + random_tokens(rng, MM_TAIL_TOKENS)
            )
            tag = f"thinker_cache/{seed}/{round_index}/{wl}"
            media = {modality: make_image(tag) if modality == "image" else make_audio(tag)}
        elif wl == "zero_reuse":
            out[wl] = [Prompt(random_tokens(rng, total)) for _ in range(num_requests + 1)]
            continue
        else:
            raise ValueError(f"unknown workload {wl!r}")
        out[wl] = [
            Prompt(shared + random_tokens(rng, UNIQUE_TOKENS), media, len(shared)) for _ in range(num_requests + 1)
        ]
    return out


def engine_prompt(prompt: Prompt, request_id: str, prefix_cache: bool) -> dict[str, Any]:
    """The prompt as `LLMStage.add` takes it. Without prefix caching each request's media gets a
    uuid of its own (`multi_modal_uuids`): vLLM's encoder cache, which keys items by content hash
    and outlives requests, would otherwise skip the encoder for a repeated image / clip, a cache the
    cache-off modes must not have (the encoder runs for every request there; `encoder_runs`)."""
    out: dict[str, Any] = {"prompt_token_ids": list(prompt.token_ids)}
    if prompt.media:
        out["multi_modal_data"] = dict(prompt.media)
        if not prefix_cache:
            out["multi_modal_uuids"] = {k: [f"{request_id}/{k}"] for k in prompt.media}
    return out


def spare_prompt(prompts: list[Prompt], wl: str, seed: int, round_index: int, i: int, k: int) -> Prompt:
    """Prompt of retry k of measured request i: like the original (the same shared prefix and media
    for the shared workloads, fresh tokens for zero_reuse), the same in every mode."""
    rng = random.Random(f"thinker_cache/{seed}/{round_index}/{wl}/{i}/retry{k}")
    first = prompts[0]
    if first.shared:
        return Prompt(first.token_ids[: first.shared] + random_tokens(rng, UNIQUE_TOKENS), first.media, first.shared)
    return Prompt(random_tokens(rng, SHARED_TOKENS + UNIQUE_TOKENS))
