"""Wire transport between stages: typed msgspec headers plus zero-copy tensor frames.

One message on the wire is one multipart ZMQ message::

    frame 0      msgpack(Envelope(msg=<tagged message Struct>, tensors=[TensorMeta, ...]))
    frame 1..n   the raw bytes of each tensor, in the order of ``Envelope.tensors``

Nothing received is ever unpickled: the header is decoded by msgspec against the caller's
declared message types (a tagged union), and tensors are rebuilt with ``torch.frombuffer``
from a fixed dtype table. Anything that does not validate raises ``BadMessage``; the
receivers log it, count it in ``dropped`` and keep going, so a broken or hostile peer can
never take a stage down.

Memory contracts (the price of zero copy):

* Sending: tensor frames of 64 KiB or more are handed to zmq by reference (``copy=False``);
  zmq's IO thread reads them *after* ``send()`` returns. Do not write to a sent tensor
  until zmq is done with it (pass ``track=True`` and wait on the returned
  ``zmq.MessageTracker`` if you reuse buffers, e.g. pinned staging tensors).
  Smaller frames are copied by pyzmq, which is cheaper than tracking them.
* Receiving: tensors share memory with the received zmq frames (no copy). Treat them as
  read-only, or ``.clone()`` them before writing in place: over ``inproc://`` the frame
  may even be the *sender's* tensor memory.
"""

from __future__ import annotations

import logging
import math
import time
import typing
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Generic, TypeVar

import msgspec
import torch
import zmq
import zmq.asyncio

# pyzmq imports this on the first zero-copy send of a frame past its copy threshold: on the
# server's event loop, during some first request (tests/test_first_use_imports.py); imported here.
import zmq.utils.garbage  # noqa: F401

logger = logging.getLogger(__name__)

DEFAULT_MAX_MESSAGE_BYTES = 256 * 2**20
DEFAULT_HWM = 1000  # messages queued per socket before send blocks (backpressure)
DEFAULT_LINGER_MS = 0  # closing drops unsent messages instead of hanging on a dead peer

# Fixed name <-> dtype table: the only dtypes accepted on the wire. Names are looked up,
# never evaluated.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_DTYPE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}

M = TypeVar("M")


class BadMessage(ValueError):
    """A received message that does not validate; the text says why."""


class MessageTooLarge(ValueError):
    """An outgoing message would exceed the codec's ``max_message_bytes``."""


class SendTimeout(RuntimeError):
    """A message could not be queued in time: the peer's queue stayed at its high-water mark (the
    peer stopped reading). Nothing of the message was sent."""


class TensorMeta(msgspec.Struct, array_like=True):
    """How to rebuild one tensor frame: its name, dtype name (a DTYPES key) and shape (each
    dimension a torch size: non-negative, within int64; declared, so a header with another one
    fails to decode)."""

    name: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    dtype: str
    shape: list[Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]]


class Envelope(msgspec.Struct, Generic[M]):
    """Frame 0: the typed message plus the description of the tensor frames that follow.

    Generic over the message type so that the decoder validates ``msg`` against the
    caller's tagged union (``Envelope[Union[A, B]]``) instead of accepting anything.
    """

    msg: M
    tensors: list[TensorMeta] = []


def _as_buffer(frame: zmq.Frame | bytes | memoryview) -> memoryview:
    buf = frame.buffer if isinstance(frame, zmq.Frame) else memoryview(frame)
    return buf.cast("B") if buf.format != "B" or buf.ndim != 1 else buf


