"""IpcClaims: one pipeline per ipc path, released at close and when the holder dies."""

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from omni_cache.wire.ipc_claims import AddressInUseError, IpcClaims


def test_second_claim_is_refused_until_the_first_is_released(tmp_path):
    addrs = [f"ipc://{tmp_path}/a.sock", f"ipc://{tmp_path}/b.sock", "tcp://127.0.0.1:5555"]
    first = IpcClaims(addrs)
    first.acquire()
    with pytest.raises(AddressInUseError, match=rf"ipc://{tmp_path}/a.sock is in use .*pid {os.getpid()}"):
        IpcClaims(addrs).acquire()
    first.release()
    second = IpcClaims(addrs)
    second.acquire()
    second.release()


def test_a_refused_claim_holds_nothing(tmp_path):
    a, b = f"ipc://{tmp_path}/a.sock", f"ipc://{tmp_path}/b.sock"
    holder = IpcClaims([b])
    holder.acquire()
    with pytest.raises(AddressInUseError, match="b.sock"):
        IpcClaims([a, b]).acquire()  # took a, then failed on b: must have let a go
    other = IpcClaims([a])
    other.acquire()
    other.release()
    holder.release()


def test_a_killed_holder_leaves_the_address_free(tmp_path):
    addr = f"ipc://{tmp_path}/x.sock"
    code = textwrap.dedent(f"""
        import sys, time
        from omni_cache.wire.ipc_claims import IpcClaims
        IpcClaims([{addr!r}]).acquire()
        print("held", flush=True)
        time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        with pytest.raises(AddressInUseError, match=f"pid {proc.pid}"):
            IpcClaims([addr]).acquire()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    claim = IpcClaims([addr])
    claim.acquire()
    claim.release()
