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

Adjacent audio items (issue 51): a realtime turn's audio is a run of encoder-window chunks, each
its own multimodal item, their placeholders adjacent inside one ``audio_start ... audio_end`` span.
vLLM's M-RoPE layout gives every audio item one closing (audio_end) position after it, so two
adjacent items count one token too many ("Position ids length mismatch"). Audio positions are
one-dimensional and sequential, so a run of adjacent audio items is laid out as one item of their
summed length: the positions of the whole clip as one item. A prompt may also end in audio (a
turn prefilled while the user still speaks: no audio_end yet); its positions are the first ones of
the prompt that goes on with the audio_end, so the KV it leaves in the prefix cache is the later
prompt's.
"""

from __future__ import annotations

from collections.abc import Iterator
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

    def get_mrope_input_positions(self, input_tokens: list[int], mm_features: list[Any]) -> tuple[torch.Tensor, int]:
        if mm_features:
            last = max(mm_features, key=lambda f: f.mm_position.offset)
            if last.modality == "audio" and last.mm_position.offset + last.mm_position.length >= len(input_tokens):
                # Ends in audio: laid out as if its audio_end followed, that position dropped.
                closed = list(input_tokens) + [self.config.audio_end_token_id]
                positions, _ = super().get_mrope_input_positions(closed, mm_features)
                positions = positions[:, : len(input_tokens)]
                return positions, int(positions.max()) + 1 - len(input_tokens)
        return super().get_mrope_input_positions(input_tokens, mm_features)

    def iter_mm_features(self, mm_features: list[Any]) -> Iterator[tuple[int, str, dict[str, Any]]]:
        """vLLM's features in prompt order, a run of adjacent audio items as one item."""
        run: tuple[int, int] | None = None  # (offset, tokens) of the audio run being merged
        for offset, modality, data in super().iter_mm_features(mm_features):
            if modality == "audio":
                n = super()._compute_audio_token_count(data["audio_feature_length"])
                if run is not None and run[0] + run[1] == offset:
                    run = (run[0], run[1] + n)
                    continue
                if run is not None:
                    yield run[0], "audio", {"audio_feature_length": AudioRun(run[1])}
                run = (offset, n)
                continue
            if run is not None:
                yield run[0], "audio", {"audio_feature_length": AudioRun(run[1])}
                run = None
            yield offset, modality, data
        if run is not None:
            yield run[0], "audio", {"audio_feature_length": AudioRun(run[1])}

    def _compute_audio_token_count(self, audio_feature_length: Any) -> int:
        if isinstance(audio_feature_length, AudioRun):
            return audio_feature_length.tokens
        return super()._compute_audio_token_count(audio_feature_length)


class AudioRun:
    """A run of adjacent audio items in M-RoPE's layout: its token count, known already."""

    __slots__ = ("tokens",)

    def __init__(self, tokens: int) -> None:
        self.tokens = tokens
