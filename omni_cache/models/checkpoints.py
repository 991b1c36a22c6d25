"""Deterministic tiny random-weight checkpoints that vLLM loads through its normal path.

No model can be downloaded where this project is built and tested, so the default pipeline and the
tests run on checkpoints written here: Hugging Face layout (``config.json``, ``model.safetensors``,
``generation_config.json``, tokenizer files), random weights with a sane init scale, and a byte-level
tokenizer. vLLM loads them exactly as it would load a real checkpoint (``vllm.LLM(model=path)``).

Checkpoints (``CHECKPOINT_NAMES``):

``thinker``
    Qwen3 dense (``Qwen3ForCausalLM``): hidden 512, 8 layers, 8 heads / 4 kv heads, head_dim 64.
``thinker-hybrid``
    Qwen3-Next (``Qwen3NextForCausalLM``): 3 GatedDeltaNet layers then 1 full-attention layer, tiny MoE
    (4 experts, every token routed to all 4: see ``_hybrid_config``).
``talker``
    Qwen3 dense over an audio-codec vocabulary (256 codes + bos/eos/pad), hidden 256, fed the thinker's
    hidden states as prompt embeddings through ``thinker_projection.safetensors``.
``decoder``
    :class:`omni_cache.models.codec_decoder.CodecDecoder`: codec codes -> 24 kHz waveform.
``qwen3-omni``
    Qwen3-Omni (``Qwen3OmniMoeForConditionalGeneration``) in the released layout: thinker (MoE, audio and
    vision encoders), talker and code2wav in one folder, with processor files and a chat template for
    image/audio/video content parts. What goes in it: :mod:`omni_cache.models.tiny_qwen3_omni`.

Determinism: the same (name, seed) gives byte-identical files. Every tensor is drawn from its own
``torch.Generator`` seeded from (seed, crc32 of "<checkpoint>/<tensor name>"), so the output does not
depend on dict order; safetensors are written with sorted keys and fixed metadata, JSON with
``sort_keys`` and no timestamps or library versions.

Token ids (thinker, thinker-hybrid): bytes 0..255 are ids 0..255 (id == byte value, GPT-2 byte-to-unicode
symbols, no merges), ``<|endoftext|>`` = 256, ``<|im_start|>`` = 257, ``<|im_end|>`` = 258 (eos);
``vocab_size`` = 512. Talker: codec codes 0..255 are ids 0..255, codec_bos = 256, codec_eos = 257 (eos),
codec_pad = 258, ``vocab_size`` = 320.

Facts about vLLM 0.32 (CPU) learned while making these load:
- CPU attention needs ``block_size`` a multiple of 32; GatedDeltaNet's CPU kernel needs linear key/value
  head dims of 128 (32 is refused).
- Qwen3-Next norms are Gemma-style ``x * (1 + w)`` (``GemmaRMSNorm``): their "unit" init is w = 0, not 1.
  The gated norm inside the GDN layer (``linear_attn.norm``, ``RMSNormGated``) is a plain ``x * w``: w = 1.
- Qwen3-Next in vLLM reads the fused HF layouts: ``linear_attn.in_proj_qkvz`` ([2*K + 2*V, hidden],
  interleaved per key-head group), ``linear_attn.in_proj_ba`` ([2 * num_v_heads, hidden]),
  ``linear_attn.conv1d.weight`` ([2*K + V, 1, kernel]); with ``attn_output_gate`` (default True)
  ``self_attn.q_proj`` is twice as tall ([2 * heads * head_dim, hidden]: query and gate per head).
- vLLM's default loader reads every ``*.safetensors`` file of the folder unless a
  ``model.safetensors.index.json`` names the ones holding the model, so the talker (which keeps
  ``thinker_projection.safetensors`` beside its weights) ships an index.
- The talker's tokenizer has its own special tokens (codec_bos/eos/pad at 256/257/258): vLLM takes its
  default stop token from the tokenizer's eos, so reusing the thinker tokenizer (eos = 258) would stop
  the talker on codec_pad.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import zlib
from pathlib import Path
from typing import Callable

import torch

from omni_cache.models.tiny import TINY_MODELS, resolve_checkpoint_dir

__all__ = [
    "CHECKPOINT_NAMES",
    "CODEBOOK_SIZE",
    "CODEC_BOS_ID",
    "CODEC_EOS_ID",
    "CODEC_PAD_ID",
    "COMPLETE_MARKER",
    "default_checkpoint_dir",
    "ensure_checkpoint",
    "write_checkpoint",
]

CHECKPOINT_NAMES = tuple(TINY_MODELS)

# Written last inside a checkpoint directory; its presence means the directory is complete.
COMPLETE_MARKER = ".omni_cache_complete"
# Bump when the generator changes what it writes (part of the marker, so stale caches are rebuilt).
FORMAT_VERSION = 6

# ---- token ids -------------------------------------------------------------------------------------
TEXT_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 256, 257, 258
TEXT_PAD_ID, IM_START_ID, IM_END_ID = 256, 257, 258
TEXT_VOCAB_SIZE = 512  # 259 real tokens rounded up to a multiple of 512 / 64

CODEBOOK_SIZE = 256
CODEC_BOS_ID, CODEC_EOS_ID, CODEC_PAD_ID = 256, 257, 258
CODEC_SPECIAL_TOKENS = ("<|codec_bos|>", "<|codec_eos|>", "<|codec_pad|>")  # ids 256, 257, 258
TALKER_VOCAB_SIZE = 320

THINKER_HIDDEN = 512
TALKER_HIDDEN = 256
MAX_POSITIONS = 32768

INIT_STD = 0.02

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['content'] is string %}{%- set content = message['content'] %}"
    "{%- else %}{%- set content = namespace(text='') %}"
    "{%- for part in message['content'] %}{%- if part['type'] == 'text' %}"
    "{%- set content.text = content.text + part['text'] %}{%- endif %}{%- endfor %}"
    "{%- set content = content.text %}{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


# ---- helpers ---------------------------------------------------------------------------------------
def default_checkpoint_dir() -> Path:
    """``$OMNI_CACHE_CHECKPOINTS`` if set, else ``~/.cache/omni_cache/checkpoints``."""
    return resolve_checkpoint_dir()


def _check_name(name: str) -> None:
    if name not in CHECKPOINT_NAMES:
        raise ValueError(
            f"unknown checkpoint name {name!r}; valid names: {', '.join(CHECKPOINT_NAMES)}"
        )


def _tensor_seed(seed: int, ckpt: str, tensor_name: str) -> int:
    # Stable across processes and Python versions (no hash()), independent of creation order.
    key = zlib.crc32(f"{ckpt}/{tensor_name}".encode("utf-8"))
    return (int(seed) * 0x9E3779B1 + key) % (2**63 - 1)


class _TensorFactory:
    """Draws each tensor from its own generator seeded by (seed, checkpoint, tensor name)."""

    def __init__(self, ckpt: str, seed: int):
        self.ckpt = ckpt
        self.seed = seed

    def _gen(self, name: str) -> torch.Generator:
        g = torch.Generator(device="cpu")
        g.manual_seed(_tensor_seed(self.seed, self.ckpt, name))
        return g

    def normal(self, name: str, shape, std: float = INIT_STD, mean: float = 0.0) -> torch.Tensor:
        t = torch.empty(shape, dtype=torch.float32)
        t.normal_(mean=mean, std=std, generator=self._gen(name))
        return t

    def uniform(self, name: str, shape, low: float, high: float) -> torch.Tensor:
        t = torch.empty(shape, dtype=torch.float32)
        t.uniform_(low, high, generator=self._gen(name))
        return t


def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def _save_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    ordered = {k: tensors[k].contiguous() for k in sorted(tensors)}
    save_file(ordered, str(path), metadata={"format": "pt"})


def _write_safetensors_index(out: Path, tensors: dict[str, torch.Tensor], filename: str) -> None:
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": {k: filename for k in sorted(tensors)}}
    _write_json(out / "model.safetensors.index.json", index)


# ---- byte-level tokenizer --------------------------------------------------------------------------
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode symbol map (what ByteLevel pre-tokenizers emit)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1)
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def _tokenizer_json(special_tokens: tuple[str, ...], fillers: tuple[str, ...] = ()) -> dict:
    """tokenizer.json for a byte-level BPE with no merges: token id == byte value, specials at 256+,
    then `fillers` (plain added tokens, so every id of a larger model vocabulary decodes to text)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {sym: b for b, sym in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False, byte_fallback=False))
    # No normalizer: arbitrary UTF-8 (including non-NFC text) must round-trip exactly.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special_tokens])
    for i, t in enumerate(special_tokens):
        assert tok.token_to_id(t) == 256 + i, (t, tok.token_to_id(t))
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in fillers])
    return json.loads(tok.to_str())


