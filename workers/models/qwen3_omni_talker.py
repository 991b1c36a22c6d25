"""Qwen3-Omni's talker as a vLLM model (vLLM 0.32 ships only the thinker).

The talker is an MoE decoder (Qwen3 attention with q/k norms and M-RoPE; Qwen2-MoE style sparse
block with a sigmoid-gated shared expert) over codec embeddings, with a codec head for the first
codebook. The code predictor, a small dense decoder, writes the other codebooks of each step from
the talker's hidden state and the first code (`residual_codes`); the next step's input is the sum
of all codebooks' embeddings plus a row of the thinker's text (`codec_input_embeds`, assembled by
workers/talker_steps.py, which this model calls through `step_inputs` from its forward).

Loaded from the released checkpoint folder as it is: `talker_hf_overrides` (vLLM's `hf_overrides`)
makes vLLM see the folder's `talker_config` with this class as its architecture, and
`load_weights` takes the `talker.*` tensors of the shared weight file. The text and hidden
projections the talker's prompt needs run in the stage's hand-off
(omni_cache/models/qwen3_omni_talker_prompt.py), not here.

Built from vLLM's own layers (`Qwen3MoeAttention`, `Qwen2MoeSparseMoeBlock`, `RMSNorm`, its
embedding and head), registered through vLLM's model registry (workers/models/__init__.py). The code
predictor is transformers' module, used as a library: it runs a few tiny steps per talker step,
outside vLLM's paged KV cache.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.models.interfaces import SupportsMRoPE
from vllm.model_executor.models.qwen2_moe import Qwen2MoeSparseMoeBlock
from vllm.model_executor.models.qwen3_moe import Qwen3MoeAttention
from vllm.model_executor.models.utils import AutoWeightsLoader, WeightsMapper, maybe_prefix

from workers.models import TALKER_ARCHITECTURE


def talker_hf_overrides(config: Any) -> Any:
    """vLLM `hf_overrides`: the checkpoint's Qwen3-Omni config -> its talker's config, served by
    this class (vLLM then sizes the KV cache, vocabulary and positions from the talker)."""
    talker = getattr(config, "talker_config", None)
    if talker is None:
        # vLLM also calls this on a blank config to see whether it changes the model type; a
        # checkpoint without a talker then fails on the architecture it names.
        return config
    talker.architectures = [TALKER_ARCHITECTURE]
    if getattr(talker, "dtype", None) is None:
        talker.dtype = getattr(config, "dtype", None) or talker.text_config.dtype
    return talker


def talker_engine_kwargs() -> dict[str, Any]:
    """Engine arguments this talker needs beyond every talker's (workers/llm_stage.py): none."""
    return {}


