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
    (4 experts, every token routed to all 4: see ``hybrid_config``).
``talker``
    Qwen3 dense over an audio-codec vocabulary (256 codes + bos/eos/pad), hidden 256, fed the thinker's
    hidden states as prompt embeddings through ``thinker_projection.safetensors``.
``decoder``
    :class:`omni_cache.models.codec_decoder.CodecDecoder`: codec codes -> 24 kHz waveform.
``qwen3-omni``
    Qwen3-Omni (``Qwen3OmniMoeForConditionalGeneration``) in the released layout: thinker (MoE, audio and
    vision encoders), talker and code2wav in one folder, with processor files and a chat template for
    image/audio/video content parts. What goes in it: :mod:`omni_cache.tiny.qwen3_omni`.
``qwen3.5``
    Qwen3.5 (``Qwen3_5ForConditionalGeneration``) in the released layout: a hybrid text model (3
    GatedDeltaNet layers, 1 gated full-attention layer) with Qwen3-VL's vision encoder, processor files
    and a chat template for image/video content parts. What goes in it:
    :mod:`omni_cache.tiny.qwen3_5`.
``qwen2.5-omni``
    Qwen2.5-Omni (``Qwen2_5OmniModel``) in the released layout: thinker (Qwen2 with audio and vision
    encoders), talker and token2wav (DiT + BigVGAN) in one folder with ``spk_dict.pt`` (two speakers),
    processor files and a chat template. What goes in it: :mod:`omni_cache.tiny.qwen2_5_omni`.

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
from collections.abc import Callable
from pathlib import Path

import torch

from omni_cache.models.checkpoint_files import (
    INIT_STD,
    TensorFactory,
    save_safetensors,
    write_json,
    write_safetensors_index,
    write_tokenizer,
)
from omni_cache.tiny.qwen3_next import hybrid_config, hybrid_weights
from omni_cache.tiny.registry import TINY_MODELS, resolve_checkpoint_dir
from omni_cache.tiny.vocab import (  # noqa: F401  (re-exported for the tests)
    CHAT_TEMPLATE,
    CODEBOOK_SIZE,
    CODEC_BOS_ID,
    CODEC_EOS_ID,
    CODEC_PAD_ID,
    CODEC_SPECIAL_TOKENS,
    IM_END_ID,
    IM_START_ID,
    MAX_POSITIONS,
    TALKER_HIDDEN,
    TALKER_VOCAB_SIZE,
    TEXT_PAD_ID,
    TEXT_SPECIAL_TOKENS,
    TEXT_VOCAB_SIZE,
    THINKER_HIDDEN,
)

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
    "write_talker",
]

CHECKPOINT_NAMES = tuple(TINY_MODELS)

# Written last inside a checkpoint directory; its presence means the directory is complete.
COMPLETE_MARKER = ".omni_cache_complete"
# Bump when the generator changes what it writes (part of the marker, so stale caches are rebuilt).
FORMAT_VERSION = 10


# ---- helpers ---------------------------------------------------------------------------------------
def default_checkpoint_dir() -> Path:
    """``$OMNI_CACHE_CHECKPOINTS`` if set, else ``~/.cache/omni_cache/checkpoints``."""
    return resolve_checkpoint_dir()


def _check_name(name: str) -> None:
    if name not in CHECKPOINT_NAMES:
        raise ValueError(f"unknown checkpoint name {name!r}; valid names: {', '.join(CHECKPOINT_NAMES)}")


def _write_text_tokenizer(out: Path) -> None:
    write_tokenizer(
        out,
        TEXT_SPECIAL_TOKENS,
        eos="<|im_end|>",
        pad="<|endoftext|>",
        bos=None,
        chat_template=CHAT_TEMPLATE,
    )


