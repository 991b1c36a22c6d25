"""The hand-off functions on streams that arrive piece by piece (pure functions, no processes).

thinker_to_talker: segment boundaries, prompts that extend each other bitwise (the talker's prefix
cache depends on it), codes asked for. talker_to_decoder: the chunks tile the audio codes exactly
once, and decoding chunk by chunk gives the whole-sequence waveform bitwise.
"""

import random

import torch

from omni_cache.handoff import (
    CODES_PER_TOKEN,
    FIRST_CHUNK_CODES,
    FIRST_SEGMENT_TOKENS,
    SEGMENT_TOKENS,
    HandoffContext,
    Upstream,
    talker_to_decoder,
    thinker_to_talker,
)
from omni_cache.models.codec_decoder import CodecDecoder, CodecWindowDecoder, random_decoder_weights


def talker_ctx(dim=16, out=8):
    gen = torch.Generator().manual_seed(0)
    ctx = HandoffContext(model_path=None)  # the projection is given, not loaded
    ctx.resources["projection"] = (
        torch.randn(out, dim, generator=gen, dtype=torch.float64),
        torch.randn(out, generator=gen, dtype=torch.float64),
        {"codebook_size": 4, "codec_eos_id": 5},
    )
    return ctx


def test_thinker_to_talker_segments():
    ctx, state, prompt, total = talker_ctx(), {}, 20, 30
    hidden = torch.randn(prompt + total, 16).to(torch.bfloat16)
    jobs_at = {}
    for rows in range(prompt, prompt + total + 1):  # one more row per thinker step
        finished = rows == prompt + total
        up = Upstream("thinker", [], {"hidden": hidden[:rows]}, prompt, finished)
        for job in thinker_to_talker(ctx, up, state):
            jobs_at[rows] = job
    ends = sorted(jobs_at)
    first = prompt + FIRST_SEGMENT_TOKENS
    assert ends == [first, *range(first + SEGMENT_TOKENS, prompt + total, SEGMENT_TOKENS), prompt + total]
    prev = None
    for end in ends:
        job = jobs_at[end]
        assert job.prompt_embeds.shape[0] == end
        if prev is not None:  # each prompt extends the previous one bitwise
            assert torch.equal(job.prompt_embeds[: prev.shape[0]], prev)
        prev = job.prompt_embeds
    weight, bias, _ = ctx.resources["projection"]  # pieces equal one projection of all rows
    assert torch.equal(prev, (hidden.double() @ weight.T + bias).to(torch.bfloat16))
    assert sum(j.max_tokens for j in jobs_at.values()) == CODES_PER_TOKEN * total
    assert [jobs_at[e].last for e in ends] == [False] * (len(ends) - 1) + [True]
    # The talker may write codes and end of speech only (ids 0..3 and 5 of the given config).
    assert all(jobs_at[e].allowed_token_ids == [0, 1, 2, 3, 5] for e in ends)


def decoder_ctx(decoder, chunk=16):
    windows = CodecWindowDecoder(decoder)
    return HandoffContext(
        model_path=None,
        resources={
            "receptive_field": windows.receptive_field,
            "num_quantizers": 1,
            "codebook_size": decoder.codebook_size,
            "chunk_size": chunk,
            "samples_per_code": windows.samples_per_code,
        },
    )


def test_talker_to_decoder_chunks_decode_to_the_whole_sequence_bitwise():
    decoder = CodecDecoder()
    gen = torch.Generator().manual_seed(3)
    decoder.load_state_dict(
        random_decoder_weights(decoder.config, lambda name, shape, std: torch.randn(shape, generator=gen) * std)
    )
    rnd = random.Random(5)
    for trial in range(20):
        n = rnd.randint(0, 70)
        codes = [rnd.randrange(decoder.codebook_size + 3) for _ in range(n)]  # ~1% specials
        ctx, state, jobs, got = decoder_ctx(decoder), {}, [], 0
        while True:  # codes arrive in random pieces, the last piece finishes the stream
            got = min(n, got + rnd.randint(1, 7))
            up = Upstream("talker", codes[:got], {}, 0, got == n)
            new = talker_to_decoder(ctx, up, state)
            if new and not jobs:  # the first chunk is small and waits only for its context
                audio_ids = [c for c in codes[:got] if c < decoder.codebook_size]
                assert len(audio_ids) >= FIRST_CHUNK_CODES + decoder.context or got == n
            jobs += new
            if got == n:
                break
        audio_ids = torch.tensor([c for c in codes if c < decoder.codebook_size])
        spc = decoder.samples_per_code
        parts = []
        for job in jobs:
            if job.window is not None:
                w = job.window
                parts.append(decoder(w.codes[0])[w.start * spc : w.stop * spc])
        whole = decoder(audio_ids) if len(audio_ids) else torch.zeros(0)
        assert torch.equal(torch.cat(parts) if parts else torch.zeros(0), whole), trial
        assert jobs and jobs[-1].last and not any(j.last for j in jobs[:-1])
        if len(audio_ids) >= FIRST_CHUNK_CODES + decoder.context:  # else the first is the last
            first = jobs[0].window
            assert first.stop - first.start == FIRST_CHUNK_CODES
