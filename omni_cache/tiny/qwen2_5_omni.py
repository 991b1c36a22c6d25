"""The tiny Qwen2.5-Omni checkpoint's contents: config, weight names and init, tokenizer specials,
speakers, processor files and chat template, in the released ``Qwen2_5OmniModel`` layout.

``omni_cache.tiny.checkpoints`` writes the files (name ``qwen2.5-omni``); this module only says what
goes in them. One folder holds the whole model, as released: ``config.json`` with ``thinker_config`` /
``talker_config`` / ``token2wav_config``, one ``model.safetensors`` with ``thinker.*``, ``talker.*`` and
``token2wav.*`` tensors (thinker and talker in bf16; token2wav in float32, the dtype transformers runs
it in), and ``spk_dict.pt`` with the speakers' conditioning.

Sizes: thinker 4 layers (Qwen2, hidden 256), 2-layer audio (Whisper-style, 128 mel bins) and vision
(Qwen2.5-VL style, patch 14, merge 2, windowed attention with one full-attention block) encoders;
talker 2 layers (hidden 128) over the thinker-wide codec embeddings; token2wav: a 4-layer DiT (hidden
64, blocks of 24 mel frames) and a BigVGAN vocoder with the released upsampling (240 samples per mel
frame, 24 kHz). About 5.5M parameters.

Codec ids: codes 0..255 (:data:`CODEBOOK_SIZE`), then the talker's specials in the released order
(released pad 8292, start 8293, end 8294, mask 8296): :data:`CODEC_PAD_ID` 256, :data:`CODEC_BOS_ID`
257, :data:`CODEC_EOS_ID` 258, :data:`CODEC_MASK_ID` 259 (the released unused id between end and mask
is not kept); talker vocabulary 264. The DiT embeds ids 0..257 (``num_embeds`` 257, like the released 8193 after
an 8192-code book).

Random weights and greedy parity: transformers' reference stops the talker on pad or end
(``talker_eos_token_id``, released ``[8292, 8294]``) and suppresses only start. A random talker would
also pick mask or the unused ids above the codebook, which token2wav cannot embed, so the rows of
``talker.codec_head.weight`` for every id >= :data:`CODEBOOK_SIZE` are zero except pad and end: their
logit is 0 while about half the code logits are positive, so greedy decoding emits only codes or a stop
id. A stop is possible but rare (none in 200 greedy steps on six prompts): bound the talker with
``talker_max_new_tokens``.

token2wav is scaled so that its audio follows the codes (see :data:`DIT_GAIN`, :data:`DIT_MEL_MEAN`,
:data:`VOCODER_CONV_GAIN`): waveform std about 0.13, no clipping, and two code sequences decoded from the
same noise differ by about 40% of that.

Token ids: bytes 0..255 are ids 0..255 (the project's byte-level tokenizer), :data:`SPECIAL_TOKENS`
follow from 256 with the released names (``<|AUDIO|>``, ``<|IMAGE|>``, ``<|VIDEO|>`` are the pads the
processor expands). The role names are single tokens, as in the released tokenizer: the talker's input
takes the first answer token at a fixed offset in the assistant turn. Each speaker of ``spk_dict.pt``
names a thinker token (``bos_token``) that opens the talker's text stream.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable

import torch

from omni_cache.tiny.processors import vision_processor, whisper_features

__all__ = [
    "CODEBOOK_SIZE",
    "CODEC_BOS_ID",
    "CODEC_EOS_ID",
    "CODEC_MASK_ID",
    "CODEC_PAD_ID",
    "DEFAULT_SPEAKER",
    "SPEAKERS",
    "SPECIAL_TOKENS",
    "CHAT_TEMPLATE",
    "TALKER_VOCAB_SIZE",
    "TOKENIZER_EXTRA_CONFIG",
    "TOKEN_ID",
    "VOCAB_SIZE",
    "config",
    "generation_config",
    "preprocessor_config",
    "random_weights",
    "speaker_dict",
    "speaker_dict_bytes",
    "video_preprocessor_config",
]

SPECIAL_TOKENS = (
    "<|endoftext|>",  # 256
    "<|im_start|>",  # 257
    "<|im_end|>",  # 258
    "<|AUDIO|>",
    "<|audio_bos|>",
    "<|audio_eos|>",
    "<|IMAGE|>",
    "<|VIDEO|>",
    "<|vision_bos|>",
    "<|vision_eos|>",
    "<|vision_pad|>",
    "<tts_text_bos>",
    "<tts_text_eod>",
    "<tts_text_pad>",
    "<tts_text_bos_single>",
    # Each speaker of spk_dict.pt starts the talker's text stream with its own thinker token.
    "<|speaker_chelsie|>",
    "<|speaker_ethan|>",
    # Role names: one token each, as in the released tokenizer.
    "system",
    "user",
    "assistant",
)
TOKEN_ID = {t: 256 + i for i, t in enumerate(SPECIAL_TOKENS)}
VOCAB_SIZE = 512

# Qwen2_5OmniProcessor reads these attributes from its tokenizer.
TOKENIZER_EXTRA_CONFIG = {
    "extra_special_tokens": {
        "audio_bos_token": "<|audio_bos|>",
        "audio_eos_token": "<|audio_eos|>",
        "audio_token": "<|AUDIO|>",
        "image_token": "<|IMAGE|>",
        "video_token": "<|VIDEO|>",
        "vision_bos_token": "<|vision_bos|>",
        "vision_eos_token": "<|vision_eos|>",
    },
}

THINKER_HIDDEN = 256
TALKER_HIDDEN = 128
# Released: 8192 codes, DiT num_embeds 8193, talker vocabulary 8448 with pad 8292, start 8293, end 8294,
# mask 8296. Here the codebook is 256 codes; the specials keep their roles and order right after it.
CODEBOOK_SIZE = 256
DIT_NUM_EMBEDS = CODEBOOK_SIZE + 1
CODEC_PAD_ID, CODEC_BOS_ID, CODEC_EOS_ID, CODEC_MASK_ID = 256, 257, 258, 259
TALKER_VOCAB_SIZE = 264

SPEAKERS = {"Chelsie": "<|speaker_chelsie|>", "Ethan": "<|speaker_ethan|>"}
# transformers' generate() default speaker.
DEFAULT_SPEAKER = "Chelsie"

INIT_STD = 0.02
CONV_GAIN = 0.8
# token2wav at INIT_STD is silent about its input: the DiT's velocity is ~0, so its mel is the starting
# noise whatever the codes (0.3% of the mel's spread came from the codes). DiT linears at 1/sqrt(fan_in)
# and unit codec embeddings make the codes move the mel by about a third of its spread.
DIT_GAIN = 1.0
# The DiT's output bias: the log-mel at which BigVGAN's normalized input (dB over [-115, 0], 20 dB
# headroom) is 0, as a trained DiT's mean output sits mid-range. At bias 0 the vocoder sees a constant
# +0.65 in every bin and its output is a fixed pattern of the upsampling kernels, not the mel.
# Rounded to 1/16 (-4.3125), a value every dtype holds exactly, so the tensor reads as a constant.
DIT_MEL_MEAN = round(16 * math.log(10 ** ((-115 / 2 + 20) / 20))) / 16
# BigVGAN stacks ~40 convolutions with SnakeBeta (x + sin^2) activations; its output level is steep in
# the gain: 0.8 gives std ~0.04, 0.88 ~0.16 (the waveform's difference between two code sequences
# ~40% of that), 0.95 clips 40% of the samples.
VOCODER_CONV_GAIN = 0.87
SAMPLE_RATE = 24000
# Mel frames of each speaker's reference mel (the DiT's speaker encoder pools over them).
REF_MEL_FRAMES = 96

# The released template's semantics: a default system message when the first message is not one, and
# one placeholder per media item where the part stands (the processor, or vLLM's multimodal processor,
# expands the pad token to the encoder's length). OpenAI content part types are accepted beside Qwen's.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if loop.first and message['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'text' %}{{- part['text'] }}"
    "{%- elif part['type'] in ['image', 'image_url'] %}"
    "{{- '<|vision_bos|><|IMAGE|><|vision_eos|>' }}"
    "{%- elif part['type'] in ['audio', 'input_audio', 'audio_url'] %}"
    "{{- '<|audio_bos|><|AUDIO|><|audio_eos|>' }}"
    "{%- elif part['type'] in ['video', 'video_url'] %}"
    "{{- '<|vision_bos|><|VIDEO|><|vision_eos|>' }}"
    "{%- endif %}{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Released thinker and talker: head_dim 128, mrope_section [16, 24, 24]; halved for head_dim 64.
_MROPE = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [8, 12, 12]}


def config() -> dict:
    """Arguments of ``Qwen2_5OmniConfig`` (the caller lets transformers fill in the defaults)."""
    tid = TOKEN_ID
    media_ids = {
        "audio_token_index": tid["<|AUDIO|>"],
        "image_token_index": tid["<|IMAGE|>"],
        "video_token_index": tid["<|VIDEO|>"],
        "audio_start_token_id": tid["<|audio_bos|>"],
        "audio_end_token_id": tid["<|audio_eos|>"],
        "position_id_per_seconds": 25,
        "seconds_per_chunk": 2,
    }
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
        "rope_parameters": dict(_MROPE),
        "use_sliding_window": False,
        "pad_token_id": tid["<|endoftext|>"],
        "bos_token_id": tid["<|im_start|>"],
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
        "n_window": 100,
        "output_dim": THINKER_HIDDEN,
    }
    vision_config = {
        "depth": 2,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_heads": 2,
        "in_channels": 3,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "window_size": 112,
        "fullatt_block_indexes": [1],
        "out_hidden_size": THINKER_HIDDEN,
        # Released; vLLM reads it for the video positions (25 when absent).
        "tokens_per_second": 25,
    }
    thinker_config = {
        "text_config": text_config,
        "audio_config": audio_config,
        "vision_config": vision_config,
        **media_ids,
        "user_token_id": tid["user"],
        # Released thinker keys transformers does not declare but keeps (vLLM reads the vision ones).
        "vision_start_token_id": tid["<|vision_bos|>"],
        "vision_end_token_id": tid["<|vision_eos|>"],
        "vision_token_id": tid["<|vision_pad|>"],
        "bos_token_id": tid["<|im_start|>"],
        "eos_token_id": tid["<|im_end|>"],
        "pad_token_id": tid["<|endoftext|>"],
    }
    talker_config = {
        "vocab_size": TALKER_VOCAB_SIZE,
        "embedding_size": THINKER_HIDDEN,
        "hidden_size": TALKER_HIDDEN,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "rope_parameters": dict(_MROPE),
        "use_sliding_window": False,
        "tts_text_start_token_id": tid["<tts_text_bos>"],
        "tts_text_end_token_id": tid["<tts_text_eod>"],
        "tts_text_pad_token_id": tid["<tts_text_pad>"],
        "tts_codec_start_token_id": CODEC_BOS_ID,
        "tts_codec_end_token_id": CODEC_EOS_ID,
        "tts_codec_pad_token_id": CODEC_PAD_ID,
        "tts_codec_mask_token_id": CODEC_MASK_ID,
        "vision_start_token_id": tid["<|vision_bos|>"],
        "vision_end_token_id": tid["<|vision_eos|>"],
        "spatial_merge_size": 2,
        **media_ids,
    }
    dit_config = {
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 2,
        "head_dim": 32,
        "ff_mult": 2,
        "emb_dim": 32,
        "max_position_embeddings": 32768,
        # Released: 22 layers, look ahead in layer 10, look back in layers 0 and 20; the same places
        # scaled to 4 layers. Blocks of 24 mel frames, as released.
        "block_size": 24,
        "look_ahead_layers": [2],
        "look_backward_layers": [0, 3],
        "repeats": 2,
        "num_embeds": DIT_NUM_EMBEDS,
        "mel_dim": 80,
        "dropout": 0.0,
        "enc_emb_dim": 32,
        "enc_dim": 32,
        "enc_channels": [32, 32, 32, 32, 96],
        "enc_kernel_sizes": [5, 3, 3, 3, 1],
        "enc_dilations": [1, 2, 3, 4, 1],
        "enc_attention_channels": 16,
        "enc_res2net_scale": 2,
        "enc_se_channels": 16,
    }
    bigvgan_config = {
        "mel_dim": 80,
        "upsample_initial_channel": 128,
        "resblock_kernel_sizes": [3, 7, 11],
        "resblock_dilation_sizes": [[1, 3, 5], [1, 3, 5], [1, 3, 5]],
        # Released: 240 samples per mel frame (24 kHz); kept.
        "upsample_rates": [5, 3, 2, 2, 2, 2],
        "upsample_kernel_sizes": [11, 7, 4, 4, 4, 4],
    }
    return {
        "architectures": ["Qwen2_5OmniModel"],
        "thinker_config": thinker_config,
        "talker_config": talker_config,
        "token2wav_config": {"dit_config": dit_config, "bigvgan_config": bigvgan_config},
        "enable_audio_output": True,
        "dtype": "bfloat16",
    }


def generation_config() -> dict:
    return {
        "bos_token_id": TOKEN_ID["<|im_start|>"],
        "eos_token_id": TOKEN_ID["<|im_end|>"],
        "pad_token_id": TOKEN_ID["<|endoftext|>"],
        "do_sample": False,
    }


_PROCESSOR_COMMON = {
    **vision_processor(
        "Qwen2_5OmniProcessor",
        mean=[0.48145466, 0.4578275, 0.40821073],
        std=[0.26862954, 0.26130258, 0.27577711],
        patch_size=14,
    ),
    # Released bounds: 56x56 to 12,845,056 pixels (about 16,000 vision tokens).
    "min_pixels": 3136,
    "max_pixels": 12845056,
    "size": {"longest_edge": 12845056, "shortest_edge": 3136},
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
    module = name.rsplit(".", 2)[-2]
    dit = name.startswith("token2wav.code2wav_dit_model.")
    if len(shape) == 1:
        if name == "token2wav.code2wav_dit_model.proj_out.bias":
            return "const", DIT_MEL_MEAN
        if leaf == "bias":
            return "const", 0.0
        if leaf in ("alpha", "beta"):  # SnakeBeta keeps log-scale parameters: exp(0) = 1
            return "const", 0.0
        if leaf == "weight" and ("norm" in module or module.startswith("ln")):
            return "const", 1.0
        raise ValueError(f"no init rule for 1-D tensor {name}")
    if len(shape) >= 3:  # convolutions
        gain = VOCODER_CONV_GAIN if name.startswith("token2wav.code2wav_bigvgan_model.") else CONV_GAIN
        return "normal", gain / math.sqrt(math.prod(shape[1:]))
    if dit:
        return "normal", 1.0 if module == "codec_embed" else DIT_GAIN / math.sqrt(shape[1])
    return "normal", INIT_STD


def _file_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of the released file layout, from transformers' own module tree."""
    from transformers import Qwen2_5OmniConfig, Qwen2_5OmniForConditionalGeneration

    with torch.device("meta"):
        model = Qwen2_5OmniForConditionalGeneration(Qwen2_5OmniConfig(**cfg))
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def random_weights(cfg: dict, normal: Callable[[str, tuple[int, ...], float], torch.Tensor]) -> dict[str, torch.Tensor]:
    """Weights for ``cfg`` in the file layout; ``normal(name, shape, std)`` draws float32 N(0, std).

    bf16 except ``token2wav.*`` (float32: transformers casts token2wav to float32 whatever the load
    dtype, so the file keeps the precision it runs at)."""
    out: dict[str, torch.Tensor] = {}
    for name, shape in _file_shapes(cfg).items():
        kind, value = _init(name, shape)
        t = normal(name, shape, value) if kind == "normal" else torch.full(shape, value)
        if name == "talker.codec_head.weight":
            # Only codes and the two stop ids can win a greedy step (module docstring).
            keep = torch.zeros(shape[0], dtype=torch.bool)
            keep[:CODEBOOK_SIZE] = True
            keep[[CODEC_PAD_ID, CODEC_EOS_ID]] = True
            t[~keep] = 0.0
        out[name] = t if name.startswith("token2wav.") else t.to(torch.bfloat16)
    return out


