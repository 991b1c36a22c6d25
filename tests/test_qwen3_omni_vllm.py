"""vLLM loads the thinker of the tiny Qwen3-Omni checkpoint (``tiny:qwen3-omni``) unmodified and answers
text, image and audio chats; its prompt log-probabilities match transformers' thinker on the same
inputs (float32 on both sides).

One engine for the module (~20 s to start on a 2-core CPU).
"""

from __future__ import annotations

import base64
import gc
import importlib.util
import io
import wave

import numpy as np
import pytest
import torch

from omni_cache.tiny import checkpoints as ck
from omni_cache.tiny.qwen3_omni import TOKEN_ID

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
]

MAX_TOKENS = 6
# float32 on both sides; the two stacks still differ in kernels (attention, fused MoE, conv as GEMM)
# and in summation order. Measured max |diff| of prompt log-probabilities: 1e-6 (text, image, audio).
LOGPROB_ATOL = 1e-4


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return ck.ensure_checkpoint("qwen3-omni", tmp_path_factory.mktemp("q3omni"))


@pytest.fixture(scope="module")
def llm(path):
    from vllm import LLM

    llm = LLM(
        model=str(path),
        dtype="float32",
        enforce_eager=True,
        block_size=32,
        gpu_memory_utilization=0.3,
        max_model_len=1024,
        max_num_seqs=4,
        seed=0,
        # An engine argument, not VLLM_CPU_KVCACHE_SPACE (which would override every engine's size).
        kv_cache_memory_bytes=2**30,
        limit_mm_per_prompt={"image": 1, "audio": 1, "video": 0},
    )
    yield llm
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


@pytest.fixture(scope="module")
def hf(path):
    from transformers import AutoProcessor, Qwen3OmniMoeForConditionalGeneration

    model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    return model.thinker, AutoProcessor.from_pretrained(path)


def _image() -> np.ndarray:
    return np.random.default_rng(0).integers(0, 256, (64, 96, 3), dtype=np.uint8)


def _png_data_url(rgb: np.ndarray) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _pcm16() -> np.ndarray:
    t = np.arange(16000) / 16000
    return np.round(0.3 * np.sin(2 * np.pi * 440 * t) * 32767).astype(np.int16)


def _wav_b64(pcm: np.ndarray, rate: int = 16000) -> str:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.tobytes())
    return base64.b64encode(buf.getvalue()).decode()


CASES = {
    "text": [{"type": "text", "text": "Tell me a story."}],
    "image": [
        {"type": "image_url", "image_url": {"url": _png_data_url(_image())}},
        {"type": "text", "text": "What is this?"},
    ],
    "audio": [
        {"type": "input_audio", "input_audio": {"data": _wav_b64(_pcm16()), "format": "wav"}},
        {"type": "text", "text": "What do you hear?"},
    ],
}


@pytest.fixture(scope="module")
def answers(llm):
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
    convs = [[{"role": "user", "content": parts}] for parts in CASES.values()]
    outs = llm.chat(convs, params, use_tqdm=False)
    return dict(zip(CASES, outs))


@pytest.mark.parametrize("case", list(CASES))
def test_chat_is_answered(answers, case):
    out = answers[case]
    ids = list(out.prompt_token_ids)
    assert ids[0] == TOKEN_ID["<|im_start|>"]
    # The role name is one token, as in the released tokenizer.
    assert ids[-3:] == [TOKEN_ID["<|im_start|>"], TOKEN_ID["assistant"], ord("\n")]
    gen = list(out.outputs[0].token_ids)
    assert len(gen) == MAX_TOKENS and all(0 <= i < 512 for i in gen)
    n_image, n_audio = ids.count(TOKEN_ID["<|image_pad|>"]), ids.count(TOKEN_ID["<|audio_pad|>"])
    # The template placed one placeholder per part; vLLM expanded it to the encoder's output length:
    # 64x96 pixels = 4x6 patches of 16, merged 2x2 -> 6 tokens; 1 s of 16 kHz audio -> 13 tokens.
    assert (n_image, n_audio) == {"text": (0, 0), "image": (6, 0), "audio": (0, 13)}[case]
    if case == "image":
        assert TOKEN_ID["<|vision_start|>"] in ids and TOKEN_ID["<|vision_end|>"] in ids
    if case == "audio":
        assert TOKEN_ID["<|audio_start|>"] in ids and TOKEN_ID["<|audio_end|>"] in ids


@pytest.mark.parametrize("case", list(CASES))
def test_prompt_logprobs_match_transformers(answers, hf, case):
    """vLLM ran the real encoders and the MoE thinker: every prompt position's log-probability equals
    transformers' within float32 kernel noise."""
    thinker, processor = hf
    out = answers[case]
    text = processor.apply_chat_template(
        [{"role": "user", "content": CASES[case]}], tokenize=False, add_generation_prompt=True
    )
    media = {}
    if case == "image":
        media["images"] = [_image()]
    if case == "audio":
        media["audio"] = [_pcm16().astype(np.float32) / 32768.0]
    inputs = processor(text=text, return_tensors="pt", **media)
    ids = inputs["input_ids"][0].tolist()
    assert ids == list(out.prompt_token_ids)
    with torch.no_grad():
        logits = thinker(**inputs).logits[0].float()
    ref = torch.log_softmax(logits, dim=-1)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    got = torch.tensor([lp[tok].logprob for lp, tok in zip(out.prompt_logprobs[1:], ids[1:])])
    assert got.shape == ref.shape
    torch.testing.assert_close(got, ref, atol=LOGPROB_ATOL, rtol=0)
