"""Qwen2.5-Omni's talker in vLLM (workers/models/qwen2_5_omni_talker.py) writes transformers' codes.

The oracle is transformers' own talker: `Qwen2_5OmniForConditionalGeneration.generate` runs the thinker
(float32, tiny checkpoint) and builds the talker's inputs; a spy takes the keyword arguments it hands
`talker.generate` and stops it there (token2wav is not under test). The same `talker.generate` is then
called with those arguments (greedy, repetition penalty 1.05, codec bos suppressed, stopping on the
checkpoint's codec pad and end ids, its `talker_eos_token_id` of [8292, 8294] on the released one).

Our talker runs in the repo's LLMStage (`submodel="talker"`) from the same inputs, as the stage
hand-off must give them: prompt embeddings (the thinker rows, the codec pad and bos embeddings added to
the last two, as the reference's forward does at prefill), the reply rows streamed while it runs (the
reference's `thinker_reply_part`: reply rows 1.., text eos, then text pad for ever), the prompt's
M-RoPE positions from the reference's `get_rope_index`, and the logits rule of
`omni_cache.models.qwen2_5_omni_talker_input.talker_logits`. The code ids must be equal.

transformers 5.19's `generate` drops an all-ones attention mask before the forward (generation/utils.py,
"We can drop the mask altogether if it's all 1s"), and the talker's forward takes both its prefill
codec embeddings and its M-RoPE positions only when a mask is given: unpatched, the reference speaks
from the thinker rows alone at plain positions. The oracle therefore hands the forward the mask
`generate` was given (tests/qwen2_5_reference.py), so it runs what its own forward says.
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
import qwen2_5_reference
import torch

pytestmark = pytest.mark.vllm

THINKER_TOKENS = 10  # the thinker's answer length in the reference
TALKER_STEPS = 30  # max codes per answer (random weights rarely stop on their own)
LOGPROBS = 5  # log-probabilities compared per step
# vLLM's log-probabilities against transformers' (float32 both; measured within 2e-6 here). Random
# weights put codes within 1e-3 of each other, so greedy codes alone can miss a wrong position:
# plain positions instead of an image's grid moved them by 1.5e-4.
LOGPROB_ATOL = 1e-5
FIRST_ROWS = 2  # reply rows known when the talker starts; the rest arrive while it runs
TEXT = [{"role": "user", "content": [{"type": "text", "text": "Hello there, how are you today?"}]}]
IMAGE = [
    {
        "role": "user",
        "content": [{"type": "image", "image": "img"}, {"type": "text", "text": "What is in the picture?"}],
    }
]


class _Stop(Exception):
    """Raised by the spy once the reference has built the talker's inputs."""


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from omni_cache.tiny.checkpoints import ensure_checkpoint

    return ensure_checkpoint("qwen2.5-omni", tmp_path_factory.mktemp("q25omni"))


@pytest.fixture(scope="module")
def reference_model(checkpoint):
    return qwen2_5_reference.load(checkpoint)


@pytest.fixture(scope="module")
def processor(checkpoint):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(checkpoint)


@pytest.fixture(scope="module")
def talker(checkpoint):
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from workers.llm_stage import LLMStage

    start = time.monotonic()
    stage = LLMStage(
        str(checkpoint),
        dict(enforce_eager=True, dtype="float32", block_size=32, gpu_memory_utilization=0.3, max_model_len=2048),
        submodel="talker",
    )
    print(f"talker engine up in {time.monotonic() - start:.1f} s")
    yield stage
    del stage


def _stop_ids(model) -> list[int]:
    cfg = model.config.talker_config
    return [cfg.tts_codec_pad_token_id, cfg.tts_codec_end_token_id]  # the reference's talker_eos_token_id


def reference_inputs(model, processor, messages, speaker: str = "Chelsie", images=None) -> dict:
    """The keyword arguments the reference `generate` hands `talker.generate` (copies)."""
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=text, images=images, return_tensors="pt")
    captured = {}
    generate = model.talker.generate

    def spy(*args, **kwargs):
        captured.update({k: v.clone() if torch.is_tensor(v) else v for k, v in kwargs.items()})
        raise _Stop

    model.talker.generate = spy
    try:
        model.generate(
            **inputs,
            speaker=speaker,
            thinker_max_new_tokens=THINKER_TOKENS,
            thinker_do_sample=False,
            talker_do_sample=False,
            talker_max_new_tokens=TALKER_STEPS,
            talker_eos_token_id=_stop_ids(model),
        )
    except _Stop:
        pass
    finally:
        model.talker.generate = generate
    assert captured, "the reference never reached its talker"
    return captured


def reference_codes(model, kwargs: dict) -> list[int]:
    return reference_run(model, kwargs)[0]


