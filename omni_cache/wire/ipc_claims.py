"""Exclusive claims on a pipeline's ipc:// socket paths.

ZMQ's bind on an ipc:// path that already exists removes the file and binds anew, so a second
pipeline started with the same addresses (the same YAML twice, or two configs that share a name)
would silently take the first one's sockets over: its requests would reach the wrong stages. The
orchestrator therefore claims every ipc path of its pipeline before it binds anything: an advisory
`flock` on `<path>.lock` (next to the socket), held as long as the orchestrator runs. The kernel
drops a flock when its holder dies, so a crashed pipeline leaves nothing to clean up; the pid written
into the lock file only serves the error message. tcp:// addresses need no claim: their bind fails
with "Address already in use".
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterable
from pathlib import Path


class AddressInUseError(RuntimeError):
    """Another running pipeline holds one of this pipeline's ipc addresses."""


def ipc_path(address: str) -> Path | None:
    return Path(address[len("ipc://") :]) if address.startswith("ipc://") else None


class IpcClaims:
    """`acquire()` claims every ipc path of `addresses` or raises AddressInUseError (holding none);
    `release()` gives them back."""

    def __init__(self, addresses: Iterable[str]) -> None:
        self.addresses = list(dict.fromkeys(addresses))  # unique, in order
        self._fds: list[int] = []

    def acquire(self) -> None:
        try:
            for address in self.addresses:
                path = ipc_path(address)
                if path is not None:
                    self._fds.append(self._claim(address, path))
        except BaseException:
            self.release()
            raise

    def _claim(self, address: str, path: Path) -> int:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(f"{path}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise AddressInUseError(
                f"{address} is in use by another running omni_cache pipeline (pid {holder}): "
                f"stop it, or give this pipeline other addresses (the stages' `address` and "
                f"`server.control_address` in its config)"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        return fd

    def release(self) -> None:
        for fd in self._fds:
            try:
                fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)
        self._fds.clear()
