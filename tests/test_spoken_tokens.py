"""Which tokens the thinker hands its talker (workers/spoken_tokens.py): exactly those whose text the
client receives, checked against vLLM's own incremental detokenizer with the request's stop
strings (the output processor's text, step by step) on the tiny Qwen3-Omni checkpoint's
byte-level tokenizer. No engine: vLLM's detokenizer class and a tokenizer."""

from __future__ import annotations

import pytest

from omni_cache.tiny.checkpoints import ensure_checkpoint
from workers.spoken_tokens import SpokenTokens


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ensure_checkpoint("qwen3-omni", tmp_path_factory.mktemp("q3")))


def run(tokenizer, text: str, *, eos: bool = False, **params):
    """Feed vLLM's detokenizer (with stops) one token per step as its output processor does, and
    SpokenTokens with what each step outputs. -> (client text, spoken token ids, spoken text,
    the spoken text was never ahead of the client's text)."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.engine.detokenizer import IncrementalDetokenizer

    sp = SamplingParams(**params)
    prompt = tokenizer.encode("hi")
    request = EngineCoreRequest(
        request_id="r",
        prompt_token_ids=prompt,
        mm_features=None,
        sampling_params=sp,
        pooling_params=None,
        arrival_time=0.0,
        lora_request=None,
        cache_salt=None,
        data_parallel_rank=None,
    )
    client = IncrementalDetokenizer.from_new_request(tokenizer, request)
    spoken = SpokenTokens(sp, tokenizer)
    tokens = tokenizer.encode(text) + ([tokenizer.eos_token_id] if eos else [])
    client_text, ids, said, never_ahead = "", [], "", True
    for i, token in enumerate(tokens):
        stop_token = eos and i == len(tokens) - 1
        stop = client.update([token], stop_token)
        finished = stop is not None or stop_token or i == len(tokens) - 1
        delta = client.get_next_output_text(finished, delta=True)
        client_text += delta
        reason = ("stop" if stop is not None or stop_token else "length") if finished else None
        out = spoken.add(prompt if i == 0 else None, [token], delta, reason, stop)
        ids += out.token_ids
        said += out.text
        never_ahead = never_ahead and client_text.startswith(said)
        if finished:
            break
    return client_text, ids, said, never_ahead


def test_without_stop_strings_every_token_is_spoken_as_it_comes(tokenizer):
    text, ids, said, never_ahead = run(tokenizer, "hello world")
    assert text == said == "hello world" and ids == tokenizer.encode("hello world") and never_ahead


def test_the_stop_token_is_not_spoken(tokenizer):
    text, ids, said, _ = run(tokenizer, "hello", eos=True)
    assert text == said == "hello" and ids == tokenizer.encode("hello")
    _, ids, _, _ = run(tokenizer, "hello", eos=True, include_stop_str_in_output=True)
    assert ids == tokenizer.encode("hello") + [tokenizer.eos_token_id]


@pytest.mark.parametrize(
    "answer, stop, include, client",
    [
        ("say <370> now", ["<370>"], False, "say "),
        ("say <370> now", ["<370>"], True, "say <370>"),
        ("abcabcab", ["ca", "zz"], False, "ab"),
        ("no stop here at all", ["<370>", "qq"], False, "no stop here at all"),
        ("héllo wörld", ["ö"], False, "héllo w"),
    ],
)
def test_with_stop_strings_the_talker_gets_exactly_the_clients_text(tokenizer, answer, stop, include, client):
    text, ids, said, never_ahead = run(tokenizer, answer, stop=stop, include_stop_str_in_output=include)
    assert text == client
    assert said == text and never_ahead
    assert ids == tokenizer.encode(answer)[: len(tokenizer.encode(client))]


def test_held_back_text_holds_back_its_tokens(tokenizer):
    """While a stop string may still be forming, neither its text nor its tokens go out."""
    from vllm.sampling_params import SamplingParams

    sp = SamplingParams(stop=["<370>"])
    spoken = SpokenTokens(sp, tokenizer)
    prompt = tokenizer.encode("hi")
    out = spoken.add(prompt, tokenizer.encode("ab<37"), "a", None, None)  # vLLM held back "b<37"
    assert (out.token_ids, out.text, spoken.count) == (tokenizer.encode("a"), "a", 1)
