"""Qwen3-Omni's code2wav as the project's decoder (omni_cache.models.qwen3_omni_code2wav) on the tiny
``qwen3-omni`` checkpoint: equal to transformers' code2wav, chunked decoding within tolerance of the
whole sequence, receptive field as computed, bad codes refused. No vLLM here."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from omni_cache.models.qwen3_omni_code2wav import CHUNKED_ATOL, Code2WavDecoder, CodeWindow
from omni_cache.tiny import checkpoints as ck

T = 120  # codes: 9.6 s of audio at 12.5 codes per second; > 2x the receptive field


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return ck.ensure_checkpoint("qwen3-omni", tmp_path_factory.mktemp("q3omni"))


@pytest.fixture(scope="module")
def decoder(path) -> Code2WavDecoder:
    return Code2WavDecoder.from_pretrained(path)


@pytest.fixture(scope="module")
def codes(decoder) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, decoder.codebook_size, (decoder.num_quantizers, T), generator=g)


@pytest.fixture(scope="module")
def whole(decoder, codes) -> torch.Tensor:
    return decoder.decode(codes)


def test_equals_transformers_code2wav(path, decoder, codes, whole):
    from transformers import Qwen3OmniMoeForConditionalGeneration

    model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model.code2wav(codes[None])[0, 0]
    assert torch.equal(whole, ref)  # same module, same weights, same ops: bitwise
    spc, rf = decoder.samples_per_code, decoder.receptive_field
    assert whole.shape == (T * spc - rf.tail_samples,) and whole.dtype == torch.float32
    assert 0.05 < whole.std() < 0.5  # audible, not saturated: the random weights make a real signal


def test_receptive_field(decoder, codes, whole):
    rf = decoder.receptive_field
    # 2 layers x (window 24 - 1) for the transformer + 10 for the convolutions; 555 = the decoder
    # blocks' transposed-conv trims (((8 * 5 + 5) * 4 + 4) * 3 + 3).
    assert (rf.left_codes, rf.conv_codes, rf.right_codes, rf.tail_samples, rf.lag_samples) == (56, 10, 0, 555, 555)
    assert decoder.samples_per_code == 1920 and decoder.sample_rate == 24000
    # Changing code p changes samples from p's own frame less the tail (the samples a decode of
    # codes[:p] does not make: why audio lags codes) up to left_codes later, and the reach is real
    # (it gets within 3 codes of the bound).
    p, spc = 20, decoder.samples_per_code
    changed = codes.clone()
    changed[:, p] = (changed[:, p] + 1) % decoder.codebook_size
    diff = (decoder.decode(changed) != whole).nonzero().flatten()
    assert diff.min() >= p * spc - rf.tail_samples
    assert diff.max() < (p + rf.left_codes + 1) * spc
    assert diff.max() >= (p + rf.left_codes - 3) * spc


def _stream(decoder, codes, arrive: int, max_codes: int | None = None, left_context=None):
    """Codes arrive ``arrive`` at a time; decode whatever can be emitted after each arrival."""
    n_total, emitted, pieces = codes.shape[-1], 0, []
    for n in [*range(arrive, n_total, arrive), n_total]:
        while w := decoder.next_window(codes[:, :n], emitted, n == n_total, max_codes, left_context):
            pieces.append(decoder.decode_windows([w])[0])
            emitted += w.stop - w.start
    assert emitted == n_total
    return torch.cat(pieces)


@pytest.mark.parametrize("arrive", [16, 45, T])  # T % 16 and T % 45: final partial chunks
def test_chunked_equals_whole_within_tolerance(decoder, codes, whole, arrive):
    wav = _stream(decoder, codes, arrive)
    assert wav.shape == whole.shape
    torch.testing.assert_close(wav, whole, atol=CHUNKED_ATOL, rtol=0)


def test_less_context_is_not_within_tolerance(decoder, codes, whole):
    short = decoder.receptive_field.left_codes - 8
    wav = _stream(decoder, codes, T, max_codes=40, left_context=short)
    assert wav.shape == whole.shape
    assert (wav - whole).abs().max() > 100 * CHUNKED_ATOL


def test_batched_windows_equal_single(decoder, codes):
    """Windows of different lengths in one forward (right-padded) give each window's own audio."""
    windows = [
        CodeWindow(codes[:, :37], 0, 37),  # final
        CodeWindow(codes[:, 10:115], 60, 100),  # context, emitted, codes after
        CodeWindow(codes[:, 115:116], 0, 1),  # one code
    ]
    batched = decoder.decode_windows(windows)
    spc, tail = decoder.samples_per_code, decoder.receptive_field.tail_samples
    assert [b.shape[0] for b in batched] == [37 * spc - tail, 40 * spc, spc - tail]
    for w, b in zip(windows, batched):
        torch.testing.assert_close(b, decoder.decode_windows([w])[0], atol=CHUNKED_ATOL, rtol=0)
    assert decoder.decode_windows([]) == []