class Codec:
    """Encodes/decodes one message type family to/from a list of ZMQ frames.

    ``message_types``: a tuple of msgspec Structs (declared with ``tag=True`` when there is
    more than one), a single Struct, or a ``Union`` of them.
    ``max_message_bytes``: limit on the whole message (header plus all tensor frames),
    enforced on both ends.
    """

    def __init__(
        self,
        message_types: tuple[type[msgspec.Struct], ...] | type,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        if isinstance(message_types, tuple):
            types = message_types
        elif typing.get_origin(message_types) is typing.Union:
            types = typing.get_args(message_types)
        else:
            types = (message_types,)
        if not types or not all(isinstance(t, type) and issubclass(t, msgspec.Struct) for t in types):
            raise TypeError(f"message_types must be msgspec Struct types, got {message_types!r}")
        self.message_types: tuple[type[msgspec.Struct], ...] = types
        self.max_message_bytes = max_message_bytes
        union = types[0] if len(types) == 1 else typing.Union[types]  # noqa: UP007 (runtime Union)
        self._encoder = msgspec.msgpack.Encoder()
        # msgspec raises TypeError here if the union is ambiguous (e.g. Structs without tag=True).
        self._decoder = msgspec.msgpack.Decoder(Envelope[union])

    def encode(self, msg: msgspec.Struct, tensors: Mapping[str, torch.Tensor] | None = None) -> list:
        """Frames for ``send_multipart``: header bytes, then one memoryview per tensor.

        Contiguous CPU tensors are exposed as views of their own memory (no copy); others are
        made contiguous first (one copy). GPU tensors are refused: the device-to-host copy
        belongs to the caller, who can overlap it with compute.
        """
        if not isinstance(msg, self.message_types):
            raise TypeError(f"{type(msg).__name__} is not one of this codec's message types")
        metas: list[TensorMeta] = []
        buffers: list[memoryview] = []
        for name, tensor in (tensors or {}).items():
            dtype_name = _DTYPE_NAMES.get(tensor.dtype)
            if dtype_name is None:
                raise TypeError(f"tensor {name!r}: dtype {tensor.dtype} is not supported on the wire")
            if tensor.device.type != "cpu":
                raise ValueError(f"tensor {name!r} is on {tensor.device}; move it to CPU before sending")
            flat = tensor.detach().contiguous().reshape(-1)
            # View as bytes inside torch (numpy has no bfloat16), then let numpy expose the
            # buffer protocol. The numpy array keeps the tensor alive while zmq holds the frame.
            buffers.append(memoryview(flat.view(torch.uint8).numpy()))
            metas.append(TensorMeta(name, dtype_name, list(tensor.shape)))
        header = self._encoder.encode(Envelope(msg=msg, tensors=metas))
        total = len(header) + sum(b.nbytes for b in buffers)
        if total > self.max_message_bytes:
            raise MessageTooLarge(f"message is {total} bytes, limit is {self.max_message_bytes}")
        return [header, *buffers]

    def decode(self, frames: list[zmq.Frame | bytes | memoryview]) -> tuple[Any, dict[str, torch.Tensor]]:
        """``(msg, tensors)`` from received frames; raises ``BadMessage`` if anything is off.

        The returned tensors share memory with ``frames`` (see the module docstring).
        """
        if not frames:
            raise BadMessage("no frames")
        buffers = [_as_buffer(f) for f in frames]
        total = sum(b.nbytes for b in buffers)
        if total > self.max_message_bytes:
            raise BadMessage(f"message is {total} bytes, limit is {self.max_message_bytes}")
        try:
            envelope = self._decoder.decode(buffers[0])
        # ValidationError (wrong tag/types) subclasses DecodeError; msgspec lets invalid UTF-8
        # inside a string surface as UnicodeDecodeError instead.
        except (msgspec.DecodeError, UnicodeDecodeError) as exc:
            raise BadMessage(f"bad header: {exc}") from None
        if len(envelope.tensors) != len(buffers) - 1:
            raise BadMessage(f"header lists {len(envelope.tensors)} tensors but {len(buffers) - 1} frames follow")
        tensors: dict[str, torch.Tensor] = {}
        for meta, buf in zip(envelope.tensors, buffers[1:]):
            if meta.name in tensors:
                raise BadMessage(f"duplicate tensor name {meta.name!r}")
            tensors[meta.name] = _rebuild_tensor(meta, buf)
        return envelope.msg, tensors


def _rebuild_tensor(meta: TensorMeta, buf: memoryview) -> torch.Tensor:
    dtype = DTYPES.get(meta.dtype)
    if dtype is None:
        raise BadMessage(f"tensor {meta.name!r}: unknown dtype {meta.dtype!r}")
    itemsize = dtype.itemsize
    expected = math.prod(meta.shape) * itemsize  # Python ints: no overflow on hostile shapes
    if buf.nbytes != expected:
        raise BadMessage(f"tensor {meta.name!r}: frame has {buf.nbytes} bytes, shape/dtype need {expected}")
    try:
        return _tensor_from_buffer(buf, dtype, meta.shape)
    except RuntimeError as exc:  # e.g. "Stride calculation overflowed" for shape [0, 2**62, 2**62]
        raise BadMessage(f"tensor {meta.name!r}: {exc}") from None


#: Whether torch.frombuffer has read a read-only buffer in this process: torch warns about that
#: once per process, so only the first such call needs the warning filtered
#: (``warnings.catch_warnings`` on every tensor was a few percent of the server loop's time
#: under 16 streamed spoken answers, py-spy).
_frombuffer_warned = False


def _tensor_from_buffer(buf: memoryview, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    global _frombuffer_warned
    if buf.nbytes == 0:
        return torch.empty(shape, dtype=dtype)  # frombuffer refuses empty buffers
    if _frombuffer_warned or not buf.readonly:
        raw = torch.frombuffer(buf, dtype=torch.uint8)
    else:
        with warnings.catch_warnings():
            # bytes frames are read-only. The module contract already says received tensors
            # are read-only, so the warning adds nothing.
            warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)
            raw = torch.frombuffer(buf, dtype=torch.uint8)
        _frombuffer_warned = True
    if dtype is torch.bool and bool((raw > 1).any()):
        raise BadMessage("bool tensor with bytes other than 0/1")  # torch assumes 0/1
    if raw.data_ptr() % dtype.itemsize:
        raw = raw.clone()  # misaligned frame (rare; e.g. a sliced memoryview): realign with one copy
    return raw.view(dtype).view(shape)


# --------------------------------------------------------------------------- sockets


def _open_socket(ctx: zmq.Context, kind: int, hwm: int, linger_ms: int, options: Mapping[int, int]) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, linger_ms)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    for option, value in options.items():
        sock.setsockopt(option, value)
    return sock