class TalkerDecoderLayer(nn.Module):
    def __init__(self, vllm_config: VllmConfig, prefix: str) -> None:
        super().__init__()
        config = vllm_config.model_config.hf_text_config
        self.self_attn = Qwen3MoeAttention(
            hidden_size=config.hidden_size,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            rope_parameters=config.rope_parameters,
            max_position_embeddings=config.max_position_embeddings,
            head_dim=getattr(config, "head_dim", None),
            rms_norm_eps=config.rms_norm_eps,
            qkv_bias=getattr(config, "attention_bias", False),
            cache_config=vllm_config.cache_config,
            quant_config=vllm_config.quant_config,
            prefix=f"{prefix}.self_attn",
        )
        self.mlp = Qwen2MoeSparseMoeBlock(config, vllm_config.quant_config, prefix=f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions=positions, hidden_states=hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class TalkerModel(nn.Module):
    def __init__(self, vllm_config: VllmConfig, prefix: str) -> None:
        super().__init__()
        config = vllm_config.model_config.hf_text_config
        self.codec_embedding = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, prefix=f"{prefix}.codec_embedding"
        )
        self.layers = nn.ModuleList(
            TalkerDecoderLayer(vllm_config, f"{prefix}.layers.{i}") for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, inputs_embeds: torch.Tensor) -> torch.Tensor:
        hidden, residual = inputs_embeds, None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class Qwen3OmniTalkerForCausalLM(nn.Module, SupportsMRoPE):
    #: Codebooks 1..G-1 come from the code predictor (workers/talker_steps.py); codes travel as frames.
    has_residual_codebooks = True
    # The checkpoint's talker.* names -> this module's; q/k/v and the shared expert's gate/up are
    # stacked as vLLM's layers hold them. Expert weights go through vLLM's MoE loader.
    hf_to_vllm_mapper = WeightsMapper(
        orig_to_new_prefix={"talker.": ""},
        orig_to_new_stacked={
            ".q_proj": (".qkv_proj", "q"),
            ".k_proj": (".qkv_proj", "k"),
            ".v_proj": (".qkv_proj", "v"),
            ".shared_expert.gate_proj": (".shared_expert.gate_up_proj", 0),
            ".shared_expert.up_proj": (".shared_expert.gate_up_proj", 1),
        },
    )
    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
            Qwen3OmniMoeTalkerCodePredictorModelForConditionalGeneration as CodePredictor,
        )

        self.config = vllm_config.model_config.hf_config  # the talker_config
        text = vllm_config.model_config.hf_text_config
        self.num_code_groups = self.config.num_code_groups
        self.model = TalkerModel(vllm_config, maybe_prefix(prefix, "model"))
        self.codec_head = ParallelLMHead(text.vocab_size, text.hidden_size, prefix=maybe_prefix(prefix, "codec_head"))
        self.logits_processor = LogitsProcessor(text.vocab_size)
        self.code_predictor = CodePredictor(self.config.code_predictor_config).to(vllm_config.model_config.dtype).eval()
        # Set by the worker (workers/talker_steps.py): rewrites the inputs of positions that feed
        # a sampled code, and gives stage-chosen M-RoPE prompt positions.
        self.step_inputs: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.prompt_positions: Callable[[int], tuple[torch.Tensor, int] | None] | None = None

    # ---- vLLM's model interface --------------------------------------------------------------
    def embed_input_ids(self, input_ids: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.model.codec_embedding(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        if inputs_embeds is None:
            inputs_embeds = self.embed_input_ids(input_ids)
        if self.step_inputs is not None:
            inputs_embeds = self.step_inputs(inputs_embeds)
        return self.model(positions, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.logits_processor(self.codec_head, hidden_states)

    def get_mrope_input_positions(self, input_tokens: list[int], mm_features: list[Any]) -> tuple[torch.Tensor, int]:
        given = self.prompt_positions(len(input_tokens)) if self.prompt_positions else None
        if given is not None:
            return given
        # A prompt of text rows: the three M-RoPE axes advance together.
        return torch.arange(len(input_tokens)).expand(3, -1).clone(), 0

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        predictor: dict[str, torch.Tensor] = {}

        def talker_weights() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if name.startswith("talker.code_predictor."):
                    predictor[name.removeprefix("talker.code_predictor.")] = tensor
                elif name.startswith("talker.") and not name.startswith(
                    ("talker.text_projection.", "talker.hidden_projection.")
                ):
                    yield name, tensor

        loader = AutoWeightsLoader(self)  # the code predictor's weights never reach it
        loaded = loader.load_weights(talker_weights(), mapper=self.hf_to_vllm_mapper)
        own = self.code_predictor.state_dict()
        missing = sorted(set(own) - set(predictor))
        if missing:
            raise ValueError(f"the checkpoint lacks code predictor weights: {missing[:4]}")
        self.code_predictor.load_state_dict({k: v.to(own[k].dtype) for k, v in predictor.items() if k in own})
        return loaded | {f"code_predictor.{k}" for k in own}

    # ---- codebooks (called by workers/talker_steps.py) ---------------------------------------
    @torch.inference_mode()
    def residual_codes(
        self, past_hidden: torch.Tensor, code0: torch.Tensor, pick: Callable[[torch.Tensor], torch.Tensor] | None = None
    ) -> torch.Tensor:
        """Codebooks 1..G-1 of a step, [B, G-1], as transformers' code predictor writes them: its
        input is the talker's hidden state at the previous position and the first code's
        embedding; step j reads with lm_head[j] and feeds codec_embedding[j]. `pick` turns each
        step's logits [B, V] into codes [B] (None: greedy)."""
        from transformers import DynamicCache

        predictor = self.code_predictor
        dtype = next(predictor.parameters()).dtype
        embeds = torch.stack([past_hidden.to(dtype), self.embed_input_ids(code0).to(dtype)], dim=1)
        cache = DynamicCache(config=predictor.config)
        codes = []
        position = 0
        for step in range(self.num_code_groups - 1):
            length = embeds.shape[1]
            positions = torch.arange(position, position + length, device=embeds.device)[None]
            out = predictor.model(inputs_embeds=embeds, position_ids=positions, past_key_values=cache, use_cache=True)
            position += length
            logits = predictor.lm_head[step](out.last_hidden_state[:, -1])
            code = logits.argmax(dim=-1) if pick is None else pick(logits)
            codes.append(code)
            embeds = predictor.model.get_input_embeddings()[step](code)[:, None]
        return torch.stack(codes, dim=1)

    @torch.inference_mode()
    def codec_input_embeds(self, code0: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The input of the position that feeds a step's codes: the sum of every codebook's
        embedding ([B] first codes, [B, G-1] the others) -> [B, hidden]."""
        tables = self.code_predictor.model.get_input_embeddings()
        dtype = self.codec_head.weight.dtype
        rows = [self.embed_input_ids(code0).to(dtype)]
        rows += [tables[i](residual[:, i]).to(dtype) for i in range(residual.shape[1])]
        # One stacked sum, as the reference adds them (same reduction, same rounding).
        return torch.stack(rows, dim=1).sum(dim=1)