def speaker_dict(cfg: dict, normal: Callable[[str, tuple[int, ...], float], torch.Tensor]) -> dict[str, dict]:
    """``spk_dict.pt``'s contents, per speaker as transformers' ``generate`` reads them: ``cond`` (the
    DiT's speaker embedding, ``[1, enc_emb_dim]``), ``ref_mel`` (a reference log-mel, ``[1, frames,
    mel_dim]``) and ``bos_token`` (the thinker token that opens the talker's text stream)."""
    dit = cfg["token2wav_config"]["dit_config"]
    out = {}
    for speaker, token in SPEAKERS.items():
        key = speaker.lower()
        # Log-mel values around -4 (quiet speech in natural-log amplitude), unit spread.
        ref_mel = normal(f"spk.{key}.ref_mel", (1, REF_MEL_FRAMES, dit["mel_dim"]), 1.0) - 4.0
        out[speaker] = {
            "cond": normal(f"spk.{key}.cond", (1, dit["enc_emb_dim"]), 1.0),
            "ref_mel": ref_mel,
            "bos_token": TOKEN_ID[token],
        }
    return out


def speaker_dict_bytes(speakers: dict[str, dict]) -> bytes:
    """``torch.save`` bytes of ``speakers`` (loads with ``torch.load(weights_only=True)``)."""
    buf = io.BytesIO()
    torch.save(speakers, buf)
    return buf.getvalue()
