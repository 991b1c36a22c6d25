"""Where a stage's messages go: its downstream stages' inboxes and the orchestrator.

A downstream peer gets each request's stream from its first message (its StreamStart) or not at
all. When a peer's connection drops (its process died; the supervisor restarts it), the socket to
it is replaced by a fresh one (linger 0, so what was queued for the dead process is discarded) and
the requests whose streams had started are not continued: the restarted process never sees the
tail of a request it has no head for, and never gets a message that was queued for its
predecessor. The orchestrator fails those requests itself when it sees the stage die.

A downstream stage with several replicas has one peer per replica. A request's stream starts (its
StreamStart) at the replica its ``route`` names (the orchestrator's choice, carried by the
StreamStart) and every later message of it follows to that same replica, because a peer sends only
the streams it started: the talker's per-request state and its own prefix hits stay in one
process.

No send blocks the stage's loop for long: a peer that stopped reading (a hung or paused process)
fills its queue, and a send then waits at most ``send_timeout_s`` for room before it raises
:class:`SendTimeout` (the caller fails the request the message carried); while that peer's queue
stays full, later sends to it fail at once instead of waiting again, so the stage goes on serving
the requests that do not need that peer.

An engine step's outputs travel together (:meth:`Outbox.one_step`): those for the orchestrator
that carry no tensors go as one ``StageOutputs`` message at the step's end, as vLLM's engine core
sends a step's outputs, instead of one message per streaming request per step, each a receive and
a decode on the server's event loop. What goes downstream in the step waits with them and goes
right after, so the orchestrator still hears of an output before a downstream stage can answer it.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from omni_cache.wire.messages import MAX_STEP_OUTPUTS, StageOutput, StageOutputs, StreamStart
from omni_cache.wire.transport import Codec, MessageTooLarge, Sender, SendTimeout

logger = logging.getLogger(__name__)

#: A send waits for room in a full queue at most this fraction of ``server.heartbeat_timeout_s``:
#: a stage held up by a peer that stopped reading must not look hung itself.
SEND_TIMEOUT_FRACTION = 0.25


def send_timeout_s(heartbeat_timeout_s: float) -> float:
    """How long one send may wait for room in its peer's queue."""
    return heartbeat_timeout_s * SEND_TIMEOUT_FRACTION


class TimedSender:
    """A :class:`Sender` whose sends wait at most ``timeout_s`` for room, and not at all while
    the peer's queue has stayed full since a send to it timed out (until a send gets through).
    ``what`` names the peer in errors ("stage 'decoder'")."""

    def __init__(self, sender: Sender, timeout_s: float | None, what: str) -> None:
        self.sender, self.timeout_s, self.what = sender, timeout_s, what
        self.full = False
        self.timeouts = 0

    def send(self, msg: Any, tensors: dict[str, torch.Tensor] | None = None) -> None:
        if self.timeout_s is None:
            self.sender.send(msg, tensors)
            return
        try:
            self.sender.send(msg, tensors, timeout_s=0.0 if self.full else self.timeout_s)
        except SendTimeout:
            if not self.full:
                logger.warning(
                    "%s stopped taking messages (its queue stayed full for %g s): what "
                    "is sent to it fails until it reads again",
                    self.what,
                    self.timeout_s,
                )
            self.full = True
            self.timeouts += 1
            raise SendTimeout(
                f"{self.what} took no message for {self.timeout_s:g} s (its queue is full: it stopped reading)"
            ) from None
        self.full = False


class Peer:
    """The socket to one replica of a downstream stage, and the requests whose streams it has
    started."""

    def __init__(
        self,
        ctx: zmq.Context,
        name: str,
        address: str,
        codec: Codec,
        auth: Any,
        replica: int = 0,
        send_timeout_s: float | None = None,
        what: str = "",
    ) -> None:
        self.ctx, self.name, self.address, self.codec, self.auth = ctx, name, address, codec, auth
        self.replica = replica
        self.send_timeout_s = send_timeout_s
        self.what = what or f"stage {name!r}"
        self.streams: set[str] = set()
        self.resets = 0
        self.send_timeouts = 0  # over every socket this peer had
        self._open()

    def _open(self) -> None:
        self.sender = Sender(self.ctx, self.address, self.codec, auth=self.auth)
        self.link = TimedSender(self.sender, self.send_timeout_s, self.what)
        self.monitor = self.sender.socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)

    def send(self, msg: StageOutput, tensors: dict[str, torch.Tensor] | None) -> None:
        """Raises SendTimeout when the peer's queue stays full: the message's stream is broken
        (nothing more of it goes to this peer), its request must fail."""
        if isinstance(msg, StreamStart):
            self.streams.add(msg.request_id)
        elif msg.request_id not in self.streams:
            return  # its stream started before this peer's current process
        try:
            self.link.send(msg, tensors)
        except SendTimeout:
            self.send_timeouts += 1
            self.streams.discard(msg.request_id)
            raise
        if msg.finished:
            self.streams.discard(msg.request_id)

    def check(self) -> None:
        """Reset the socket if the peer's connection dropped since the last check."""
        dropped = False
        while True:
            try:
                event = recv_monitor_message(self.monitor, flags=zmq.NOBLOCK)
            except zmq.Again:
                break
            dropped |= event["event"] == zmq.EVENT_DISCONNECTED
        if dropped:
            logger.warning(
                "stage %s went away: dropping what was queued for it and %d request stream(s) it had started",
                self.name,
                len(self.streams),
            )
            self.close()
            self.streams.clear()
            self.resets += 1
            self._open()

    def close(self) -> None:
        self.sender.socket.disable_monitor()
        self.monitor.close(linger=0)
        self.sender.close()


