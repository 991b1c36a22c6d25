"""Voices: what a checkpoint folder offers (omni_cache/models/voices.py), and a client's choice checked
by the chat API and the realtime session against them (400 / error event naming the valid ones)."""

from __future__ import annotations

import json

import pytest

from omni_cache.models.voices import DEFAULT_VOICE, checkpoint_voices, resolve_voice
from omni_cache.serving.chat_request import parse_chat_request
from omni_cache.serving.errors import APIError
from omni_cache.serving.realtime import session_config
from omni_cache.serving.realtime.protocol import EventError
from omni_cache.tiny.checkpoints import ensure_checkpoint


@pytest.fixture(scope="module")
def qwen2_5(tmp_path_factory):
    return ensure_checkpoint("qwen2.5-omni", tmp_path_factory.mktemp("q25"))


def test_a_qwen2_5_omni_folder_offers_its_speakers(qwen2_5):
    assert checkpoint_voices(qwen2_5) == (DEFAULT_VOICE, "chelsie", "ethan")


def test_a_qwen3_omni_config_offers_its_talkers_speakers(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"talker_config": {"speaker_id": {"Ethan": 3, "Aiden": 4}}}))
    assert checkpoint_voices(tmp_path) == (DEFAULT_VOICE, "aiden", "ethan")


def test_a_folder_without_speakers_offers_only_the_default(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert checkpoint_voices(tmp_path) == (DEFAULT_VOICE,)


def test_a_voice_resolves_to_the_checkpoints_name_without_case():
    names = ["Chelsie", "Ethan"]
    assert resolve_voice("", names, "Chelsie") == "Chelsie"
    assert resolve_voice("default", names, "Chelsie") == "Chelsie"
    assert resolve_voice("ETHAN", names, "Chelsie") == "Ethan"
    with pytest.raises(ValueError, match="unknown voice 'nova'.*Chelsie, Ethan"):
        resolve_voice("nova", names, "Chelsie")


def body(voice) -> bytes:
    return json.dumps(
        {"messages": [{"role": "user", "content": "hi"}], "modalities": ["text", "audio"], "audio": {"voice": voice}}
    ).encode()


def test_the_chat_api_takes_a_pipeline_voice_and_refuses_others():
    voices = (DEFAULT_VOICE, "chelsie", "ethan")
    assert parse_chat_request(body("Ethan"), "m", voices).voice == "ethan"
    assert parse_chat_request(body("default"), "m", voices).voice == ""
    with pytest.raises(APIError) as e:
        parse_chat_request(body("alloy"), "m", voices)
    assert e.value.status == 400 and e.value.param == "audio.voice"
    assert "'alloy' is not available" in str(e.value) and "'ethan'" in str(e.value)
    with pytest.raises(APIError):
        parse_chat_request(body("ethan"), "m")  # a pipeline without named speakers


def test_a_realtime_session_takes_a_pipeline_voice_and_refuses_others():
    voices = (DEFAULT_VOICE, "chelsie", "ethan")
    assert session_config.voice("Chelsie", "session.audio.output.voice", voices) == "chelsie"
    assert session_config.voice(None, "session.audio.output.voice", voices) is None
    with pytest.raises(EventError, match="'marin' is not available"):
        session_config.voice("marin", "session.audio.output.voice", voices)
