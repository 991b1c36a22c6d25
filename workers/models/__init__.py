"""Model-layer classes this project registers with vLLM.

`register` is a vLLM general plugin (entry point `vllm.general_plugins` in pyproject.toml), so vLLM
calls it in every process it starts (engine core, workers, model inspection), before any model is
built: a layer registered here is the one every process instantiates, which is what keeps the
scheduler's block allocation and the layer's state writes in lockstep on multi-process hosts too.
"""

from __future__ import annotations

#: The architecture name of this project's Qwen3-Omni talker (workers/models/qwen3_omni_talker.py).
TALKER_ARCHITECTURE = "OmniCacheQwen3OmniTalker"
#: The released Qwen3-Omni checkpoints' architecture; vLLM serves its thinker under this name.
QWEN3_OMNI_ARCHITECTURE = "Qwen3OmniMoeForConditionalGeneration"


def register() -> None:
    _register_qwen3_omni()
    from vllm.model_executor.custom_op import op_registry_oot
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention

    from workers.models.gdn_block_states import BlockStateGatedDeltaNet

    # vLLM may load plugins more than once per process; register_oot asserts on duplicates.
    if op_registry_oot.get("QwenGatedDeltaNetAttention") is not BlockStateGatedDeltaNet:
        QwenGatedDeltaNetAttention.register_oot(BlockStateGatedDeltaNet, name="QwenGatedDeltaNetAttention")


def _register_qwen3_omni() -> None:
    from vllm import ModelRegistry

    # Lazy ("module:Class"): importing the model needs vLLM's layers, which plugins load early.
    # Registering a name again replaces its class (vLLM logs it at debug level), so this is
    # idempotent; the thinker replaces vLLM's own class for the checkpoint's architecture.
    ModelRegistry.register_model(TALKER_ARCHITECTURE, "workers.models.qwen3_omni_talker:Qwen3OmniTalkerForCausalLM")
    ModelRegistry.register_model(
        QWEN3_OMNI_ARCHITECTURE, "workers.models.qwen3_omni_thinker:Qwen3OmniThinkerForConditionalGeneration"
    )
