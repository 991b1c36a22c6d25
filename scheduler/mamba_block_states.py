"""A recurrent state at every block boundary a prefill chunk crosses (hybrid thinkers, align mode).

vLLM 0.32's MambaManager in "align" mode fills the block-table columns a chunk passes over with the
null block and gives a real block only to the column where the chunk ends: the state exists only
there, so a request that shares a prompt up to an earlier boundary misses although the attention
KV for it is cached. `BlockStateMambaManager` allocates a real block for each of those columns too.
vLLM's own bookkeeping then does the rest unchanged: `cache_blocks` hashes them like any full
block, `remove_skipped_blocks` releases them once the request has moved on (they stay in the
prefix cache until evicted), and a later request's lookup finds them. The states themselves are
written by the GDN layer (workers/models/gdn_block_states.py) into exactly the non-null interior
columns.

Cost: one state block per boundary crossed, taken from the same pool as attention blocks (a hybrid
model's blocks are one page size); they are freed (kept as cache) when the chunk is done.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.utils.math_utils import cdiv
from vllm.v1.core.single_type_kv_cache_manager import MambaManager

logger = logging.getLogger(__name__)


class BlockStateMambaManager(MambaManager):
    """MambaManager that keeps a state block at every interior block boundary of a chunk.

    Handles the plain case only (no speculative blocks, no partial-block hit); anything else is
    left exactly to vLLM, and the layer writes nothing it was not given a block for.
    """

    def _covers(self, request_id: str) -> bool:
        return (
            self.mamba_cache_mode == "align"
            and self.num_speculative_blocks == 0
            and request_id not in self._partial_hit_reqs
        )

    def _num_interior(self, first_new_column: int, num_tokens: int) -> int:
        # vLLM nulls columns [first_new_column, cdiv(num_tokens, B) - 1); the last one is the
        # chunk's running state block.
        return max(0, cdiv(num_tokens, self.block_size) - 1 - first_new_column)

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Any,
        total_computed_tokens: int,
        num_local_computed_tokens: int,
        num_tokens_main_model: int,
        *args: Any,
        **kwargs: Any,
    ) -> int:
        needed = super().get_num_blocks_to_allocate(
            request_id,
            num_tokens,
            new_computed_blocks,
            total_computed_tokens,
            num_local_computed_tokens,
            num_tokens_main_model,
            *args,
            **kwargs,
        )
        if needed > self.block_pool.num_gpu_blocks or not self._covers(request_id):
            return needed  # "not this step" or a case left to vLLM
        if self._has_partial_local_hit(new_computed_blocks, num_local_computed_tokens):
            return needed
        first_new = len(self.req_to_blocks[request_id]) + len(new_computed_blocks)
        return needed + self._num_interior(first_new, num_tokens_main_model)

    def allocate_new_blocks(self, request_id: str, num_tokens: int, num_tokens_main_model: int) -> list:
        covered = self._covers(request_id)
        req_blocks = self.req_to_blocks[request_id]
        prev_len = len(req_blocks)
        new = super().allocate_new_blocks(request_id, num_tokens, num_tokens_main_model)
        # The worker appends `new` to its block-table row, so it must be exactly the new columns.
        if not covered or not new or len(new) != len(req_blocks) - prev_len:
            return new
        interior = [i for i in range(prev_len, len(req_blocks) - 1) if req_blocks[i].is_null]
        if not interior:
            return new
        for column, block in zip(interior, self.block_pool.get_new_blocks(len(interior))):
            req_blocks[column] = block
        return req_blocks[prev_len:]


def recurrent_layers_reason(specs: dict[str, Any], layer_types: dict[str, type]) -> str | None:
    """None when every recurrent layer of the model writes block states, else why not.

    ``specs``: layer name -> its KV-cache spec, for the layers of the engine's Mamba groups;
    ``layer_types``: layer name -> the class the model built for it. The rule is what the model
    *is*, not its name: each recurrent layer must be the layer this project put in place of
    vLLM's ``QwenGatedDeltaNetAttention`` (Qwen3-Next, Qwen3.5 and the models built on their
    decoder layers) and hold vLLM's GatedDeltaNet state layout (a conv state and a recurrent
    state, the two tensors the layer copies into a boundary's block). Another recurrent layer
    (Mamba2, Kimi's KDA, OLMo's GDN) runs its own kernel and would leave the boundary blocks
    the scheduler hands out unwritten, so one such layer turns block states off for the model.
    """
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

    if not specs:
        return "the model has no recurrent layers"
    for name, spec in sorted(specs.items()):
        layer = layer_types.get(name)
        if layer is None:
            return f"layer {name} is not built in the scheduler's process"
        if not getattr(layer, "WRITES_BLOCK_STATES", False):
            return (
                f"layer {name} is {layer.__name__}, not vLLM's QwenGatedDeltaNetAttention "
                "replaced by the omni_cache vLLM plugin (workers.models:register)"
            )
        if (
            getattr(spec, "mamba_type", None) != MambaAttentionBackendEnum.GDN_ATTN
            or len(getattr(spec, "shapes", ())) != 2
        ):
            return f"layer {name} does not hold vLLM's GatedDeltaNet state layout (a conv and a recurrent state)"
    return None


def _recurrent_layers(scheduler: Any) -> tuple[dict[str, Any], dict[str, type]]:
    """The scheduler's Mamba-group layers: their specs and the classes the model built.

    A stage runs one in-process vLLM worker, so the model's layers are in this process's
    forward context (vLLM fills it while it builds the model, before the scheduler starts)."""
    from vllm.v1.kv_cache_interface import MambaSpec

    specs = {
        name: group.kv_cache_spec
        for group in scheduler.kv_cache_config.kv_cache_groups
        if isinstance(group.kv_cache_spec, MambaSpec)
        for name in group.layer_names
    }
    context = scheduler.vllm_config.compilation_config.static_forward_context
    return specs, {name: type(context[name]) for name in specs if name in context}


def block_states_supported(scheduler: Any) -> str | None:
    """None when block states can be on for this engine, else why not (logged)."""
    from vllm.platforms import current_platform

    vllm_config = scheduler.vllm_config
    cache = vllm_config.cache_config
    if not cache.enable_prefix_caching or cache.mamba_cache_mode != "align":
        return "prefix caching is off or not in align mode"
    reason = recurrent_layers_reason(*_recurrent_layers(scheduler))
    if reason is not None:
        return reason
    if not current_platform.is_cpu():
        return "only vLLM's CPU GatedDeltaNet path writes block states"
    if not vllm_config.model_config.enforce_eager:
        return "needs enforce_eager (the segment plan is not compiled)"
    if (vllm_config.additional_config or {}).get("omni_cache_block_states") is False:
        return "turned off by the stage (omni_cache_block_states=False)"
    return None


def needs_aligned_chunks(scheduler: Any) -> bool:
    """Cases where vLLM's chunk stops carry more than block states replace: partial-block hash hits
    (a hash block below the attention block) and EAGLE's dropped block."""
    return bool(
        getattr(scheduler, "mamba_partial_cache_hit", False) or getattr(scheduler, "use_eagle_block_drop", False)
    )


def install(scheduler: Any) -> bool:
    """Re-class the scheduler's align-mode MambaManagers; True when block states are on.

    vLLM builds its managers inside KVCacheManager from a type-keyed map and offers no hook to
    choose the class; BlockStateMambaManager adds no state, so re-classing the built instance is
    exact.
    """
    reason = block_states_supported(scheduler)
    if reason is not None:
        logger.info("hybrid block states off: %s", reason)
        return False
    managers = scheduler.kv_cache_manager.coordinator.single_type_managers
    mamba = [m for m in managers if type(m) is MambaManager]
    for manager in mamba:
        manager.__class__ = BlockStateMambaManager
    logger.info("hybrid block states on for %d mamba group(s)", len(mamba))
    return bool(mamba)
