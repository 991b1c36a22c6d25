"""A fresh server imports nothing, and builds no pydantic model, on its event loop when the first
request of each kind comes.

An import on the event loop holds every client: the first streamed answer used to import anyio's
asyncio back end (starlette's task group; ~40 ms on a 2-vCPU Zen 3) and the first media URL
httpcore (httpx's transport; ~50 ms), each time a server was new. tests/first_use_server.py runs a
fresh server of fake stages in a process of its own and records what is imported after it is
ready and on which thread; here one request of each kind is sent to it (the chat API streamed and
not, text, audio out, an image as a data: URL and as an http URL, audio in, a refused body, the
realtime API with and without server VAD, /health, /v1/models, /metrics), and the imports its
loop thread made are listed. Imports on worker threads (an image decoder's plug-ins) do not hold
the loop and are allowed. The OpenAI SDK's models are built on first use (``defer_build``): the
first realtime session built its events' classes on the loop (up to 53 ms on a 2-vCPU Zen 4), so
builds are recorded too.
"""

from __future__ import annotations

import asyncio
import base64
import json
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
from media_samples import clip_b64, png_data_url, served_file

from benchmarks.realtime_client import append_audio, connect, next_event, read_answer
from benchmarks.speech_clips import speech

HELPER = Path(__file__).with_name("first_use_server.py")
LOOP_THREAD = "omni-cache-http"


def chat_requests(model: str, image_url: str) -> list[dict]:
    user = {"role": "user", "content": "hello there"}
    image = lambda url: {  # noqa: E731
        "role": "user",
        "content": [{"type": "text", "text": "what is it"}, {"type": "image_url", "image_url": {"url": url}}],
    }
    audio_in = {
        "role": "user",
        "content": [{"type": "input_audio", "input_audio": {"data": clip_b64(0.5), "format": "wav"}}],
    }
    base = {"model": model, "max_tokens": 4}
    return [
        base | {"messages": [user]},
        base | {"messages": [user], "stream": True},
        base | {"messages": [user], "modalities": ["text", "audio"], "audio": {"voice": "default", "format": "wav"}},
        base | {"messages": [user], "modalities": ["text", "audio"], "stream": True},
        base | {"messages": [image(png_data_url(16, 16))]},
        base | {"messages": [image(image_url)], "stream": True},
        base | {"messages": [audio_in]},
        base | {"messages": [user], "temperature": "hot"},  # refused: 400
    ]


async def realtime_turns(url: str, model: str, api_key: str) -> None:
    async with connect(url, model, api_key) as conn:  # text and an audio turn, turns committed by hand
        assert (await next_event(conn)).type == "session.created"
        await conn.session.update(
            session={"type": "realtime", "max_output_tokens": 4, "audio": {"input": {"turn_detection": None}}}
        )
        assert (await next_event(conn)).type == "session.updated"
        await conn.conversation.item.create(
            item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}
        )
        await append_audio(conn, speech(1.0, seed=1))
        await conn.input_audio_buffer.commit()
        await conn.response.create()
        # (4 tokens: "incomplete", cut at max_output_tokens)
        assert (await read_answer(conn, timeout=60)).done.response.status in ("completed", "incomplete")
    async with connect(url, model, api_key) as conn:  # server VAD (the default): speech, then silence
        assert (await next_event(conn)).type == "session.created"
        await append_audio(conn, np.concatenate([speech(1.5, seed=2), np.zeros(24000, np.float32)]))
        while (await next_event(conn, 60)).type != "input_audio_buffer.speech_stopped":
            pass


def test_the_first_request_of_each_kind_imports_nothing_on_the_event_loop():
    proc = subprocess.Popen(
        [sys.executable, str(HELPER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1
    )
    try:
        ready = json.loads(proc.stdout.readline())
        url, model, key = ready["url"], ready["model"], ready["api_key"]
        headers = {"Authorization": f"Bearer {key}"}
        statuses = []
        png = base64.b64decode(png_data_url(32, 24, seed=3).split(",", 1)[1])
        with (
            served_file(png, "image/png", "cat.png") as image_url,
            httpx.Client(base_url=url, headers=headers, timeout=60) as http,
        ):
            for path in ("/health", "/v1/models", "/metrics"):
                statuses.append(http.get(path).status_code)
            for body in chat_requests(model, image_url):
                with http.stream("POST", "/v1/chat/completions", json=body) as r:
                    r.read()
                    statuses.append(r.status_code)
            asyncio.run(asyncio.wait_for(realtime_turns(url, model, key), 120))
        proc.stdin.write("done\n")
        imports = json.loads(proc.stdout.readline())
    finally:
        proc.kill()
        proc.wait(30)
    assert statuses == [200] * 10 + [400], statuses  # every kind was served (the last one refused)
    on_loop = [i for i in imports if i["thread"] == LOOP_THREAD]
    assert not on_loop, "imported or built on the event loop by a first request:\n" + "\n".join(
        f"{i['module']}: {' < '.join(reversed(i['by']))}" for i in on_loop
    )
