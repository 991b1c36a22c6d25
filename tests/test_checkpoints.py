"""Tiny random-weight checkpoints: determinism, tokenizer, layout, codec decoder. No vLLM here."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from omni_cache.models.codec_decoder import CodecDecoder
from omni_cache.tiny import checkpoints as ck


def _files(d: Path) -> dict[str, bytes]:
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def ckpt_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ckpts")
    for name in ck.CHECKPOINT_NAMES:
        ck.ensure_checkpoint(name, root, seed=0)
    return root


@pytest.mark.parametrize("name", ck.CHECKPOINT_NAMES)
def test_same_seed_is_byte_identical(name, ckpt_root, tmp_path):
    again = ck.write_checkpoint(name, tmp_path / "again", seed=0)
    first = _files(ckpt_root / f"{name}-s0")
    first.pop(ck.COMPLETE_MARKER)
    second = _files(again)
    assert sorted(first) == sorted(second)
    for rel in first:
        assert first[rel] == second[rel], f"{name}/{rel} differs between two writes with seed 0"


@pytest.mark.parametrize("name", ck.CHECKPOINT_NAMES)
def test_other_seed_changes_weights(name, ckpt_root, tmp_path):
    other = ck.write_checkpoint(name, tmp_path / "s1", seed=1)
    base = ckpt_root / f"{name}-s0"
    assert (other / "config.json").read_bytes() == (base / "config.json").read_bytes()
    a, b = load_file(base / "model.safetensors"), load_file(other / "model.safetensors")
    assert sorted(a) == sorted(b)
    random_keys = [k for k in a if a[k].numel() > 1 and a[k].float().std() > 0]  # norms are constant
    assert random_keys
    for k in random_keys:
        assert not torch.equal(a[k], b[k]), k


def test_unknown_name_lists_valid_names(tmp_path):
    with pytest.raises(ValueError, match="thinker-hybrid"):
        ck.ensure_checkpoint("nope", tmp_path)
    with pytest.raises(ValueError, match="talker"):
        ck.write_checkpoint("nope", tmp_path)


def test_ensure_is_idempotent_and_atomic(tmp_path):
    results: list[Path] = []
    errors: list[BaseException] = []

    def worker():
        try:
            results.append(ck.ensure_checkpoint("decoder", tmp_path, seed=3))
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert set(results) == {tmp_path / "decoder-s3"}
    # No temp dirs left behind; a complete dir is returned untouched.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["decoder-s3"]
    mtime = (tmp_path / "decoder-s3" / "model.safetensors").stat().st_mtime_ns
    assert ck.ensure_checkpoint("decoder", tmp_path, seed=3) == tmp_path / "decoder-s3"
    assert (tmp_path / "decoder-s3" / "model.safetensors").stat().st_mtime_ns == mtime


def test_incomplete_dir_is_replaced(tmp_path):
    stale = tmp_path / "decoder-s0"
    stale.mkdir()
    (stale / "junk").write_text("half-written")
    path = ck.ensure_checkpoint("decoder", tmp_path, seed=0)
    assert path == stale and not (path / "junk").exists() and (path / ck.COMPLETE_MARKER).exists()


def test_default_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv("OMNI_CACHE_CHECKPOINTS", str(tmp_path))
    assert ck.default_checkpoint_dir() == tmp_path
    monkeypatch.delenv("OMNI_CACHE_CHECKPOINTS")
    assert ck.default_checkpoint_dir() == Path.home() / ".cache" / "omni_cache" / "checkpoints"


def test_cli(tmp_path, capsys):
    assert ck.main(["--out", str(tmp_path), "--seed", "2", "decoder"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "decoder-s2")


# ---- tokenizer ---------------------------------------------------------------------------------------
TEXTS = [
    "",
    "hello world",
    "  leading and trailing spaces  \n\ttabs\r\n",
    "héllo wörld, naïve café — “quotes” …",
    "你好，世界。日本語のテキスト。한국어",
    "emoji 🎵🎶👩‍👩‍👧 and combining e\u0301 vs \u00e9 (not NFC-normalized)",
    "<|im_start|>literal specials<|im_end|>",
    "\x00\x01 control \x7f bytes",
]


@pytest.mark.parametrize("name", ["thinker", "thinker-hybrid"])
def test_tokenizer_round_trip_and_chat_template(name, ckpt_root):
    from transformers import AutoTokenizer

    path = ckpt_root / f"{name}-s0"
    tok = AutoTokenizer.from_pretrained(path)
    cfg = json.loads((path / "config.json").read_text())
    gen = json.loads((path / "generation_config.json").read_text())
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == ck.IM_END_ID == 258
    assert cfg["eos_token_id"] == gen["eos_token_id"] == tok.eos_token_id
    assert tok.pad_token == "<|endoftext|>" and tok.pad_token_id == 256
    assert tok.convert_tokens_to_ids("<|im_start|>") == 257
    assert cfg["vocab_size"] == 512 and len(tok) == 259
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        assert all(0 <= i < cfg["vocab_size"] for i in ids)
        assert tok.decode(ids) == text
    ascii_ids = tok.encode("abc", add_special_tokens=False)
    assert ascii_ids == [97, 98, 99]  # id == byte value
    assert tok.encode("é", add_special_tokens=False) == list("é".encode())

    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi ünïcode"}]
    prompt = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert prompt == (
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi ünïcode<|im_end|>\n<|im_start|>assistant\n"
    )
    no_gen = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False)
    assert not no_gen.endswith("assistant\n")
    ids = tok.encode(prompt, add_special_tokens=False)
    assert ids[0] == 257 and ids.count(258) == 2
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert "user\nab<|im_end|>" in tok.apply_chat_template(parts, tokenize=False)


def test_talker_layout(ckpt_root):
    from transformers import AutoTokenizer

    path = ckpt_root / "talker-s0"
    tcfg = json.loads((path / "talker_config.json").read_text())
    assert tcfg == {
        "codebook_size": 256,
        "codec_bos_id": 256,
        "codec_eos_id": 257,
        "codec_pad_id": 258,
        "thinker_hidden_size": 512,
        "talker_hidden_size": 256,
    }
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["vocab_size"] == 320 and cfg["hidden_size"] == 256 and cfg["eos_token_id"] == 257
    proj = load_file(path / "thinker_projection.safetensors")
    assert proj["weight"].shape == (256, 512) and proj["weight"].dtype == torch.float32
    assert proj["bias"].shape == (256,) and proj["bias"].dtype == torch.float32
    tok = AutoTokenizer.from_pretrained(path)
    assert tok.eos_token_id == 257 and tok.bos_token_id == 256 and tok.pad_token_id == 258


def test_thinker_weights_shapes(ckpt_root):
    w = load_file(ckpt_root / "thinker-s0" / "model.safetensors")
    assert w["model.embed_tokens.weight"].shape == (512, 512)
    assert w["lm_head.weight"].shape == (512, 512)
    assert w["model.layers.7.self_attn.k_proj.weight"].shape == (256, 512)
    assert w["model.layers.0.mlp.down_proj.weight"].shape == (512, 1536)
    assert all(t.dtype == torch.bfloat16 for t in w.values())
    assert not any(k.startswith("model.layers.8.") for k in w)


def test_hybrid_weight_names_match_transformers(ckpt_root):
    """Every HF Qwen3-Next parameter is in the file with its shape (experts: HF v5 fuses them in
    memory; files, and vLLM, use one tensor per expert)."""
    from transformers import AutoConfig, Qwen3NextForCausalLM

    path = ckpt_root / "thinker-hybrid-s0"
    cfg = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = Qwen3NextForCausalLM(cfg)
    hf = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    ours = {k: tuple(v.shape) for k, v in load_file(path / "model.safetensors").items()}
    fused = {k for k in hf if ".mlp.experts." in k}
    assert {k for k in hf if k not in fused} == {k for k in ours if ".mlp.experts." not in k}
    for k in hf.keys() - fused:
        assert hf[k] == ours[k], k
    for k in fused:  # [E, 2*I, H] gate_up / [E, H, I] down
        prefix = k.rsplit(".", 1)[0]
        n_exp = hf[k][0]
        if k.endswith("gate_up_proj"):
            shapes = [ours[f"{prefix}.{e}.gate_proj.weight"] for e in range(n_exp)]
            assert all(s == (hf[k][1] // 2, hf[k][2]) for s in shapes), k
        else:
            shapes = [ours[f"{prefix}.{e}.down_proj.weight"] for e in range(n_exp)]
            assert all(s == hf[k][1:] for s in shapes), k


@pytest.mark.parametrize("name", ["thinker", "thinker-hybrid", "talker"])
def test_transformers_forward_is_finite(name, ckpt_root):
    """transformers loads the files (for Qwen3-Next: converts per-expert tensors to its fused layout)
    and a bf16 forward keeps every hidden state finite and at a sane scale."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt_root / f"{name}-s0", dtype=torch.bfloat16)
    ids = torch.tensor([list("hello wörld, 12345".encode())])
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    for h in out.hidden_states:
        assert torch.isfinite(h).all()
        assert 0.005 < h.float().std() < 10
    assert torch.isfinite(out.logits).all() and out.logits.shape[-1] == model.config.vocab_size


