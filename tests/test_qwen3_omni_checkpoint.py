"""The tiny Qwen3-Omni checkpoint (``tiny:qwen3-omni``): released layout, transformers loads the model
and its processor unmodified, the chat template places media placeholders. No vLLM here (that is
tests/test_qwen3_omni_vllm.py); determinism is in tests/test_checkpoints.py (every checkpoint name)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors import safe_open

from omni_cache.tiny import checkpoints as ck
from omni_cache.tiny.qwen3_omni import TOKEN_ID


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return ck.ensure_checkpoint("qwen3-omni", tmp_path_factory.mktemp("q3omni"))


def test_released_layout(path):
    files = sorted(p.name for p in path.iterdir())
    assert files == sorted(
        [
            ck.COMPLETE_MARKER,
            "chat_template.json",
            "config.json",
            "generation_config.json",
            "model.safetensors",
            "preprocessor_config.json",
            "special_tokens_map.json",
            "tokenizer.json",
            "tokenizer_config.json",
            "video_preprocessor_config.json",
        ]
    )
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3OmniMoeForConditionalGeneration"]
    assert cfg["model_type"] == "qwen3_omni_moe"
    assert {"thinker_config", "talker_config", "code2wav_config"} <= cfg.keys()
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
        dtypes = {f.get_slice(k).get_dtype() for k in keys}
    assert {k.split(".", 1)[0] for k in keys} == {"thinker", "talker", "code2wav"}
    assert dtypes == {"BF16"}
    # Experts one tensor each, as released (and as vLLM reads them).
    assert "thinker.model.layers.0.mlp.experts.3.down_proj.weight" in keys
    assert "talker.model.layers.1.mlp.experts.0.gate_proj.weight" in keys
    pp = json.loads((path / "preprocessor_config.json").read_text())
    assert pp["feature_size"] == 128 and pp["image_processor_type"] == "Qwen2VLImageProcessor"
    vp = json.loads((path / "video_preprocessor_config.json").read_text())
    assert vp["video_processor_type"] == "Qwen2VLVideoProcessor"
    gen = json.loads((path / "generation_config.json").read_text())
    assert gen["eos_token_id"] == TOKEN_ID["<|im_end|>"] == 258


def test_transformers_loads_model_unmodified(path):
    from transformers import Qwen3OmniMoeForConditionalGeneration

    model, info = Qwen3OmniMoeForConditionalGeneration.from_pretrained(
        path, dtype=torch.float32, output_loading_info=True
    )
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert model.has_talker and model.code2wav.config.num_quantizers == 4
    ids = torch.tensor([list(b"hello")])
    with torch.no_grad():
        out = model.thinker(input_ids=ids, output_hidden_states=True)
    for h in out.hidden_states:
        assert torch.isfinite(h).all() and 0.005 < h.std() < 10
    assert out.logits.shape == (1, 5, 512)


def test_processor_and_chat_template(path):
    from transformers import AutoProcessor

    proc = AutoProcessor.from_pretrained(path)
    assert type(proc).__name__ == "Qwen3OmniMoeProcessor"
    assert type(proc.image_processor).__name__.startswith("Qwen2VLImageProcessor")
    assert type(proc.feature_extractor).__name__ == "WhisperFeatureExtractor"
    assert proc.feature_extractor.feature_size == 128
    tok = proc.tokenizer
    assert tok.eos_token_id == 258 and tok.pad_token_id == 256
    assert tok.encode("abc", add_special_tokens=False) == [97, 98, 99]  # byte-level: id == byte
    for t, i in TOKEN_ID.items():
        assert tok.convert_tokens_to_ids(t) == i

    # OpenAI content parts and Qwen's own part names give the same placeholders.
    for image_part, audio_part in [
        ({"type": "image_url", "image_url": {"url": "data:,"}}, {"type": "input_audio", "input_audio": {}}),
        ({"type": "image"}, {"type": "audio"}),
    ]:
        msgs = [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [image_part, audio_part, {"type": "text", "text": "what?"}]},
        ]
        text = proc.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        assert text == (
            "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\n"
            "<|vision_start|><|image_pad|><|vision_end|><|audio_start|><|audio_pad|><|audio_end|>"
            "what?<|im_end|>\n<|im_start|>assistant\n"
        )
    video = [{"role": "user", "content": [{"type": "video"}]}]
    assert "<|vision_start|><|video_pad|><|vision_end|>" in proc.apply_chat_template(video, tokenize=False)

    image = np.random.default_rng(0).integers(0, 256, (64, 96, 3), dtype=np.uint8)
    audio = np.zeros(16000, np.float32)
    inputs = proc(text=text, images=[image], audio=[audio], return_tensors="pt")
    ids = inputs["input_ids"][0].tolist()
    # 64x96 px -> 4x6 patches of 16 -> 2x3 after the 2x2 merge; 1 s of audio -> 13 tokens.
    assert ids.count(TOKEN_ID["<|image_pad|>"]) == 6 and ids.count(TOKEN_ID["<|audio_pad|>"]) == 13
    assert inputs["input_features"].shape[1] == 128
