"""The realtime session's parts without engines or processes (omni_cache/serving/realtime/).

Peers as oracles where they define the behaviour: ITU-T G.711's levels (and CPython's ``audioop``
while it exists) for G.711 bytes, soundfile for 16-bit PCM, the openai
SDK's own models for what a client event may hold, Silero (the real model) for speech detection.
"""

from __future__ import annotations

import asyncio
import io
import json
import threading
import warnings
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import soundfile

from benchmarks.speech_clips import silence, speech
from omni_cache.config.server_schema import ThreadsConfig
from omni_cache.pcm import pcm16, to_int16
from omni_cache.serving.realtime import audio_codecs as ac
from omni_cache.serving.realtime import protocol
from omni_cache.serving.realtime.connection import RateLimiter
from omni_cache.serving.realtime.conversation import Conversation, Item, ItemPart, SpokenText, audio_item
from omni_cache.serving.realtime.input_buffer import InputAudioBuffer
from omni_cache.serving.realtime.protocol import (
    OFF_LOOP_BYTES,
    EventError,
    parse_client_event,
    parse_client_event_async,
)
from omni_cache.serving.realtime.session_config import SessionConfig, TurnDetection, describe, updated
from omni_cache.serving.realtime.vad import SpeechDetector, load_model
from omni_cache.serving.realtime.vad_batch import BatchScorer
from omni_cache.thread_pools import ThreadPools

# ---- audio formats -----------------------------------------------------------------------------

ALL_INT16 = np.arange(-32768, 32768, dtype=np.int16)
ALL_CODES = np.arange(256, dtype=np.uint8)