def test_reads_only_code2wav_tensors(path, decoder, codes, whole, tmp_path):
    """A sharded folder whose thinker/talker shard is missing still loads: only code2wav.* is read."""
    weights = load_file(path / "model.safetensors")
    c2w = {k: v for k, v in weights.items() if k.startswith("code2wav.")}
    assert c2w and len(c2w) < len(weights)
    save_file(c2w, str(tmp_path / "model-00002-of-00002.safetensors"), metadata={"format": "pt"})
    index = {k: "model-00001-of-00002.safetensors" for k in weights}  # never written
    index.update({k: "model-00002-of-00002.safetensors" for k in c2w})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
    shutil.copy(path / "config.json", tmp_path / "config.json")
    loaded = Code2WavDecoder.from_pretrained(tmp_path)
    assert torch.equal(loaded.decode(codes[:, :20]), decoder.decode(codes[:, :20]))


def test_bad_codes_are_refused(decoder, codes):
    q = decoder.num_quantizers
    with pytest.raises(ValueError, match="num_quantizers"):
        decoder.decode(codes[:1])
    with pytest.raises(ValueError, match=r"\[0, 256\)"):
        decoder.decode(torch.full((q, 3), 256))
    with pytest.raises(ValueError, match=r"\[0, 256\)"):
        decoder.decode(torch.full((q, 3), -1))
    with pytest.raises(ValueError, match="integers"):
        decoder.decode(codes.float())
    with pytest.raises(ValueError, match="start <= stop"):
        decoder.decode_windows([CodeWindow(codes[:, :10], 5, 4)])
    with pytest.raises(ValueError, match="start <= stop"):
        decoder.decode_windows([CodeWindow(codes[:, :10], 0, 11)])


def test_next_window_plan(decoder, codes):
    """code2wav is causal: nothing is held back as lookahead (its audio lags the codes by
    tail_samples instead), the emitted codes are capped, the left context covers the lag."""
    rf, spc = decoder.receptive_field, decoder.samples_per_code
    ctx = rf.context_codes(spc)
    assert rf.right_codes == 0 and 0 < rf.lag_samples == rf.tail_samples < spc
    assert ctx == rf.left_codes + 1
    w = decoder.next_window(codes[:, :1], 0, final=False)  # one code is enough for audio
    assert (w.start, w.stop, w.codes.shape[-1]) == (0, 1, 1)
    assert decoder.decode_windows([w])[0].shape == (spc - rf.lag_samples,)
    w = decoder.next_window(codes, 100, final=False, max_codes=8)
    assert (w.start, w.stop) == (ctx, ctx + 8)
    assert torch.equal(w.codes, codes[:, 100 - ctx : 108])
    w = decoder.next_window(codes, 100, final=True)
    assert w.final and torch.equal(w.codes, codes[:, 100 - ctx :])
    assert decoder.next_window(codes, T, final=True) is None
    with pytest.raises(ValueError, match="outside"):
        decoder.next_window(codes[:, :10], 11, final=False)


def test_not_a_qwen3_omni_folder(tmp_path):
    ck.write_checkpoint("decoder", tmp_path)
    with pytest.raises(ValueError, match="not a Qwen3-Omni checkpoint"):
        Code2WavDecoder.from_pretrained(tmp_path)
