"""vLLM loads the tiny checkpoints through its normal path (``vllm.LLM(model=path)``) and generates.

One engine start costs ~30 s on a 2-core CPU machine, so each engine is created once and shared by the
tests of its class (class-scoped fixture: torn down, and its memory freed, as soon as its tests are done,
instead of all three engines living until the end of the session).
"""

from __future__ import annotations

import gc
import importlib.util
from pathlib import Path

import pytest
import torch

from omni_cache.tiny import checkpoints as ck

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
]

MAX_TOKENS = 8

# CPU facts (see DESIGN.md): block_size a multiple of 32, gpu_memory_utilization is a fraction of one
# NUMA node's memory (the default 0.92 fails), eager mode halves start-up time.
COMMON_ENGINE_ARGS = dict(
    dtype="bfloat16",
    enforce_eager=True,
    gpu_memory_utilization=0.3,
    max_model_len=4096,
    max_num_seqs=8,
    seed=0,
    # An engine argument, not VLLM_CPU_KVCACHE_SPACE: vLLM's CPU platform lets that variable
    # override every engine's kv_cache_memory_bytes, so setting it here would resize the small KV
    # caches other test modules ask for (the churn tests check they got them).
    kv_cache_memory_bytes=2**30,
)


@pytest.fixture(scope="session")
def vllm_ckpt_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("vllm_ckpts")


def _make_llm(path: Path, **kwargs):
    from vllm import LLM

    return LLM(model=str(path), **{**COMMON_ENGINE_ARGS, **kwargs})


def _shutdown(llm) -> None:
    """Stop the engine-core process now rather than whenever the LLM is garbage collected."""
    engine_core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if engine_core is not None and hasattr(engine_core, "shutdown"):
        engine_core.shutdown()


def _greedy(max_tokens: int = MAX_TOKENS, **kw):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def _check_text_generation(llm) -> None:
    from vllm import SamplingParams

    plain = llm.generate("hello", SamplingParams(max_tokens=MAX_TOKENS, temperature=0), use_tqdm=False)
    assert 1 <= len(plain[0].outputs[0].token_ids) <= MAX_TOKENS  # may stop early on <|im_end|>
    outs = llm.generate(["hello", "héllo wörld 你好"], _greedy(ignore_eos=True), use_tqdm=False)
    assert len(outs) == 2
    for out in outs:
        ids = list(out.outputs[0].token_ids)
        assert len(ids) == MAX_TOKENS
        assert all(0 <= i < ck.TEXT_VOCAB_SIZE for i in ids)
        assert isinstance(out.outputs[0].text, str)
    # The prompt went through our byte-level tokenizer: token id == byte value.
    assert list(outs[0].prompt_token_ids) == list(b"hello")
    assert list(outs[1].prompt_token_ids) == list("héllo wörld 你好".encode())
    # Deterministic: greedy decoding twice gives the same tokens.
    again = llm.generate("hello", _greedy(ignore_eos=True), use_tqdm=False)
    assert list(again[0].outputs[0].token_ids) == list(outs[0].outputs[0].token_ids)


@pytest.fixture(scope="class")
def thinker_llm(vllm_ckpt_root):
    llm = _make_llm(ck.ensure_checkpoint("thinker", vllm_ckpt_root), block_size=32)
    yield llm
    _shutdown(llm)
    del llm
    gc.collect()


@pytest.fixture(scope="class")
def hybrid_llm(vllm_ckpt_root):
    # No block_size: with prefix caching on, vLLM picks mamba_cache_mode "align" and raises the
    # attention block size so that one KV block's page matches one recurrent state's page.
    llm = _make_llm(ck.ensure_checkpoint("thinker-hybrid", vllm_ckpt_root))
    yield llm
    _shutdown(llm)
    del llm
    gc.collect()


@pytest.fixture(scope="class")
def talker_path(vllm_ckpt_root):
    return ck.ensure_checkpoint("talker", vllm_ckpt_root)


@pytest.fixture(scope="class")
def talker_llm(talker_path):
    llm = _make_llm(talker_path, block_size=32, enable_prompt_embeds=True)
    yield llm
    _shutdown(llm)
    del llm
    gc.collect()


class TestThinker:
    @pytest.fixture
    def llm(self, thinker_llm):
        return thinker_llm

    def test_generates_from_text(self, llm):
        _check_text_generation(llm)

    def test_chat(self, llm):
        outs = llm.chat([{"role": "user", "content": "hi"}], _greedy(ignore_eos=True), use_tqdm=False)
        ids = list(outs[0].prompt_token_ids)
        assert ids[0] == ck.IM_START_ID and ids[-len(b"assistant\n") :] == list(b"assistant\n")
        assert len(outs[0].outputs[0].token_ids) == MAX_TOKENS

    def test_eos_is_im_end(self, llm):
        assert llm.get_tokenizer().eos_token_id == ck.IM_END_ID


class TestThinkerHybrid:
    @pytest.fixture
    def llm(self, hybrid_llm):
        return hybrid_llm

    def test_generates_from_text(self, llm):
        _check_text_generation(llm)

    def test_hybrid_cache_config(self, llm):
        cache_config = llm.llm_engine.vllm_config.cache_config
        assert cache_config.block_size % 32 == 0
        assert cache_config.mamba_cache_mode == "align"


class TestTalker:
    @pytest.fixture
    def llm(self, talker_llm):
        return talker_llm

    @pytest.fixture
    def path(self, talker_path):
        return talker_path

    def test_generates_codes_from_prompt_embeds(self, llm, path):
        from safetensors.torch import load_file

        proj = load_file(path / "thinker_projection.safetensors")
        g = torch.Generator().manual_seed(0)
        thinker_hidden = torch.randn(23, ck.THINKER_HIDDEN, generator=g)
        embeds = torch.nn.functional.linear(thinker_hidden, proj["weight"], proj["bias"])
        embeds = embeds.to(torch.bfloat16)
        assert embeds.shape == (23, ck.TALKER_HIDDEN)

        outs = llm.generate(
            [{"prompt_embeds": embeds}, {"prompt_embeds": embeds[:5]}],
            _greedy(ignore_eos=True),
            use_tqdm=False,
        )
        for out in outs:
            ids = list(out.outputs[0].token_ids)
            assert len(ids) == MAX_TOKENS
            assert all(0 <= i < ck.TALKER_VOCAB_SIZE for i in ids)
        again = llm.generate({"prompt_embeds": embeds}, _greedy(ignore_eos=True), use_tqdm=False)
        assert list(again[0].outputs[0].token_ids) == list(outs[0].outputs[0].token_ids)

    def test_eos_is_codec_eos(self, llm):
        assert llm.get_tokenizer().eos_token_id == ck.CODEC_EOS_ID
