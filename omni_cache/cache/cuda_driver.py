"""The few CUDA driver calls the host mirror's `write` makes every step, called through ctypes.

Why not torch: `LatentStore.write` runs once per model step in the serving loop, and on a small
(decode) step it is pure CPU overhead. Through torch every operation it needs (a device copy, an
event record, a stream switch, the current stream) costs 4-6 us of Python on the H200 host we
measured; the same driver calls through ctypes cost about 1 us each, and there is nothing to switch:
each call names its stream. The handles are torch's own (`Stream.cuda_stream`, `Event.cuda_event`,
`torch._C._cuda_getCurrentRawStream`), so the ordering with torch's work is exactly what the torch
calls would give: copies on the compute stream are ordered with the caching allocator's reuse of
their source memory, events are the events torch waits on.

`driver()` returns None where libcuda cannot be loaded (CPU-only machines); callers then use torch.
"""

from __future__ import annotations

import ctypes
import functools

import torch

_u64, _sz, _ptr, _int = ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_int


class CudaDriver:
    """Asynchronous copies and events on explicit streams (raw handles as Python ints)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib
        self._d2d = self._fn("cuMemcpyDtoDAsync_v2", _u64, _u64, _sz, _ptr)
        self._d2h = self._fn("cuMemcpyDtoHAsync_v2", _ptr, _u64, _sz, _ptr)
        self._record = self._fn("cuEventRecord", _ptr, _ptr)
        self._wait = self._fn("cuStreamWaitEvent", _ptr, _ptr, ctypes.c_uint)

    def _fn(self, name: str, *argtypes):
        f = getattr(self._lib, name)
        f.argtypes, f.restype = list(argtypes), _int
        return f

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            msg = ctypes.c_char_p()
            self._lib.cuGetErrorName(rc, ctypes.byref(msg))
            raise RuntimeError(f"CUDA driver {what} failed: {(msg.value or b'?').decode()} ({rc})")

    def copy_d2d(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self._check(self._d2d(dst, src, nbytes, stream), "cuMemcpyDtoDAsync")

    def copy_d2h(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self._check(self._d2h(dst, src, nbytes, stream), "cuMemcpyDtoHAsync")

    def record(self, event: int, stream: int) -> None:
        self._check(self._record(event, stream), "cuEventRecord")

    def wait(self, stream: int, event: int) -> None:
        self._check(self._wait(stream, event, 0), "cuStreamWaitEvent")


@functools.cache
def driver() -> CudaDriver | None:
    # PyDLL: the calls keep the GIL. They only enqueue work (microseconds); releasing and
    # re-taking the GIL around each would hand it to the store's drain thread every call and make
    # the serving loop wait to get it back.
    try:
        return CudaDriver(ctypes.PyDLL("libcuda.so.1"))
    except (OSError, AttributeError):
        return None


def current_stream_handle(device_index: int):
    """A function returning the raw handle of the current stream of `device_index`: torch's
    private fast accessor where it exists (~0.3 us), else the public one (~5 us)."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return functools.partial(raw, device_index)
    return lambda: torch.cuda.current_stream(device_index).cuda_stream


def event_handle(event: torch.cuda.Event, stream: torch.cuda.Stream) -> int:
    """Raw handle of a torch event (torch creates the CUDA event lazily, at its first record)."""
    event.record(stream)
    event.synchronize()
    return int(event.cuda_event)
