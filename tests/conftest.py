"""Fixtures more than one test module uses."""

from __future__ import annotations

import os

import pytest
import yaml
from xdist.scheduler import LoadScopeScheduling

# A Ray call made by a test process that has not joined a cluster fails instead of starting a
# local cluster of its own (Ray's auto-init): the tests join theirs explicitly, and a stray call
# (a thread outliving a test's fake ray) once started one whose loss, 60 s later, ended pytest
# with exit code 1 and no summary. Read by ray when it is first imported, so set here.
os.environ.setdefault("RAY_ENABLE_AUTO_CONNECT", "0")


#: The test files that use each shared server, in the order they run. Under pytest-xdist
#: (``--dist loadfile``) each fixture's files are one unit of work, run by one worker in this order
#: (see pytest_xdist_make_scheduler): the server starts once and is stopped after its last user in
#: both modes. A file that uses a shared server and is not listed here is a collection error.
SHARED_SERVER_FILES = {
    "qwen3_5_server": ("tests/test_qwen3_5_thinker.py", "tests/test_vllm_conformance.py"),
    "qwen3_omni_server": (
        "tests/test_qwen3_omni_streaming.py",
        "tests/test_realtime_e2e.py",
        "tests/test_realtime_listening_e2e.py",
    ),
}
SHARED_GROUP = {path: fixture for fixture, paths in SHARED_SERVER_FILES.items() for path in paths}


class SharedServerScheduling(LoadScopeScheduling):
    """pytest-xdist's file-at-a-time scheduling (``--dist loadfile``) with the files that share a
    server as one unit, and the units in collection order (engine files first: see
    engine_files_first) rather than by their number of tests. xdist's own ``--dist loadgroup``
    would group them too, but 3.8 marks the groups through ``item._nodeid``, which pytest 9.2 no
    longer reads."""

    def _split_scope(self, nodeid: str) -> str:
        path = file_of(nodeid)
        return SHARED_GROUP.get(path, path)

    def schedule(self) -> None:
        self.config.option.loadscopereorder = False
        super().schedule()


def pytest_configure(config):
    """Under pytest-xdist, torch in each worker computes on one thread: two workers share the
    host's two cores with the stage processes (which the shipped configs give one thread each),
    and a vLLM engine or reference model run in a worker on two threads spent most of its time
    in OpenMP's waits under that load (a single-token reference pass took 116-300 ms on two
    threads, 17-28 ms on one, at load 7-13). Set before any engine starts: vLLM's CPU worker
    disables ``torch.set_num_threads`` once it has started one."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    return SharedServerScheduling(config, log) if config.getvalue("dist") == "loadfile" else None


@pytest.fixture(scope="session")
def qwen3_5_server(tmp_path_factory):
    """omni-serve on stage_configs/qwen3_5.yaml (tests/qwen3_5_served.py), started by the first
    module that asks (tests/test_qwen3_5_thinker.py in file order) and kept for the next
    (tests/test_vllm_conformance.py): one engine start, not two. Stopped after its last user."""
    from qwen3_5_served import served_qwen3_5  # (imported by the modules that use it only)

    with served_qwen3_5(tmp_path_factory.mktemp("qwen3_5_shared")) as shared:
        _RELEASE["qwen3_5_server"] = shared.server
        yield shared


#: Servers stopped after the last test that uses them (see pytest_runtest_teardown below).
_RELEASE: dict[str, object] = {}
_LAST_USER: dict[str, str] = {}


@pytest.fixture(scope="session")
def qwen3_omni_server(tmp_path_factory):
    """The shipped Qwen3-Omni pipeline (stage_configs/qwen3_omni.yaml: thinker, talker and
    code2wav in their own processes, no start-up warm-up) served in this process as model
    ``q3shared``, started by the first module that asks (tests/test_qwen3_omni_streaming.py in
    file order) and kept for the others in SHARED_SERVER_FILES: one start of its three engines, not
    three. Stopped right after the last test of its files, not at the end of the run
    (its processes hold a few GiB)."""
    from served_config import QWEN3_OMNI_SHARED, served, write_pipeline_config  # (imported by its users only)

    path = write_pipeline_config(tmp_path_factory.mktemp("qwen3_omni_shared"), QWEN3_OMNI_SHARED, "qwen3_omni.yaml")
    data = yaml.safe_load(path.read_text())
    with served(data, path.parent) as srv:
        _RELEASE["qwen3_omni_server"] = srv
        yield srv


@pytest.hookimpl(trylast=True)  # after -k and -m deselected theirs
def pytest_collection_modifyitems(items):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        engine_files_first(items)
    for item in items:
        for name, files in SHARED_SERVER_FILES.items():
            if name in getattr(item, "fixturenames", ()) and module_of(item) not in files:
                raise pytest.UsageError(
                    f"{module_of(item)} uses the shared {name}: add it to tests/conftest.py's SHARED_SERVER_FILES"
                )
            if module_of(item) in files:  # (a test may ask for it by request.getfixturevalue)
                _LAST_USER[name] = item.nodeid


@pytest.hookimpl(trylast=True)  # after the test's own teardown
def pytest_runtest_teardown(item, nextitem):
    for name, nodeid in _LAST_USER.items():
        srv = _RELEASE.pop(name, None) if item.nodeid == nodeid else None
        if srv is not None:
            srv.stop()  # (stopping again at the end of the session does nothing more)


def engine_files_first(items) -> None:
    """Under pytest-xdist, the files that start vLLM engines (the ``vllm`` marker: 20-170 s each)
    before the others (most under a few seconds), each file's tests in their order: workers take
    files in this order, so the short ones fill in at the end instead of one long file running
    alone after the other worker has finished."""
    engines = {module_of(item) for item in items if item.get_closest_marker("vllm")}
    items.sort(key=lambda item: module_of(item) not in engines)  # stable: order within each kept


def module_of(item) -> str:
    return file_of(item.nodeid)


def file_of(nodeid: str) -> str:
    return nodeid.split("::")[0]