def reference_run(model, kwargs: dict) -> tuple[list[int], torch.Tensor]:
    """Codes and raw log-probabilities ([steps, vocab]) of `talker.generate` on those arguments.
    The reference also hands it the media tensors (`pixel_values`), which the talker's forward never
    reads and transformers 5.19's `generate` refuses as unused model kwargs (the reference fails on
    an image prompt there): they are left out."""
    unused = {"pixel_values", "pixel_values_videos", "input_features"}
    with torch.no_grad():
        out = model.talker.generate(
            **{k: v.clone() if torch.is_tensor(v) else v for k, v in kwargs.items() if k not in unused},
            output_logits=True,
            return_dict_in_generate=True,
        )
    codes = out.sequences[0, kwargs["input_ids"].shape[1] :].tolist()
    return codes, torch.cat(out.logits).log_softmax(dim=-1)  # [steps, vocab], before the logits rule


def talker_job(model, kwargs: dict) -> dict:
    """Our talker's request, as the stage hand-off must build it from the thinker's output."""
    from omni_cache.models.qwen2_5_omni_talker_input import Qwen25TalkerInput
    from omni_cache.models.qwen2_5_omni_talker_input import talker_logits as qwen2_5_omni_talker_logits

    cfg = model.config.talker_config
    codec = model.talker.get_input_embeddings()
    embeds = kwargs["inputs_embeds"][0].clone()
    with torch.no_grad():
        embeds[-2] += codec(torch.tensor(cfg.tts_codec_pad_token_id))
        embeds[-1] += codec(torch.tensor(cfg.tts_codec_start_token_id))
    positions, delta = model.talker.get_rope_index(
        kwargs["input_text_ids"],
        kwargs.get("image_grid_thw"),
        kwargs.get("video_grid_thw"),
        kwargs["attention_mask"],
        kwargs.get("use_audio_in_video", False),
        kwargs.get("audio_feature_lengths"),
        kwargs.get("video_second_per_grid"),
    )
    reply = kwargs["thinker_reply_part"][0]
    return dict(
        embeds=embeds,
        positions=(positions[:, 0], int(delta.reshape(-1)[0])),
        rows=reply[:-1].clone(),  # reply rows 1.., then text eos
        pad=reply[-1].clone(),  # text pad: every step after the last row reads it
        stop=_stop_ids(model),
        extra_args=qwen2_5_omni_talker_logits(Qwen25TalkerInput.load(model.name_or_path)),
    )


def run_talker(
    stage, request_id: str, job: dict, waits: list | None = None, logprobs: list | None = None
) -> tuple[list[int], int]:
    """Codes and cached prompt tokens of one request. Starts with FIRST_ROWS reply rows and feeds one
    more each time the request starves (the stage has nothing to do: it waits for its row); `waits`
    gets the number of codes written at each of those times, `logprobs` vLLM's raw log-probabilities
    of each step's LOGPROBS most likely ids ({id: logprob} per step)."""
    from vllm import SamplingParams

    from scheduler.streamed_rows import StreamedRows

    params = SamplingParams(
        temperature=0.0,
        max_tokens=TALKER_STEPS,
        stop_token_ids=job["stop"],
        extra_args=job["extra_args"],
        logprobs=LOGPROBS if logprobs is not None else None,
    )
    rows = job["rows"]
    stream = StreamedRows(job["pad"])
    stream.add(rows[:FIRST_ROWS])
    fed = FIRST_ROWS
    stage.add(request_id, {"prompt_embeds": job["embeds"]}, params, streamed=stream, positions=job["positions"])
    codes, cached, finished = [], 0, False
    while not finished:
        if not stage.has_work():
            assert fed < rows.shape[0], "the talker waits for a row after the last one"
            if waits is not None:
                waits.append(len(codes))
            stage.feed(request_id, rows[fed : fed + 1], done=fed + 1 >= rows.shape[0])
            fed += 1
            continue
        for out in stage.step():
            assert out.error is None, out.error
            assert out.codes is None  # one codebook: the codes are the sampled ids
            codes += out.token_ids
            if logprobs is not None:
                logprobs += [{e.token_id: e.logprob for e in step} for step in out.logprobs or ()]
            cached = max(cached, out.num_cached_tokens)
            finished = finished or out.finished
    return codes, cached


def assert_logprobs_close(got: list[dict[int, float]], want: torch.Tensor) -> None:
    assert len(got) == want.shape[0]
    for step, top in enumerate(got):
        ids = list(top)
        diff = (torch.tensor([top[i] for i in ids]) - want[step, ids]).abs().max().item()
        assert diff <= LOGPROB_ATOL, (step, diff)


def an_image() -> np.ndarray:
    rng = np.random.default_rng(0)
    return rng.integers(0, 256, size=(96, 128, 3), dtype=np.uint8)


