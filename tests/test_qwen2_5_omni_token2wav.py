"""Qwen2.5-Omni's token2wav as the project's decoder (omni_cache.models.qwen2_5_omni_token2wav) on the
tiny ``qwen2.5-omni`` checkpoint: a whole-answer window equals transformers' token2wav given the same
seed, streamed windows (the hand-off's, block-aligned) stay within the measured bound, speakers and
seeds reach the audio, bad speakers and codes are refused. No vLLM here."""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from decoder_harness import make_runner

from omni_cache.handoff import HandoffContext, Upstream, talker_to_decoder
from omni_cache.models.code_windows import CodeWindow
from omni_cache.models.qwen2_5_omni_token2wav import STREAM_MAX_ABS, STREAM_RMS, WHOLE_ATOL, Token2WavDecoder
from omni_cache.models.window_decoders import load_window_decoder
from omni_cache.tiny import checkpoints as ck
from omni_cache.tiny import qwen2_5_omni as q25
from omni_cache.wire.messages import StageOutput, StreamStart
from omni_cache.wire.sampling import EngineSampling

T = 120  # codes: 2.4 s of audio at 50 codes a second; 10 DiT blocks


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread: on a loaded 2-core machine two threads made the DiT 20x slower (spinning
    OpenMP threads wait on each other), which would cost this module seconds per decode."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def path() -> Path:
    return ck.ensure_checkpoint("qwen2.5-omni")


@pytest.fixture(scope="module")
def decoder(path) -> Token2WavDecoder:
    return load_window_decoder(path)


