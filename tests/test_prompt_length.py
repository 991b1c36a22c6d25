"""A prompt too long for the model's context is refused from its length in characters, before it
is tokenized (omni_cache/runtime/request_path/text_codec.py): the bound is vLLM's own for the same
tokenizer, the tokenization it goes through gives the ids the chat template's own does, a prompt
at the bound is tokenized, and one past it is refused without being tokenized. Through the
server: tests/test_qwen3_omni_streaming.py (chat), tests/test_realtime_e2e.py (realtime), and
`vllm serve`'s own answer as the oracle in tests/test_vllm_conformance.py."""

from __future__ import annotations

import pytest

from omni_cache.runtime.request_path.text_codec import PromptTooLong, TextCodec, max_chars_per_token
from omni_cache.tiny.checkpoints import ensure_checkpoint

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "weather",
            "description": "The weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


@pytest.fixture(scope="module")
def codec():
    c = TextCodec()
    c.load(ensure_checkpoint("qwen3-omni"))
    return c


def test_the_bound_is_vllms(codec):
    from vllm.tokenizers.hf import get_cached_tokenizer

    ours = max_chars_per_token(codec.tokenizer)
    assert ours == codec.max_chars_per_token
    assert ours == get_cached_tokenizer(codec.tokenizer).max_chars_per_token
    assert max_chars_per_token(object()) is None  # no vocabulary: no bound


@pytest.mark.parametrize(
    "messages, template",
    [
        ([{"role": "user", "content": "Hello there, how are you?"}], {}),
        (
            [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Zürich 東京 🚀 <|im_end|> typed"},
                {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nFine."},
                {"role": "user", "content": "  spaces\n\n\tand tabs  "},
            ],
            {},
        ),
        ([{"role": "user", "content": "Weather in Paris?"}], {"tools": TOOLS}),
        (
            [{"role": "user", "content": "Go on:"}, {"role": "assistant", "content": "Once upon"}],
            {"template_kwargs": {"continue_final_message": True, "add_generation_prompt": False}},
        ),
    ],
)
def test_the_ids_are_the_chat_templates_own(codec, messages, template):
    tools = template.get("tools")
    kwargs = template.get("template_kwargs", {"add_generation_prompt": True})
    expected = codec.tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, **kwargs)
    if hasattr(expected, "keys"):
        expected = expected["input_ids"]
    assert codec.tokenize_messages(messages, max_tokens=8192, **template) == list(expected)
    assert codec.tokenize_messages(messages, **template) == list(expected)  # unbounded: the template's call


def rendered_length(codec, text: str) -> int:
    messages = [{"role": "user", "content": text}]
    return len(codec.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))


def test_a_prompt_at_the_bound_is_tokenized_and_one_past_it_is_not(codec, monkeypatch):
    per_token, max_tokens = codec.max_chars_per_token, 64
    frame = rendered_length(codec, "")
    at_bound = "a" * (max_tokens * per_token - frame)
    assert rendered_length(codec, at_bound) == max_tokens * per_token
    ids = codec.tokenize_messages([{"role": "user", "content": at_bound}], max_tokens=max_tokens)
    assert len(ids) > max_tokens  # too long still, found by counting tokens (admission's check)

    calls = []
    real_call = type(codec.tokenizer).__call__
    monkeypatch.setattr(
        type(codec.tokenizer), "__call__", lambda self, *a, **k: calls.append(1) or real_call(self, *a, **k)
    )
    with pytest.raises(PromptTooLong) as e:
        codec.tokenize_messages([{"role": "user", "content": at_bound + "a"}], max_tokens=max_tokens)
    assert not calls  # refused before tokenizing
    assert e.value.status == 400 and e.value.param == "input_text"  # as vLLM names it
    assert f"{max_tokens * per_token + 1} characters" in e.value.message
    assert e.value.tokens_at_least == max_tokens + 1


def test_no_text_has_fewer_tokens_than_the_bound_says(codec):
    """The bound is sound: the vocabulary's longest entries, repeated, take at least one token
    per ``max_chars_per_token`` characters (it refuses no prompt that would fit)."""
    vocab = codec.tokenizer.get_vocab()
    longest = sorted(vocab, key=len, reverse=True)[:20]
    for entry in longest:
        text = codec.tokenizer.convert_tokens_to_string([entry]) * 50
        n = len(codec.tokenizer(text, add_special_tokens=False)["input_ids"])
        assert len(text) <= n * codec.max_chars_per_token, entry
