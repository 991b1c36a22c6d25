"""The tiny Qwen3-Omni checkpoint's contents: config, weight names and init, tokenizer specials,
processor files and chat template, in the released ``Qwen3OmniMoeForConditionalGeneration`` layout.

``omni_cache.tiny.checkpoints`` writes the files (name ``qwen3-omni``); this module only says what
goes in them. One folder holds the whole model, as released: ``config.json`` with ``thinker_config`` /
``talker_config`` / ``code2wav_config``, one ``model.safetensors`` with ``thinker.*``, ``talker.*`` and
``code2wav.*`` tensors (MoE experts one tensor per expert, as in the released files and as vLLM reads
them; transformers fuses them when it loads).

Sizes: thinker 4 layers, hidden 256, MoE 4 experts top-2, 2-layer audio (Whisper-style, 128 mel bins)
and vision (patch 16, merge 2, deepstack) encoders; talker 2 MoE layers + a 1-layer code predictor over
4 code groups; code2wav 2 sliding-window layers (window 24) over 4 quantizers of 256 codes, 1920 samples
per code (24 kHz at 12.5 codes per second, as released). About 7M parameters, 14 MB in bf16.

Config keys a minimal config lacks but vLLM 0.32 reads (learned the hard way):
``vision_config.image_size`` (``(image_size / patch_size)**2 == num_position_embeddings``),
``vision_config.apply_vit_abs_pos_embed``, ``text_config.tie_word_embeddings``,
``thinker_config.audio_end_token_id``, ``talker_config.spatial_merge_size``. transformers' talker
suppresses the top 1024 ids of its vocabulary while generating, so the talker vocabulary is the codebook
plus 1024.

Token ids: bytes 0..255 are ids 0..255 (the project's byte-level tokenizer), :data:`SPECIAL_TOKENS`
follow from 256 (``<|endoftext|>`` 256, ``<|im_start|>`` 257, ``<|im_end|>`` 258, as in the other tiny
checkpoints). The role names ``system``, ``user`` and ``assistant`` are single tokens after them, as in
the released tokenizer (``<|im_start|>assistant\n`` is 3 tokens): transformers' talker input
assumes that layout (it takes the assistant turn's 4th token as the first answer token, and places
the end-of-speech marker by counting answer tokens from there).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from omni_cache.tiny.processors import vision_processor, whisper_features

__all__ = [
    "CHAT_TEMPLATE",
    "CODE2WAV_CODEBOOK_SIZE",
    "CODE2WAV_NUM_QUANTIZERS",
    "SPECIAL_TOKENS",
    "TOKEN_ID",
    "TOKENIZER_EXTRA_CONFIG",
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
    "<|audio_start|>",
    "<|audio_end|>",
    "<|audio_pad|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tts_pad>",
    "<tts_text_bos>",
    "<tts_text_eod>",
    "<tts_text_bos_single>",
    # Role names: one token each, as in the released tokenizer.
    "system",
    "user",
    "assistant",
)
TOKEN_ID = {t: 256 + i for i, t in enumerate(SPECIAL_TOKENS)}
VOCAB_SIZE = 512

# Qwen3OmniMoeProcessor reads these attributes from its tokenizer.
TOKENIZER_EXTRA_CONFIG = {
    "extra_special_tokens": {
        "audio_bos_token": "<|audio_start|>",
        "audio_eos_token": "<|audio_end|>",
        "audio_token": "<|audio_pad|>",
        "image_token": "<|image_pad|>",
        "video_token": "<|video_pad|>",
        "vision_bos_token": "<|vision_start|>",
        "vision_eos_token": "<|vision_end|>",
    },
}

THINKER_HIDDEN = 256
CODE2WAV_CODEBOOK_SIZE = 256
CODE2WAV_NUM_QUANTIZERS = 4
# Talker codec specials sit right after the codebook.
CODEC_PAD_ID, CODEC_BOS_ID, CODEC_EOS_ID = 256, 257, 258
CODEC_NOTHINK_ID, CODEC_THINK_BOS_ID, CODEC_THINK_EOS_ID, SPEAKER_ID = 259, 260, 261, 262

INIT_STD = 0.02
CONV_GAIN = 0.8
# Residual branch scales of code2wav (released init: layer scale 0.01, ConvNeXt gamma 1e-6, which make
# those branches vanish in a random model). 0.5 keeps the sliding-window transformer and the ConvNeXt
# blocks audible, so tests of the decoder's receptive field test something.
CODE2WAV_BRANCH_SCALE = 0.5

# Qwen3-Omni's template places one placeholder per media item where the part stands; the processor
# (or vLLM's multimodal processor) expands the pad token to the encoder's length. OpenAI content part
# types are accepted beside Qwen's own names.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'text' %}{{- part['text'] }}"
    "{%- elif part['type'] in ['image', 'image_url'] %}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] in ['audio', 'input_audio', 'audio_url'] %}"
    "{{- '<|audio_start|><|audio_pad|><|audio_end|>' }}"
    "{%- elif part['type'] in ['video', 'video_url'] %}"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{%- endif %}{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_MROPE = {"interleaved": True, "mrope_interleaved": True, "rope_theta": 1000000.0, "rope_type": "default"}


def config() -> dict:
    """Arguments of ``Qwen3OmniMoeConfig`` (the caller lets transformers fill in the defaults)."""
    tid = TOKEN_ID
    text_config = {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": THINKER_HIDDEN,
        "intermediate_size": 512,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "moe_intermediate_size": 128,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "rope_parameters": {**_MROPE, "mrope_section": [12, 10, 10]},
        "pad_token_id": tid["<|endoftext|>"],
        "eos_token_id": tid["<|im_end|>"],
        "tie_word_embeddings": False,
    }
    audio_config = {
        "num_mel_bins": 128,
        "encoder_layers": 2,
        "encoder_attention_heads": 4,
        "encoder_ffn_dim": 256,
        "d_model": 128,
        "max_source_positions": 1500,
        "n_window": 50,
        "n_window_infer": 800,
        "conv_chunksize": 500,
        "downsample_hidden_size": 32,
        "output_dim": THINKER_HIDDEN,
    }
    vision_config = {
        "depth": 2,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_heads": 2,
        "in_channels": 3,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "out_hidden_size": THINKER_HIDDEN,
        "num_position_embeddings": 256,
        "image_size": 256,
        "apply_vit_abs_pos_embed": True,
        "deepstack_visual_indexes": [0, 1],
    }
    media_ids = {
        "audio_token_id": tid["<|audio_pad|>"],
        "image_token_id": tid["<|image_pad|>"],
        "video_token_id": tid["<|video_pad|>"],
        "vision_start_token_id": tid["<|vision_start|>"],
        "audio_start_token_id": tid["<|audio_start|>"],
    }
    thinker_config = {
        "text_config": text_config,
        "audio_config": audio_config,
        "vision_config": vision_config,
        **media_ids,
        "audio_end_token_id": tid["<|audio_end|>"],
        "vision_end_token_id": tid["<|vision_end|>"],
        "user_token_id": tid["user"],
        "position_id_per_seconds": 13,
    }
    talker_config = {
        "text_config": {
            "vocab_size": CODE2WAV_CODEBOOK_SIZE + 1024,
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 64,
            "moe_intermediate_size": 64,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "shared_expert_intermediate_size": 128,
            "max_position_embeddings": 32768,
            "rope_parameters": {**_MROPE, "mrope_section": [16, 8, 8]},
        },
        "code_predictor_config": {
            "vocab_size": CODE2WAV_CODEBOOK_SIZE,
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 64,
            "num_code_groups": CODE2WAV_NUM_QUANTIZERS,
            "max_position_embeddings": 32768,
        },
        "num_code_groups": CODE2WAV_NUM_QUANTIZERS,
        "thinker_hidden_size": THINKER_HIDDEN,
        "accept_hidden_layer": 2,
        "codec_eos_token_id": CODEC_EOS_ID,
        "codec_nothink_id": CODEC_NOTHINK_ID,
        "codec_think_bos_id": CODEC_THINK_BOS_ID,
        "codec_think_eos_id": CODEC_THINK_EOS_ID,
        "codec_pad_id": CODEC_PAD_ID,
        "codec_bos_id": CODEC_BOS_ID,
        "speaker_id": {"ethan": SPEAKER_ID},
        "spatial_merge_size": 2,
        **media_ids,
    }
    code2wav_config = {
        "codebook_size": CODE2WAV_CODEBOOK_SIZE,
        "num_quantizers": CODE2WAV_NUM_QUANTIZERS,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        # Released: 72 (a 578-code receptive field over 8 layers). 24 keeps the tiny model's field at
        # 56 codes, so tests of chunked decoding with full context stay short.
        "sliding_window": 24,
        "max_position_embeddings": 8000,
        "upsample_rates": [8, 5, 4, 3],
        "upsampling_ratios": [2, 2],
        "decoder_dim": 96,
    }
    return {
        "architectures": ["Qwen3OmniMoeForConditionalGeneration"],
        "thinker_config": thinker_config,
        "talker_config": talker_config,
        "code2wav_config": code2wav_config,
        "enable_audio_output": True,
        "im_start_token_id": tid["<|im_start|>"],
        "im_end_token_id": tid["<|im_end|>"],
        "tts_pad_token_id": tid["<tts_pad>"],
        "tts_bos_token_id": tid["<tts_text_bos>"],
        "tts_eos_token_id": tid["<tts_text_eod>"],
        "system_token_id": tid["system"],
        "user_token_id": tid["user"],
        "assistant_token_id": tid["assistant"],
        "dtype": "bfloat16",
    }


def generation_config() -> dict:
    return {
        "bos_token_id": TOKEN_ID["<|endoftext|>"],
        "eos_token_id": TOKEN_ID["<|im_end|>"],
        "pad_token_id": TOKEN_ID["<|endoftext|>"],
        "do_sample": False,
    }


_PROCESSOR_COMMON = {
    **vision_processor("Qwen3OmniMoeProcessor", mean=[0.5, 0.5, 0.5], std=[0.5, 0.5, 0.5], patch_size=16),
    # The released cap (12,845,056 pixels: about 12,500 vision tokens), so an image costs the
    # tiny model as many tokens as it costs the real one; the tests send small images.
    "min_pixels": 32 * 32,
    "max_pixels": 12845056,
    "size": {"longest_edge": 12845056, "shortest_edge": 32 * 32},
}


def preprocessor_config() -> dict:
    """Whisper feature extractor (128 mel bins, 16 kHz) and Qwen2-VL image processor, one file."""
    return {
        **_PROCESSOR_COMMON,
        "image_processor_type": "Qwen2VLImageProcessor",
        **whisper_features(),
    }


def video_preprocessor_config() -> dict:
    return {**_PROCESSOR_COMMON, "video_processor_type": "Qwen2VLVideoProcessor"}


def _init(name: str, shape: tuple[int, ...]) -> tuple[str, float]:
    """(kind, value) for one file tensor: ("const", c) or ("normal", std)."""
    leaf = name.rsplit(".", 1)[-1]
    module = name.rsplit(".", 2)[-2] if name.count(".") >= 1 else ""
    if len(shape) == 1:
        if leaf == "bias":
            return "const", 0.0
        if leaf in ("alpha", "beta"):  # SnakeBeta keeps log-scale parameters: exp(0) = 1
            return "const", 0.0
        if leaf == "scale" or leaf == "gamma":  # layer scale / ConvNeXt gamma
            return "const", CODE2WAV_BRANCH_SCALE
        if leaf == "weight" and ("norm" in module or module.startswith("ln")):
            return "const", 1.0
        raise ValueError(f"no init rule for 1-D tensor {name}")
    if len(shape) >= 3:  # convolutions
        # code2wav stacks ~30 convolutions with residual SnakeBeta units: at gain 1 its waveform
        # saturates (95% of samples clipped to +-1), at 0.6 it is near silence; 0.8 gives std ~0.2.
        return "normal", CONV_GAIN / math.sqrt(math.prod(shape[1:]))
    return "normal", INIT_STD


def _file_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of the released file layout, from transformers' own module tree.

    transformers 5 keeps each MoE layer's experts fused in memory (``experts.gate_up_proj``
    ``[E, 2*I, H]``, ``experts.down_proj`` ``[E, H, I]``); files hold one tensor per expert.
    """
    from transformers import Qwen3OmniMoeConfig, Qwen3OmniMoeForConditionalGeneration

    with torch.device("meta"):
        model = Qwen3OmniMoeForConditionalGeneration(Qwen3OmniMoeConfig(**cfg))
    shapes: dict[str, tuple[int, ...]] = {}
    for name, t in model.state_dict().items():
        prefix, leaf = name.rsplit(".", 1)
        if prefix.endswith(".experts") and leaf == "gate_up_proj":
            n_exp, two_i, h = t.shape
            for e in range(n_exp):
                shapes[f"{prefix}.{e}.gate_proj.weight"] = (two_i // 2, h)
                shapes[f"{prefix}.{e}.up_proj.weight"] = (two_i // 2, h)
        elif prefix.endswith(".experts") and leaf == "down_proj":
            for e in range(t.shape[0]):
                shapes[f"{prefix}.{e}.down_proj.weight"] = tuple(t.shape[1:])
        else:
            shapes[name] = tuple(t.shape)
    return shapes


def random_weights(cfg: dict, normal: Callable[[str, tuple[int, ...], float], torch.Tensor]) -> dict[str, torch.Tensor]:
    """bf16 weights for ``cfg`` in the file layout; ``normal(name, shape, std)`` draws float32 N(0, std)."""
    out: dict[str, torch.Tensor] = {}
    for name, shape in _file_shapes(cfg).items():
        kind, value = _init(name, shape)
        t = normal(name, shape, value) if kind == "normal" else torch.full(shape, value)
        out[name] = t.to(torch.bfloat16)
    return out