def _write_tokenizer(
    out: Path,
    special_tokens: tuple[str, ...],
    eos: str,
    pad: str,
    bos: str | None,
    chat_template: str | None,
    extra_config: dict | None = None,
    fillers: tuple[str, ...] = (),
) -> None:
    _write_json(out / "tokenizer.json", _tokenizer_json(special_tokens, fillers))
    added = {
        str(256 + i): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": i < len(special_tokens),
        }
        for i, t in enumerate(special_tokens + fillers)
    }
    cfg = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": [t for t in special_tokens if t not in (eos, pad, bos)],
        "bos_token": bos,
        "clean_up_tokenization_spaces": False,
        "eos_token": eos,
        "errors": "replace",
        "model_max_length": MAX_POSITIONS,
        "pad_token": pad,
        "split_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }
    if chat_template is not None:
        cfg["chat_template"] = chat_template
    cfg.update(extra_config or {})
    _write_json(out / "tokenizer_config.json", cfg)
    smap = {
        "additional_special_tokens": cfg["additional_special_tokens"],
        "eos_token": eos,
        "pad_token": pad,
    }
    if bos is not None:
        smap["bos_token"] = bos
    _write_json(out / "special_tokens_map.json", smap)


def _write_text_tokenizer(out: Path) -> None:
    _write_tokenizer(
        out,
        TEXT_SPECIAL_TOKENS,
        eos="<|im_end|>",
        pad="<|endoftext|>",
        bos=None,
        chat_template=CHAT_TEMPLATE,
    )