def itu_ulaw(codes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ITU-T G.711 mu-law: each code's level on the 16-bit scale and its segment's step. A code is
    sent inverted; its sign bit set means negative; on 14 bits a level is (2m + 33) * 2**e - 33."""
    u = ~codes.astype(np.int64) & 0xFF
    e, m = (u >> 4) & 7, u & 0xF
    level = 4 * (((2 * m + 33) << e) - 33)
    return np.where(u & 0x80, -level, level), 4 * (2 << e)


def itu_alaw(codes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ITU-T G.711 A-law: even bits inverted (0x55), sign bit set means positive; on 13 bits a
    level is 2m + 1 in segment 0 and (2m + 33) * 2**(e - 1) above."""
    a = codes.astype(np.int64) ^ 0x55
    e, m = (a >> 4) & 7, a & 0xF
    level = 8 * np.where(e == 0, 2 * m + 1, (2 * m + 33) << np.maximum(e - 1, 0))
    return np.where(a & 0x80, level, -level), 8 * np.where(e == 0, 2, 1 << np.maximum(e, 1))


G711 = {"ULAW": itu_ulaw, "ALAW": itu_alaw}


@pytest.mark.parametrize("law", G711)
def test_g711_decodes_to_the_standards_levels(law):
    assert np.array_equal(ac.g711_decode(ALL_CODES.tobytes(), law), G711[law](ALL_CODES)[0])


@pytest.mark.parametrize("law", G711)
def test_g711_chunks_are_libsndfiles_own_coding(law):
    """The codec looks samples up in tables libsndfile made: a chunk's bytes are what soundfile
    writes for it, and its samples what soundfile reads back."""
    pcm = np.random.default_rng(2).integers(-32768, 32768, 4000).astype(np.int16)
    buf = io.BytesIO()
    soundfile.write(buf, pcm, 8000, format="RAW", subtype=law)
    assert ac.g711_encode(pcm, law) == buf.getvalue()
    back, _ = soundfile.read(
        io.BytesIO(buf.getvalue()), format="RAW", subtype=law, samplerate=8000, channels=1, dtype="int16"
    )
    assert np.array_equal(ac.g711_decode(buf.getvalue(), law), back)
    assert ac.g711_encode(pcm[:0], law) == b"" and ac.g711_decode(b"", law).size == 0


@pytest.mark.parametrize("law", G711)
def test_g711_codes_each_sample_inside_its_codes_decision_interval(law):
    """Every int16 value's code decodes to a level within half that segment's step of it (beyond
    the top level, to the top level): G.711's decision intervals, and monotone in the sample."""
    codes = np.frombuffer(ac.g711_encode(ALL_INT16, law), np.uint8)
    level, step = G711[law](codes)
    top = np.abs(G711[law](ALL_CODES)[0]).max()
    x = np.clip(ALL_INT16.astype(np.int64), -top, top)
    assert np.all(np.abs(x - level) <= step // 2)
    assert np.all(np.diff(level) >= 0)


@pytest.mark.parametrize("law", G711)
def test_g711_matches_audioop(law):
    """CPython's audioop (the classic Sun code; removed in Python 3.13): the same levels for every
    code; the same code for all but a few samples, where the two sit on a decision boundary of a
    negative segment (audioop shifts the sample right, rounding a negative one down, before taking
    its magnitude; libsndfile divides the magnitude) and pick neighbouring levels."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        audioop = pytest.importorskip("audioop")
    lin2, to_lin = {"ULAW": (audioop.lin2ulaw, audioop.ulaw2lin), "ALAW": (audioop.lin2alaw, audioop.alaw2lin)}[law]
    levels = ac.g711_decode(ALL_CODES.tobytes(), law)
    assert levels.astype("<i2").tobytes() == to_lin(ALL_CODES.tobytes(), 2)
    ours = np.frombuffer(ac.g711_encode(ALL_INT16, law), np.uint8)
    theirs = np.frombuffer(lin2(ALL_INT16.astype("<i2").tobytes(), 2), np.uint8)
    differ = ours != theirs
    assert differ.sum() < 0.01 * len(ALL_INT16) and np.all(ALL_INT16[differ] < 0)
    levels = np.unique(G711[law](ALL_CODES)[0])
    rank = [np.searchsorted(levels, G711[law](codes[differ])[0]) for codes in (ours, theirs)]
    assert np.all(np.abs(rank[0] - rank[1]) == 1)


def test_pcm_is_soundfiles_pcm16_rounded_to_nearest():
    """audio/pcm bytes are the chat API's pcm16 bytes, and libsndfile's PCM_16 of the same floats:
    x 32768, clipped to [-32768, 32767]. libsndfile up to 1.2.2 floors where later ones round to
    nearest (its commit d8c58ee): ours rounds, so it is soundfile's value or, where the two
    roundings differ, one step above it."""
    x = np.concatenate(
        [
            np.random.default_rng(0).uniform(-1.2, 1.2, 50_000),
            np.arange(-70_000, 70_000) / 65536.0,
            [1.0, -1.0, 0.5, -0.5, 32767 / 32768, -1.0, 4.0, -4.0],
        ]
    ).astype(np.float32)
    ours = np.frombuffer(ac.PCM.encode(x), "<i2")
    assert ac.PCM.encode(x) == pcm16(x)
    buf = io.BytesIO()
    soundfile.write(buf, x, ac.PCM.rate, format="RAW", subtype="PCM_16")
    theirs = np.frombuffer(buf.getvalue(), "<i2")
    scaled = x.astype(np.float64) * 32768
    same_rounding = np.rint(scaled) == np.floor(scaled)
    assert np.array_equal(ours[same_rounding], theirs[same_rounding])
    assert set(np.unique(ours[~same_rounding].astype(int) - theirs[~same_rounding])) <= {0, 1}
    assert list(ours[-8:]) == [32767, -32768, 16384, -16384, 32767, -32768, 32767, -32768]
    assert list(to_int16(np.array([np.nan, np.inf, -np.inf]))) == [0, 32767, -32768]
    assert np.array_equal(ac.PCM.decode(ac.PCM.encode(ours / 32768)), ours / 32768)  # exact both ways


@pytest.mark.parametrize("fmt", [ac.PCM, ac.PCMU, ac.PCMA], ids=lambda f: f.type)
def test_formats_round_trip_a_waveform(fmt):
    t = np.arange(fmt.rate) / fmt.rate
    x = (0.4 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    data = fmt.encode(x)
    assert len(data) == len(x) * fmt.bytes_per_sample
    y = fmt.decode(data)
    # 16-bit PCM is exact to one step; G.711's 8-bit log steps keep ~35 dB SNR on a loud tone.
    tolerance = 1 / 32768 if fmt is ac.PCM else 0.02
    assert np.sqrt(np.mean((y - x) ** 2)) < tolerance


def test_torn_pcm_sample_is_an_error():
    with pytest.raises(ValueError, match="even number of bytes"):
        ac.PCM.decode(b"\x00\x01\x02")


def test_stream_resampler_keeps_the_rate_across_chunks():
    r = ac.StreamResampler(24000, 16000)
    x = speech(1.0, seed=1)
    out = np.concatenate([r(x[i : i + 480]) for i in range(0, len(x), 480)] + [r(x[:0], last=True)])
    assert abs(len(out) - 16000) <= 1
    assert ac.StreamResampler(16000, 16000)(x) is not None


# ---- client events: the SDK's schema, errors naming the field ----------------------------------


@pytest.mark.parametrize(
    "event, param",
    [
        (
            {
                "type": "session.update",
                "session": {
                    "type": "realtime",
                    "audio": {"input": {"turn_detection": {"type": "server_vad", "threshold": "high"}}},
                },
            },
            "session.audio.input.turn_detection.threshold",
        ),
        (
            {"type": "session.update", "session": {"type": "realtime", "output_modalities": ["video"]}},
            "session.output_modalities.0",
        ),
        (
            {
                "type": "session.update",
                "session": {"type": "realtime", "audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000}}}},
            },
            "session.audio.input.format.rate",
        ),
        (
            {
                "type": "conversation.item.create",
                "item": {"type": "message", "role": "user", "content": [{"type": "input_text", "text": 5}]},
            },
            "item.content.0.text",
        ),
        ({"type": "conversation.item.truncate", "item_id": "x", "content_index": 0}, "audio_end_ms"),
        ({"type": "input_audio_buffer.append", "audio": 5}, "audio"),
        ({"type": "response.create", "response": {"max_output_tokens": "lots"}}, "response.max_output_tokens"),
        ({"type": "nonsense.event"}, "type"),
    ],
    ids=[
        "threshold",
        "modality",
        "pcm-rate",
        "item-text",
        "truncate-missing",
        "append-audio",
        "max-tokens",
        "unknown-type",
    ],
)
def test_bad_events_name_the_field(event, param):
    with pytest.raises(EventError) as e:
        parse_client_event(json.dumps({**event, "event_id": "ev_1"}))
    assert e.value.param == param, e.value.message
    if param != "type":
        assert e.value.event_id == "ev_1"


def test_not_json_and_not_an_object():
    with pytest.raises(EventError) as e:
        parse_client_event("{nope")
    assert e.value.code == "invalid_json"
    with pytest.raises(EventError, match="JSON object"):
        parse_client_event("[1]")


def test_an_event_without_a_string_type_says_so_in_jsons_words():
    """Before, ``{}`` was "unknown event type None" (Python's word) and a long type was echoed whole."""
    for raw, needle in [
        ("{}", "the event has no 'type'"),
        ('{"type": null}', "'type' must be a string, not null"),
        ('{"type": ["x"]}', "'type' must be a string, not an array"),
        ('{"type": "' + "x" * 5000 + '"}', '"' + "x" * 64 + '"...'),
    ]:
        with pytest.raises(EventError) as e:
            parse_client_event(raw)
        assert needle in e.value.message and e.value.param == "type"
        assert "None" not in e.value.message and "x" * 65 not in e.value.message


@pytest.mark.parametrize(
    "raw, param",
    [
        (
            '{"type": "conversation.item.create", "event_id": "ev_1", "item": {"type": "message", '
            '"role": "user", "content": [{"type": "input_text", "text": "hi \\ud800"}]}}',
            "item.content.0.text",
        ),
        (
            '{"type": "session.update", "event_id": "ev_1", "session": {"type": "realtime", '
            '"instructions": "\\udfff\\ud800"}}',
            "session.instructions",
        ),
        (
            '{"type": "response.create", "event_id": "ev_1", "response": {"metadata": {"k": "\\udc00"}}}',
            "response.metadata.k",
        ),
        (
            '{"type": "response.create", "event_id": "ev_1", "response": {"metadata": {"k\\ud800": "v"}}}',
            "response.metadata.k\\ud800",
        ),
        # The same half pair written as UTF-8 bytes: json reads bytes with "surrogatepass".
        (
            b'{"type": "session.update", "event_id": "ev_1", "session": {"type": "realtime", '
            b'"instructions": "\xed\xa0\x80"}}',
            "session.instructions",
        ),
        ('{"type": "input_audio_buffer.clear", "event_id": "\\ud800"}', "event_id"),
    ],
    ids=["item-text", "instructions", "metadata-value", "metadata-key", "utf8-bytes", "event-id"],
)
def test_a_lone_surrogate_is_an_error_naming_its_field(raw, param):
    """Before, the event was carried out and the server event echoing the text failed to serialize:
    an ``internal_error`` after the item was added (every later response then failed in the
    tokenizer), or a response that never ended (its ``response.created`` carried the metadata)."""
    with pytest.raises(EventError) as e:
        parse_client_event(raw)
    assert e.value.param == param and e.value.code == "invalid_value"
    assert "lone UTF-16 surrogate" in e.value.message
    assert e.value.event_id == (None if param == "event_id" else "ev_1")
    # What the client is sent can be written as JSON.
    protocol.wire(protocol.error_event(e.value, e.value.event_id))


def test_surrogate_pairs_and_other_characters_are_taken():
    text = "\U0001f389 \u00e9 \ud55c \u0000"
    for ascii_only in (True, False):  # escaped (the emoji as a surrogate pair) and as UTF-8 bytes
        raw = json.dumps(
            {"type": "session.update", "session": {"type": "realtime", "instructions": text}}, ensure_ascii=ascii_only
        )
        event, _ = parse_client_event(raw.encode())
        assert event.session.instructions == text


@pytest.mark.parametrize(
    "event, param, wanted, unwanted",
    [
        (
            {"type": "conversation.item.create", "item": {"type": "foo", "role": "user", "content": []}},
            "item.type",
            ["'message'", "'function_call'"],
            ["'system'", "'user'"],
        ),
        (
            {"type": "conversation.item.create", "item": {"type": "message", "role": "developer", "content": []}},
            "item.role",
            ["'assistant'", "'system'", "'user'"],
            ["'function_call'", "'message'"],
        ),
        (
            {
                "type": "session.update",
                "session": {"type": "realtime", "audio": {"input": {"format": {"type": "audio/mp3"}}}},
            },
            "session.audio.input.format.type",
            ["'audio/pcm'", "'audio/pcma'", "'audio/pcmu'"],
            ["'transcription'"],
        ),
        (
            {
                "type": "session.update",
                "session": {"type": "realtime", "audio": {"input": {"turn_detection": {"type": "nope"}}}},
            },
            "session.audio.input.turn_detection.type",
            ["'server_vad'", "'semantic_vad'"],
            ["'transcription'"],
        ),
    ],
    ids=["item-type", "item-role", "format-type", "turn-detection-type"],
)
def test_a_wrong_type_or_role_names_that_field_and_only_its_values(event, param, wanted, unwanted):
    """Before, ``type: "foo"`` was blamed on ``item.role`` with item types and message roles in one
    list, and a bad audio format listed the transcription session's ``'transcription'``."""
    with pytest.raises(EventError) as e:
        parse_client_event(json.dumps(event))
    assert e.value.param == param, e.value.message
    assert all(w in e.value.message for w in wanted), e.value.message
    assert not any(u in e.value.message for u in unwanted), e.value.message


def test_deep_large_and_many_valued_events_are_errors_naming_the_problem():
    """Checked before anything is parsed: before, 200,000 brackets raised RecursionError (an
    ``internal_error``) and nothing bounded an event's size or values."""
    for raw, max_bytes, code, needle in [
        ("[" * 200_000 + "]" * 200_000, None, "invalid_json", "nests at least 65536 levels deep; at most 64"),
        ('{"type": "x", "a": [' + ",".join(["0"] * 100_001) + "]}", None, "invalid_json", "at most 100000"),
        ('{"type": "input_audio_buffer.append", "audio": "' + "A" * 2000 + '"}', 1000, "event_too_large", "max_event"),
        ("é" * 600, 1000, "event_too_large", "the event is 1200 bytes"),  # counted in bytes, not characters
    ]:
        with pytest.raises(EventError, match=needle) as e:
            parse_client_event(raw, max_bytes)
        assert e.value.code == code and e.value.type == "invalid_request_error"


def test_large_events_are_parsed_off_the_event_loop():
    small = json.dumps({"type": "input_audio_buffer.append", "audio": "AAAA"})
    large = json.dumps({"type": "input_audio_buffer.append", "audio": "A" * OFF_LOOP_BYTES})
    pools = ThreadPools(ThreadsConfig())

    async def thread_of(raw):
        threads = []
        real = protocol.parse_client_event
        with mock.patch.object(
            protocol, "parse_client_event", lambda *a: threads.append(threading.current_thread()) or real(*a)
        ):
            await parse_client_event_async(raw, 1 << 20, pools.realtime_events)
        return threads[0]

    try:
        assert asyncio.run(thread_of(small)) is threading.main_thread()
        assert asyncio.run(thread_of(large)).name.startswith("omni-realtime_events")
    finally:
        pools.close()


def session_of(**session):
    event, _ = parse_client_event(json.dumps({"type": "session.update", "session": {"type": "realtime", **session}}))
    return event.session


def test_session_update_applies_only_what_is_present():
    c = SessionConfig()
    assert c.turn_detection == TurnDetection()
    c2 = updated(c, session_of(instructions="be brief"), "m")
    assert c2.instructions == "be brief" and c2.turn_detection == TurnDetection()
    c3 = updated(c2, session_of(audio={"input": {"turn_detection": None}}), "m")
    assert c3.turn_detection is None and c3.instructions == "be brief"
    c4 = updated(
        c3,
        session_of(
            audio={"input": {"turn_detection": {"type": "server_vad", "threshold": 0.7, "silence_duration_ms": 200}}}
        ),
        "m",
    )
    assert c4.turn_detection == TurnDetection(threshold=0.7, silence_duration_ms=200)
    c5 = updated(
        c4,
        session_of(
            audio={"input": {"format": {"type": "audio/pcmu"}}, "output": {"format": {"type": "audio/pcma"}}},
            output_modalities=["text"],
            max_output_tokens=7,
        ),
        "m",
    )
    assert (c5.input_format, c5.output_format, c5.output_modalities, c5.max_output_tokens) == (
        ac.PCMU,
        ac.PCMA,
        ("text",),
        7,
    )
    assert updated(c5, session_of(max_output_tokens="inf"), "m").max_output_tokens is None


@pytest.mark.parametrize(
    "session, param",
    [
        ({"tools": [{"type": "function", "name": "f"}]}, "session.tools"),
        ({"audio": {"input": {"turn_detection": {"type": "semantic_vad"}}}}, "session.audio.input.turn_detection.type"),
        ({"audio": {"input": {"transcription": {"model": "whisper-1"}}}}, "session.audio.input.transcription"),
        ({"audio": {"output": {"voice": "alloy"}}}, "session.audio.output.voice"),
        ({"model": "gpt-realtime"}, "session.model"),
        ({"output_modalities": ["text", "audio"]}, "session.output_modalities"),
        ({"max_output_tokens": 5000}, "session.max_output_tokens"),
        (
            {"audio": {"input": {"turn_detection": {"type": "server_vad", "threshold": 1.5}}}},
            "session.audio.input.turn_detection.threshold",
        ),
    ],
    ids=[
        "tools",
        "semantic-vad",
        "transcription",
        "voice",
        "model",
        "both-modalities",
        "max-tokens",
        "threshold-range",
    ],
)
def test_session_update_refuses_what_is_not_served(session, param):
    with pytest.raises(EventError) as e:
        updated(SessionConfig(), session_of(**session), "m")
    assert e.value.param == param


@pytest.mark.parametrize(
    "session, param, ga",
    [
        ({"input_audio_format": "g711_ulaw"}, "session.input_audio_format", "session.audio.input.format"),
        ({"modalities": ["text"]}, "session.modalities", "session.output_modalities"),
        ({"turn_detection": None}, "session.turn_detection", "session.audio.input.turn_detection"),
        ({"voice": "alloy"}, "session.voice", "session.audio.output.voice"),
        ({"temperature": 0.6}, "session.temperature", "no such field"),
    ],
    ids=["input-format", "modalities", "turn-detection", "voice", "temperature"],
)
def test_a_beta_api_field_is_refused_naming_its_ga_place(session, param, ga):
    """Before, the SDK's model kept it as an unknown extra and the update was answered
    ``session.updated`` with nothing of it applied (G.711 audio read as PCM, VAD left on)."""
    with pytest.raises(EventError) as e:
        updated(SessionConfig(), session_of(instructions="x", **session), "m")
    assert (e.value.param, e.value.code) == (param, "unknown_parameter") and ga in e.value.message
    # What the server itself sends back (id, object) is not refused: a client may echo it.
    echoed = describe(SessionConfig(), "m", "sess_1").model_dump(exclude_unset=True)
    assert updated(SessionConfig(), session_of(**{k: v for k, v in echoed.items() if k != "type"}), "m")


def test_described_session_is_what_the_sdk_parses():
    from openai.types.realtime import SessionCreatedEvent

    config = updated(SessionConfig(), session_of(audio={"input": {"turn_detection": None}}), "m")
    body = describe(config, "m", "sess_1").model_dump(exclude_unset=True)
    assert body["audio"]["input"]["turn_detection"] is None  # manual commits, said explicitly
    event = SessionCreatedEvent.model_validate({"type": "session.created", "event_id": "e", "session": body})
    assert event.session.model == "m" and event.session.audio.output.format.rate == 24000


# ---- VAD ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def silero():
    return BatchScorer(load_model())


def feed_in_chunks(scorer, detector, samples_16k, chunk=320):
    events = []
    for i in range(0, len(samples_16k), chunk):
        events += scorer.score([(detector, detector.windows(samples_16k[i : i + chunk]))])[0]
    return events


def test_vad_finds_speech_between_silences(silero):
    clip = np.concatenate([silence(1.0, 16000), speech(2.0, seed=3, rate=16000), silence(1.5, 16000)])
    events = feed_in_chunks(silero, SpeechDetector(0.5, 500), clip)
    assert [e.kind for e in events] == ["start", "stop"]
    start, stop = events[0].at_ms, events[1].at_ms
    assert 900 <= start <= 1300
    # Speech ends at 3000 ms; the stop comes after silence_duration_ms of silence.
    assert 3300 <= stop <= 3800


def test_vad_ignores_silence_and_a_steady_tone(silero):
    t = np.arange(3 * 16000) / 16000
    tone = (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    assert feed_in_chunks(silero, SpeechDetector(0.5, 500), np.concatenate([silence(1.0, 16000), tone])) == []


def test_a_longer_silence_duration_waits_longer(silero):
    clip = np.concatenate([silence(0.5, 16000), speech(1.5, seed=2, rate=16000), silence(2.0, 16000)])
    stops = []
    for ms in (300, 1200):
        events = feed_in_chunks(silero, SpeechDetector(0.5, ms), clip)
        stops.append([e.at_ms for e in events if e.kind == "stop"][0])
    assert stops[1] - stops[0] >= 800


# ---- input buffer ------------------------------------------------------------------------------


def test_input_buffer_clock_limit_and_padding():
    buf = InputAudioBuffer(16000, max_seconds=1.0)
    buf.append(np.zeros(8000, np.float32))
    buf.append(np.ones(4000, np.float32))
    assert (buf.start_ms, buf.end_ms, buf.duration_ms) == (0, 750, 750)
    buf.keep_last(100)
    assert (buf.start_ms, buf.end_ms, buf.duration_ms) == (650, 750, 100)
    with pytest.raises(EventError) as e:
        buf.append(np.zeros(15000, np.float32))
    assert e.value.param == "audio" and e.value.code == "input_audio_buffer_full"
    assert buf.duration_ms == 100  # the refused append left the buffer as it was
    assert np.all(buf.take() == 1.0) and buf.duration_ms == 0 and buf.end_ms == 750


def test_input_buffer_keeps_exactly_the_last_samples_across_chunks():
    rng = np.random.default_rng(0)
    for _ in range(100):
        buf, held = InputAudioBuffer(16000, max_seconds=60.0), np.zeros(0, np.float32)
        for _ in range(15):
            x = rng.standard_normal(int(rng.integers(0, 3000))).astype(np.float32)
            buf.append(x)
            held = np.concatenate([held, x])
            if rng.random() < 0.5:
                ms = int(rng.integers(0, 400))
                buf.keep_last(ms)
                held = held[max(0, len(held) - ms * 16) :]
            assert buf.size == len(held)
        assert np.array_equal(buf.take(), held)


# ---- conversation ------------------------------------------------------------------------------


def test_conversation_prompt_holds_every_turn_with_stable_audio():
    conv = Conversation(max_items=10)
    clip = speech(1.0, seed=1, rate=16000)
    user = Item("user", [ItemPart("input_audio", media=audio_item(clip, 16000))])
    conv.add(user)
    answer = Item("assistant", [ItemPart("output_audio", "hello there")], spoken=SpokenText(finished=True))
    conv.add(answer)
    conv.add(Item("user", [ItemPart("input_text", "and?")]))
    messages, media = conv.prompt("be brief")
    assert messages == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "audio"}]},
        {"role": "assistant", "content": "hello there"},
        {"role": "user", "content": "and?"},
    ]
    assert len(media) == 1 and media[0].sample_rate == 16000
    # The same samples give the same digest (vLLM's multimodal key) in every later prompt.
    assert media[0].digest == audio_item(clip.copy(), 16000).digest
    assert media[0].digest != audio_item(clip * 0.5, 16000).digest


