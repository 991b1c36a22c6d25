"""No parameter of vLLM's ``ChatCompletionRequest`` is accepted and then ignored
(omni_cache/serving/chat_fields.py, omni_cache/serving/chat_sampling.py).

* The field table names exactly the fields of the pinned vLLM's request model: a field a later pin
  adds fails here until the table says what happens to it.
* Every refused field, set, is a 400 naming it and saying why; every ignored one is one vLLM
  ignores too; a field that is not vLLM's (a typo) is refused by name.
* What ``to_sampling_params`` makes of a request reaches the thinker's engine field for field:
  the wire struct rebuilt into vLLM's ``SamplingParams`` in the stage equals the server's, and a
  ``SamplingParams`` field that does not travel is refused unless it holds vLLM's default.
* docs/api.md names every field.
* A content part that is not one this server takes, or whose fields have the wrong types, is a
  400 naming the part (``messages.0.content.1.image_url.url``), never pydantic's list of every
  part type it tried nor a 500 from the decoders; a bare string part is text, as vLLM reads it.

Pure unit tests: vLLM's classes, no engine.
"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from omni_cache.serving.chat_fields import EXTRA_FIELDS, FIELDS, IGNORED, REFUSED, SUPPORTED, refusal
from omni_cache.serving.chat_request import parse_chat_request
from omni_cache.serving.chat_sampling import CARRIED, NOT_FROM_REQUESTS, engine_sampling, wire_sampling
from omni_cache.serving.errors import APIError
from omni_cache.wire.sampling import EngineSampling

ROOT = Path(__file__).resolve().parents[1]
MODEL = "m"

#: A value other than the default for every refused field (one vLLM's own validators accept).
REFUSED_VALUES = {
    "thinking_token_budget": 10,
    "use_beam_search": True,
    "watermarking": True,
    "length_penalty": 0.5,
    "truncate_prompt_tokens": 5,
    "truncation_side": "left",
    "prompt_logprobs": 1,
    "echo": True,
    "add_special_tokens": True,
    "chat_template": "x",
    "media_io_kwargs": {"image": {}},
    "return_prompt_text": True,
    "cache_salt": "salt",
    "kv_transfer_params": {"a": 1},
    "ec_transfer_params": {"a": 1},
    "vllm_xargs": {"a": 1},
    "repetition_detection": {"max_pattern_size": 4, "min_count": 3},
    "stream_interval": 2,
}
#: A value for every ignored field, and why vLLM ignoring it too can be seen.
IGNORED_VALUES = {
    "user": "someone",
    "priority": 3,
    "routed_experts_prompt_start": 2,
    "return_token_offsets": True,
    "mm_payload": "none",
    "return_mm_kwargs": False,
    "metadata": {"team": "a"},
}


def body(**fields) -> bytes:
    fields.setdefault("model", MODEL)
    fields.setdefault("messages", [{"role": "user", "content": "hi"}])
    return json.dumps(fields).encode()


def refused(**fields) -> APIError:
    with pytest.raises(APIError) as e:
        parse_chat_request(body(**fields), MODEL)
    assert e.value.status == 400
    return e.value


def test_the_table_names_exactly_vllms_request_fields():
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    fields = set(ChatCompletionRequest.model_fields)
    assert set(FIELDS) == fields, (
        f"new in vLLM (place them in chat_fields.FIELDS): {sorted(fields - set(FIELDS))}; "
        f"gone from vLLM: {sorted(set(FIELDS) - fields)}"
    )
    assert not set(EXTRA_FIELDS) & fields
    assert all(rule.kind in (SUPPORTED, REFUSED, IGNORED) and rule.note for rule in {**FIELDS, **EXTRA_FIELDS}.values())


def test_every_refused_field_set_is_a_400_naming_it_and_why():
    assert set(REFUSED_VALUES) == {n for n, r in FIELDS.items() if r.kind == REFUSED}
    for name, value in REFUSED_VALUES.items():
        err = refused(**{name: value})
        assert err.param == name and name in err.message and FIELDS[name].note in err.message


def test_a_refused_field_at_its_default_is_taken():
    chat = parse_chat_request(body(use_beam_search=False, echo=False, length_penalty=1.0, cache_salt=None), MODEL)
    assert chat.modalities == ("text",)


def test_ignored_fields_are_taken_and_are_ones_vllm_ignores():
    assert set(IGNORED_VALUES) == {n for n, r in {**FIELDS, **EXTRA_FIELDS}.items() if r.kind == IGNORED}
    parse_chat_request(body(**IGNORED_VALUES), MODEL)


@pytest.mark.parametrize("name", ["temprature", "store", "service_tier", "functions"])
def test_a_field_that_is_not_vllms_is_refused_by_name(name):
    err = refused(**{name: 1})
    assert err.param == name and name in err.message


@pytest.mark.parametrize(
    "fields, param, needle",
    [
        ({"n": 2}, "n", "n=1"),
        (
            {"modalities": ["text", "audio"], "tools": [{"type": "function", "function": {"name": "f"}}]},
            "tools",
            "cannot be spoken",
        ),
        (
            {"modalities": ["text", "audio"], "add_generation_prompt": False, "continue_final_message": True},
            "add_generation_prompt",
            "new assistant turn",
        ),
        ({"include_reasoning": False}, "include_reasoning", "reasoning parser"),
        # An audio key OpenAI's audio object lacks was taken and ignored.
        (
            {"modalities": ["text", "audio"], "audio": {"voice": "default", "speed": 2}},
            "audio.speed",
            "{voice, format}",
        ),
        ({"mm_processor_kwargs": {"fps": 4}}, "mm_processor_kwargs", "use_audio_in_video"),
        ({"mm_processor_kwargs": {"use_audio_in_video": "yes"}}, "mm_processor_kwargs", "true|false"),
    ],
)
def test_limits_of_supported_fields(fields, param, needle):
    err = refused(**fields)
    assert err.param == param and needle in err.message


def test_use_audio_in_video_is_taken():
    chat = parse_chat_request(body(mm_processor_kwargs={"use_audio_in_video": False}), MODEL)
    assert chat.body.mm_processor_kwargs == {"use_audio_in_video": False}


def test_tools_with_tool_choice_none_may_be_spoken():
    chat = parse_chat_request(
        body(modalities=["text", "audio"], tool_choice="none", tools=[{"type": "function", "function": {"name": "f"}}]),
        MODEL,
    )
    assert chat.wants_audio


def test_vllms_own_validation_comes_first():
    from vllm.exceptions import VLLMValidationError

    with pytest.raises(VLLMValidationError) as e:
        parse_chat_request(body(top_logprobs=2), MODEL)
    assert e.value.parameter == "top_logprobs"


SUPPORTED_SAMPLING = dict(
    temperature=0.7,
    top_p=0.9,
    top_k=5,
    min_p=0.05,
    seed=11,
    presence_penalty=0.5,
    frequency_penalty=-0.25,
    repetition_penalty=1.2,
    stop=["ab", "c"],
    stop_token_ids=[7, 9],
    include_stop_str_in_output=True,
    ignore_eos=True,
    min_tokens=2,
    logprobs=True,
    top_logprobs=3,
    logit_bias={"5": 2.5},
    allowed_token_ids=[1, 2, 3, 5],
    bad_words=["xy"],
    skip_special_tokens=False,
    spaces_between_special_tokens=False,
    max_completion_tokens=9,
    response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "object"}}},
)


@pytest.mark.parametrize(
    "fields",
    [
        SUPPORTED_SAMPLING,
        {"max_tokens": 4, "logprobs": True, "logprob_token_ids": [3, 4]},
        {"structured_outputs": {"regex": "[ab]+"}},
        {"structured_outputs": {"choice": ["yes", "no"]}},
        {"response_format": {"type": "json_object"}, "stop": "z"},
        {},
    ],
)
def test_what_to_sampling_params_made_reaches_the_engine_unchanged(fields):
    from workers.ar_request import sampling_params

    req = parse_chat_request(body(**fields), MODEL).body
    defaults = EngineSampling(temperature=0.0, top_p=1.0, max_tokens=32)
    wire = engine_sampling(req, prompt_len=10, max_model_len=100, defaults=defaults)
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(wire), type=EngineSampling)
    in_stage = sampling_params(wire)
    expected = req.to_sampling_params(wire.max_tokens, {"temperature": 0.0, "top_p": 1.0})
    for f in msgspec.structs.fields(type(expected)):
        if f.name in NOT_FROM_REQUESTS:
            continue
        got, want = getattr(in_stage, f.name), getattr(expected, f.name)
        if f.name == "stop" and isinstance(want, str):
            want = [want]
        assert got == want, f.name


def test_max_tokens_default_is_the_stage_default_clamped_to_the_context():
    req = parse_chat_request(body(), MODEL).body
    wire = engine_sampling(req, prompt_len=90, max_model_len=100, defaults=EngineSampling(max_tokens=32, seed=4))
    assert (wire.max_tokens, wire.seed) == (10, 4)


def test_a_sampling_field_that_does_not_travel_must_hold_its_default():
    from vllm.sampling_params import SamplingParams

    names = {f.name for f in msgspec.structs.fields(SamplingParams)}
    assert CARRIED <= names and NOT_FROM_REQUESTS <= names
    assert wire_sampling(SamplingParams(max_tokens=3)).max_tokens == 3
    for name, value in {"prompt_logprobs": 1, "n": 2, "thinking_token_budget": 4, "extra_args": {"a": 1}}.items():
        with pytest.raises(APIError) as e:
            wire_sampling(SamplingParams(**{name: value}))
        assert e.value.status == 400 and e.value.param == name


def test_the_docs_name_every_field():
    api = (ROOT / "docs" / "api.md").read_text()
    missing = [n for n in {**FIELDS, **EXTRA_FIELDS} if f"`{n}`" not in api]
    assert not missing, f"docs/api.md does not name {missing}"


def test_refusal_reads_only_fields_the_client_set():
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    req = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}])
    assert refusal(req, {}, wants_audio=True) is None


@pytest.mark.parametrize(
    "role, part, param, needle",
    [
        # pydantic checks an OpenAI message's parts only as they are read: its errors listed
        # every part type tried ("7 validation errors for ValidatorIterator"), param None.
        ("user", {"type": "input_text", "text": "x"}, "messages.0.content.0.type", "'input_text' is not supported"),
        ("user", {"type": "image_url", "image_url": {"url": 5}}, "messages.0.content.0.image_url.url", "string"),
        ("user", {"type": "text"}, "messages.0.content.0.text", "Field required"),
        ("user", 1, "messages.0.content.0", "must be an object"),
        ("user", "x", "messages.0.content.0", "must be an object"),  # strings alone: 400 as in vLLM
        ("tool", {"type": "input_text", "text": "x"}, "messages.0.content.0.type", "'input_text' is not supported"),
        # A message vLLM reads as its own (a key OpenAI's messages lack): these reached the
        # media decoders and were 500s ("'int' object has no attribute 'decode'").
        ("user+", {"type": "image_url", "image_url": {"url": 5}}, "messages.0.content.0.image_url.url", "string"),
        ("user+", {"type": "video_url", "video_url": {"url": 5}}, "messages.0.content.0.video_url.url", "string"),
        ("user+", {"type": "input_audio", "input_audio": {"data": 1}}, "messages.0.content.0.input_audio.data", "str"),
    ],
)
def test_a_bad_content_part_is_a_400_naming_it(role, part, param, needle):
    message = {"role": role.rstrip("+"), "content": [part]}
    if role.endswith("+"):
        message["tool_call_id"] = "call_1"
    err = refused(messages=[message])
    assert err.param == param and needle in err.message, (err.param, err.message)
    assert "ValidatorIterator" not in err.message and "pydantic" not in err.message


def test_a_bare_string_part_is_text_as_vllm_reads_it():
    """Before, ``'str' object has no attribute 'get'``: a 500."""
    chat = parse_chat_request(body(messages=[{"role": "user", "content": ["a", {"type": "text", "text": "b"}]}]), MODEL)
    assert chat.messages[0]["content"] == "ab"


def test_content_that_is_an_object_is_a_400():
    """pydantic reads an object as the ``Iterable`` of parts OpenAI's message types declare: its
    keys, each a string, so strings alone in a list stay refused (the body fuzz's
    ``"content": {"a": 1}``), as vLLM refuses them when it reads them."""
    err = refused(messages=[{"role": "user", "content": {"a": 1}}])
    assert err.param == "messages.0.content.0" and "must be an object" in err.message
