"""The orchestrator's inbox pump gives the event loop a turn between stage messages (issue 52).

pyzmq's asyncio receive completes at once while messages are waiting (its future is done before
it is awaited), so without a turn per message a burst of stage outputs runs back to back ahead of
everything else the loop has ready (an HTTP request, /health). The receive here is pyzmq's own,
over a real PUSH/PULL pair (inproc).
"""

from __future__ import annotations

import asyncio
import logging

import zmq
import zmq.asyncio

from omni_cache.runtime.supervision.stage_fleet import pump

BURST = 40


def test_work_that_became_ready_runs_before_a_burst_of_stage_messages_ends():
    async def main() -> tuple[list[int], int]:
        ctx = zmq.asyncio.Context()
        pull = ctx.socket(zmq.PULL)
        push = ctx.socket(zmq.PUSH)
        # inproc: a send puts the message in the PULL socket's pipe, so once the sends return the
        # whole burst is waiting there.
        pull.bind("inproc://inbox")
        push.connect("inproc://inbox")
        for i in range(BURST):
            await push.send_multipart([str(i).encode()])
        handled: list[int] = []
        seen_at: list[int] = []

        async def recv() -> tuple[int, dict]:
            (frame,) = await pull.recv_multipart()
            return int(frame), {}

        task = asyncio.create_task(pump(recv, lambda msg, tensors: handled.append(msg), lambda: False))
        # Ready now, as a request's bytes would be: it must not wait for the burst to be handled.
        asyncio.get_running_loop().call_soon(lambda: seen_at.append(len(handled)))
        while len(handled) < BURST:
            await asyncio.sleep(0.01)
        task.cancel()
        push.close(0)
        pull.close(0)
        ctx.term()
        return handled, seen_at[0]

    handled, seen_at = asyncio.run(main())
    assert handled == list(range(BURST))
    assert seen_at <= 2, f"the ready callback ran only after {seen_at} of {BURST} messages"


def test_a_message_the_handler_fails_on_is_logged_and_the_next_is_handled(caplog):
    async def main() -> list[int]:
        items = [(1, {}), None, (2, {}), (3, {})]
        handled: list[int] = []

        async def recv():
            if items:
                return items.pop(0)
            raise zmq.ZMQError(zmq.ETERM)  # the inbox closed

        def handle(msg: int, tensors: dict) -> None:
            if msg == 2:
                raise ValueError("bad message")
            handled.append(msg)

        await pump(recv, handle, lambda: not items)
        return handled

    with caplog.at_level(logging.ERROR):
        assert asyncio.run(main()) == [1, 3]
    assert "error handling int from a stage" in caplog.text