# ---- model weights ---------------------------------------------------------------------------------
def _qwen3_config(
    *, vocab_size: int, hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int,
    intermediate: int, eos_token_id: int, bos_token_id: int, pad_token_id: int | None = None,
) -> dict:
    cfg = {
        "architectures": ["Qwen3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "initializer_range": INIT_STD,
        "intermediate_size": intermediate,
        "max_position_embeddings": MAX_POSITIONS,
        "max_window_layers": layers,
        "model_type": "qwen3",
        "num_attention_heads": heads,
        "num_hidden_layers": layers,
        "num_key_value_heads": kv_heads,
        "rms_norm_eps": 1e-6,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": vocab_size,
    }
    if pad_token_id is not None:
        cfg["pad_token_id"] = pad_token_id
    return cfg


def _qwen3_weights(cfg: dict, f: _TensorFactory) -> dict[str, torch.Tensor]:
    h, hd = cfg["hidden_size"], cfg["head_dim"]
    nh, nkv, inter = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["intermediate_size"]
    v = cfg["vocab_size"]
    # Residual-branch output projections scaled by 1/sqrt(2 * layers) (GPT-2 style) keep the residual
    # stream's scale flat across depth.
    out_std = INIT_STD / math.sqrt(2 * cfg["num_hidden_layers"])
    w: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": f.normal("model.embed_tokens.weight", (v, h)),
        "model.norm.weight": torch.ones(h),
        "lm_head.weight": f.normal("lm_head.weight", (v, h)),
    }
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes = {
            "self_attn.q_proj.weight": ((nh * hd, h), INIT_STD),
            "self_attn.k_proj.weight": ((nkv * hd, h), INIT_STD),
            "self_attn.v_proj.weight": ((nkv * hd, h), INIT_STD),
            "self_attn.o_proj.weight": ((h, nh * hd), out_std),
            "mlp.gate_proj.weight": ((inter, h), INIT_STD),
            "mlp.up_proj.weight": ((inter, h), INIT_STD),
            "mlp.down_proj.weight": ((h, inter), out_std),
        }
        for k, (shape, std) in shapes.items():
            w[p + k] = f.normal(p + k, shape, std=std)
        w[p + "self_attn.q_norm.weight"] = torch.ones(hd)
        w[p + "self_attn.k_norm.weight"] = torch.ones(hd)
        w[p + "input_layernorm.weight"] = torch.ones(h)
        w[p + "post_attention_layernorm.weight"] = torch.ones(h)
    return {k: t.to(torch.bfloat16) for k, t in w.items()}


