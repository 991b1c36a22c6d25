"""The tiny Qwen2.5-Omni checkpoint's contents: config, weight names and init, tokenizer specials, speakers,
processor files and chat template, in the released ``Qwen2_5OmniModel`` layout.

``omni_cache.models.checkpoints`` writes the files (name ``qwen2.5-omni``); this module only says what
goes in them. (Docstring completed below with the rest of the module.)
"""

from __future__ import annotations

__all__ = [
    "CODEBOOK_SIZE",
    "CODEC_BOS_ID",
    "CODEC_EOS_ID",
    "CODEC_MASK_ID",
    "CODEC_PAD_ID",
    "DEFAULT_SPEAKER",
    "SPEAKERS",
    "SPECIAL_TOKENS",
    "TALKER_VOCAB_SIZE",
    "TOKENIZER_EXTRA_CONFIG",
    "TOKEN_ID",
    "VOCAB_SIZE",
    "config",
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
