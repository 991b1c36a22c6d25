"""vLLM's Qwen3-Omni thinker, with layer taps that read as the reference's hidden states.

The talker reads the thinker's state after `accept_hidden_layer` at image/video positions. The
reference (transformers) records that state as the decoder layer's output; vision "deepstack"
features are added to the residual stream only afterwards, before the next layer. vLLM adds them
first and takes its aux-hidden-state taps after, so a vLLM tap k (k >= 1, k - 1 a deepstack level)
carries `deepstack[k - 1]` on top of what the reference hands the talker, at every visual position.
This class removes it from the taps, so the cached latents are the reference's. The model's own
computation (logits, the KV cache) is untouched.

Registered in place of vLLM's class for the checkpoint's architecture name
(`Qwen3OmniMoeForConditionalGeneration`) by `workers.models.register`: the model registry is vLLM's
extension point for this, and the subclass only differs while aux taps are on (our latent worker).
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.model_executor.models.qwen3_omni_moe_thinker import Qwen3OmniMoeThinkerForConditionalGeneration


class Qwen3OmniThinkerForConditionalGeneration(Qwen3OmniMoeThinkerForConditionalGeneration):
    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> Any:
        # vLLM clears its deepstack buffer inside forward, so the rows are read before it runs.
        injected = self._deepstack_at_taps(inputs_embeds)
        out = super().forward(input_ids, positions, intermediate_tensors, inputs_embeds, **kwargs)
        if not injected or not isinstance(out, tuple):
            return out
        hidden, taps = out
        taps = [tap - injected[i] if i in injected else tap for i, tap in enumerate(taps)]
        return hidden, taps

    def _deepstack_at_taps(self, inputs_embeds: torch.Tensor | None) -> dict[int, torch.Tensor]:
        """{index in the tap list: the deepstack rows vLLM added before that tap} for this step
        (empty when no visual features are in the step or no taps are on)."""
        if inputs_embeds is None or not getattr(self, "deepstack_input_embeds_num_tokens", 0):
            return {}
        layers = sorted(getattr(self.language_model.model, "aux_hidden_state_layers", ()))
        levels = self.deepstack_input_embeds
        num_tokens = inputs_embeds.size(0)
        return {i: levels[k - 1][:num_tokens].clone() for i, k in enumerate(layers) if 1 <= k <= len(levels)}
