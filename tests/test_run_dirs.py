"""Run directories (omni_cache/config/addresses.py): made by tempfile.mkdtemp under a root of the
user's own, $XDG_RUNTIME_DIR/omni_cache or /tmp/omni_cache-<uid>, created 0700; a root another
user owns, that others may write, or that is a symlink is refused with a message saying what to
do. (The root shared by all users, /tmp/omni_cache, could be made first by anyone.)"""

from __future__ import annotations

import gc
import os
import shutil
import stat
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from fake_pipeline import FAKE_STAGE, ByteTokenizer

from omni_cache.config import load_config
from omni_cache.config.addresses import RunDirError, new_run_dir, run_root
from omni_cache.runtime.orchestrator import Orchestrator

TINY = Path(__file__).resolve().parents[1] / "stage_configs" / "tiny_omni.yaml"


@pytest.fixture
def xdg(monkeypatch) -> Iterator[Path]:
    """A runtime directory as systemd makes it (0700, ours, a short path like /run/user/1000),
    set as $XDG_RUNTIME_DIR."""
    runtime = Path(tempfile.mkdtemp(prefix="xdg", dir="/tmp"))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    yield runtime
    shutil.rmtree(runtime, ignore_errors=True)


def _mode(path: str | Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_under_xdg_runtime_dir(xdg):
    config = load_config(TINY)
    a, b = new_run_dir(config), new_run_dir(config)
    root = xdg / "omni_cache"
    assert run_root() == str(root)
    for made in (a, b):
        assert made.startswith(f"{root}/tiny_omni-{os.getpid()}-")
        assert _mode(made) == 0o700 and os.lstat(made).st_uid == os.getuid()
    assert a != b and _mode(root) == 0o700


def test_under_tmp_without_xdg_runtime_dir(monkeypatch):
    root = f"/tmp/omni_cache-{os.getuid()}"
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/" + "r" * 60)  # too long for the sockets' paths
    assert run_root() == root
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert run_root() == root
    made = new_run_dir(load_config(TINY))
    try:
        assert made.startswith(f"{root}/tiny_omni-{os.getpid()}-") and _mode(made) == 0o700
        assert _mode(root) == 0o700 and os.lstat(root).st_uid == os.getuid()
    finally:
        os.rmdir(made)


def test_a_root_of_another_user_is_refused(xdg, monkeypatch):
    (xdg / "omni_cache").mkdir(0o700)
    other = os.getuid() + 1  # the root is ours: to this process, now another user's
    monkeypatch.setattr(os, "getuid", lambda: other)
    with pytest.raises(
        RunDirError,
        match=rf"owned by uid {other - 1}, not by this user \(uid "
        rf"{other}\).*set XDG_RUNTIME_DIR",
    ):
        new_run_dir(load_config(TINY))


def test_a_root_others_may_write_is_refused(xdg):
    root = xdg / "omni_cache"
    root.mkdir()
    root.chmod(0o777)
    with pytest.raises(
        RunDirError,
        match=r"may be written by its group or others \(mode 0777\); "
        r"chmod 700 it",
    ):
        new_run_dir(load_config(TINY))
    root.chmod(0o750)  # group may read: allowed, nobody else writes
    os.rmdir(new_run_dir(load_config(TINY)))


def test_a_symlinked_root_is_refused(xdg, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(0o700)
    (xdg / "omni_cache").symlink_to(elsewhere)
    with pytest.raises(RunDirError, match="is not a directory"):
        new_run_dir(load_config(TINY))


def test_the_server_refuses_to_start_on_an_untrusted_root(xdg):
    root = xdg / "omni_cache"
    root.mkdir()
    root.chmod(0o757)
    with pytest.raises(RunDirError, match="chmod 700"):
        Orchestrator(load_config(TINY))


def test_a_server_never_started_leaves_no_directory(xdg):
    orch = Orchestrator(load_config(TINY), tokenizer=ByteTokenizer(), stage_argv=[sys.executable, str(FAKE_STAGE)])
    run_dir = Path(orch.fleet.placement.run_dir)
    assert run_dir.is_dir() and run_dir.parent == xdg / "omni_cache"
    del orch
    gc.collect()
    assert not run_dir.exists()
