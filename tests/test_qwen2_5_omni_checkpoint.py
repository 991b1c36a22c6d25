"""The tiny Qwen2.5-Omni checkpoint (``tiny:qwen2.5-omni``): released layout, byte-identical rewrites,
transformers loads the whole model (thinker, talker, token2wav, speakers) unmodified and speaks through
its reference ``generate``, and vLLM's thinker answers text and image chats with transformers' greedy
tokens (float32 on both sides). One vLLM engine for the module (~30-50 s to start on a 2-core CPU)."""

from __future__ import annotations

import base64
import gc
import importlib.util
import io
import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors import safe_open

from omni_cache.tiny import checkpoints as ck
from omni_cache.tiny import qwen2_5_omni as q25
from omni_cache.tiny.qwen2_5_omni import TOKEN_ID

MAX_TOKENS = 8
SAMPLES_PER_CODE = 2 * 240  # DiT repeats each code twice; BigVGAN makes 240 samples per mel frame


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return ck.ensure_checkpoint("qwen2.5-omni", tmp_path_factory.mktemp("q25omni"))


@pytest.fixture(scope="module")
def hf(path):
    from transformers import AutoProcessor, Qwen2_5OmniForConditionalGeneration

    # transformers 5.19's Qwen2_5OmniForConditionalGeneration.from_pretrained cannot return loading info
    # (it calls load_speakers on the (model, info) tuple), so load through the base class and read the
    # speakers as its from_pretrained would.
    cls = Qwen2_5OmniForConditionalGeneration
    model, info = super(cls, cls).from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    model.load_speakers(path / "spk_dict.pt")
    return model.eval(), info, AutoProcessor.from_pretrained(path)


def _image() -> np.ndarray:
    # 56x84 px: 4x6 patches of 14, merged 2x2 -> 6 image tokens.
    return np.random.default_rng(0).integers(0, 256, (56, 84, 3), dtype=np.uint8)


def _png_data_url(rgb: np.ndarray) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


CASES = {
    "text": [{"type": "text", "text": "Tell me a story."}],
    "image": [
        {"type": "image_url", "image_url": {"url": _png_data_url(_image())}},
        {"type": "text", "text": "What is this?"},
    ],
}


def _hf_inputs(processor, case: str):
    text = processor.apply_chat_template(
        [{"role": "user", "content": CASES[case]}], tokenize=False, add_generation_prompt=True
    )
    media = {"images": [_image()]} if case == "image" else {}
    return processor(text=text, return_tensors="pt", **media)


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
            "spk_dict.pt",
            "tokenizer.json",
            "tokenizer_config.json",
            "video_preprocessor_config.json",
        ]
    )
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen2_5OmniModel"] and cfg["model_type"] == "qwen2_5_omni"
    assert {"thinker_config", "talker_config", "token2wav_config"} <= cfg.keys()
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}
        head = f.get_tensor("talker.codec_head.weight").float()
    assert {k.split(".", 1)[0] for k in dtypes} == {"thinker", "talker", "token2wav"}
    assert {d for k, d in dtypes.items() if not k.startswith("token2wav.")} == {"BF16"}
    assert {d for k, d in dtypes.items() if k.startswith("token2wav.")} == {"F32"}
    # Above the codebook only the two stop ids can be predicted (module docstring of tiny_qwen2_5_omni).
    assert head.shape[0] == q25.TALKER_VOCAB_SIZE
    live = [i for i in range(q25.CODEBOOK_SIZE, q25.TALKER_VOCAB_SIZE) if head[i].abs().sum() > 0]
    assert live == [q25.CODEC_PAD_ID, q25.CODEC_EOS_ID]
    speakers = torch.load(path / "spk_dict.pt", weights_only=True)
    assert sorted(speakers) == sorted(q25.SPEAKERS) and q25.DEFAULT_SPEAKER == "Chelsie"
    for name, spk in speakers.items():
        assert spk["bos_token"] == TOKEN_ID[q25.SPEAKERS[name]]
        assert spk["cond"].shape == (1, 32) and spk["ref_mel"].shape == (1, q25.REF_MEL_FRAMES, 80)


def test_rewrite_in_another_process_is_byte_identical(path, tmp_path):
    """Same seed, fresh interpreter: every file (spk_dict.pt's zip records included) is the same."""
    code = f"from omni_cache.tiny import checkpoints as ck; ck.write_checkpoint('qwen2.5-omni', {str(tmp_path)!r})"
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
    for p in path.iterdir():
        if p.name != ck.COMPLETE_MARKER:
            assert (tmp_path / p.name).read_bytes() == p.read_bytes(), p.name


