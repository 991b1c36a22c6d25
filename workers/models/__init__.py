"""Model-layer classes this project registers with vLLM.

`register` is a vLLM general plugin (entry point `vllm.general_plugins` in pyproject.toml), so vLLM
calls it in every process it starts (engine core, workers, model inspection), before any model is
built: a layer registered here is the one every process instantiates, which is what keeps the
scheduler's block allocation and the layer's state writes in lockstep on multi-process hosts too.
"""

from __future__ import annotations

from typing import Any

#: The architecture name of this project's Qwen3-Omni talker (workers/models/qwen3_omni_talker.py).
TALKER_ARCHITECTURE = "OmniCacheQwen3OmniTalker"
#: The released Qwen3-Omni checkpoints' architecture; vLLM serves its thinker under this name.
QWEN3_OMNI_ARCHITECTURE = "Qwen3OmniMoeForConditionalGeneration"
#: The architecture name of this project's Qwen2.5-Omni talker (workers/models/qwen2_5_omni_talker.py).
QWEN2_5_OMNI_TALKER_ARCHITECTURE = "OmniCacheQwen2_5OmniTalker"
#: The released Qwen2.5-Omni checkpoints' architecture names; vLLM serves their thinker under both.
QWEN2_5_OMNI_ARCHITECTURES = ("Qwen2_5OmniModel", "Qwen2_5OmniForConditionalGeneration")
#: The talker module of each family, by its checkpoint's config.json model_type: each module has
#: the same small interface (its hf_overrides and the engine arguments it needs).
TALKER_MODULES = {
    "qwen3_omni_moe": "workers.models.qwen3_omni_talker",
    "qwen2_5_omni": "workers.models.qwen2_5_omni_talker",
}


def register() -> None:
    _register_omni_models()
    from vllm.model_executor.custom_op import op_registry_oot
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention

    from workers.models.gdn_block_states import BlockStateGatedDeltaNet

    # vLLM may load plugins more than once per process; register_oot asserts on duplicates.
    if op_registry_oot.get("QwenGatedDeltaNetAttention") is not BlockStateGatedDeltaNet:
        QwenGatedDeltaNetAttention.register_oot(BlockStateGatedDeltaNet, name="QwenGatedDeltaNetAttention")


def _register_omni_models() -> None:
    from vllm import ModelRegistry

    # Lazy ("module:Class"): importing the model needs vLLM's layers, which plugins load early.
    # Registering a name again replaces its class (vLLM logs it at debug level), so this is
    # idempotent; the thinker replaces vLLM's own class for the checkpoint's architecture.
    ModelRegistry.register_model(TALKER_ARCHITECTURE, "workers.models.qwen3_omni_talker:Qwen3OmniTalkerForCausalLM")
    ModelRegistry.register_model(
        QWEN2_5_OMNI_TALKER_ARCHITECTURE, "workers.models.qwen2_5_omni_talker:Qwen2_5OmniTalkerForCausalLM"
    )
    ModelRegistry.register_model(
        QWEN3_OMNI_ARCHITECTURE, "workers.models.qwen3_omni_thinker:Qwen3OmniThinkerForConditionalGeneration"
    )
    for arch in QWEN2_5_OMNI_ARCHITECTURES:
        ModelRegistry.register_model(
            arch, "workers.models.qwen2_5_omni_thinker:Qwen2_5OmniThinkerForConditionalGeneration"
        )


def talker_module(model: str) -> Any:
    """The talker module (TALKER_MODULES) of the checkpoint folder `model`."""
    import importlib
    import json
    from pathlib import Path

    config = Path(model) / "config.json"
    if not config.is_file():
        raise ValueError(f"submodel talker: {model} is not a checkpoint folder (no config.json)")
    model_type = json.loads(config.read_text()).get("model_type")
    if model_type not in TALKER_MODULES:
        raise ValueError(
            f"submodel talker: no talker for model_type {model_type!r} ({model}); known: {sorted(TALKER_MODULES)}"
        )
    return importlib.import_module(TALKER_MODULES[model_type])
