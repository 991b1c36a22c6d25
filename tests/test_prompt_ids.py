"""Prompt token ids are checked once, on the thread that tokenizes them, so that admission on the
event loop does not walk a long prompt's ids again (omni_cache/runtime/request_path/prompt_ids.py);
ids a Python API caller made are still checked, with a 400 naming the problem."""

from __future__ import annotations

import asyncio
import uuid

import httpx
import numpy as np
import pytest
from fake_pipeline import API_KEY, ByteTokenizer, make_orchestrator, write_config

from omni_cache.runtime.request_path.prompt_ids import PromptIds, prompt_ids
from omni_cache.runtime.request_path.results import RequestError
from omni_cache.runtime.request_path.text_codec import TextCodec
from omni_cache.serving.server import ServerThread


def test_ids_are_checked_into_prompt_ids_once():
    ids = prompt_ids([3, 0, 7])
    assert type(ids) is PromptIds and ids == [3, 0, 7]
    assert prompt_ids(ids) is ids  # already checked: returned as it is, not walked again
    numpy_ids = prompt_ids(np.array([4, 5], dtype=np.int64))
    assert numpy_ids == [4, 5] and {type(t) for t in numpy_ids} == {int}


@pytest.mark.parametrize("bad", [[1, -1], [1, True], [1, 2.0], [1, "2"]])
def test_anything_but_non_negative_integers_is_a_400(bad):
    with pytest.raises(RequestError) as e:
        prompt_ids(bad)
    assert e.value.status == 400 and "non-negative integers" in str(e.value)


def test_the_tokenizer_thread_makes_prompt_ids():
    codec = TextCodec(ByteTokenizer())
    ids = codec.tokenize_messages([{"role": "user", "content": "hi"}])
    assert type(ids) is PromptIds and bytes(ids) == b"user: hi\n"


@pytest.fixture(scope="module")
def srv():
    orch = make_orchestrator(write_config(f"ids_{uuid.uuid4().hex[:8]}"))
    with ServerThread(orch, api_key=API_KEY) as server:
        server.wait_ready(60)
        yield server


def submit_on_loop(srv, ids):
    loop = srv.server.servers[0].get_loop()  # the server's event loop, where the orchestrator runs
    return asyncio.run_coroutine_threadsafe(srv.orchestrator.submit(ids, max_tokens=2), loop).result(30)


def test_the_server_hands_the_orchestrator_checked_ids(srv, monkeypatch):
    orch = srv.orchestrator
    seen = []
    submit = orch.submit

    async def recording(ids, **kwargs):
        seen.append(type(ids))
        return await submit(ids, **kwargs)

    monkeypatch.setattr(orch, "submit", recording)
    body = {"model": orch.served_model_name, "messages": [{"role": "user", "content": "x" * 300}], "max_tokens": 3}
    r = httpx.post(
        srv.url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30
    )
    assert r.status_code == 200, r.text
    assert seen == [PromptIds]


@pytest.mark.parametrize(("ids", "needle"), [([5, -1], "non-negative integers"), ([], "the prompt is empty")])
def test_a_python_api_callers_own_ids_are_still_checked(srv, ids, needle):
    with pytest.raises(RequestError) as e:
        submit_on_loop(srv, ids)
    assert e.value.status == 400 and needle in str(e.value)
    assert submit_on_loop(srv, [104, 105]).request_id  # and it goes on serving
