"""Stage processes forked from a process that imported vLLM once (``server.stage_launch: fork``:
omni_cache/runtime/supervision/stage_forker.py, workers/forker.py).

A real forker forks real ``python -m workers`` children here: one that fails to start (its exit
code and output come back through the forker), one that runs (signalled as a group, reported
dead by signal), and one left running when the server's forkers close (it goes with its
forker). What a whole pipeline does with them (its stages forked, a forker killed under it) is
in tests/test_pipeline_e2e.py.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import yaml

from omni_cache.config import load_config
from omni_cache.runtime.supervision.placement import StagePlacement
from omni_cache.runtime.supervision.process_runner import spawned_stage_env
from omni_cache.runtime.supervision.stage_forker import ForkedRunner, StageForkers, import_env_key
from workers.forker import ImportedEnv, with_parent

ROOT = Path(__file__).resolve().parents[1]
STAGE_COMMAND = [sys.executable, "-m", "workers"]

pytestmark = pytest.mark.vllm


# ---- which stages share a forker, and what a child's environment is ------------------------------


def test_stages_share_a_forker_only_where_imports_see_the_same_environment():
    base = {"PATH": "/usr/bin", "OMP_NUM_THREADS": "1"}
    # vLLM reads the KV cache size when the engine is built, in the child: one forker serves both.
    assert import_env_key({**base, "VLLM_CPU_KVCACHE_SPACE": "2"}) == import_env_key(base)
    # torch's OpenMP reads the thread count as it loads, in the forker: another forker.
    assert import_env_key({**base, "OMP_NUM_THREADS": "2"}) != import_env_key(base)


def test_a_child_repeats_what_the_forker_s_imports_did_to_the_environment():
    imported = ImportedEnv(changed={"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "LD_LIBRARY_PATH": "/cv2"}, removed=["X"])
    env = imported.applied_to({"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "X": "1", "KEEP": "k"})
    assert env == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "LD_LIBRARY_PATH": "/cv2", "KEEP": "k"}


def test_a_forked_stage_watches_its_forker_not_the_server():
    args = ["--stage", "thinker", "--parent-pid", "100", "--replica", "0"]
    assert with_parent(args, 7) == ["--stage", "thinker", "--parent-pid", "7", "--replica", "0"]


def _placement(tmp_path: Path, launch: str, stage_argv: list[str]) -> StagePlacement:
    config = load_config(ROOT / "stage_configs" / "tiny_omni.yaml", check_paths=False)
    config.server.stage_launch = launch
    config.server.control_address = f"ipc://{tmp_path}/orchestrator.sock"
    for stage in config.stages:
        stage.address = f"ipc://{tmp_path}/{stage.name}.sock"
    placement = StagePlacement(config, run_dir=str(tmp_path / "run"), stage_argv=stage_argv, external=set())
    placement.make_run_dir()
    return placement


@pytest.mark.parametrize(
    ("launch", "stage_argv", "forked"),
    [("fork", STAGE_COMMAND, True), ("spawn", STAGE_COMMAND, False), ("fork", [sys.executable, "other.py"], False)],
)
def test_the_default_command_is_forked_unless_the_config_says_spawn(tmp_path, launch, stage_argv, forked):
    placement = _placement(tmp_path, launch, stage_argv)
    try:
        for _, replica, runner, env in placement.runners(f"ipc://{tmp_path}/orchestrator.sock"):
            assert isinstance(runner, ForkedRunner) is forked, (launch, stage_argv)
            argv = runner.argv if forked else runner
            assert argv[: len(stage_argv)] == stage_argv and replica.stage in argv
            assert env["OMP_NUM_THREADS"] == "1" and env["PYTHONUNBUFFERED"] == "1"
    finally:
        placement.close()


# ---- a real forker -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def forkers(tmp_path_factory):
    """A pool whose forker was started, and served a first fork, from a thread that has ended
    since (as a pipeline's event loop does while the process goes on with others): the forker
    must outlive that thread; the tests below fork through it."""
    pool = StageForkers()
    missing = tmp_path_factory.mktemp("forker") / "missing.yaml"

    ended: list[bool] = []  # checked here: an assert in the thread would fail no test

    def first_fork() -> None:
        runner = _runner(pool, ["--stage-config", str(missing), "--stage", "decoder"])
        runner.start(lambda line: None)
        ended.append(runner.wait(600))

    started = threading.Thread(target=first_fork)
    started.start()
    started.join()
    assert ended == [True]  # the forker has imported everything and forked once
    [first] = pool.started
    yield pool
    assert pool.started == [first] and first.alive  # the ended thread's forker served every test
    pool.close()


def _stage_env(pool: StageForkers) -> dict[str, str]:
    return spawned_stage_env({"OMP_NUM_THREADS": "1"}, pool.base_env)


class Output:
    """A child's output lines, as the supervisor's log tail gets them."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.changed = threading.Condition()

    def __call__(self, line: str) -> None:
        with self.changed:
            self.lines.append(line)
            self.changed.notify_all()

    def wait_for(self, text: str, timeout: float) -> None:
        with self.changed:
            assert self.changed.wait_for(lambda: any(text in line for line in self.lines), timeout), self.lines[-20:]


def _runner(forkers: StageForkers, args: list[str], name: str = "decoder") -> ForkedRunner:
    return ForkedRunner(forkers, [*STAGE_COMMAND, *args], args, _stage_env(forkers), name)


def _decoder_args(tmp_path: Path) -> list[str]:
    """A decoder stage a test can run alone: every address spelled out (nobody listens at the
    orchestrator's: it announces itself into the void until it is stopped)."""
    data = yaml.safe_load((ROOT / "stage_configs" / "tiny_omni.yaml").read_text())
    data["server"]["control_address"] = f"ipc://{tmp_path}/orchestrator.sock"
    for stage in data["stages"]:
        stage["address"] = f"ipc://{tmp_path}/{stage['name']}.sock"
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(data))
    return ["--stage-config", str(path), "--stage", "decoder", "--checkpoint-dir", str(tmp_path / "ckpt")]