def test_conversation_insert_delete_and_limits():
    conv = Conversation(max_items=3)
    a, b, c = (Item("user", [ItemPart("input_text", t)]) for t in "abc")
    assert conv.add(a) is None
    assert conv.add(b) == a.id
    assert conv.add(c, previous_item_id=a.id) == a.id
    assert [i.id for i in conv.items] == [a.id, c.id, b.id]
    with pytest.raises(EventError) as e:
        conv.add(Item("user", [ItemPart("input_text", "d")]))
    assert e.value.code == "conversation_full"
    conv.delete(c.id)
    with pytest.raises(EventError) as e:
        conv.add(Item("user", [ItemPart("input_text", "d")]), previous_item_id="item_nope")
    assert e.value.param == "previous_item_id"
    with pytest.raises(EventError) as e:
        conv.get("item_nope")
    assert e.value.param == "item_id"


def test_spoken_text_is_cut_where_the_audio_was():
    spoken = SpokenText()
    for word in ("one ", "two ", "three ", "four "):
        spoken.add_text(word, 1)
    spoken.audio_ms = 320.0  # audio lags the text: 4 tokens, 320 ms sent so far
    # In flight with no pace known: this answer's own ratio (80 ms/token): 200 ms -> 2 tokens.
    assert spoken.heard(200, None) == "one two "
    # A pace measured on earlier answers wins while in flight.
    assert spoken.heard(200, 40.0) == "one two three four "
    spoken.audio_ms, spoken.finished = 800.0, True  # done: 200 ms per token
    assert spoken.heard(450, 40.0) == "one two "
    assert spoken.heard(800, None) == "one two three four "
    assert SpokenText().heard(1000, None) == ""