def _generation_config(eos: int, bos: int, pad: int) -> dict:
    return {"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad, "do_sample": False}


def _write_thinker(out: Path, seed: int) -> None:
    cfg = _qwen3_config(
        vocab_size=TEXT_VOCAB_SIZE, hidden=THINKER_HIDDEN, layers=8, heads=8, kv_heads=4, head_dim=64,
        intermediate=1536, eos_token_id=IM_END_ID, bos_token_id=TEXT_PAD_ID, pad_token_id=TEXT_PAD_ID,
    )
    _write_json(out / "config.json", cfg)
    _write_json(out / "generation_config.json", _generation_config(IM_END_ID, TEXT_PAD_ID, TEXT_PAD_ID))
    _save_safetensors(out / "model.safetensors", _qwen3_weights(cfg, _TensorFactory("thinker", seed)))
    _write_text_tokenizer(out)


def _hybrid_config() -> dict:
    layer_types = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]
    return {
        "architectures": ["Qwen3NextForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": TEXT_PAD_ID,
        "decoder_sparse_step": 1,
        "eos_token_id": IM_END_ID,
        "full_attention_interval": 4,
        "head_dim": 64,
        "hidden_act": "silu",
        "hidden_size": THINKER_HIDDEN,
        "initializer_range": INIT_STD,
        "intermediate_size": 1024,  # unused: every layer is MoE (mlp_only_layers == [])
        "layer_types": layer_types,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,  # the CPU GDN kernel refuses 32
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_value_head_dim": 128,
        "max_position_embeddings": MAX_POSITIONS,
        "mlp_only_layers": [],
        "model_type": "qwen3_next",
        "moe_intermediate_size": 256,
        "norm_topk_prob": True,
        "num_attention_heads": 8,
        "num_experts": 4,
        # Every token goes to all experts (weighted by the router's softmax). With top-2 of 4, a
        # bf16 rounding difference between two batch shapes (which differs by CPU: AMX vs AVX2)
        # flipped the expert pair of tokens whose 2nd and 3rd router logits were nearly tied, moving
        # those rows by 7-71%; with all experts routing is continuous in the input and cache-on vs
        # cache-off comparisons stay at kernel noise. vLLM's router and fused-MoE path still run.
        "num_experts_per_tok": 4,
        "num_hidden_layers": len(layer_types),
        "num_key_value_heads": 2,
        "output_router_logits": False,
        "pad_token_id": TEXT_PAD_ID,
        "partial_rotary_factor": 0.25,
        "rms_norm_eps": 1e-6,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.001,
        "shared_expert_intermediate_size": 256,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": TEXT_VOCAB_SIZE,
    }


def _hybrid_weights(cfg: dict, f: _TensorFactory) -> dict[str, torch.Tensor]:
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    hd, nh, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv, ks = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"], cfg["linear_conv_kernel_dim"]
    key_dim, value_dim = nk * dk, nv * dv
    ne, mi, si = cfg["num_experts"], cfg["moe_intermediate_size"], cfg["shared_expert_intermediate_size"]
    out_std = INIT_STD / math.sqrt(2 * cfg["num_hidden_layers"])
    w: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": f.normal("model.embed_tokens.weight", (v, h)),
        "model.norm.weight": torch.zeros(h),  # Gemma-style norm: x * (1 + w)
        "lm_head.weight": f.normal("lm_head.weight", (v, h)),
    }
    for i, lt in enumerate(cfg["layer_types"]):
        p = f"model.layers.{i}."
        normal: dict[str, tuple[tuple[int, ...], float]] = {}
        if lt == "linear_attention":
            a = p + "linear_attn."
            normal[a + "in_proj_qkvz.weight"] = ((2 * key_dim + 2 * value_dim, h), INIT_STD)
            normal[a + "in_proj_ba.weight"] = ((2 * nv, h), INIT_STD)
            # Depthwise causal conv over [q | k | v] channels; ~1/sqrt(kernel) keeps its output scale.
            normal[a + "conv1d.weight"] = ((2 * key_dim + value_dim, 1, ks), 1.0 / math.sqrt(ks))
            normal[a + "out_proj.weight"] = ((h, value_dim), out_std)
            w[a + "dt_bias"] = torch.ones(nv)
            # HF init: A ~ U(0, 16), stored as log; keep A in [1, 16] so every head decays.
            w[a + "A_log"] = torch.log(f.uniform(a + "A_log", (nv,), 1.0, 16.0))
            w[a + "norm.weight"] = torch.ones(dv)  # RMSNormGated: plain x * w
        else:
            a = p + "self_attn."
            # attn_output_gate: q_proj yields query and gate per head -> 2 * heads * head_dim rows.
            normal[a + "q_proj.weight"] = ((2 * nh * hd, h), INIT_STD)
            normal[a + "k_proj.weight"] = ((nkv * hd, h), INIT_STD)
            normal[a + "v_proj.weight"] = ((nkv * hd, h), INIT_STD)
            normal[a + "o_proj.weight"] = ((h, nh * hd), out_std)
            w[a + "q_norm.weight"] = torch.zeros(hd)  # Gemma-style
            w[a + "k_norm.weight"] = torch.zeros(hd)
        m = p + "mlp."
        normal[m + "gate.weight"] = ((ne, h), INIT_STD)
        for e in range(ne):
            normal[m + f"experts.{e}.gate_proj.weight"] = ((mi, h), INIT_STD)
            normal[m + f"experts.{e}.up_proj.weight"] = ((mi, h), INIT_STD)
            normal[m + f"experts.{e}.down_proj.weight"] = ((h, mi), out_std)
        normal[m + "shared_expert.gate_proj.weight"] = ((si, h), INIT_STD)
        normal[m + "shared_expert.up_proj.weight"] = ((si, h), INIT_STD)
        normal[m + "shared_expert.down_proj.weight"] = ((h, si), out_std)
        normal[m + "shared_expert_gate.weight"] = ((1, h), INIT_STD)
        for k, (shape, std) in normal.items():
            w[k] = f.normal(k, shape, std=std)
        w[p + "input_layernorm.weight"] = torch.zeros(h)
        w[p + "post_attention_layernorm.weight"] = torch.zeros(h)
    # A_log stays float32 (as in the released Qwen3-Next checkpoints); everything else bf16.
    return {k: (t if k.endswith("A_log") else t.to(torch.bfloat16)) for k, t in w.items()}


