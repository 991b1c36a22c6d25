"""Model-layer classes this project registers with vLLM.

`register` is a vLLM general plugin (entry point `vllm.general_plugins` in pyproject.toml), so vLLM
calls it in every process it starts (engine core, workers, model inspection), before any model is
built: a layer registered here is the one every process instantiates, which is what keeps the
scheduler's block allocation and the layer's state writes in lockstep on multi-process hosts too.
"""

from __future__ import annotations


def register() -> None:
    from vllm.model_executor.custom_op import op_registry_oot
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import (
        QwenGatedDeltaNetAttention,
    )

    from workers.models.gdn_block_states import BlockStateGatedDeltaNet

    # vLLM may load plugins more than once per process; register_oot asserts on duplicates.
    if op_registry_oot.get("QwenGatedDeltaNetAttention") is not BlockStateGatedDeltaNet:
        QwenGatedDeltaNetAttention.register_oot(BlockStateGatedDeltaNet,
                                                name="QwenGatedDeltaNetAttention")
