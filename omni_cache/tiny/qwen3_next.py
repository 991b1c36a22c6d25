"""The tiny hybrid thinker's config and weights: Qwen3-Next (``Qwen3NextForCausalLM``), three
GatedDeltaNet layers then one full-attention layer, a tiny MoE, in the layout of the released
checkpoints (Gemma-style norms, ``A_log`` in float32, the rest bfloat16)."""

from __future__ import annotations

import math

import torch

from omni_cache.models.checkpoint_files import INIT_STD, TensorFactory
from omni_cache.tiny.vocab import IM_END_ID, MAX_POSITIONS, TEXT_PAD_ID, TEXT_VOCAB_SIZE, THINKER_HIDDEN


def hybrid_config() -> dict:
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


def hybrid_weights(cfg: dict, f: TensorFactory) -> dict[str, torch.Tensor]:
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