def _write_thinker_hybrid(out: Path, seed: int) -> None:
    cfg = _hybrid_config()
    _write_json(out / "config.json", cfg)
    _write_json(out / "generation_config.json", _generation_config(IM_END_ID, TEXT_PAD_ID, TEXT_PAD_ID))
    _save_safetensors(
        out / "model.safetensors", _hybrid_weights(cfg, _TensorFactory("thinker-hybrid", seed))
    )
    _write_text_tokenizer(out)


def talker_config() -> dict:
    """Contents of the talker's ``talker_config.json``."""
    return {
        "codebook_size": CODEBOOK_SIZE,
        "codec_bos_id": CODEC_BOS_ID,
        "codec_eos_id": CODEC_EOS_ID,
        "codec_pad_id": CODEC_PAD_ID,
        "thinker_hidden_size": THINKER_HIDDEN,
        "talker_hidden_size": TALKER_HIDDEN,
    }


def _write_talker(out: Path, seed: int) -> None:
    cfg = _qwen3_config(
        vocab_size=TALKER_VOCAB_SIZE, hidden=TALKER_HIDDEN, layers=4, heads=4, kv_heads=2, head_dim=64,
        intermediate=768, eos_token_id=CODEC_EOS_ID, bos_token_id=CODEC_BOS_ID,
        pad_token_id=CODEC_PAD_ID,
    )
    f = _TensorFactory("talker", seed)
    _write_json(out / "config.json", cfg)
    _write_json(
        out / "generation_config.json", _generation_config(CODEC_EOS_ID, CODEC_BOS_ID, CODEC_PAD_ID)
    )
    weights = _qwen3_weights(cfg, f)
    _save_safetensors(out / "model.safetensors", weights)
    # vLLM's loader reads every *.safetensors in the folder unless model.safetensors.index.json
    # lists the files that hold the model: without the index it tries to load the projection's
    # "weight"/"bias" into Qwen3ForCausalLM and fails.
    _write_safetensors_index(out, weights, "model.safetensors")
    # thinker hidden (RMS-normed, ~unit scale) -> talker input embedding (~INIT_STD scale, like the
    # talker's own token embeddings). float32: the caller projects, then casts to the talker's dtype.
    proj = {
        "weight": f.normal("thinker_projection.weight", (TALKER_HIDDEN, THINKER_HIDDEN),
                           std=INIT_STD / math.sqrt(THINKER_HIDDEN)),
        "bias": f.normal("thinker_projection.bias", (TALKER_HIDDEN,), std=INIT_STD / 4),
    }
    _save_safetensors(out / "thinker_projection.safetensors", proj)
    _write_json(out / "talker_config.json", talker_config())
    # Codes 0..255 are the byte symbols (meaningless as text, harmless to detokenize); the specials
    # are the codec's, so the tokenizer's eos is codec_eos.
    _write_tokenizer(
        out,
        CODEC_SPECIAL_TOKENS,
        eos="<|codec_eos|>",
        pad="<|codec_pad|>",
        bos="<|codec_bos|>",
        chat_template=None,
    )