# ---- model weights ---------------------------------------------------------------------------------
def _qwen3_config(
    *,
    vocab_size: int,
    hidden: int,
    layers: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    intermediate: int,
    eos_token_id: int,
    bos_token_id: int,
    pad_token_id: int | None = None,
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


def _qwen3_weights(cfg: dict, f: TensorFactory) -> dict[str, torch.Tensor]:
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
        vocab_size=TEXT_VOCAB_SIZE,
        hidden=THINKER_HIDDEN,
        layers=8,
        heads=8,
        kv_heads=4,
        head_dim=64,
        intermediate=1536,
        eos_token_id=IM_END_ID,
        bos_token_id=TEXT_PAD_ID,
        pad_token_id=TEXT_PAD_ID,
    )
    write_json(out / "config.json", cfg)
    write_json(out / "generation_config.json", _generation_config(IM_END_ID, TEXT_PAD_ID, TEXT_PAD_ID))
    save_safetensors(out / "model.safetensors", _qwen3_weights(cfg, TensorFactory("thinker", seed)))
    _write_text_tokenizer(out)


def _write_thinker_hybrid(out: Path, seed: int) -> None:
    cfg = hybrid_config()
    write_json(out / "config.json", cfg)
    write_json(out / "generation_config.json", _generation_config(IM_END_ID, TEXT_PAD_ID, TEXT_PAD_ID))
    save_safetensors(out / "model.safetensors", hybrid_weights(cfg, TensorFactory("thinker-hybrid", seed)))
    _write_text_tokenizer(out)


def talker_config(thinker_hidden: int = THINKER_HIDDEN) -> dict:
    """Contents of the talker's ``talker_config.json``."""
    return {
        "codebook_size": CODEBOOK_SIZE,
        "codec_bos_id": CODEC_BOS_ID,
        "codec_eos_id": CODEC_EOS_ID,
        "codec_pad_id": CODEC_PAD_ID,
        "thinker_hidden_size": thinker_hidden,
        "talker_hidden_size": TALKER_HIDDEN,
    }


def _write_talker(out: Path, seed: int) -> None:
    write_talker(out, seed)