def test_a_text_prompts_codes_equal_the_reference(talker, reference_model, processor):
    kwargs = reference_inputs(reference_model, processor, TEXT)
    want, want_logprobs = reference_run(reference_model, kwargs)
    waits, logprobs = [], []
    got, _ = run_talker(talker, "text", talker_job(reference_model, kwargs), waits, logprobs)
    assert got == want
    assert_logprobs_close(logprobs, want_logprobs)
    assert len(set(got)) > 1  # not one code over and over
    # Step s reads row s: with FIRST_ROWS rows the talker waited after FIRST_ROWS + 1 codes (the
    # prefill's code needs no row), then once per code until the rows ran out.
    assert waits[:3] == [FIRST_ROWS + 1, FIRST_ROWS + 2, FIRST_ROWS + 3]


def test_an_image_prompts_codes_equal_the_reference(talker, reference_model, processor):
    kwargs = reference_inputs(reference_model, processor, IMAGE, images=[an_image()])
    job = talker_job(reference_model, kwargs)
    positions, delta = job["positions"]
    # The image's grid: its positions are not the plain ones, and decoding continues from them.
    assert delta != 0 and not torch.equal(positions[1], positions[0])
    want, want_logprobs = reference_run(reference_model, kwargs)
    logprobs = []
    got, _ = run_talker(talker, "image", job, logprobs=logprobs)
    assert got == want
    assert_logprobs_close(logprobs, want_logprobs)


def test_a_repeated_prompt_hits_the_talkers_prefix_cache(talker, reference_model, processor):
    kwargs = reference_inputs(reference_model, processor, TEXT)
    job = talker_job(reference_model, kwargs)
    first, _ = run_talker(talker, "repeat-1", job)
    again, cached = run_talker(talker, "repeat-2", job)
    assert again == first == reference_codes(reference_model, kwargs)
    block = 32
    assert cached >= (job["embeds"].shape[0] - 1) // block * block > 0


def test_two_speakers_prompts_differ_from_the_speaker_row_on(talker, reference_model, processor):
    speakers = sorted(reference_model.speaker_map)
    assert len(speakers) >= 2
    jobs, codes = {}, {}
    for speaker in speakers[:2]:
        kwargs = reference_inputs(reference_model, processor, TEXT, speaker=speaker)
        jobs[speaker] = talker_job(reference_model, kwargs)
        codes[speaker] = (
            run_talker(talker, f"speaker-{speaker}", jobs[speaker]),
            reference_codes(reference_model, kwargs),
        )
    a, b = (jobs[s]["embeds"] for s in speakers[:2])
    speaker_row = a.shape[0] - 2  # thinker prompt rows, then the speaker's text bos row
    assert torch.equal(a[:speaker_row], b[:speaker_row])
    assert not torch.equal(a[speaker_row], b[speaker_row])
    for speaker in speakers[:2]:
        (got, cached), want = codes[speaker]
        assert got == want
    # The second speaker's request reuses the first one's blocks before the speaker row, no more.
    (_, cached), _ = codes[speakers[1]]
    assert cached == speaker_row // 32 * 32


def test_the_logits_rule_is_hfs_penalty_over_prompt_ids_and_codes_then_bos_suppressed(reference_model):
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor, SuppressTokensLogitsProcessor

    from omni_cache.models.qwen2_5_omni_talker_input import TALKER_REPETITION_PENALTY as REPETITION_PENALTY
    from omni_cache.models.qwen2_5_omni_talker_input import Qwen25TalkerInput
    from omni_cache.models.qwen2_5_omni_talker_input import talker_logits as qwen2_5_omni_talker_logits
    from workers.codec_logits import CodecLogits

    cfg = reference_model.config.talker_config
    talker_input = Qwen25TalkerInput.load(reference_model.name_or_path)
    params = type("Params", (), {"extra_args": qwen2_5_omni_talker_logits(talker_input)})()
    rule = CodecLogits.__new__(CodecLogits).new_req_logits_processor(params)
    prompt = [cfg.tts_codec_mask_token_id] * 5 + [cfg.tts_codec_pad_token_id, cfg.tts_codec_start_token_id]
    generated = [3, 7, 7, cfg.tts_codec_end_token_id]
    logits = torch.randn(cfg.vocab_size, generator=torch.Generator().manual_seed(0))
    ids = torch.tensor([prompt + generated])
    want = RepetitionPenaltyLogitsProcessor(REPETITION_PENALTY)(ids, logits[None].clone())
    want = SuppressTokensLogitsProcessor([cfg.tts_codec_start_token_id])(ids, want)[0]
    got = rule(list(generated), logits.clone())
    assert torch.equal(got, want)