def _write_decoder(out: Path, seed: int) -> None:
    from omni_cache.models.codec_decoder import decoder_config, random_decoder_weights

    cfg = decoder_config()
    _write_json(out / "config.json", cfg)
    f = _TensorFactory("decoder", seed)
    weights = random_decoder_weights(cfg, lambda name, shape, std: f.normal(name, shape, std=std))
    _save_safetensors(out / "model.safetensors", weights)


def _write_qwen3_omni(out: Path, seed: int) -> None:
    from omni_cache.models import tiny_qwen3_omni as q3

    cfg = q3.config()
    # A compact config.json (transformers and vLLM fill in every default); model_type picks the class.
    _write_json(out / "config.json", {"model_type": "qwen3_omni_moe", **cfg})
    _write_json(out / "generation_config.json", q3.generation_config())
    f = _TensorFactory("qwen3-omni", seed)
    weights = q3.random_weights(cfg, lambda name, shape, std: f.normal(name, shape, std=std))
    _save_safetensors(out / "model.safetensors", weights)
    _write_tokenizer(
        out,
        q3.SPECIAL_TOKENS,
        eos="<|im_end|>",
        pad="<|endoftext|>",
        bos=None,
        chat_template=q3.CHAT_TEMPLATE,
        extra_config=q3.TOKENIZER_EXTRA_CONFIG,
        # The thinker's vocabulary is larger than bytes + specials; a random model samples those
        # ids too, and an id without a token would decode to nothing (empty answers).
        fillers=tuple(f"<{i}>" for i in range(256 + len(q3.SPECIAL_TOKENS), q3.VOCAB_SIZE)),
    )
    # transformers' processors and vLLM's multimodal processor read the template from here.
    _write_json(out / "chat_template.json", {"chat_template": q3.CHAT_TEMPLATE})
    _write_json(out / "preprocessor_config.json", q3.preprocessor_config())
    _write_json(out / "video_preprocessor_config.json", q3.video_preprocessor_config())


