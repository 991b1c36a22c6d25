"""What the thinker cache benchmark (python -m benchmarks.thinker_cache) runs: its four modes, the
engine arguments and workloads of its two models, the row tolerances, the targets and the
thresholds of its verdicts, retries and quiet medians."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

MODES: dict[str, dict[str, Any]] = {
    "plain": dict(latents=False, prefix_cache=False),
    "plain_apc": dict(latents=False, prefix_cache=True),
    "latents": dict(latents=True, prefix_cache=False),
    "latents_cache": dict(latents=True, prefix_cache=True),
}
# Workloads whose requests share a prefix, and the modality of what they share.
SHARED_WORKLOADS = {"shared_prefix": "text", "shared_image": "image", "shared_audio": "audio"}
ENGINE_ARGS: dict[str, Any] = dict(
    enforce_eager=True,
    gpu_memory_utilization=0.3,
    dtype="bfloat16",
    block_size=32,
    max_model_len=8192,
    kv_cache_memory_bytes=2**30,
)
SHARED_TOKENS, UNIQUE_TOKENS = 4000, 100
MAX_TOKENS = 2
# Row tolerance between this benchmark's two bf16 latents modes (the tests compare in float32 at
# 1e-4; bf16 GEMMs round a row differently by batch shape, a few bf16 ulps after 8 layers).
ROW_RTOL = 2.0**-6
VOCAB = 256  # byte ids of the tiny thinker's tokenizer
TARGET_SPEEDUP_FRACTION = 0.95

# ---- the multimodal run (--model qwen3-omni) ----------------------------------------------------
# Text context before the image / audio clip of the shared_image / shared_audio prefixes, and shared
# text after it (an instruction about the media): at least a block, so the whole-block prefix hit
# covers every media token and a hit needs no encoder output at all.
MM_CONTEXT_TOKENS, MM_TAIL_TOKENS = 1000, 48
# 1024 x 1024 pixels = 64 x 64 patches of 16, merged 2 x 2: 1,024 image tokens, 4,096 patches
# through the vision encoder (`max_pixels` below pins that size whatever the checkpoint's cap).
IMAGE_SIDE = 1024
# 30 s at 16 kHz: 390 audio tokens from 3,000 mel frames through the audio encoder.
AUDIO_SECONDS, AUDIO_RATE = 30.0, 16000
OMNI_ENGINE_ARGS: dict[str, Any] = dict(
    # float32: the MoE router's top-2 choice flips on bf16 rounding, which would make rows of the two
    # latents modes differ for reasons that have nothing to do with the cache.
    enforce_eager=True,
    gpu_memory_utilization=0.3,
    dtype="float32",
    block_size=32,
    max_model_len=8192,
    kv_cache_memory_bytes=2**30,
    limit_mm_per_prompt={"image": 1, "audio": 1, "video": 0},
    mm_processor_kwargs={"max_pixels": IMAGE_SIDE * IMAGE_SIDE},
    # No processor cache in any mode: every request's image / clip goes through the HF processor
    # (resize, patchify; mel features), the same front-end work in every mode.
    mm_processor_cache_gb=0,
)
# float32 on both sides; rows of one prompt from two engines differ only in summation order (batch
# shapes of the prefill, a prefix served from the mirror): measured <= 1e-5; a flipped MoE route
# would give O(1), so 1e-4 (the test suite's float32 tolerance) separates the two.
OMNI_ROW_RTOL = 1e-4
OMNI_TARGET_SPEEDUP_FRACTION = 0.97  # issue 20


@dataclass(frozen=True)
class ModelSpec:
    """What differs between the text-only run (issue 3) and the multimodal run (issue 20)."""

    checkpoint: str  # omni_cache.tiny.checkpoints name
    engine_args: dict[str, Any]
    workloads: tuple[str, ...]
    row_rtol: float
    target_fraction: float


def model_spec(name: str) -> ModelSpec:
    if name == "thinker":
        return ModelSpec("thinker", ENGINE_ARGS, ("shared_prefix", "zero_reuse"), ROW_RTOL, TARGET_SPEEDUP_FRACTION)
    if name == "qwen3-omni":
        return ModelSpec(
            "qwen3-omni",
            OMNI_ENGINE_ARGS,
            ("shared_prefix", "shared_image", "shared_audio", "zero_reuse"),
            OMNI_ROW_RTOL,
            OMNI_TARGET_SPEEDUP_FRACTION,
        )
    raise ValueError(f"unknown model {name!r} (thinker, qwen3-omni)")


WORKLOADS = model_spec("thinker").workloads


def latent_names(latents: dict[str, Any]) -> tuple[str, ...]:
    from workers.latent_capture import LatentOptions

    return LatentOptions(**latents).names


def talker_latents(model_path: str) -> dict[str, Any]:
    """The latents the shipped pipeline's next stage reads (`LatentOptions` keyword arguments): for a
    Qwen3-Omni thinker, the merged latent of its talker (tap 0, the talker config's
    `accept_hidden_layer` at media positions; stage_configs/qwen3_omni.yaml); for the text-only
    thinker, the final hidden state (the tiny talker's input)."""
    with open(os.path.join(model_path, "config.json")) as f:
        cfg = json.load(f)
    talker = cfg.get("talker_config")
    if talker:
        return {"hidden": False, "layers": (), "merged": (0, int(talker["accept_hidden_layer"]))}
    return {"hidden": True, "layers": (), "merged": None}


# A verdict needs at least this much: with one round of 5 requests (--quick) a 2-core machine's noise
# alone moved hidden_cache_speedup from 87% to 103% of APC's and zero-reuse overhead to -21%.
VERDICT_MIN_ROUNDS, VERDICT_MIN_REQUESTS = 3, 10
TARGET_ZERO_REUSE_OVERHEAD = 0.02
# A request counts as "quiet" when its threads waited for a CPU less than this fraction of its TTFT
# (on an otherwise idle machine a 4,100-token prefill shows 3-10%: the stage's own threads; under
# other jobs' load 50-500%);
# quiet medians need at least MIN_QUIET such requests per mode and workload.
QUIET_WAIT_FRACTION = 0.25
# --retries: a measured request whose threads waited for a CPU more than this fraction of its TTFT
# is run again (with a spare prompt of the same shape).
RETRY_WAIT_FRACTION = 0.25
MIN_QUIET = 3
# Untimed requests of the measured shape after each workload's warm-up, per engine.
EXTRA_WARMUPS = 2
