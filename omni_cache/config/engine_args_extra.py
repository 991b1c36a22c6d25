"""Which ``engine_args.extra`` keys an autoregressive stage takes.

``extra`` is passed verbatim to ``vllm.EngineArgs`` (workers/llm_stage.py), so a key there is
checked before anything starts, each refusal naming the key and why:

* keys ``EngineArgs`` (the schema's struct) types itself: set them there;
* keys the stage sets itself: its worker and scheduler classes (the latent capture and the
  scheduler's plumbing live in them), prefix caching (the stage's ``prefix_cache``), the KV-cache
  events prefix routing reads, the model and its tokenizer (the server tokenizes with the model
  folder's, omni_cache/runtime/request_path/text_codec.py), and for a talker what it needs to read embeddings
  and write codes;
* what one in-process vLLM worker per stage cannot run: parallelism across processes or GPUs
  (pipeline, data, context and expert parallelism, their addresses and ranks; a stage scales by
  ``replicas``), speculative decoding (the captured latents follow the tokens fed, drafts and
  rejected ones included), KV transfer and offloading (blocks that come back into the pool
  without their latents in the mirror), pooling runners;
* names vLLM's ``EngineArgs`` does not have (:mod:`omni_cache.config.vllm_engine_args`).

Nothing here imports vLLM.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterator, Mapping
from typing import Any

from omni_cache.config.vllm_engine_args import ENGINE_ARG_NAMES, VLLM_VERSION

_PARALLEL = (
    "a stage runs one in-process vLLM worker (workers/llm_stage.py): no parallelism "
    "across processes or GPUs; scale a stage with `replicas` instead"
)
_SPECULATIVE = (
    "speculative decoding is not supported: the stage captures the latents of every "
    "token fed, drafts and rejected ones included (workers/latent_worker.py)"
)
_KV_ELSEWHERE = (
    "KV blocks that come back into the pool from elsewhere have no latents in the "
    "hidden-state cache, which mirrors only this engine's pool"
)

#: key -> why the stage does not take it from ``extra``.
REFUSED: dict[str, str] = {
    "model": "set the stage's model instead",
    "enable_prefix_caching": "set the stage's prefix_cache instead",
    "worker_cls": "the stage sets it (workers/latent_worker.py: the latent capture)",
    "worker_extension_cls": "the stage sets its worker class (workers/latent_worker.py)",
    "scheduler_cls": "the stage sets it (scheduler/omni_scheduler.py)",
    "kv_events_config": "the stage sets it when prefix routing reads its blocks (scheduler/block_events.py)",
    "distributed_executor_backend": _PARALLEL,
    "tokenizer": "the server tokenizes prompts with the model folder's tokenizer "
    "(omni_cache/runtime/request_path/text_codec.py); the stage must read them with the same one",
    "skip_tokenizer_init": "the stage sets it for a talker; a stage that writes text needs its tokenizer",
    "runner": "a stage runs a generating model (vLLM's default runner)",
    "convert": "a stage runs a generating model (vLLM's default runner)",
    "pooler_config": "a stage runs a generating model (vLLM's default runner)",
    **dict.fromkeys(
        (
            "pipeline_parallel_size",
            "prefill_context_parallel_size",
            "decode_context_parallel_size",
            "dcp_comm_backend",
            "dcp_q_replicate",
            "dcp_kv_cache_interleave_size",
            "cp_kv_cache_interleave_size",
            "master_addr",
            "master_port",
            "nnodes",
            "node_rank",
            "enable_expert_parallel",
            "enable_eplb",
            "eplb_config",
            "expert_placement_strategy",
            "all2all_backend",
            "enable_elastic_ep",
            "elastic_ep_max_dp_size",
            "enable_dbo",
            "ubatch_size",
            "dbo_decode_token_threshold",
            "dbo_prefill_token_threshold",
            "dp_sync_interval",
            "disable_nccl_for_dp_synchronization",
        ),
        _PARALLEL,
    ),
    **dict.fromkeys(("speculative_config", "spec_method", "spec_model", "spec_tokens"), _SPECULATIVE),
    **dict.fromkeys(
        (
            "kv_transfer_config",
            "ec_transfer_config",
            "ec_manager_config",
            "kv_offloading_size",
            "kv_offloading_backend",
        ),
        _KV_ELSEWHERE,
    ),
}
#: Every ``data_parallel_*`` argument: one in-process worker has no data parallelism.
REFUSED_PREFIXES = {"data_parallel_": _PARALLEL}
#: Keys a talker stage (``submodel: talker``) sets itself: it reads embeddings and writes codes.
SET_FOR_TALKER = ("hf_overrides", "logits_processors")
#: Keys of ``extra.additional_config`` the stage writes (workers/llm_stage.py).
STAGE_ADDITIONAL_CONFIG = ("omni_cache", "omni_cache_block_states")
#: The only ``prefix_caching_hash_algo`` whose hashes prefix routing computes
#: (omni_cache/runtime/routing/block_hashes.py).
ROUTED_HASH_ALGO = "sha256"


def extra_problems(
    extra: Mapping[str, Any], *, typed: frozenset[str] | set[str], submodel: str | None
) -> Iterator[tuple[tuple[str, ...], str]]:
    """(key path under ``extra``, message) for every key a stage refuses; ``typed``: the keys the
    schema's ``EngineArgs`` has fields for; ``submodel``: the stage's."""
    for key, value in extra.items():
        why = _refusal(key, value, typed, submodel)
        if why is not None:
            yield why


def _refusal(
    key: str, value: Any, typed: frozenset[str] | set[str], submodel: str | None
) -> tuple[tuple[str, ...], str] | None:
    if key in typed:
        return (key,), f"not allowed here: set engine_args.{key} instead"
    if key in REFUSED:
        return (key,), f"not allowed here: {REFUSED[key]}"
    for prefix, why in REFUSED_PREFIXES.items():
        if key.startswith(prefix):
            return (key,), f"not allowed here: {why}"
    if key not in ENGINE_ARG_NAMES:
        close = difflib.get_close_matches(key, sorted(ENGINE_ARG_NAMES), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        return (key,), (f"unknown vLLM engine argument (vllm.EngineArgs {VLLM_VERSION} has no field {key!r}){hint}")
    if submodel == "talker" and key in SET_FOR_TALKER:
        return (key,), "not allowed here: the stage sets it for a talker (workers/llm_stage.py)"
    if key == "additional_config" and isinstance(value, Mapping):
        taken = [k for k in STAGE_ADDITIONAL_CONFIG if k in value]
        if taken:
            return (key, taken[0]), "not allowed here: the stage writes it (workers/llm_stage.py)"
    if key == "prefix_caching_hash_algo" and value != ROUTED_HASH_ALGO:
        return (key,), (
            f"{value!r} is not supported: prefix routing computes the prompt's block "
            f"hashes as vLLM's {ROUTED_HASH_ALGO!r} does (omni_cache/runtime/routing/block_hashes.py)"
        )
    return None
