"""transformers' Qwen2.5-Omni reference as the oracle of the pipeline (test helper, not a test module).

``load(checkpoint)``: `Qwen2_5OmniForConditionalGeneration` in float32 with its speakers, patched only
where transformers 5.19's `generate` does not run what the model's own forward says:

- it drops an all-ones attention mask before the forward, and the talker's forward adds its prefill
  codec embeddings (pad, bos) and uses its M-RoPE positions only when given a mask: a pre-forward
  hook hands it the mask `generate` was given (tests/test_qwen2_5_omni_talker.py found this);
- it hands the media tensors (`pixel_values`, ...) on to `talker.generate`, which refuses them as
  unused: they are left out (the talker's forward never reads them).

``reference(model, token_ids, **media)``: the answer's token ids, the talker's codes (its stop id
included when it stopped) and the waveform of `generate(..., return_audio=True)`, greedy, with
token2wav's initial noise drawn after ``torch.manual_seed(seed)``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

#: Inputs the reference hands its talker that the talker's `generate` refuses (never read).
_UNUSED_BY_TALKER = ("pixel_values", "pixel_values_videos", "input_features", "feature_attention_mask")


def load(checkpoint: Path):
    from transformers import Qwen2_5OmniForConditionalGeneration

    model = Qwen2_5OmniForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()
    model.talker.register_forward_pre_hook(_keep_attention_mask, with_kwargs=True)
    return model


def _keep_attention_mask(module, args, kwargs):
    if kwargs.get("attention_mask") is None:
        cache = kwargs.get("past_key_values")
        past = cache.get_seq_length() if cache is not None else 0
        new = kwargs["inputs_embeds"] if kwargs.get("inputs_embeds") is not None else kwargs["input_ids"]
        kwargs["attention_mask"] = torch.ones(new.shape[0], past + new.shape[1], dtype=torch.long)
    return args, kwargs


def stop_ids(model) -> list[int]:
    cfg = model.config.talker_config
    return [cfg.tts_codec_pad_token_id, cfg.tts_codec_end_token_id]


def reference(
    model,
    token_ids: list[int],
    *,
    thinker_tokens: int,
    talker_steps: int,
    speaker: str = "Chelsie",
    seed: int = 0,
    **media,
) -> tuple[list[int], list[int], np.ndarray]:
    captured = {}
    generate = model.talker.generate

    def spy(*args, **kwargs):
        out = generate(*args, **{k: v for k, v in kwargs.items() if k not in _UNUSED_BY_TALKER})
        captured["codes"] = out[0, kwargs["input_ids"].shape[1] :].tolist()
        return out

    model.talker.generate = spy
    try:
        torch.manual_seed(seed)
        ids = torch.tensor([token_ids])
        sequences, wav = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            speaker=speaker,
            return_audio=True,
            thinker_max_new_tokens=thinker_tokens,
            thinker_do_sample=False,
            talker_do_sample=False,
            talker_max_new_tokens=talker_steps,
            talker_eos_token_id=stop_ids(model),
            **media,
        )
    finally:
        model.talker.generate = generate
    answer = sequences[0, len(token_ids) :].tolist()
    return answer, captured["codes"], wav.reshape(-1).float().numpy()