def _attach(sock: zmq.Socket, address: str, bind: bool, auth: Any = None) -> str:
    """Bind or connect; returns the resolved address (e.g. the port chosen for ``tcp://h:*``).
    ``auth`` (an :class:`omni_cache.wire.stage_auth.StageAuth`) makes the socket CURVE-secured first."""
    if auth is not None:
        auth.secure(sock, bind=bind)
    if bind:
        if address.startswith("ipc://"):
            Path(address[len("ipc://") :]).parent.mkdir(parents=True, exist_ok=True)
        sock.bind(address)
        return sock.getsockopt_string(zmq.LAST_ENDPOINT)
    sock.connect(address)
    return address


class _Endpoint:
    """One PUSH or PULL socket and its codec: the set-up all four endpoint classes share.

    ``bind`` defaults to the class's ``binds_by_default`` (receivers bind, senders connect);
    ``auth`` (a :class:`omni_cache.wire.stage_auth.StageAuth`) secures the socket with CURVE.
    The asyncio classes accept a ``zmq.asyncio.Context`` or a plain one.
    """

    socket_type: int
    binds_by_default: bool
    uses_asyncio: bool = False

    def __init__(
        self,
        ctx: zmq.Context,
        address: str,
        codec: Codec,
        bind: bool | None = None,
        *,
        hwm: int = DEFAULT_HWM,
        linger_ms: int = DEFAULT_LINGER_MS,
        auth: Any = None,
    ) -> None:
        self.codec = codec
        if self.uses_asyncio:
            ctx = _async_context(ctx)
        self.socket = _open_socket(ctx, self.socket_type, hwm, linger_ms, self._socket_options())
        self.address = _attach(self.socket, address, self.binds_by_default if bind is None else bind, auth)

    def _socket_options(self) -> dict[int, int]:
        """Extra options set before the socket binds or connects."""
        return {}

    def close(self) -> None:
        self.socket.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _ReceiverBase(_Endpoint):
    """Shared set-up of the PULL side.

    ``zmq.MAXMSGSIZE`` is set to ``codec.max_message_bytes``. It is a *per-frame* limit
    checked by zmq's wire decoder before it allocates the frame, so a peer announcing a
    huge frame cannot make this process allocate it. On tcp/ipc zmq reacts by
    disconnecting that peer: the offending message and whatever else was in flight on that
    connection are lost without reaching ``recv`` (so they are not counted in ``dropped``),
    and the peer reconnects on its own. We accept that: a sender using the same codec
    limit never produces such a frame (``encode`` raises ``MessageTooLarge`` first), so
    only a broken or hostile peer pays. Messages whose frames are each under the limit but
    whose total is over it arrive and are dropped (and counted) by the codec. The option
    has no effect on ``inproc://``, where the codec check alone applies.
    """

    socket_type = zmq.PULL
    binds_by_default = True
    dropped = 0  # bad messages received and skipped (an instance attribute from the first one)

    def _socket_options(self) -> dict[int, int]:
        return {zmq.MAXMSGSIZE: self.codec.max_message_bytes}

    def _decode_or_drop(self, frames: list[zmq.Frame]) -> tuple[Any, dict[str, torch.Tensor]] | None:
        try:
            return self.codec.decode(frames)
        except BadMessage as exc:
            self.dropped += 1
            logger.warning("dropped bad message on %s (%d dropped so far): %s", self.address, self.dropped, exc)
            return None