@pytest.fixture(scope="module")
def codes() -> torch.Tensor:
    return torch.randint(0, q25.CODEBOOK_SIZE, (1, T), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def whole(decoder, codes) -> torch.Tensor:
    return decoder.decode(codes, seed=3)


def _context(decoder: Token2WavDecoder, chunk: int) -> HandoffContext:
    """The resources the decoder stage gives its hand-off (workers/decoder_runner.py)."""
    return HandoffContext(
        Path("."),
        resources={
            "receptive_field": decoder.receptive_field,
            "chunk_size": chunk,
            "samples_per_code": decoder.samples_per_code,
            "num_quantizers": decoder.num_quantizers,
            "codebook_size": decoder.codebook_size,
        },
    )


def _handoff_windows(decoder, token_ids: list[int], chunk: int = 36) -> list[CodeWindow]:
    """The talker's ids arriving one at a time through the unchanged talker_to_decoder."""
    ctx, up, state, windows = _context(decoder, chunk), Upstream("talker", [], {}, 0, False), {}, []
    for i, t in enumerate(token_ids):
        up.token_ids.append(t)
        up.finished = i == len(token_ids) - 1
        windows += [job.window for job in talker_to_decoder(ctx, up, state) if job.window is not None]
    return windows


def _audio(decoder, windows, **request) -> torch.Tensor:
    return torch.cat([decoder.decode_windows([replace(w, **request)])[0] for w in windows])


def test_loads_as_the_stage_decoder(decoder):
    assert isinstance(decoder, Token2WavDecoder)
    rf = decoder.receptive_field
    # Blocks of 24 mel frames = 12 codes; the reference's context: 2 blocks before, 1 after.
    assert (rf.block_codes, rf.left_codes, rf.right_codes, rf.tail_samples, rf.lag_samples) == (12, 24, 12, 0, 0)
    assert decoder.samples_per_code == 480 and decoder.sample_rate == 24000 and decoder.num_quantizers == 1
    assert decoder.codebook_size == q25.CODEBOOK_SIZE  # DiT num_embeds 257 = the codebook plus one id
    assert sorted(decoder.speakers) == sorted(q25.SPEAKERS) and decoder.default_speaker == q25.DEFAULT_SPEAKER


def test_whole_window_equals_transformers(path, decoder, codes, whole):
    """transformers' own model and speakers (from_pretrained reads spk_dict.pt), the global RNG
    seeded as the decoder's seed: the same noise, the same ops."""
    from transformers import Qwen2_5OmniForConditionalGeneration

    model = Qwen2_5OmniForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    spk = model.speaker_map[q25.DEFAULT_SPEAKER]
    torch.manual_seed(3)
    with torch.no_grad():
        ref = model.token2wav(codes, conditioning=spk["cond"].float(), reference_mel=spk["ref_mel"].float())
    assert whole.shape == ref.shape == (T * decoder.samples_per_code,) and whole.dtype == torch.float32
    assert (whole - ref).abs().max() <= WHOLE_ATOL  # measured: 0 (bitwise)
    assert 0.05 < whole.std() < 0.5  # a real signal, not silence or clipping
    assert torch.equal(decoder.decode(codes, speaker=q25.DEFAULT_SPEAKER, seed=3), whole)  # None = the default
    odd = codes[:, :50]  # not a whole number of DiT blocks: the last block is short, as in the reference
    torch.manual_seed(0)
    with torch.no_grad():
        ref = model.token2wav(odd, conditioning=spk["cond"].float(), reference_mel=spk["ref_mel"].float())
    assert (decoder.decode(odd) - ref).abs().max() <= WHOLE_ATOL


def test_noise_is_prefix_consistent(decoder):
    """CPU normal_ makes normals 16 at a time: draws of multiples of 16 values are prefixes of longer
    ones and pieces drawn in turn are one draw; other sizes are not (why a frame's 80 values work)."""
    g = lambda: torch.Generator().manual_seed(5)  # noqa: E731
    big = torch.randn(160 * 80, generator=g())
    assert torch.equal(torch.randn(48 * 80, generator=g()), big[: 48 * 80])
    gen = g()
    assert torch.equal(torch.cat([torch.randn(n * 80, generator=gen) for n in (24, 7, 73, 56)]), big)
    assert not torch.equal(torch.randn(40, generator=g()), torch.randn(80, generator=g())[:40])
    torch.manual_seed(5)  # the reference's draw: the global generator, [1, frames, 80]
    assert torch.equal(decoder.noise(5, 48, 160), torch.randn([1, 160, 80])[0, 48:])


def test_streamed_within_measured_bound(decoder, codes, whole):
    """The hand-off's windows (one block first, then growing to 36-code chunks, all on block
    boundaries) and the reference's fixed 36-code chunks, against the whole-sequence decode."""
    windows = _handoff_windows(decoder, codes[0].tolist())
    assert [w.stop - w.start for w in windows] == [12, 24, 36, 36, 12]
    for w in windows:
        assert w.offset % 12 == 0 and (w.offset + w.start) % 12 == 0
        assert (w.offset + w.stop) % 12 == 0 or w.final
    for chunks in (windows, _reference_chunks(decoder, codes)):
        diff = _audio(decoder, chunks, seed=3) - whole
        assert diff.shape == whole.shape
        # Measured 6.9e-3 / 4.5e-3, RMS 2.3e-4 / 1.4e-4 (signal std 0.135) with the DiT's attention at
        # 1/sqrt(fan_in); at std 0.02 its frames hardly mix and the difference is rounding (1e-6).
        assert diff.abs().max() <= STREAM_MAX_ABS and diff.pow(2).mean().sqrt() <= STREAM_RMS


def _reference_chunks(decoder, codes, left_context: int | None = None) -> list[CodeWindow]:
    windows, emitted = [], 0
    while w := decoder.next_window(codes, emitted, True, left_context=left_context):
        windows.append(w)
        emitted = w.offset + w.stop
    assert [w.stop - w.start for w in windows] == [36, 36, 36, 12]
    return windows


def _mixing(decoder: Token2WavDecoder) -> Token2WavDecoder:
    """The decoder with its DiT blocks' weights (attention, its modulation and gates, MLP) drawn at
    1/sqrt(fan_in), seeded: frames mix across blocks as trained weights make them, whatever the tiny
    checkpoint's init is (at std 0.02 the gates shut attention out and streaming is exact)."""
    module = copy.deepcopy(decoder.module)
    g = torch.Generator().manual_seed(0)
    for name, p in module.code2wav_dit_model.transformer_blocks.named_parameters():
        if name.endswith("weight"):
            p.copy_(torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)
    return Token2WavDecoder(module, {n: {"cond": c, "ref_mel": r} for n, (c, r) in decoder.speakers.items()})


def test_streaming_error_comes_from_cut_context(decoder, codes):
    """With frames mixing, the reference's windows stay within the bound yet are not the whole
    sequence (chunked flow matching is approximate), and without left context they part 20x
    further: the error is what the DiT does not see, not the windows' bookkeeping."""
    mixing = _mixing(decoder)
    whole = mixing.decode(codes, seed=3)
    diff = _audio(mixing, _reference_chunks(mixing, codes), seed=3) - whole
    # Measured 2.0e-4 to 5.1e-3 (RMS 6.9e-6 to 1.5e-4) over seeds 0-2 and two inits of the checkpoint.
    assert 5e-5 < diff.abs().max() <= STREAM_MAX_ABS and diff.pow(2).mean().sqrt() <= STREAM_RMS
    blind = _audio(mixing, _reference_chunks(mixing, codes, left_context=0), seed=3) - whole
    assert blind.abs().max() > 5 * STREAM_MAX_ABS  # measured 0.33-0.47


def test_speaker_and_seed_change_the_audio(decoder, codes, whole):
    other = decoder.decode(codes, speaker="Ethan", seed=3)
    assert other.shape == whole.shape and (other - whole).abs().max() > 0.1  # measured 0.55
    assert (decoder.decode(codes, seed=4) - whole).abs().max() > 1e-1  # other noise: other audio


def test_unknown_speaker_is_refused(decoder, codes):
    with pytest.raises(ValueError, match=r"unknown voice 'Nobody'; this checkpoint speaks with Chelsie, Ethan"):
        decoder.decode_windows([CodeWindow(codes[:, :12], 0, 12, speaker="Nobody")])


def test_codes_outside_the_codebook(decoder, codes):
    """The decoder refuses them; the hand-off drops them from the talker's ids (its pad and end
    ids are >= the codebook), so the audio is the codes' own."""
    with pytest.raises(ValueError, match=r"\[0, 256\)"):
        decoder.decode(torch.full((1, 3), q25.CODEC_PAD_ID))
    ids = codes[0, :36].tolist()
    with_specials = ids[:20] + [q25.CODEC_PAD_ID, q25.CODEC_EOS_ID] + ids[20:] + [q25.CODEC_EOS_ID]
    got = _handoff_windows(decoder, with_specials)
    want = _handoff_windows(decoder, ids)
    assert want, "36 codes made no window: the comparison below would compare nothing"
    assert [(w.offset, w.start, w.stop) for w in got] == [(w.offset, w.start, w.stop) for w in want]
    assert all(torch.equal(a.codes, b.codes) for a, b in zip(got, want))


def test_batched_windows_equal_single(decoder, codes):
    """Windows of other lengths, speakers and seeds in one call: each gets its own audio."""
    windows = [
        CodeWindow(codes[:, :48], 12, 24, speaker="Ethan", seed=2),
        CodeWindow(codes[:, 12:60], 24, 48, offset=12, speaker="Ethan", seed=3),
        CodeWindow(codes[:, 24:60], 24, 36, offset=24, seed=2),
        CodeWindow(codes[:, :30], 0, 30, seed=4),
        CodeWindow(codes[:, :30], 5, 5),  # nothing to emit
    ]
    batched = decoder.decode_windows(windows)
    assert [b.shape[0] for b in batched] == [(w.stop - w.start) * 480 for w in windows]
    for w, b in zip(windows, batched):
        torch.testing.assert_close(b, decoder.decode_windows([w])[0], atol=WHOLE_ATOL, rtol=0)
    # Context that starts inside a block is cut back to the block boundary: the DiT sees whole blocks.
    ragged = CodeWindow(codes[:, 5:60], 19, 31, offset=5, seed=2)
    aligned = CodeWindow(codes[:, 12:60], 12, 24, offset=12, seed=2)
    assert torch.equal(*decoder.decode_windows([ragged]), *decoder.decode_windows([aligned]))


def test_vocoder_reach_bounds_the_real_one(decoder):
    """Which mel frames one output sample depends on (autograd): within vocoder_frames each side."""
    mel = (torch.randn(1, 80, 121, generator=torch.Generator().manual_seed(0)) - 4).requires_grad_(True)
    with torch.enable_grad():
        decoder.vocoder(mel)[60 * decoder.hop + decoder.hop // 2].backward()
    frames = (mel.grad.abs().sum(1)[0] > 0).nonzero().flatten() - 60
    assert -decoder.vocoder_frames <= frames.min() and frames.max() <= decoder.vocoder_frames
    assert frames.max() >= decoder.vocoder_frames // 2  # a bound, not a wild one (measured 29 of 41)


def test_runner_gives_windows_the_request_seed(tmp_path, path, decoder, codes):
    """The decoder stage with this checkpoint: talker_to_decoder unchanged, every window stamped
    with the StreamStart's sampling seed."""
    runner, close = make_runner(tmp_path, str(path))
    try:
        ids = codes[0, :40].tolist()
        for rid, seed in (("seeded", 7), ("unseeded", None)):
            first = StageOutput(request_id=rid, stage="talker", seq=0, token_ids=ids, finished=True)
            runner.accept(StreamStart.opening(first, sampling=EngineSampling(seed=seed)), {})
        seeded, unseeded = (list(runner.requests[r].jobs) for r in ("seeded", "unseeded"))
        assert len(seeded) == len(unseeded) >= 2
        assert all(j.window.seed == 7 for j in seeded) and all(j.window.seed == 0 for j in unseeded)
        # One block first, then two (the stream ends: the last window takes what is left).
        assert [j.window.stop - j.window.start for j in seeded] == [12, 28] and seeded[-1].last
    finally:
        close()