_WRITERS: dict[str, Callable[[Path, int], None]] = {
    "thinker": _write_thinker,
    "thinker-hybrid": _write_thinker_hybrid,
    "talker": _write_talker,
    "decoder": _write_decoder,
    "qwen3-omni": _write_qwen3_omni,
}


# ---- public API ------------------------------------------------------------------------------------
def write_checkpoint(name: str, out_dir: str | Path, seed: int = 0) -> Path:
    """Write checkpoint ``name`` into ``out_dir`` (created if missing); returns ``out_dir``.

    The same (name, seed) always gives byte-identical files. Does not write the completion marker
    (that is :func:`ensure_checkpoint`'s job).
    """
    _check_name(name)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _WRITERS[name](out, int(seed))
    return out


def _marker_text(name: str, seed: int) -> str:
    return json.dumps({"format_version": FORMAT_VERSION, "name": name, "seed": seed}, sort_keys=True)


def _is_complete(path: Path, name: str, seed: int) -> bool:
    try:
        return (path / COMPLETE_MARKER).read_text() == _marker_text(name, seed)
    except OSError:
        return False


def ensure_checkpoint(name: str, root: str | Path | None = None, seed: int = 0) -> Path:
    """Return ``<root>/<name>-s<seed>``, generating it on first use.

    Safe under concurrency: the checkpoint is written into a temporary directory inside ``root`` and
    moved into place with ``os.replace``; a complete directory (holding the marker file) is returned
    untouched. ``root`` defaults to :func:`default_checkpoint_dir`.
    """
    _check_name(name)
    seed = int(seed)
    root = Path(root) if root is not None else default_checkpoint_dir()
    final = root / f"{name}-s{seed}"
    if _is_complete(final, name, seed):
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-s{seed}.tmp-", dir=root))
    try:
        write_checkpoint(name, tmp, seed)
        (tmp / COMPLETE_MARKER).write_text(_marker_text(name, seed))
        # mkdtemp (0700) and safetensors (0600) are private; a shared cache should be readable.
        os.chmod(tmp, 0o755)
        for f in tmp.iterdir():
            os.chmod(f, 0o644)
        try:
            os.replace(tmp, final)
        except OSError:
            # `final` exists and is a non-empty directory: another process won the race (fine if it
            # is complete) or a stale/incomplete directory is in the way (move it aside, retry once).
            if _is_complete(final, name, seed):
                return final
            stale = Path(tempfile.mkdtemp(prefix=f".{name}-s{seed}.stale-", dir=root))
            try:
                os.replace(final, stale / "old")
            except OSError:
                pass
            shutil.rmtree(stale, ignore_errors=True)
            try:
                os.replace(tmp, final)
            except OSError:
                if not _is_complete(final, name, seed):
                    raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m omni_cache.models.checkpoints",
        description="Write deterministic tiny random-weight checkpoints.",
    )
    parser.add_argument("--out", required=True, type=Path, help="root directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"default: all of {CHECKPOINT_NAMES}")
    args = parser.parse_args(argv)
    names = args.names or list(CHECKPOINT_NAMES)
    for n in names:
        if n not in CHECKPOINT_NAMES:
            parser.error(f"unknown checkpoint name {n!r}; valid names: {', '.join(CHECKPOINT_NAMES)}")
    for n in names:
        print(ensure_checkpoint(n, args.out, args.seed), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
