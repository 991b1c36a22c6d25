"""The server's worker threads (omni_cache/thread_pools.py, ``server.threads``): a pool per
kind of work, sized from the config or the host's CPUs, and a flood of slow media decodes that
does not hold up the parsing of a text-only request (against a real server of fake stages)."""

from __future__ import annotations

import asyncio
import contextvars
import os
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from fake_pipeline import API_KEY, echo, serve_config, write_config
from media_samples import flat_png_data_url

from omni_cache.config import ConfigError, load_config
from omni_cache.config.server_schema import ThreadsConfig
from omni_cache.serving.media import MediaDecoder
from omni_cache.thread_pools import KINDS, ThreadPools, pool_sizes


def test_pool_sizes_follow_the_config_and_the_cpus():
    assert pool_sizes(ThreadsConfig(), cpus=2) == {"request": 6, "media": 2, "response": 2, "realtime_events": 2}
    assert pool_sizes(ThreadsConfig(), cpus=64) == {"request": 32, "media": 16, "response": 8, "realtime_events": 2}
    set_ = ThreadsConfig(request=3, media=5, response=1, realtime_events=4)
    assert pool_sizes(set_, cpus=64) == {"request": 3, "media": 5, "response": 1, "realtime_events": 4}


def test_each_kind_runs_on_threads_of_its_own_in_the_callers_context():
    var: contextvars.ContextVar[str] = contextvars.ContextVar("var")
    pools = ThreadPools(ThreadsConfig(media=1))

    def where() -> tuple[str, str]:
        return threading.current_thread().name, var.get()

    async def go() -> dict[str, tuple[str, str]]:
        var.set("the caller's")
        return {kind: await getattr(pools, kind)(where) for kind in KINDS}

    try:
        seen = asyncio.run(go())
    finally:
        pools.close()
    for kind, (name, value) in seen.items():
        assert name.startswith(f"omni-{kind}_"), (kind, name)
        assert value == "the caller's"
    assert len({name for name, _ in seen.values()}) == len(KINDS)


def test_a_pool_of_no_threads_is_a_config_error_naming_the_key_and_file(tmp_path):
    path = write_config(f"thr_{uuid.uuid4().hex[:8]}", server_extra=", threads: {media: 0}")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert "server.threads.media" in str(e.value) and str(path) in str(e.value)


def test_slow_media_decodes_do_not_hold_up_a_text_request(monkeypatch):
    """More requests with an image than asyncio's default executor has threads, each decode held:
    with one shared pool (as before server.threads) every thread waited in a decode and a text
    request never had its body parsed; with the media threads (2 here) it is answered at once, and
    the held requests are answered once their decodes go on."""
    default_threads = min(32, (os.cpu_count() or 1) + 4)  # asyncio's default executor
    held = default_threads + 2
    gate, entered = threading.Event(), threading.Semaphore(0)
    decode_all = MediaDecoder.decode_all

    def held_decode(self, encoded):
        entered.release()
        assert gate.wait(120), "the test never let the decodes go on"
        return decode_all(self, encoded)

    monkeypatch.setattr(MediaDecoder, "decode_all", held_decode)
    path = write_config(f"thr_{uuid.uuid4().hex[:8]}", timeout_s=120.0, server_extra=", threads: {media: 2}")
    with serve_config(path) as srv:
        model = srv.orchestrator.served_model_name
        headers = {"Authorization": f"Bearer {API_KEY}"}

        def ask(content) -> httpx.Response:
            body = {"model": model, "max_tokens": 8, "messages": [{"role": "user", "content": content}]}
            return httpx.post(srv.url + "/v1/chat/completions", json=body, headers=headers, timeout=120)

        image = [{"type": "image_url", "image_url": {"url": flat_png_data_url(8, 8)}}]
        with ThreadPoolExecutor(held) as clients:
            waiting = [clients.submit(ask, image + [{"type": "text", "text": f"n{i}"}]) for i in range(held)]
            try:
                for _ in range(2):  # both media threads are in a held decode
                    assert entered.acquire(timeout=60), "no decode started"
                text = ask("hello")  # its parse, template and tokenize: the request threads
                assert text.status_code == 200, text.text
                assert text.json()["choices"][0]["message"]["content"] == echo("hello", 8)
                assert not any(f.done() for f in waiting), "a held request was answered before its decode"
            finally:
                gate.set()
            answered = [f.result() for f in waiting]
    assert [r.status_code for r in answered] == [200] * held, [r.text for r in answered if r.status_code != 200]


def test_start_threads_starts_every_pools_threads_before_any_work():
    pools = ThreadPools(ThreadsConfig(request=3, media=2, response=1, realtime_events=2))
    try:
        pools.start_threads()
        names = [t.name for t in threading.enumerate()]
        started = {kind: sum(name.startswith(f"omni-{kind}_") for name in names) for kind in KINDS}
        assert started == pools.sizes

        async def where() -> str:
            return await pools.request(lambda: threading.current_thread().name)

        assert asyncio.run(where()).startswith("omni-request_")  # they take work as before
    finally:
        pools.close()


def test_closing_lets_a_start_that_still_waits_go_at_once():
    pools = ThreadPools(ThreadsConfig(request=2))
    held = threading.Event()
    holder = threading.Thread(target=asyncio.run, args=(pools.request(held.wait, 30),), daemon=True)
    holder.start()  # one of the two threads busy: the start's second job finds no thread
    starting = threading.Thread(target=pools.start_threads, kwargs={"timeout": 30}, daemon=True)
    starting.start()
    try:
        while sum(t.name.startswith("omni-request_") for t in threading.enumerate()) < 2:
            held.wait(0.01)  # (a poll: the start's first job has its thread once there are two)
        pools.close()
        starting.join(10)
        assert not starting.is_alive(), "close() did not let the waiting start go"
    finally:
        held.set()
        holder.join(10)


def test_a_start_that_times_out_returns_and_work_still_runs():
    pools = ThreadPools(ThreadsConfig(request=2))
    held = threading.Event()
    holder = threading.Thread(target=asyncio.run, args=(pools.request(held.wait, 30),), daemon=True)
    holder.start()  # one of the two threads busy for the whole start: its barrier cannot fill
    try:
        pools.start_threads(timeout=0.5)  # returns: the server's start does not fail on it
        held.set()
        holder.join(10)

        async def where() -> str:
            return await pools.request(lambda: threading.current_thread().name)

        assert asyncio.run(where()).startswith("omni-request_")
    finally:
        held.set()
        pools.close()
