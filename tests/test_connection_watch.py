"""The connection watch must never stop the ZMQ context it watches on.

libzmq reports a socket's events with a blocking send from the context's I/O thread; a monitor
whose reading end closed while its socket could still report blocks that thread for good, and
every connection of the context with it (the server then heard no stage at all after a
hand-started stage was killed: tests/test_external_stages.py failed so now and then in CI).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

# Run in a child process: a context whose I/O thread is blocked cannot be destroyed, so the
# failure would hang the test process instead of failing the test.
SCENARIO = textwrap.dedent("""
    import asyncio, os, socket
    import zmq, zmq.asyncio
    from omni_cache.runtime.supervision.connection_watch import ConnectionWatch

    async def main():
        ctx = zmq.asyncio.Context()
        inbox = ctx.socket(zmq.PULL)
        port = inbox.bind_to_random_port("tcp://127.0.0.1")
        out = ctx.socket(zmq.PUSH)
        out.connect(f"tcp://127.0.0.1:{port}")
        probe = socket.socket()
        probe.bind(("127.0.0.1", 0))
        refused = probe.getsockname()[1]
        probe.close()  # nothing listens there: every connect is refused and retried
        events = []
        watch = ConnectionWatch(lambda name, event: events.append(event))
        for i in range(300):
            # What the server does with a down stage's socket: unwatch it, close it at once.
            sock = ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.RECONNECT_IVL, 1)
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1)
            sock.connect(f"tcp://127.0.0.1:{refused}")
            watch.watch("stage", sock)
            seen = len(events)
            while len(events) < seen + 2:  # it is reporting retries, one a millisecond
                await asyncio.sleep(0.001)
            watch.unwatch("stage")
            sock.close(linger=0)
            await asyncio.sleep(0.01)  # the watch's task ends and closes its monitor
            await out.send(b"%d" % i)
            try:
                assert await asyncio.wait_for(inbox.recv(), 5) == b"%d" % i
            except asyncio.TimeoutError:
                print(f"the context stopped carrying messages after {i} replacements", flush=True)
                os._exit(3)
        for task in watch.stop():
            await asyncio.gather(task, return_exceptions=True)
        ctx.destroy(linger=0)
        print("carried", i + 1, flush=True)

    asyncio.run(main())
""")


def test_unwatching_then_closing_a_refused_connection_keeps_the_context_carrying():
    # Before the fix the context stopped after 21 to 80 replacements (6 runs).
    done = subprocess.run([sys.executable, "-c", SCENARIO], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    assert "carried 300" in done.stdout
