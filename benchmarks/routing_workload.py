"""The routing benchmark's workload (python -m benchmarks.routing): which tenant each request
belongs to, the tenants' shared parts (a system prompt, or an image, clip or video of about as
many tokens) and the requests built on them, the warm-up requests, and the default size of a
replica's KV pool.
"""

from __future__ import annotations

import math
import random
from typing import Any

from benchmarks.workloads import Session, content_sizes, random_text

#: ``--workload`` -> the tenant kinds the tenants take in turn.
WORKLOADS = {"text": ("text",), "media": ("text", "image", "audio", "video")}
#: Audio tokens per second of a clip in Qwen3-Omni's thinker (16 kHz, 100 feature frames a second,
#: downsampled 8x), to size a clip tenant's medium like the others' prefixes.
AUDIO_TOKENS_PER_S = 12.5


def tenant_order(tenants: int, num_requests: int, seed: int, round_: int) -> list[int]:
    """Which tenant each request belongs to: every tenant equally often (the remainder to the
    lowest), shuffled with a seed of its own per round (all policies of a round get this order)."""
    order = [i % tenants for i in range(num_requests)]
    random.Random(f"omni_cache-routing/order/{seed}/{round_}").shuffle(order)
    return order


def build_requests(
    order: list[int],
    *,
    shared_tokens: int,
    unique_tokens: int,
    max_tokens: int,
    seed: int,
    round_: int,
    label: str,
    kinds: tuple[str, ...] = ("text",),
) -> list[Session]:
    """The sessions of one turn: tenant prefixes seeded by (seed, round, label), so each policy's
    turn has prefixes no earlier turn cached; the unique parts are the round's (same per policy).
    Tenant ``t`` is of kind ``kinds[t % len(kinds)]``: its prefix is a system prompt (text) or
    its medium (image, audio, video; no system prompt)."""
    sys_chars, user_chars = content_sizes(shared_tokens, unique_tokens)
    prefix_rng = random.Random(f"omni_cache-routing/tenants/{seed}/{round_}/{label}")
    tenants = [
        tenant_prefix(kinds[t % len(kinds)], prefix_rng, shared_tokens, sys_chars) for t in range(max(order) + 1)
    ]
    user_rng = random.Random(f"omni_cache-routing/users/{seed}/{round_}")
    return [
        Session(
            i,
            f"tenant{t}" if kinds == ("text",) else f"tenant{t}-{kinds[t % len(kinds)]}",
            users=[random_text(user_rng, user_chars)],
            max_tokens=max_tokens,
            **tenants[t],
        )
        for i, t in enumerate(order)
    ]


def tenant_prefix(kind: str, rng: random.Random, shared_tokens: int, sys_chars: int) -> dict[str, Any]:
    """A tenant's shared part as Session fields: a system prompt, or a medium of about
    ``shared_tokens`` tokens (seeded by ``rng``)."""
    from benchmarks.workloads import image_data_url, video_data_url

    if kind == "text":
        return {"system": random_text(rng, sys_chars)}
    seed = rng.randrange(1 << 30)
    if kind == "image":
        return {"system": "", "image": image_data_url(shared_tokens, seed)}
    if kind == "audio":
        return {"system": "", "audio": clip_b64(shared_tokens / AUDIO_TOKENS_PER_S, seed)}
    if kind == "video":
        return {"system": "", "video": video_data_url(seed, seconds=4.0, width=192, height=128)}
    raise ValueError(f"unknown tenant kind {kind!r}")


def clip_b64(seconds: float, seed: int, rate: int = 16000) -> str:
    """A WAV clip (base64) of ``seconds`` of seeded noise under a tone: its content differs by seed."""
    import base64
    import io

    import numpy as np
    import soundfile as sf

    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    x = 0.2 * np.sin(2 * np.pi * rng.uniform(200, 800) * t) + 0.05 * rng.standard_normal(t.size)
    buf = io.BytesIO()
    sf.write(buf, x.astype(np.float32), rate, format="WAV")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def warmup_requests(n: int, max_tokens: int, seed: int) -> list[Session]:
    """Short prompts nobody else sends, one per replica, sent at once (least loaded and prefix
    put them on different replicas, round robin in turn): the first request of an engine pays
    one-time costs that should not land in any policy's numbers."""
    rng = random.Random(f"omni_cache-routing/warmup/{seed}")
    return [
        Session(i, "warmup", random_text(rng, 200), [random_text(rng, 40)], max_tokens, warmup=True) for i in range(n)
    ]


def default_pool_blocks(tenants: int, shared: int, unique: int, max_tokens: int, block_size: int) -> int:
    """Blocks of one replica's pool that hold half of the tenants' whole requests (prompt and
    answer), plus the null block vLLM keeps for itself."""
    per_request = math.ceil((shared + unique + max_tokens) / block_size)
    return math.ceil(tenants / 2) * per_request + 1