def test_processor_and_chat_template(hf):
    _, _, proc = hf
    assert type(proc).__name__ == "Qwen2_5OmniProcessor"
    assert type(proc.feature_extractor).__name__ == "WhisperFeatureExtractor"
    tok = proc.tokenizer
    assert tok.eos_token_id == 258 and tok.pad_token_id == 256
    assert tok.encode("abc", add_special_tokens=False) == [97, 98, 99]  # byte-level: id == byte
    for t, i in TOKEN_ID.items():
        assert tok.convert_tokens_to_ids(t) == i
    for image_part, audio_part in [
        ({"type": "image_url", "image_url": {"url": "data:,"}}, {"type": "input_audio", "input_audio": {}}),
        ({"type": "image"}, {"type": "audio"}),
    ]:
        msgs = [{"role": "user", "content": [image_part, audio_part, {"type": "text", "text": "what?"}]}]
        text = proc.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        # As released: a default system message when the conversation has none.
        assert text == (
            "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
            "<|vision_bos|><|IMAGE|><|vision_eos|><|audio_bos|><|AUDIO|><|audio_eos|>"
            "what?<|im_end|>\n<|im_start|>assistant\n"
        )
    own_system = [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "video"}]}]
    assert proc.apply_chat_template(own_system, tokenize=False) == (
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\n<|vision_bos|><|VIDEO|><|vision_eos|><|im_end|>\n"
    )
    inputs = proc(text=text, images=[_image()], audio=[np.zeros(16000, np.float32)], return_tensors="pt")
    ids = inputs["input_ids"][0].tolist()
    # 1 s of 16 kHz audio: 100 mel frames, halved by the conv front and again by the pooling -> 25.
    assert ids.count(TOKEN_ID["<|IMAGE|>"]) == 6 and ids.count(TOKEN_ID["<|AUDIO|>"]) == 25
    assert inputs["input_features"].shape[1] == 128


def test_transformers_loads_and_speaks(hf):
    model, info, proc = hf
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert sorted(model.speaker_map) == sorted(q25.SPEAKERS) and model.token2wav.dtype == torch.float32
    inputs = _hf_inputs(proc, "text")
    torch.manual_seed(0)  # token2wav's DiT starts from noise
    ids, wav = model.generate(
        **inputs,
        return_audio=True,
        speaker=q25.DEFAULT_SPEAKER,
        thinker_max_new_tokens=MAX_TOKENS,
        talker_max_new_tokens=16,
        talker_do_sample=False,
        talker_eos_token_id=[q25.CODEC_PAD_ID, q25.CODEC_EOS_ID],
    )
    n_prompt = inputs["input_ids"].shape[1]
    assert ids.shape[0] == 1 and 0 < ids.shape[1] - n_prompt <= MAX_TOKENS
    assert wav.ndim == 1 and wav.numel() > 0 and wav.numel() % SAMPLES_PER_CODE == 0
    assert torch.isfinite(wav).all()
    # Audible and not saturated (BigVGAN clamps to +-1).
    assert 0.01 < wav.std() < 0.5 and (wav.abs() >= 0.999).float().mean() < 0.01


def test_token2wav_follows_the_codes(hf):
    """The vocoder's audio depends on the codes, not only on the DiT's starting noise (the tiny init's
    point: see tiny_qwen2_5_omni's DIT_GAIN / DIT_MEL_MEAN)."""
    model = hf[0]
    spk = model.speaker_map[q25.DEFAULT_SPEAKER]
    g = torch.Generator().manual_seed(1)
    wavs = []
    for codes in torch.randint(0, q25.CODEBOOK_SIZE, (2, 1, 24), generator=g):
        torch.manual_seed(0)  # the same starting noise for both
        with torch.no_grad():
            wavs.append(model.token2wav(codes, conditioning=spk["cond"], reference_mel=spk["ref_mel"]))
    assert wavs[0].shape == (24 * SAMPLES_PER_CODE,)
    assert (wavs[0] - wavs[1]).std() > 0.2 * wavs[0].std() > 0.01


# ---- vLLM ------------------------------------------------------------------------------------------
requires_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")


@pytest.fixture(scope="module")
def answers(path):
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=str(path),
        dtype="float32",
        enforce_eager=True,
        block_size=32,
        gpu_memory_utilization=0.3,
        max_model_len=2048,
        max_num_seqs=4,
        seed=0,
        # An engine argument, not VLLM_CPU_KVCACHE_SPACE (which would size every engine of the process).
        kv_cache_memory_bytes=2**30,
        limit_mm_per_prompt={"image": 1, "audio": 1, "video": 0},
    )
    try:
        convs = [[{"role": "user", "content": parts}] for parts in CASES.values()]
        outs = llm.chat(convs, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0), use_tqdm=False)
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    return dict(zip(CASES, outs))


@pytest.mark.vllm
@requires_vllm
@pytest.mark.parametrize("case", list(CASES))
def test_vllm_thinker_matches_transformers(answers, hf, case):
    model, _, proc = hf
    out = answers[case]
    inputs = _hf_inputs(proc, case)
    prompt = inputs["input_ids"][0].tolist()
    # vLLM's multimodal processor and transformers' processor give the same prompt: the template's one
    # placeholder per part expanded to the encoder's length (6 image tokens for 56x84 px).
    assert list(out.prompt_token_ids) == prompt
    assert prompt.count(TOKEN_ID["<|IMAGE|>"]) == (6 if case == "image" else 0)
    with torch.no_grad():
        ref = model.thinker.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
    assert list(out.outputs[0].token_ids) == ref[0, len(prompt) :].tolist()