# ---- codec decoder ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def decoder(ckpt_root) -> CodecDecoder:
    return CodecDecoder.from_pretrained(ckpt_root / "decoder-s0")


def test_decoder_shape_range_determinism(decoder):
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 256, (2, 37), generator=g)
    wav = decoder(codes)
    assert wav.shape == (2, 37 * 1920) and wav.dtype == torch.float32
    assert decoder.samples_per_code == 1920 and decoder.sample_rate == 24000
    assert torch.isfinite(wav).all() and wav.abs().max() < 1.0
    assert wav.std() > 0.05  # not silence
    assert torch.equal(wav, decoder(codes.clone()))
    assert decoder(codes[0]).shape == (37 * 1920,)
    assert decoder(torch.zeros(1, 0, dtype=torch.long)).shape == (1, 0)


def test_decoder_context_is_exact(decoder):
    assert decoder.context == 2
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 256, (1, 61), generator=g)
    whole = decoder(codes)
    spc = decoder.samples_per_code
    c = decoder.context
    for chunk in (1, 5, 16, 61):
        pieces = []
        for s in range(0, 61, chunk):
            e = min(61, s + chunk)
            lo, hi = max(0, s - c), min(61, e + c)
            pieces.append(decoder(codes[:, lo:hi])[:, (s - lo) * spc : (e - lo) * spc])
            assert torch.equal(decoder.decode_range(codes, s, e), pieces[-1])
        assert torch.equal(torch.cat(pieces, dim=1), whole), f"chunk={chunk}"
    # Less context than documented is not exact: the receptive field really is 2 codes.
    s, e = 20, 30
    short = decoder(codes[:, s - 1 : e + 1])[:, spc : (e - s + 1) * spc]
    assert not torch.equal(short, whole[:, s * spc : e * spc])
    # Changing a code only changes frames within `context` of it.
    changed = codes.clone()
    changed[0, 30] = (changed[0, 30] + 1) % 256
    diff = (decoder(changed) != whole).view(61, spc).any(dim=1).nonzero().flatten().tolist()
    assert diff and min(diff) >= 30 - c and max(diff) <= 30 + c


def test_decoder_rejects_bad_codes(decoder):
    with pytest.raises(ValueError, match="256"):
        decoder(torch.tensor([[1, 2, 256]]))
    with pytest.raises(ValueError):
        decoder(torch.tensor([[1, -1]]))
    with pytest.raises(ValueError):
        decoder(torch.tensor([[0.5]]))


def test_deterministic_across_processes(ckpt_root, tmp_path):
    """A fresh interpreter (other hash seed, other allocation order) writes the same bytes."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONHASHSEED": "123"}
    root = Path(__file__).resolve().parents[1]
    names = ("talker", "decoder", "qwen3-omni")
    out = subprocess.run(
        [sys.executable, "-m", "omni_cache.tiny.checkpoints", "--out", str(tmp_path), *names],
        cwd=root,
        env=env,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    assert out == [str(tmp_path / f"{name}-s0") for name in names]
    for name in names:
        assert _files(tmp_path / f"{name}-s0") == _files(ckpt_root / f"{name}-s0")