class Receiver(_ReceiverBase):
    """PULL socket that yields decoded ``(msg, tensors)``; binds by default."""

    def recv(self, timeout_ms: int | None = None) -> tuple[Any, dict[str, torch.Tensor]] | None:
        """Next valid message; bad ones are logged, counted and skipped.

        With ``timeout_ms``, returns None if no valid message arrived in that time.
        """
        deadline = None if timeout_ms is None else time.monotonic() + timeout_ms / 1000
        while True:
            if deadline is not None:
                remaining_ms = max(0, int((deadline - time.monotonic()) * 1000))
                if not self.socket.poll(remaining_ms, zmq.POLLIN):
                    return None
            decoded = self._decode_or_drop(self.socket.recv_multipart(copy=False))
            if decoded is not None:
                return decoded


class AsyncReceiver(_ReceiverBase):
    """asyncio version of ``Receiver``; accepts a ``zmq.asyncio.Context`` or a plain one."""

    uses_asyncio = True

    async def recv(self, timeout_ms: int | None = None) -> tuple[Any, dict[str, torch.Tensor]] | None:
        deadline = None if timeout_ms is None else time.monotonic() + timeout_ms / 1000
        while True:
            if deadline is not None:
                remaining_ms = max(0, int((deadline - time.monotonic()) * 1000))
                if not await self.socket.poll(remaining_ms, zmq.POLLIN):
                    return None
            decoded = self._decode_or_drop(await self.socket.recv_multipart(copy=False))
            if decoded is not None:
                return decoded


class Sender(_Endpoint):
    """PUSH socket that encodes and sends ``(msg, tensors)``; connects by default.

    ``send`` blocks while the queue is at its high-water mark (backpressure), at most
    ``timeout_s`` when one is given.
    """

    socket_type = zmq.PUSH
    binds_by_default = False

    def send(
        self,
        msg: msgspec.Struct,
        tensors: Mapping[str, torch.Tensor] | None = None,
        *,
        track: bool = False,
        timeout_s: float | None = None,
    ) -> zmq.MessageTracker | None:
        """Send one message; with ``track=True`` returns a tracker that is done once zmq
        no longer references the tensors' memory. With ``timeout_s`` (0: do not wait), raises
        :class:`SendTimeout` when the queue is still full after that long; nothing is sent then."""
        frames = self.codec.encode(msg, tensors)
        if timeout_s is None:
            return self.socket.send_multipart(frames, copy=False, track=track)
        # Room for one message means room for all its frames: zmq queues a multipart message
        # whole once its first frame is accepted.
        if not self.socket.poll(max(0, int(timeout_s * 1000)), zmq.POLLOUT):
            raise SendTimeout(
                f"{type(msg).__name__} not taken within {timeout_s:g} s by {self.address}: its queue is full"
            )
        try:
            return self.socket.send_multipart(frames, flags=zmq.NOBLOCK, copy=False, track=track)
        except zmq.Again:
            raise SendTimeout(f"{type(msg).__name__} not taken by {self.address}: its queue is full") from None


class AsyncSender(_Endpoint):
    """asyncio version of ``Sender``; accepts a ``zmq.asyncio.Context`` or a plain one."""

    socket_type = zmq.PUSH
    binds_by_default = False
    uses_asyncio = True

    async def send(
        self, msg: msgspec.Struct, tensors: Mapping[str, torch.Tensor] | None = None, *, track: bool = False
    ) -> zmq.MessageTracker | None:
        return await self.socket.send_multipart(self.codec.encode(msg, tensors), copy=False, track=track)


def _async_context(ctx: zmq.Context) -> zmq.asyncio.Context:
    # A shadow shares the underlying libzmq context (so inproc endpoints are shared) but
    # creates asyncio sockets; it does not own the context and never terminates it.
    return ctx if isinstance(ctx, zmq.asyncio.Context) else zmq.asyncio.Context.shadow(ctx)
