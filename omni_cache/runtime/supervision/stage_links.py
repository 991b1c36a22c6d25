"""The orchestrator's sockets: its inbox (one PULL socket every stage sends to) and one PUSH
socket to each stage replica's inbox, all on one ZMQ context (CURVE-authenticated when
``server.stage_auth_key_file`` is set, :mod:`omni_cache.wire.stage_auth`).

A replica that went down gets a fresh socket (:meth:`StageLinks.reset`): its old one is closed with
linger 0, so what was queued for the dead process is dropped instead of reaching its next
incarnation as stale requests. Connections to stages started elsewhere are watched by the
supervisor (their closing is the quickest sign such a process died).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from omni_cache.config import PipelineConfig
from omni_cache.config.replicas import Replica
from omni_cache.runtime.supervision.supervisor import StageSupervisor
from omni_cache.wire.messages import MESSAGE_TYPES
from omni_cache.wire.stage_auth import StageAuth, load_stage_auth
from omni_cache.wire.transport import AsyncReceiver, AsyncSender, Codec

logger = logging.getLogger(__name__)


class StageLinks:
    """``replicas`` (replica name -> its address) is read when a socket is made, so addresses
    that Ray placement fills in later are the ones connected to; ``external``: the stages whose
    connections the supervisor watches; ``run_secret``: the run's stage key where the server
    made one (Ray placement, :attr:`omni_cache.runtime.supervision.placement.StagePlacement.run_secret`),
    else the config's key file, if any, secures the sockets."""

    def __init__(
        self,
        config: PipelineConfig,
        replicas: Mapping[str, Replica],
        supervisor: StageSupervisor,
        external: set[str],
        run_secret: str | None = None,
    ) -> None:
        self._config = config
        self._run_secret = run_secret
        self._replicas = replicas
        self._supervisor = supervisor
        self._external = external
        self.codec = Codec(MESSAGE_TYPES, max_message_bytes=config.server.max_message_bytes)
        self._ctx: zmq.asyncio.Context | None = None
        self._auth: Any = None
        self._inbox: AsyncReceiver | None = None
        self._senders: dict[str, AsyncSender] = {}
        self._closing = False

    def open(self) -> None:
        """The context, with its authenticator started before anything binds."""
        self._ctx = zmq.asyncio.Context()
        self._auth = StageAuth(self._run_secret) if self._run_secret else load_stage_auth(self._config)
        if self._auth is not None:
            self._auth.guard(self._ctx)

    def bind_inbox(self, address: str) -> str:
        """Bind the inbox at ``address``; the address bound (the port the OS picked for
        ``tcp://host:*``)."""
        assert self._ctx is not None, "open() first"
        self._inbox = AsyncReceiver(self._ctx, address, self.codec, bind=True, auth=self._auth)
        return self._inbox.address

    def connect_all(self) -> None:
        """A socket to every replica."""
        for name in self._replicas:
            self._senders[name] = self._new_sender(name)

    def _new_sender(self, name: str) -> AsyncSender:
        assert self._ctx is not None
        replica = self._replicas[name]
        sender = AsyncSender(self._ctx, replica.address, self.codec, auth=self._auth)
        if replica.stage in self._external:
            self._supervisor.watch_connection(name, sender.socket)
        return sender

    def reset(self, name: str) -> None:
        """Replica ``name`` went down: drop what is queued for it (linger 0) and connect anew."""
        old = self._senders.pop(name, None)
        self._supervisor.unwatch_connection(name)
        if old is not None:
            with contextlib.suppress(Exception):
                old.close()
        if not self._closing and self._ctx is not None:
            self._senders[name] = self._new_sender(name)

    async def send(
        self, name: str, msg: msgspec.Struct, tensors: Mapping[str, Any] | None = None, *, timeout: float | None = 5.0
    ) -> bool:
        """Send to replica ``name``; False (logged) when it could not be sent in ``timeout``.
        Raises :class:`~omni_cache.wire.transport.MessageTooLarge` for a message over the limit."""
        sender = self._senders.get(name)
        if sender is None:
            return False
        try:
            await asyncio.wait_for(sender.send(msg, tensors), timeout)
            return True
        except (TimeoutError, zmq.ZMQError) as e:
            logger.warning("could not send %s to stage %s: %s", type(msg).__name__, name, e or "timeout")
            return False

    async def recv(self) -> tuple[Any, dict[str, Any]] | None:
        """The next message to the inbox (None: one that did not validate and was dropped)."""
        assert self._inbox is not None
        return await self._inbox.recv()

    @property
    def closed(self) -> bool:
        return self._closing

    def close(self) -> None:
        self._closing = True
        for sender in self._senders.values():
            with contextlib.suppress(Exception):
                sender.close()
        self._senders.clear()
        if self._inbox is not None:
            with contextlib.suppress(Exception):
                self._inbox.close()
        if self._auth is not None:
            with contextlib.suppress(Exception):
                self._auth.stop()
        if self._ctx is not None:
            with contextlib.suppress(Exception):
                self._ctx.destroy(linger=0)