@dataclass
class StepSends:
    """What one engine step has waiting to be sent at its end (:meth:`Outbox.one_step`);
    ``failed(request_id, exc)`` fails a request whose message could not go."""

    failed: Callable[[str, BaseException], None]
    outputs: list[StageOutput] = field(default_factory=list)  # to the orchestrator, no tensors
    downstream: list[tuple[StageOutput, dict[str, torch.Tensor] | None]] = field(default_factory=list)


class Outbox:
    """``downstream``: each downstream stage's replica addresses, by replica index.
    ``send_timeout_s``: how long a send waits for room in a full queue (None: as long as it
    takes); then it raises :class:`SendTimeout`."""

    def __init__(
        self,
        ctx: zmq.Context,
        codec: Codec,
        downstream: dict[str, list[str]],
        orchestrator: str | None,
        auth: Any = None,
        send_timeout_s: float | None = None,
    ) -> None:
        self.peers = [
            Peer(
                ctx,
                name,
                addr,
                codec,
                auth,
                replica=i,
                send_timeout_s=send_timeout_s,
                what=f"stage {name!r}" + (f" replica {i}" if len(addrs) > 1 else ""),
            )
            for name, addrs in downstream.items()
            for i, addr in enumerate(addrs)
        ]
        self._replicas = {name: len(addrs) for name, addrs in downstream.items()}
        self.orchestrator_sender = Sender(ctx, orchestrator, codec, auth=auth) if orchestrator else None
        self.orchestrator = (
            TimedSender(self.orchestrator_sender, send_timeout_s, "the orchestrator")
            if self.orchestrator_sender is not None
            else None
        )
        self._step: StepSends | None = None  # within one_step

    @contextlib.contextmanager
    def one_step(self, failed: Callable[[str, BaseException], None]) -> Iterator[None]:
        """Within it (one engine step), outputs to the orchestrator without tensors and messages
        downstream wait; at its end the outputs go as one message, then the downstream messages
        in the order they were made. A send that fails there fails its requests through
        ``failed(request_id, exc)`` (the runner's ``fail``), as it would have failed the request
        sending it."""
        step = self._step = StepSends(failed)
        try:
            yield
        finally:
            self._step = None
            self._send_outputs(step)
            for msg, tensors in step.downstream:
                try:
                    self._send_downstream(msg, tensors)
                except Exception as exc:  # noqa: BLE001 -- SendTimeout and the like: that request fails
                    step.failed(msg.request_id, exc)

    def to_orchestrator(self, msg: Any, tensors: dict[str, torch.Tensor] | None = None) -> None:
        """Raises SendTimeout when the orchestrator's queue stays full (outside a step; within
        one, a waiting output's failure fails its request at the step's end)."""
        if self.orchestrator is None:
            return
        if self._step is not None:
            if type(msg) is StageOutput and not tensors:
                self._step.outputs.append(msg)
                return
            self._send_outputs(self._step)  # what the step made before this goes first
        self.orchestrator.send(msg, tensors)

    def _send_outputs(self, step: StepSends) -> None:
        outputs, step.outputs = step.outputs, []
        if self.orchestrator is None or not outputs:
            return
        for i in range(0, len(outputs), MAX_STEP_OUTPUTS):
            part = outputs[i : i + MAX_STEP_OUTPUTS]
            try:
                self.orchestrator.send(part[0] if len(part) == 1 else StageOutputs(stage=part[0].stage, outputs=part))
            except MessageTooLarge:  # together past max_message_bytes: each alone (one may still be)
                for out in part:
                    try:
                        self.orchestrator.send(out)
                    except Exception as exc:  # noqa: BLE001 -- that request fails
                        step.failed(out.request_id, exc)
            except Exception as exc:  # noqa: BLE001 -- SendTimeout: every request of the message fails
                for request_id in dict.fromkeys(out.request_id for out in part):
                    step.failed(request_id, exc)

    def to_downstream(self, msg: StageOutput, tensors: dict[str, torch.Tensor] | None = None) -> None:
        """Send to every downstream stage: a StreamStart to the replica its ``route`` names, the
        rest of the stream where its StreamStart went. ValueError (this request fails alone) for a
        route naming a replica the stage does not have."""
        route = msg.route if isinstance(msg, StreamStart) else None
        for name, index in (route or {}).items():
            count = self._replicas.get(name)
            if count is not None and not 0 <= index < count:
                raise ValueError(f"route names replica {index} of stage {name!r}, which has {count}")
        if self._step is not None:
            self._step.downstream.append((msg, tensors))
            return
        self._send_downstream(msg, tensors)

    def _send_downstream(self, msg: StageOutput, tensors: dict[str, torch.Tensor] | None) -> None:
        route = msg.route if isinstance(msg, StreamStart) else None
        for peer in self.peers:
            if route is not None and peer.replica != route.get(peer.name, 0):
                continue
            peer.send(msg, tensors)

    def forget(self, request_id: str) -> None:
        """The request ended here early: nothing more of it goes downstream."""
        if self._step is not None:
            self._step.downstream = [(m, t) for m, t in self._step.downstream if m.request_id != request_id]
        for peer in self.peers:
            peer.streams.discard(request_id)

    def check_peers(self) -> None:
        for peer in self.peers:
            peer.check()

    @property
    def peer_resets(self) -> int:
        return sum(p.resets for p in self.peers)

    @property
    def send_timeouts(self) -> int:
        """Sends that found their peer's queue full (downstream stages and the orchestrator)."""
        return sum(p.send_timeouts for p in self.peers) + (
            self.orchestrator.timeouts if self.orchestrator is not None else 0
        )

    def close(self) -> None:
        for peer in self.peers:
            peer.close()
        if self.orchestrator_sender is not None:
            self.orchestrator_sender.close()