def test_a_forked_stage_that_fails_reports_its_exit_code_and_output(forkers, tmp_path):
    output = Output()
    runner = _runner(forkers, ["--stage-config", str(tmp_path / "missing.yaml"), "--stage", "decoder"])
    runner.start(output)
    assert runner.wait(600), "no exit reported"  # the first fork waits for the forker's imports
    assert runner.poll() == 2 and runner.describe_exit(2) == "exit code 2"
    output.wait_for("missing.yaml", 30)  # its config error, as `python -m workers` prints it


def test_a_forked_stage_is_its_own_group_and_its_death_by_signal_is_reported(forkers, tmp_path):
    output = Output()
    runner = _runner(forkers, _decoder_args(tmp_path))
    runner.start(output)
    output.wait_for("stage decoder ready", 600)
    assert runner.pid is not None and os.getpgid(runner.pid) == runner.pid and runner.poll() is None
    runner.signal(signal.SIGKILL)
    assert runner.wait(60)
    assert runner.poll() == -signal.SIGKILL
    assert runner.describe_exit(-signal.SIGKILL) == "killed by signal SIGKILL"


def test_idle_forkers_beyond_the_bound_end_and_closing_takes_the_stages_along(tmp_path):
    """A pool that keeps no idle forker (as a test session's does with two) ends one when
    another starts, but never while a stage of it runs; closing the pool ends the rest, and the
    stages still running go with their forker."""
    pool = StageForkers(keep_idle=0)
    (tmp_path / "b").mkdir()
    first, second = _runner(pool, _decoder_args(tmp_path)), _runner(pool, _decoder_args(tmp_path / "b"))
    env = _stage_env(pool)  # what _runner gives them
    other_env = spawned_stage_env({"OMP_NUM_THREADS": "2"}, pool.base_env)  # another forker's
    try:
        output = Output()
        first.start(output)
        output.wait_for("stage decoder ready", 600)
        forker = pool.forker_for(env)
        pool.forker_for(other_env)
        assert forker.alive and forker.proc.poll() is None  # busy: kept
        first.signal(signal.SIGKILL)
        assert first.wait(60)
        pool.forker_for(other_env)  # now idle, and none is kept: it ends
        assert forker.proc.wait(60) is not None
        output = Output()
        second.start(output)  # a new forker for the first environment
        output.wait_for("stage decoder ready", 600)
        pid = second.pid
    finally:
        pool.close()
    assert second.wait(60), "the stage outlived its forker"
    assert "forker process ended" in second.describe_exit(second.poll())
    deadline = time.monotonic() + 30
    while _running(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _running(pid)


def _running(pid: int) -> bool:
    """Whether ``pid`` still runs (an orphan's zombie waits for init to reap it)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
