"""vLLM's Qwen2.5-Omni thinker, with the aux-hidden-state interface its language model already has.

Qwen2.5-Omni's talker reads, at every prompt and answer position, the thinker's input embedding (the
encoder output at image/audio/video positions) plus its final hidden state. vLLM 0.32's thinker class
does not expose layer taps, but the Qwen2 language model inside it implements vLLM's EAGLE-3 interface
(`set_aux_hidden_state_layers`; tap 0 is the residual stream entering layer 0, i.e. the merged input
embeddings): this class only forwards the interface to it, so the latent worker can ask for tap 0. The
model's computation (logits, KV cache) is untouched; with no taps set it is vLLM's class exactly.

Registered in place of vLLM's class for the released architecture names by `workers.models.register`.
"""

from __future__ import annotations

from vllm.model_executor.models import qwen2_5_omni_thinker as vllm_thinker


class Qwen2_5OmniThinkerForConditionalGeneration(vllm_thinker.Qwen2_5OmniThinkerForConditionalGeneration):
    def set_aux_hidden_state_layers(self, layers: tuple[int, ...]) -> None:
        self.language_model.set_aux_hidden_state_layers(layers)

    def get_eagle3_default_aux_hidden_state_layers(self) -> tuple[int, ...]:
        return self.language_model.get_eagle3_default_aux_hidden_state_layers()
