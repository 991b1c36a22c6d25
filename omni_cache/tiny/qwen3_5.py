"""The tiny Qwen3.5 checkpoint's contents: config, weight names and init, tokenizer specials,
processor files and chat template, in the released ``Qwen3_5ForConditionalGeneration`` layout.

``omni_cache.tiny.checkpoints`` writes the files (name ``qwen3.5``); this module only says what goes
in them. As released: ``config.json`` with ``text_config`` (``layer_types``: GatedDeltaNet
``linear_attention`` layers and gated ``full_attention`` layers, interleaved M-RoPE on a quarter of
each head) and ``vision_config`` (Qwen3-VL's encoder, no deepstack), one ``model.safetensors`` with
``model.language_model.*`` (GatedDeltaNet projections unfused: ``in_proj_qkv``, ``in_proj_z``,
``in_proj_b``, ``in_proj_a``), ``model.visual.*`` and ``lm_head.*``; processor files for
``Qwen3VLProcessor`` (images through ``Qwen2VLImageProcessorFast``, video through
``Qwen3VLVideoProcessor``, which writes a ``<t seconds>`` stamp before every frame group).
The released checkpoints also hold ``mtp.*`` (multi-token prediction) weights; vLLM's plain model
skips them and transformers does not build them, so the tiny one has none.

Sizes: text hidden 256, 3 GatedDeltaNet layers then 1 full-attention layer (Qwen3.5's 3:1 pattern),
dense MLP 512; GatedDeltaNet with 1 key head and 2 value heads of dim 128 (vLLM's CPU kernel refuses
smaller head dims); attention 4 query / 4 KV heads of dim 128. vLLM sizes a hybrid's block so that
one attention page (block x 2 KiB of KV per token here) holds one recurrent-state page (about 131 KiB:
the state is float32 for Qwen3.5): few GatedDeltaNet heads and wide KV keep that block at 128 tokens
(its default alignment on x86 CPUs), so tests of hits at block boundaries stay short. Vision: 1
block, hidden 64, patch 16, merge 2. About 3M parameters.

Norms are Gemma-style ``x * (1 + w)`` (``Qwen3_5RMSNorm``): their "unit" init is w = 0. The gated
norm inside the GatedDeltaNet layer (``linear_attn.norm``) is a plain ``x * w``: w = 1. ``A_log``
stays float32 as released; everything else is bfloat16 (vLLM's CPU GatedDeltaNet kernel takes
nothing else).

Token ids: bytes 0..255 are ids 0..255 (the project's byte-level tokenizer), :data:`SPECIAL_TOKENS`
follow from 256 (``<|endoftext|>`` 256, ``<|im_start|>`` 257, ``<|im_end|>`` 258, as in the other tiny
checkpoints), then filler tokens up to :data:`VOCAB_SIZE` so every id the random model samples decodes.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from omni_cache.tiny.processors import vision_processor

__all__ = [
    "CHAT_TEMPLATE",
    "SPECIAL_TOKENS",
    "TOKEN_ID",
    "TOKENIZER_EXTRA_CONFIG",
    "VOCAB_SIZE",
    "config",
    "generation_config",
    "preprocessor_config",
    "random_weights",
    "video_preprocessor_config",
]

SPECIAL_TOKENS = (
    "<|endoftext|>",  # 256
    "<|im_start|>",  # 257
    "<|im_end|>",  # 258
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tool_call>",
    "</tool_call>",
    "<think>",
    "</think>",
)
TOKEN_ID = {t: 256 + i for i, t in enumerate(SPECIAL_TOKENS)}
VOCAB_SIZE = 512

# Qwen3VLProcessor (and vLLM's Qwen3-VL processor) read these attributes from the tokenizer.
TOKENIZER_EXTRA_CONFIG = {
    "extra_special_tokens": {
        "image_token": "<|image_pad|>",
        "video_token": "<|video_pad|>",
        "vision_bos_token": "<|vision_start|>",
        "vision_eos_token": "<|vision_end|>",
    },
}

HIDDEN = 256
INIT_STD = 0.02

# Qwen3.5's template, reduced to what the tiny model needs: ChatML turns, one placeholder per image
# or video where the part stands (the processor expands it: a video becomes one stamped group per
# frame pair), OpenAI content-part names beside Qwen's own, and the released model's thinking switch
# (the assistant turn opens with ``<think>\n`` unless ``enable_thinking`` is false).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'text' %}{{- part['text'] }}"
    "{%- elif part['type'] in ['image', 'image_url'] %}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] in ['video', 'video_url'] %}"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{%- endif %}{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- else %}{{- '<think>\\n' }}{%- endif %}"
    "{%- endif %}"
)

LAYER_TYPES = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]


def config() -> dict:
    """``config.json`` as the released checkpoints write it (compact: transformers and vLLM fill in
    every other default)."""
    tid = TOKEN_ID
    text_config = {
        "model_type": "qwen3_5_text",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_output_gate": True,
        "dtype": "bfloat16",
        "eos_token_id": tid["<|im_end|>"],
        "pad_token_id": tid["<|endoftext|>"],
        "full_attention_interval": 4,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": HIDDEN,
        "initializer_range": INIT_STD,
        "intermediate_size": 512,
        "layer_types": LAYER_TYPES,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_num_key_heads": 1,
        "linear_num_value_heads": 2,
        "linear_value_head_dim": 128,
        "max_position_embeddings": 32768,
        "num_attention_heads": 4,
        "num_hidden_layers": len(LAYER_TYPES),
        "num_key_value_heads": 4,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "use_cache": True,
        "vocab_size": VOCAB_SIZE,
        # Interleaved M-RoPE (t, h, w) on a quarter of each head (32 of 128 dims: 16 frequencies).
        "rope_parameters": {
            "mrope_interleaved": True,
            "mrope_section": [6, 5, 5],
            "rope_type": "default",
            "rope_theta": 10000000,
            "partial_rotary_factor": 0.25,
        },
    }
    vision_config = {
        "model_type": "qwen3_5",
        "depth": 1,
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_size": 64,
        "in_channels": 3,
        "initializer_range": INIT_STD,
        "intermediate_size": 128,
        "num_heads": 2,
        # (image_size / patch_size)**2 == num_position_embeddings: vLLM interpolates a 8x8 grid.
        "num_position_embeddings": 64,
        "out_hidden_size": HIDDEN,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    }
    return {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "text_config": text_config,
        "vision_config": vision_config,
        "image_token_id": tid["<|image_pad|>"],
        "video_token_id": tid["<|video_pad|>"],
        "vision_start_token_id": tid["<|vision_start|>"],
        "vision_end_token_id": tid["<|vision_end|>"],
        "tie_word_embeddings": False,
    }


def generation_config() -> dict:
    return {
        "bos_token_id": TOKEN_ID["<|endoftext|>"],
        "eos_token_id": TOKEN_ID["<|im_end|>"],
        "pad_token_id": TOKEN_ID["<|endoftext|>"],
        "do_sample": False,
    }


_PROCESSOR_COMMON = vision_processor("Qwen3VLProcessor", mean=[0.5, 0.5, 0.5], std=[0.5, 0.5, 0.5], patch_size=16)


def preprocessor_config() -> dict:
    """The image processor, with the released bounds (64 Ki .. 16 Mi pixels)."""
    return {
        **_PROCESSOR_COMMON,
        "image_processor_type": "Qwen2VLImageProcessorFast",
        "size": {"longest_edge": 16777216, "shortest_edge": 65536},
    }


def video_preprocessor_config() -> dict:
    """The video processor, with the released bounds; frames are sampled at 2 fps."""
    return {
        **_PROCESSOR_COMMON,
        "video_processor_type": "Qwen3VLVideoProcessor",
        "size": {"longest_edge": 25165824, "shortest_edge": 4096},
        "fps": 2,
        "min_frames": 4,
        "max_frames": 768,
        "do_sample_frames": True,
    }


def _init(name: str, shape: tuple[int, ...], layers: int) -> tuple[str, float]:
    """(kind, value) for one file tensor: ("const", c), ("a_log", 0) or ("normal", std)."""
    leaf = name.rsplit(".", 1)[-1]
    module = name.rsplit(".", 2)[-2]
    if leaf == "A_log":
        return "a_log", 0.0
    if leaf == "dt_bias":
        return "const", 1.0
    if len(shape) == 1:
        if leaf == "bias":
            return "const", 0.0
        if name.startswith("model.language_model.") and module.endswith("norm"):
            # Qwen3_5RMSNorm is x * (1 + w); the GatedDeltaNet's gated norm is a plain x * w.
            return "const", 1.0 if name.endswith("linear_attn.norm.weight") else 0.0
        if leaf == "weight" and ("norm" in module or module.startswith("ln")):
            return "const", 1.0  # vision LayerNorms
        raise ValueError(f"no init rule for 1-D tensor {name}")
    if leaf in ("o_proj", "out_proj", "down_proj") or module in ("o_proj", "out_proj", "down_proj"):
        # Residual-branch outputs scaled by 1/sqrt(2 * layers) keep the residual stream flat.
        return "normal", INIT_STD / math.sqrt(2 * layers)
    if module == "conv1d":  # depthwise causal conv: ~1/sqrt(kernel) keeps its output scale
        return "normal", 1.0 / math.sqrt(shape[-1])
    if len(shape) >= 3:  # the vision patch embedding
        return "normal", 1.0 / math.sqrt(math.prod(shape[1:]))
    return "normal", INIT_STD


def _file_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of the released file layout, from transformers' own module tree."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    with torch.device("meta"):
        model = Qwen3_5ForConditionalGeneration(Qwen3_5Config(**cfg))
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def random_weights(
    cfg: dict,
    normal: Callable[[str, tuple[int, ...], float], torch.Tensor],
    uniform: Callable[[str, tuple[int, ...], float, float], torch.Tensor],
) -> dict[str, torch.Tensor]:
    """Weights for ``cfg`` in the file layout: bf16, ``A_log`` float32. ``normal(name, shape, std)``
    and ``uniform(name, shape, low, high)`` draw float32 tensors."""
    layers = cfg["text_config"]["num_hidden_layers"]
    out: dict[str, torch.Tensor] = {}
    for name, shape in _file_shapes(cfg).items():
        kind, value = _init(name, shape, layers)
        if kind == "a_log":
            # HF init draws A ~ U(0, 16); [1, 16] makes every head decay.
            out[name] = torch.log(uniform(name, shape, 1.0, 16.0))
            continue
        t = normal(name, shape, value) if kind == "normal" else torch.full(shape, value)
        out[name] = t.to(torch.bfloat16)
    return out
