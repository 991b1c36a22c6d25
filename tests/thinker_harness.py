"""Drive an in-process LLMStage to completion and collect whole latent sequences (test helper).

The dense thinker runs in float32 (the correctness tests compare a cache-on engine with a cache-off
one; float32 keeps vLLM's CPU kernel noise, which differs by batch shape and by CPU, far below the
tolerance). The hybrid runs in bfloat16 because vLLM 0.32's CPU GatedDeltaNet kernel accepts nothing
else ("CPU GDN attention requires BF16"). See test_hidden_cache.py for the tolerances.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, field

import torch

from omni_cache.tiny.checkpoints import ensure_checkpoint
from workers.latent_capture import LatentOptions
from workers.llm_stage import LLMStage

TAP = 2  # the layer tap the tests request besides the final hidden state
NAMES = ("hidden", f"layer_{TAP}")


@dataclass
class Result:
    token_ids: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0
    num_prompt_tokens: int = 0
    prompt_token_ids: list[int] = field(default_factory=list)  # as vLLM expanded it
    chunks: list[tuple[int, dict[str, torch.Tensor]]] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)  # per generated token: top-2 + sampled

    @property
    def latents(self) -> dict[str, torch.Tensor]:
        # Chunks must tile positions 0.. contiguously: that is part of what is tested.
        pos = 0
        for start, rows in self.chunks:
            assert start == pos, f"latent chunk starts at {start}, expected {pos}"
            pos += next(iter(rows.values())).shape[0]
        names = self.chunks[0][1].keys() if self.chunks else NAMES
        return {n: torch.cat([rows[n] for _, rows in self.chunks]) for n in names}


DTYPE = {"thinker": "float32", "thinker-hybrid": "bfloat16"}


def make_stage(model: str, *, cache: bool, async_scheduling: bool = False, **engine_args) -> LLMStage:
    args = dict(
        enforce_eager=True,
        gpu_memory_utilization=0.3,
        dtype=DTYPE[model],
        max_model_len=8192,
        kv_cache_memory_bytes=256 * 2**20,
    )
    args.update(engine_args)
    return LLMStage(
        str(ensure_checkpoint(model)),
        args,
        prefix_cache=cache,
        async_scheduling=async_scheduling,
        latents=LatentOptions(hidden=True, layers=(TAP,), cache=cache),
    )


def run(
    stage: LLMStage, prompts: dict[str, list[int] | dict], max_tokens: int = 4, background: tuple[str, ...] = ()
) -> dict[str, Result]:
    """Submit all prompts together (so they can share steps) and run until all finish. A prompt is
    token ids, or a vLLM prompt dict (token ids with ``multi_modal_data``).

    background: ids of requests added to the stage earlier, run alongside and not collected."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=2)
    for rid, prompt in prompts.items():
        stage.add(rid, prompt if isinstance(prompt, dict) else {"prompt_token_ids": prompt}, params)
    results = {rid: Result() for rid in prompts}
    while stage.has_work():
        for out in stage.step():
            if out.error is not None:
                raise out.error
            if out.request_id in background:
                continue
            r = results[out.request_id]
            r.token_ids += out.token_ids
            r.logprobs += [{e.token_id: e.logprob for e in pos} for pos in out.logprobs or []]
            r.num_cached_tokens = out.num_cached_tokens
            r.num_prompt_tokens = out.num_prompt_tokens
            if out.prompt_token_ids:
                r.prompt_token_ids = list(out.prompt_token_ids)
            if out.latents:
                r.chunks.append((out.latent_start, out.latents))
    for rid, r in results.items():
        # num_prompt_tokens is vLLM's count, image/audio placeholders expanded.
        expected = r.num_prompt_tokens + len(r.token_ids) - 1
        rows = r.latents["hidden"].shape[0]
        assert rows == expected, f"{rid}: {rows} latent rows, expected {expected}"
    return results


def close(stage: LLMStage) -> None:
    stage.engine.engine_core.shutdown()
    del stage
    gc.collect()


def divergence(on: Result, off: Result, what: str, tie: float) -> int | None:
    """Index of the first generated token where the engines differ (None if none); asserts a near-tie."""
    for j, (a, b) in enumerate(zip(on.token_ids, off.token_ids)):
        if a == b:
            continue
        margins = []
        for lp, chosen, other in ((on.logprobs[j], a, b), (off.logprobs[j], b, a)):
            assert other in lp, (
                f"{what}: token {j} is {a} with the cache and {b} without, and the "
                f"other token is not even in the top 2 ({lp}): not a near-tie"
            )
            margins.append(lp[chosen] - lp[other])
        assert max(margins) <= tie, (
            f"{what}: token {j} is {a} with the cache and {b} without, logprob margins {margins} "
            f"> {tie}: not a near-tie"
        )
        return j
    return None


def comparable_rows(on: Result, off: Result, what: str, tie: float) -> int:
    """Rows fed the same inputs in both engines: up to and including the one that sampled the first
    diverging token (row i is the model's output for input token i)."""
    j = divergence(on, off, what, tie)
    if j is None:
        return on.latents["hidden"].shape[0]
    return on.num_prompt_tokens + j
