"""Qwen3.5 as a thinker stage (stage_configs/qwen3_5.yaml on the tiny checkpoint: a real omni-serve
with its vLLM stage process, ZMQ and HTTP) against transformers' reference
`Qwen3_5ForConditionalGeneration` on the same checkpoint, for text, image and video prompts, with
and without prefix hits, greedy and seeded sampling, streamed and not.

What "equal" means here. vLLM's CPU GatedDeltaNet kernel takes only bfloat16, and a random model's
next-token distribution is flat (top logprobs ~ -5.2 over 512 ids), so two bf16 implementations
(vLLM's kernels, transformers' torch reference) sometimes order a near-tie differently: on the tiny
checkpoint greedy answers differed once in 12 tokens, where transformers' top two were 0.008 apart.
So every served answer is checked token by token against the reference fed the same tokens
(teacher forcing, one forward over prompt + answer):

* the prompt as the server answers it (``prompt_token_ids``, media placeholders expanded as
  vLLM's engine saw them, Qwen3.5's per-frame timestamps included) equals the reference
  processor's, token for token;
* each answer token's logprob as served equals the reference's within LOGPROB_ATOL (a wrong state,
  KV block or media row moves them by ~0.1-1);
* greedy: each answer token is the reference's argmax, or within TIE of it; and the answer equals
  transformers' own `generate` up to its first near-tie (none, in most runs).

Seeded sampling is vLLM's sampler (transformers' draws different random numbers for the same
seed), so there only the distribution is compared: the logprobs of the sampled tokens.
"""

from __future__ import annotations

import base64
import copy
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from media_samples import png_data_url, video_bytes
from qwen3_5_served import NAME
from served_config import system_prompt

pytestmark = pytest.mark.vllm

TOKENS = 8
# bf16 noise between vLLM's kernels and transformers' reference, in nats: at most 0.012 over 92
# answer tokens on an AMD EPYC (AVX2); greedy answers were the reference's argmax at every step.
LOGPROB_ATOL = 0.05
TIE = 0.05
# Longer than a block (128 tokens here, up to 640 on other CPUs), so a repeat can hit.
CONTEXT = system_prompt(720, seed=35)


@pytest.fixture(scope="module")
def server(qwen3_5_server):
    """The omni-serve on stage_configs/qwen3_5.yaml that tests/test_vllm_conformance.py uses too
    (tests/conftest.py)."""
    return qwen3_5_server


@pytest.fixture(scope="module")
def checkpoint(server) -> Path:
    return server.checkpoint


@pytest.fixture(scope="module")
def block(server) -> int:
    """The thinker's KV block, in tokens. vLLM picks it for a hybrid model (an attention page
    must hold a whole recurrent state: 128 for the tiny checkpoint on x86 CPUs, other CPUs
    differ): the same derivation from the stage's engine arguments, without an engine."""
    from vllm.engine.arg_utils import EngineArgs

    stage = next(s for s in server.config["stages"] if s["name"] == "thinker")
    args = stage.get("engine_args") or {}
    extra = args.get("extra") or {}
    picked = {k: args[k] for k in ("dtype", "block_size", "max_model_len", "enforce_eager") if k in args}
    if "prefix_cache_retention_interval" in extra:
        picked["prefix_cache_retention_interval"] = extra["prefix_cache_retention_interval"]
    config = EngineArgs(
        model=str(server.checkpoint), enable_prefix_caching=bool(stage.get("prefix_cache", True)), **picked
    ).create_engine_config()
    return config.cache_config.block_size


@pytest.fixture(scope="module")
def reference(checkpoint):
    from transformers import AutoProcessor, Qwen3_5ForConditionalGeneration

    model = Qwen3_5ForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.bfloat16).eval()
    # (model, processor, what was computed per chat: a repeat of a prompt asks the same again)
    return model, AutoProcessor.from_pretrained(checkpoint), {}