def test_rate_limiter_allows_a_burst_then_the_rate():
    now = [0.0]
    limiter = RateLimiter(10, clock=lambda: now[0])
    assert sum(limiter.allow() for _ in range(15)) == 10
    now[0] += 0.5
    assert sum(limiter.allow() for _ in range(15)) == 5


# ---- config and benchmark bookkeeping ----------------------------------------------------------


def test_a_bad_realtime_limit_names_its_key(tmp_path):
    from omni_cache.config import ConfigError, load_config

    text = Path("stage_configs/qwen3_omni.yaml").read_text().replace("    max_sessions: 64 ", "    max_sessions: 0 ")
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config(path, check_paths=False)
    assert "server.realtime.max_sessions" in str(e.value) and str(path) in str(e.value)


def test_benchmark_config_and_summary(tmp_path):
    import yaml

    from benchmarks.realtime import bench_config, summarize

    shipped = yaml.safe_load(Path("stage_configs/qwen3_omni.yaml").read_text())["stages"]
    limit = next(s for s in shipped if s["name"] == "thinker")["engine_args"]["extra"]["limit_mm_per_prompt"]["audio"]
    # A session longer than the shipped limit raises it; a shorter one keeps it.
    for turns, expected in ((limit + 4, limit + 4), (max(1, limit - 4), limit)):
        path = bench_config("stage_configs/qwen3_omni.yaml", tmp_path / "b.yaml", turns=turns, talker_max_tokens=50)
        stages = {s["name"]: s for s in yaml.safe_load(path.read_text())["stages"]}
        assert stages["thinker"]["engine_args"]["extra"]["limit_mm_per_prompt"]["audio"] == expected
    assert stages["talker"]["sampling"]["max_tokens"] == 50
    side = {
        "sessions": [
            {
                "turns": [
                    {"turn": 1, "first_audio_s": fa1, "input_tokens": 50, "cached_tokens": 0},
                    {"turn": 2, "first_audio_s": fa2, "input_tokens": 100, "cached_tokens": 64},
                ]
            }
            for fa1, fa2 in ((0.1, 0.12), (0.2, 0.22), (0.3, 0.32))
        ],
        "counters": {"thinker": {"queried": 300.0, "hit": 192.0}, "decoder": {}},
    }
    s = summarize(side)
    assert [t["first_audio_p50_s"] for t in s["turns"]] == pytest.approx([0.2, 0.22])
    assert s["turns"][1]["cached_share"] == pytest.approx(0.64)
    assert s["last_over_first_p50"] == pytest.approx(1.1)
    assert s["linear_fit"] == {"slope_ms_per_turn": pytest.approx(20.0), "last_over_first": pytest.approx(1.1)}
    assert s["stage_hit_rates"] == {"thinker": pytest.approx(0.64)}


def test_an_internal_error_names_the_event_not_the_exception():
    """Before: the exception's type and text went to the client (paths, internals)."""
    from omni_cache.serving.realtime.connection import handle_event

    class Session:
        id = "sess_1"
        threads = ThreadPools(ThreadsConfig())  # large events only: none is started here

        async def handle(self, event):
            raise RuntimeError("/srv/secret/path exploded")

    class Outbox:
        sent: list = []

        def send(self, event):
            self.sent.append(event)

    outbox = Outbox()
    asyncio.run(handle_event(json.dumps({"type": "response.cancel", "event_id": "ev_9"}), Session(), outbox, 1 << 20))
    Session.threads.close()
    (event,) = outbox.sent
    assert event.error.code == "internal_error" and event.error.event_id == "ev_9"
    assert "secret" not in event.error.message and "sess_1" in event.error.message
