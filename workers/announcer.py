"""A stage's announcements: StageReady to the orchestrator, now and every heartbeat interval.

They come from a thread with its own socket, so they keep coming while the stage loop is busy in
a long model step: they say the process is alive and reachable, which is what the orchestrator
needs to tell a stage started elsewhere from a dead one. Each also says whether the stage's loop
is moving (``busy``, ``stalled_s``: workers/loop_progress.py), so a process that is alive but
whose loop is stuck is noticed too. The socket queues nothing while the orchestrator is away
(``ZMQ_IMMEDIATE`` + non-blocking sends): a server that starts later gets the next announcement,
not a backlog of stale ones.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import uuid
from typing import Any

import msgspec
import zmq

from omni_cache.wire.messages import PROTOCOL_VERSION, StageReady
from omni_cache.wire.transport import Codec
from workers.loop_progress import LoopProgress

logger = logging.getLogger(__name__)


class Announcer:
    def __init__(
        self,
        ctx: zmq.Context,
        codec: Codec,
        orchestrator: str,
        stage: str,
        *,
        interval_s: float,
        max_model_len: int = 0,
        auth: Any = None,
        replica: int = 0,
        progress: LoopProgress | None = None,
        config_hash: str = "",
    ) -> None:
        """``progress``: the stage loop's (None: a loop that is never stuck, e.g. a test's)."""
        self.message = StageReady(
            stage=stage,
            pid=os.getpid(),
            replica=replica,
            max_model_len=max_model_len or 0,
            incarnation=uuid.uuid4().hex,
            host=socket.gethostname(),
            protocol=PROTOCOL_VERSION,
            config_hash=config_hash,
        )
        self.interval_s = interval_s
        self.progress = progress
        self._codec = codec
        self._sock = ctx.socket(zmq.PUSH)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.IMMEDIATE, 1)
        self._sock.setsockopt(zmq.SNDHWM, 1)
        if auth is not None:
            auth.secure(self._sock, bind=False)
        self._sock.connect(orchestrator)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"omni-cache-announce-{stage}", daemon=True)

    def start(self) -> Announcer:
        self._thread.start()
        return self

    def beat(self) -> StageReady:
        """The announcement as of now: with how long ago the loop last moved."""
        if self.progress is None:
            return self.message
        busy, stalled_s = self.progress.report()
        return msgspec.structs.replace(self.message, busy=busy, stalled_s=round(stalled_s, 3))

    def _run(self) -> None:
        while True:
            try:
                self._sock.send_multipart(self._codec.encode(self.beat()), flags=zmq.NOBLOCK, copy=True)
            except zmq.Again:
                pass  # no orchestrator connected right now: the next beat tries again
            except zmq.ZMQError as e:
                if self._stop.is_set():
                    break
                logger.warning("stage %s: announcement failed: %s", self.message.stage, e)
            if self._stop.wait(self.interval_s):
                break
        self._sock.close(linger=0)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)