# ---- requests -----------------------------------------------------------------------------------
def chat(server, messages: list[dict], **fields: Any) -> dict:
    """One answer: its token ids, each token's served logprob, the prompt ids, cached tokens."""
    body = {
        "model": NAME,
        "messages": messages,
        "max_tokens": TOKENS,
        "temperature": 0.0,
        "logprobs": True,
        "return_token_ids": True,
        **fields,
    }
    if body.get("stream"):
        return _streamed(server, body)
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    out = r.json()
    choice = out["choices"][0]
    return {
        "ids": choice["token_ids"],
        "logprobs": [c["logprob"] for c in choice["logprobs"]["content"]],
        "prompt_ids": out["prompt_token_ids"],
        "text": choice["message"]["content"],
        "prompt_tokens": out["usage"]["prompt_tokens"],
        "cached": (out["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0,
    }


def _streamed(server, body: dict) -> dict:
    body = {**body, "stream_options": {"include_usage": True}}
    ids, logprobs, text, prompt_ids, cached, prompt_tokens = [], [], "", None, 0, 0
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            prompt_ids = chunk.get("prompt_token_ids") or prompt_ids
            if chunk.get("usage"):
                prompt_tokens = chunk["usage"]["prompt_tokens"]
                cached = (chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            for choice in chunk.get("choices") or ():
                ids += choice.get("token_ids") or []
                text += choice["delta"].get("content") or ""
                logprobs += [c["logprob"] for c in (choice.get("logprobs") or {}).get("content") or ()]
    return {
        "ids": ids,
        "logprobs": logprobs,
        "prompt_ids": prompt_ids,
        "text": text,
        "cached": cached,
        "prompt_tokens": prompt_tokens,
    }


def image_url(seed: int) -> str:
    return png_data_url(64, 48, seed=seed)


def video_url(seed: int) -> str:
    return "data:video/mp4;base64," + base64.b64encode(video_bytes(seed=seed)).decode()


def user(*parts: dict | str, context: str = CONTEXT) -> list[dict]:
    content = [{"type": "text", "text": p} if isinstance(p, str) else p for p in parts]
    return [{"role": "system", "content": context}, {"role": "user", "content": content}]


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def video_part(url: str) -> dict:
    return {"type": "video_url", "video_url": {"url": url}}


# ---- the reference ------------------------------------------------------------------------------
def reference_inputs(processor, messages: list[dict]) -> dict[str, torch.Tensor]:
    """transformers' processor over the same chat: images as the server decodes them, and each
    video's every frame with the clip's metadata, sampled and stamped by the processor itself."""
    from vllm.multimodal.video import VideoBackend

    from omni_cache.serving.media import MediaDecoder

    decoder = MediaDecoder(use_audio_in_video=False)
    images, videos, metadata = [], [], []
    for message in messages:
        for part in message["content"] if isinstance(message["content"], list) else ():
            if part["type"] == "image_url":
                images.append(decoder.image(part["image_url"]["url"], "image").array)
            elif part["type"] == "video_url":
                data = base64.b64decode(part["video_url"]["url"].split(",", 1)[1])
                frames, meta = VideoBackend.load_bytes(data, backend="opencv")  # the whole clip
                assert len(frames) == meta["total_num_frames"]
                videos.append(frames)
                metadata.append({k: meta[k] for k in ("fps", "frames_indices", "total_num_frames", "duration")})
    # (transformers' processor rewrites the parts of the conversation it is given: a copy)
    text = processor.apply_chat_template(copy.deepcopy(messages), add_generation_prompt=True, tokenize=False)
    kwargs: dict[str, Any] = {}
    if images:
        kwargs["images"] = images
    if videos:
        kwargs.update(videos=videos, video_metadata=metadata, do_sample_frames=True)
    return dict(processor(text=[text], return_tensors="pt", **kwargs))


def teacher_forced(model, inputs: dict, answer: list[int]) -> torch.Tensor:
    """The reference's log-softmax at every answer position, fed the served answer."""
    prompt = inputs["input_ids"]
    ids = torch.cat([prompt, torch.tensor([answer])], dim=1)
    extra = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask", "mm_token_type_ids")}
    pad = torch.zeros(1, len(answer), dtype=inputs["mm_token_type_ids"].dtype)
    with torch.no_grad():
        logits = model(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            mm_token_type_ids=torch.cat([inputs["mm_token_type_ids"], pad], dim=1),
            **extra,
        ).logits[0]
    n = prompt.shape[1]
    return logits[n - 1 : n - 1 + len(answer)].float().log_softmax(-1)


def reference_generate(model, inputs: dict) -> list[int]:
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=TOKENS, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def memo(reference, key: tuple, compute):
    done = reference[2]
    if key not in done:
        done[key] = compute()
    return done[key]


def check(reference, messages: list[dict], got: dict, *, greedy: bool = True) -> None:
    model, processor, _ = reference
    chat_key = json.dumps(messages, sort_keys=True)
    inputs = memo(reference, ("inputs", chat_key), lambda: reference_inputs(processor, messages))
    # The prompt as the engine saw it (vLLM's prompt_token_ids: media placeholders expanded, a
    # video's per-frame timestamps included) is the reference processor's, token for token.
    assert got["prompt_ids"] == inputs["input_ids"][0].tolist(), "another prompt, or media expanded otherwise"
    assert got["prompt_tokens"] == inputs["input_ids"].shape[1]
    assert got["ids"] and len(got["logprobs"]) == len(got["ids"])
    ref = memo(reference, ("forced", chat_key, tuple(got["ids"])), lambda: teacher_forced(model, inputs, got["ids"]))
    for step, (token, got_lp) in enumerate(zip(got["ids"], got["logprobs"])):
        want = ref[step, token].item()
        assert abs(got_lp - want) <= LOGPROB_ATOL, (step, token, got_lp, want)
        if greedy:
            assert ref[step].max().item() - want <= TIE, f"step {step}: {token} is not the reference's choice"
    if greedy:
        generated = memo(reference, ("generate", chat_key), lambda: reference_generate(model, inputs))
        same = next((i for i, (a, b) in enumerate(zip(got["ids"], generated)) if a != b), None)
        if same is not None:  # only at a near-tie of the reference
            top = ref[same].topk(2).values
            assert (top[0] - top[1]).item() <= TIE, (same, got["ids"], generated)
        else:
            assert got["ids"] == generated[: len(got["ids"])]


def repeat_hit(again: dict, block: int) -> int:
    """What a repeated prompt hits: every whole block short of its last token (the first asking
    kept a recurrent state at every block boundary it crossed)."""
    return (len(again["prompt_ids"]) - 1) // block * block


# ---- tests ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["text", "image", "video"])
def test_answers_equal_the_reference_with_and_without_a_prefix_hit(server, reference, block, kind):
    media = {"text": [], "image": [image_part(image_url(3))], "video": [video_part(video_url(4))]}[kind]
    # (A question long enough that a block boundary lies past the media: the prompt as the engine
    # sees it, placeholders expanded, is ~850 tokens without it, its media ending near 800.)
    messages = user(
        *media,
        f"Describe the {kind} in one line; then name its main colour, the corner "
        "that stands out most and the mood it sets, each in a word or two, please.",
    )
    first = chat(server, messages)
    check(reference, messages, first)
    again = chat(server, messages)  # the same prompt: a prefix hit through the media
    # (prompt_ids are the engine's: the media's last placeholder position there.)
    media_end = max(
        (
            i
            for i, t in enumerate(again["prompt_ids"])
            if t in (reference[0].config.image_token_id, reference[0].config.video_token_id)
        ),
        default=0,
    )
    assert again["cached"] == repeat_hit(again, block) > media_end, (again["cached"], media_end, block)
    check(reference, messages, again)


def test_a_follow_up_turn_hits_the_first_turn_and_equals_the_reference(server, reference, block):
    """The next turn resends the first (its image, its answer): a prefix hit up to the first
    turn's last block boundary, then the rest. The first turn computed its prompt and all but
    the last token of its answer, with a recurrent state at every block boundary it crossed
    (block states, prefix_cache_retention_interval: null); the follow-up shares a prefix of it
    (the chat template renders the answer back), so it hits exactly the last block boundary of
    that shared part, short of its own last token."""
    first_turn = user(image_part(image_url(7)), "What colour dominates?")
    answer = chat(server, first_turn)
    follow_up = first_turn + [
        {"role": "assistant", "content": answer["text"]},
        {"role": "user", "content": [{"type": "text", "text": "And the edges?"}]},
    ]
    got = chat(server, follow_up)
    computed = answer["prompt_ids"] + answer["ids"][:-1]
    shared = next(
        (i for i, (a, b) in enumerate(zip(computed, got["prompt_ids"])) if a != b),
        min(len(computed), len(got["prompt_ids"])),
    )
    expected = min(shared, len(got["prompt_ids"]) - 1) // block * block
    assert expected >= block, (expected, shared, block)  # (the first turn is longer than a block)
    assert got["cached"] == expected, (got["cached"], expected, shared, block)
    check(reference, follow_up, got)


def test_a_streamed_answer_equals_the_reference(server, reference, block):
    messages = user("Stream a short story.", context=system_prompt(720, seed=36))  # not seen before
    got = chat(server, messages, stream=True)
    check(reference, messages, got)
    assert got["cached"] == 0
    again = chat(server, messages, stream=True)
    assert again["cached"] == repeat_hit(again, block) > 0, (again["cached"], block)
    check(reference, messages, again)


def test_seeded_sampling_draws_from_the_reference_distribution(server, reference, block):
    """Seeded sampling at temperature 1: the sampled tokens' logprobs are the reference's (also on
    the repeat, a prefix hit, and under another seed, which draws another answer)."""
    messages = user(image_part(image_url(9)), "Tell me something random.")
    first = chat(server, messages, temperature=1.0, seed=1234)
    check(reference, messages, first, greedy=False)
    again = chat(server, messages, temperature=1.0, seed=1234)
    assert again["cached"] == repeat_hit(again, block) > 0, (again["cached"], block)
    check(reference, messages, again, greedy=False)
    other = chat(server, messages, temperature=1.0, seed=4321)
    check(reference, messages, other, greedy=False)
    assert other["ids"] != first["ids"], "another seed drew the same answer"