def write_talker(out: Path, seed: int = 0, thinker_hidden: int = THINKER_HIDDEN) -> Path:
    """The tiny talker, its thinker projection sized for a thinker of hidden size
    ``thinker_hidden`` (``tiny:talker`` is sized for ``tiny:thinker``; a test pipeline puts it
    behind another thinker, e.g. ``tiny:qwen3.5``'s 256)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = _qwen3_config(
        vocab_size=TALKER_VOCAB_SIZE,
        hidden=TALKER_HIDDEN,
        layers=4,
        heads=4,
        kv_heads=2,
        head_dim=64,
        intermediate=768,
        eos_token_id=CODEC_EOS_ID,
        bos_token_id=CODEC_BOS_ID,
        pad_token_id=CODEC_PAD_ID,
    )
    f = TensorFactory("talker", seed)
    write_json(out / "config.json", cfg)
    write_json(out / "generation_config.json", _generation_config(CODEC_EOS_ID, CODEC_BOS_ID, CODEC_PAD_ID))
    weights = _qwen3_weights(cfg, f)
    save_safetensors(out / "model.safetensors", weights)
    # vLLM's loader reads every *.safetensors in the folder unless model.safetensors.index.json
    # lists the files that hold the model: without the index it tries to load the projection's
    # "weight"/"bias" into Qwen3ForCausalLM and fails.
    write_safetensors_index(out, weights, "model.safetensors")
    # thinker hidden (RMS-normed, ~unit scale) -> talker input embedding (~INIT_STD scale, like the
    # talker's own token embeddings). float32: the caller projects, then casts to the talker's dtype.
    proj = {
        "weight": f.normal(
            "thinker_projection.weight", (TALKER_HIDDEN, thinker_hidden), std=INIT_STD / math.sqrt(thinker_hidden)
        ),
        "bias": f.normal("thinker_projection.bias", (TALKER_HIDDEN,), std=INIT_STD / 4),
    }
    save_safetensors(out / "thinker_projection.safetensors", proj)
    write_json(out / "talker_config.json", talker_config(thinker_hidden))
    # Codes 0..255 are the byte symbols (meaningless as text, harmless to detokenize); the specials
    # are the codec's, so the tokenizer's eos is codec_eos.
    write_tokenizer(
        out,
        CODEC_SPECIAL_TOKENS,
        eos="<|codec_eos|>",
        pad="<|codec_pad|>",
        bos="<|codec_bos|>",
        chat_template=None,
    )
    return out


def _write_decoder(out: Path, seed: int) -> None:
    from omni_cache.models.codec_decoder import decoder_config, random_decoder_weights

    cfg = decoder_config()
    write_json(out / "config.json", cfg)
    f = TensorFactory("decoder", seed)
    weights = random_decoder_weights(cfg, lambda name, shape, std: f.normal(name, shape, std=std))
    save_safetensors(out / "model.safetensors", weights)


def _write_multimodal_files(out: Path, m) -> None:
    """Tokenizer, chat template and processor files of a released-layout multimodal checkpoint whose
    contents module ``m`` describes (``tiny_qwen3_omni``, ``tiny_qwen3_5``, ``tiny_qwen2_5_omni``)."""
    write_tokenizer(
        out,
        m.SPECIAL_TOKENS,
        eos="<|im_end|>",
        pad="<|endoftext|>",
        bos=None,
        chat_template=m.CHAT_TEMPLATE,
        extra_config=m.TOKENIZER_EXTRA_CONFIG,
        # The thinker's vocabulary is larger than bytes + specials; a random model samples those
        # ids too, and an id without a token would decode to nothing (empty answers).
        fillers=tuple(f"<{i}>" for i in range(256 + len(m.SPECIAL_TOKENS), m.VOCAB_SIZE)),
    )
    # transformers' processors and vLLM's multimodal processor read the template from here.
    write_json(out / "chat_template.json", {"chat_template": m.CHAT_TEMPLATE})
    write_json(out / "preprocessor_config.json", m.preprocessor_config())
    write_json(out / "video_preprocessor_config.json", m.video_preprocessor_config())


def _write_qwen3_omni(out: Path, seed: int) -> None:
    from omni_cache.tiny import qwen3_omni as q3

    cfg = q3.config()
    # A compact config.json (transformers and vLLM fill in every default); model_type picks the class.
    write_json(out / "config.json", {"model_type": "qwen3_omni_moe", **cfg})
    write_json(out / "generation_config.json", q3.generation_config())
    f = TensorFactory("qwen3-omni", seed)
    weights = q3.random_weights(cfg, lambda name, shape, std: f.normal(name, shape, std=std))
    save_safetensors(out / "model.safetensors", weights)
    _write_multimodal_files(out, q3)


def _write_qwen3_5(out: Path, seed: int) -> None:
    from omni_cache.tiny import qwen3_5 as q35

    cfg = q35.config()
    write_json(out / "config.json", cfg)
    write_json(out / "generation_config.json", q35.generation_config())
    f = TensorFactory("qwen3.5", seed)
    weights = q35.random_weights(cfg, lambda name, shape, std: f.normal(name, shape, std=std), f.uniform)
    save_safetensors(out / "model.safetensors", weights)
    _write_multimodal_files(out, q35)


def _write_qwen2_5_omni(out: Path, seed: int) -> None:
    from omni_cache.tiny import qwen2_5_omni as q25

    cfg = q25.config()
    write_json(out / "config.json", {"model_type": "qwen2_5_omni", **cfg})
    write_json(out / "generation_config.json", q25.generation_config())
    f = TensorFactory("qwen2.5-omni", seed)
    save_safetensors(out / "model.safetensors", q25.random_weights(cfg, f.normal))
    # The released folder's speakers file; transformers' from_pretrained requires it.
    (out / "spk_dict.pt").write_bytes(q25.speaker_dict_bytes(q25.speaker_dict(cfg, f.normal)))
    _write_multimodal_files(out, q25)


_WRITERS: dict[str, Callable[[Path, int], None]] = {
    "thinker": _write_thinker,
    "thinker-hybrid": _write_thinker_hybrid,
    "talker": _write_talker,
    "decoder": _write_decoder,
    "qwen3-omni": _write_qwen3_omni,
    "qwen3.5": _write_qwen3_5,
    "qwen2.5-omni": _write_qwen2_5_omni,
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
        prog="python -m omni_cache.tiny.checkpoints",
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
