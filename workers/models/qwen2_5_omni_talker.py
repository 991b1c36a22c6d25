"""Qwen2.5-Omni's talker as a vLLM model (vLLM 0.32 ships only the thinker).

The talker is a dense Qwen2 decoder (q/k/v biases, M-RoPE) with ONE codebook. Its inputs live in the
thinker's width (`embedding_size`): the prompt rows are the thinker's hidden state plus its token
embedding per position, and the codec embeddings are as wide; `thinker_to_talker_proj` maps every
input row to the decoder's width, and `codec_head` gives the codec logits. The input of the position
that feeds the s-th sampled code is its codec embedding plus the s-th row of the thinker's reply
(`codec_input_embeds`, assembled by workers/talker_steps.py, which this model calls through
`step_inputs` from its forward). vLLM must therefore allocate and accept input embeddings of the
thinker's width, not the decoder's: `talker_hf_overrides` says so through the config field vLLM reads
for it (`projection_dim`, `ModelConfig.get_inputs_embeds_size`).

Loaded from the released checkpoint folder as it is: `talker_hf_overrides` makes vLLM see the
folder's `talker_config` with this class as its architecture, and `load_weights` takes the
`talker.*` tensors of the shared weight file. The prompt, the logits rule and the stop ids are the
stage hand-off's (`omni_cache.models.qwen2_5_omni_talker_input.thinker_to_talker`,
`omni_cache.models.qwen2_5_omni_talker_input`).

Built from vLLM's own layers (`LlamaAttention`: it reads the config's `head_dim`, which vLLM's Qwen2
attention would derive as hidden_size // num_heads instead; `Qwen2MLP`, `RMSNorm`, its embedding
and head), registered through vLLM's model registry (workers/models/__init__.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import ReplicatedLinear
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.models.interfaces import SupportsMRoPE
from vllm.model_executor.models.llama import LlamaAttention
from vllm.model_executor.models.qwen2 import Qwen2MLP
from vllm.model_executor.models.utils import AutoWeightsLoader, WeightsMapper, maybe_prefix

from workers.models import QWEN2_5_OMNI_TALKER_ARCHITECTURE


def talker_hf_overrides(config: Any) -> Any:
    """vLLM `hf_overrides`: the checkpoint's Qwen2.5-Omni config -> its talker's config, served by
    this class, with input embeddings as wide as the thinker's rows (`embedding_size`)."""
    talker = getattr(config, "talker_config", None)
    if talker is None:
        # vLLM also calls this on a blank config to see whether it changes the model type.
        return config
    talker.architectures = [QWEN2_5_OMNI_TALKER_ARCHITECTURE]
    # vLLM sizes its input-embeddings buffer (and the prompt embeddings it accepts) from this.
    talker.projection_dim = talker.embedding_size
    if getattr(talker, "dtype", None) is None:
        talker.dtype = getattr(config, "dtype", None) or config.thinker_config.text_config.dtype
    return talker


def talker_engine_kwargs() -> dict[str, Any]:
    """Engine arguments this talker needs beyond every talker's (workers/llm_stage.py): none."""
    return {}


class Qwen25TalkerDecoderLayer(nn.Module):
    def __init__(self, vllm_config: VllmConfig, prefix: str) -> None:
        super().__init__()
        config = vllm_config.model_config.hf_text_config
        # Qwen2: biased q/k/v, unbiased o_proj.
        self.self_attn = LlamaAttention(
            config=config,
            hidden_size=config.hidden_size,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            max_position_embeddings=config.max_position_embeddings,
            quant_config=vllm_config.quant_config,
            bias=True,
            bias_o_proj=False,
            cache_config=vllm_config.cache_config,
            prefix=f"{prefix}.self_attn",
        )
        self.mlp = Qwen2MLP(
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            hidden_act=config.hidden_act,
            quant_config=vllm_config.quant_config,
            prefix=f"{prefix}.mlp",
        )
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


class Qwen25TalkerModel(nn.Module):
    def __init__(self, vllm_config: VllmConfig, prefix: str) -> None:
        super().__init__()
        config = vllm_config.model_config.hf_text_config
        # Codec embeddings are thinker-wide: they are added to thinker rows before the projection.
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.embedding_size, prefix=f"{prefix}.embed_tokens"
        )
        self.layers = nn.ModuleList(
            Qwen25TalkerDecoderLayer(vllm_config, f"{prefix}.layers.{i}") for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class Qwen2_5OmniTalkerForCausalLM(nn.Module, SupportsMRoPE):
    # The checkpoint's talker.* names -> this module's; q/k/v and gate/up are stacked as vLLM's
    # layers hold them.
    hf_to_vllm_mapper = WeightsMapper(
        orig_to_new_prefix={"talker.": ""},
        orig_to_new_stacked={
            ".q_proj": (".qkv_proj", "q"),
            ".k_proj": (".qkv_proj", "k"),
            ".v_proj": (".qkv_proj", "v"),
            ".gate_proj": (".gate_up_proj", 0),
            ".up_proj": (".gate_up_proj", 1),
        },
    )
    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    #: One codebook: a step's code is its sampled token id (workers/talker_steps.py, llm_stage.py).
    has_residual_codebooks = False

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        self.config = vllm_config.model_config.hf_config  # the talker_config
        config = vllm_config.model_config.hf_text_config
        self.thinker_to_talker_proj = ReplicatedLinear(
            config.embedding_size,
            config.hidden_size,
            bias=True,
            quant_config=None,
            prefix=maybe_prefix(prefix, "thinker_to_talker_proj"),
        )
        self.model = Qwen25TalkerModel(vllm_config, maybe_prefix(prefix, "model"))
        self.codec_head = ParallelLMHead(
            config.vocab_size, config.hidden_size, bias=False, prefix=maybe_prefix(prefix, "codec_head")
        )
        self.logits_processor = LogitsProcessor(config.vocab_size)
        # Set by the worker (workers/talker_steps.py): rewrites the inputs of positions that feed
        # a sampled code, and gives stage-chosen M-RoPE prompt positions.
        self.step_inputs: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.prompt_positions: Callable[[int], tuple[torch.Tensor, int] | None] | None = None

    # ---- vLLM's model interface --------------------------------------------------------------
    def embed_input_ids(self, input_ids: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

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
        hidden, _ = self.thinker_to_talker_proj(inputs_embeds)
        return self.model(positions, hidden)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.logits_processor(self.codec_head, hidden_states)

    def get_mrope_input_positions(self, input_tokens: list[int], mm_features: list[Any]) -> tuple[torch.Tensor, int]:
        given = self.prompt_positions(len(input_tokens)) if self.prompt_positions else None
        if given is not None:
            return given
        # A prompt of text rows: the three M-RoPE axes advance together.
        return torch.arange(len(input_tokens)).expand(3, -1).clone(), 0

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        talker = ((name, tensor) for name, tensor in weights if name.startswith("talker."))
        return AutoWeightsLoader(self).load_weights(talker, mapper=self.hf_to_vllm_mapper)

    # ---- the decode steps' inputs (called by workers/talker_steps.py) ------------------------
    @torch.inference_mode()
    def codec_input_embeds(self, code0: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The codec part of the input of the position that feeds a code ([B] codes -> [B,
        embedding_size]); the caller adds the thinker's reply row, as the reference does."""
        return self.embed_input_ids(code0)
