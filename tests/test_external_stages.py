"""Stages started by hand (``external``): start order, heartbeats, re-announcement after a server
restart, fast failure when one dies, stage authentication (CURVE), and the config/CLI parts.

The stages here are the fake stages of tests/fake_stage.py, started by hand as separate OS
processes on tcp://127.0.0.1 (as they would be on other hosts), speaking the real protocol over
real ZMQ; the server is the real HTTP server (ServerThread). tests/test_external_stages_e2e.py does
the same with the real vLLM stages.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest
import zmq
import zmq.utils.monitor
from stage_probe import inject

from omni_cache import cli
from omni_cache.config import ConfigError, load_config
from omni_cache.config.identity import pipeline_hash
from omni_cache.runtime.metrics.prometheus import parse_metrics
from omni_cache.runtime.orchestrator import Orchestrator
from omni_cache.serving.server import ServerThread
from omni_cache.wire.messages import MESSAGE_TYPES, PROTOCOL_VERSION, StageReady
from omni_cache.wire.stage_auth import StageAuth, StageAuthError, new_key
from omni_cache.wire.transport import Codec, Receiver

REPO = Path(__file__).resolve().parents[1]
FAKE_STAGE = Path(__file__).with_name("fake_stage.py")
QWEN = REPO / "stage_configs" / "qwen3_omni_example.yaml"
#: Generous bounds: they only decide when a broken build gives up, no assertion is timed.
WAIT_S = 60.0


class ByteTokenizer:
    chat_template = ""

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True, tools=None, **template_kwargs):
        return list("".join(f"{m['role']}: {m['content']}\n" for m in messages).encode())

    def decode(self, ids, skip_special_tokens=True):
        return bytes(i for i in ids if i < 256).decode(errors="replace")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_config(*, heartbeat_timeout_s: float = 10.0, key_file: Path | None = None, external: bool = True) -> Path:
    d = Path(tempfile.mkdtemp(prefix="ocx"))
    ports = [free_port() for _ in range(3)]
    # The stages bind 0.0.0.0 (as on other hosts): without a key only the opt-out lets them.
    auth = f", stage_auth_key_file: {key_file}" if key_file else ", allow_unauthenticated_stages: true"
    path = d / "pipeline.yaml"
    path.write_text(
        textwrap.dedent(f"""
        name: ext_{uuid.uuid4().hex[:8]}
        server: {{host: 127.0.0.1, port: 0, request_timeout_s: 120,
                  control_address: "tcp://127.0.0.1:{ports[0]}",
                  heartbeat_interval_s: 0.1, heartbeat_timeout_s: {heartbeat_timeout_s}{auth}}}
        stages:
          - name: thinker
            kind: autoregressive
            model: tiny:thinker
            address: tcp://127.0.0.1:{ports[1]}
            bind_address: tcp://0.0.0.0:{ports[1]}
            external: {str(external).lower()}
            final_output: text
            engine_args: {{max_model_len: 512}}
            sampling: {{max_tokens: 16}}
          - name: decoder
            kind: generation
            model: tiny:decoder
            inputs: [thinker]
            handoff: omni_cache.handoff.talker_to_decoder
            address: tcp://127.0.0.1:{ports[2]}
            external: {str(external).lower()}
            final_output: audio
        """)
    )
    return path


class Stages:
    """Fake stages started by hand, each its own process (kill -9 able)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, *names: str) -> None:
        for name in names or ("thinker", "decoder"):
            self.procs[name] = subprocess.Popen(
                [sys.executable, str(FAKE_STAGE), "--stage-config", str(self.path), "--stage", name],
                env={**os.environ, "FAKE_TOKEN_DELAY": "0.01"},
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                start_new_session=True,
            )

    def kill(self, name: str) -> None:
        proc = self.procs.pop(name)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(WAIT_S)

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs.values())

    def stop(self) -> None:
        for proc in self.procs.values():
            with_suppress_kill(proc)
        self.procs.clear()


def with_suppress_kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(WAIT_S)


def server_for(path: Path) -> ServerThread:
    orch = Orchestrator(load_config(path), tokenizer=ByteTokenizer(), start_timeout_s=WAIT_S, echo_stage_logs=False)
    return ServerThread(orch).start()


def chat(srv: ServerThread, content: str, *, audio: bool = True, timeout: float = WAIT_S) -> httpx.Response:
    body = {
        "model": srv.orchestrator.served_model_name,
        "max_tokens": 16,
        "messages": [{"role": "user", "content": content}],
    }
    if audio:
        body["modalities"] = ["text", "audio"]
    return httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=timeout)


def wait_until(predicate, what: str, timeout: float = WAIT_S, state=None) -> None:
    """Poll ``predicate``; on timeout, fail naming ``what`` and, if given, ``state()`` (what
    the server says at that moment, for the failure's reader)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            now = f"; at that moment: {state()!r}" if state is not None else ""
            raise AssertionError(f"not within {timeout:g} s: {what}{now}")
        time.sleep(0.05)


def all_up(srv: ServerThread, what: str) -> None:
    """Wait until every stage serves; on timeout, say why each one that does not is down."""
    wait_until(
        lambda: srv.orchestrator.not_ready() == {},
        what,
        state=lambda: {
            "not_ready": srv.orchestrator.not_ready(),
            "replicas": {
                n: {
                    k: getattr(sp, k)
                    for k in ("up", "announced", "connection_down", "pid", "incarnation", "lost_reason", "restarts")
                }
                | {"liveness": vars(sp.liveness)}
                for n, sp in srv.orchestrator.supervisor.stages.items()
            },
        },
    )


def metric(srv: ServerThread, name: str, stage: str) -> float:
    """One sample of /metrics (``name`` or ``name_total``) for ``stage``."""
    text = httpx.get(srv.url + "/metrics", timeout=WAIT_S).text
    found = [v for n, lab, v in parse_metrics(text) if n in (name, name + "_total") and lab.get("stage") == stage]
    assert len(found) == 1, f"{name}{{stage={stage!r}}} in:\n{text}"
    return found[0]


def assert_answer(resp: httpx.Response, content: str) -> None:
    assert resp.status_code == 200, resp.text
    msg = resp.json()["choices"][0]["message"]
    assert msg["content"] == f"user: {content}\n"[:16]
    assert msg["audio"]["data"]  # the decoder stage took part


@pytest.fixture(autouse=True)
def supervisor_log(caplog):
    """The supervisor's INFO lines (a stage up, its pid and host) in a failing test's report."""
    caplog.set_level(logging.INFO, logger="omni_cache.runtime.supervision.supervisor")


@pytest.fixture
def stages(request):
    made: list[Stages] = []

    def make(path: Path) -> Stages:
        made.append(Stages(path))
        return made[-1]

    yield make
    for s in made:
        s.stop()


@pytest.fixture
def servers():
    made: list[ServerThread] = []

    def make(path: Path) -> ServerThread:
        made.append(server_for(path))
        return made[-1]

    yield make
    for s in made:
        s.stop()


# --------------------------------------------------------------------------------------------------
# Start order and re-announcement
# --------------------------------------------------------------------------------------------------


def test_server_first_waits_for_hand_started_stages(stages, servers):
    path = write_config()
    srv = servers(path)
    health = httpx.get(srv.url + "/health", timeout=WAIT_S)
    assert health.status_code == 503
    assert "started elsewhere, waiting for it to announce itself" in health.json()["stages"]["thinker"]
    st = stages(path)
    st.start()
    srv.wait_ready(WAIT_S)
    assert httpx.get(srv.url + "/health", timeout=WAIT_S).status_code == 200
    assert_answer(chat(srv, "hello"), "hello")


def test_stages_first_and_a_restarted_server_finds_them_again(stages, servers):
    path = write_config()
    st = stages(path)
    st.start()
    first = servers(path)
    first.wait_ready(WAIT_S)
    assert_answer(chat(first, "one"), "one")
    pids = first.orchestrator.stage_pids()
    first.stop()
    assert st.alive()  # the server does not own hand-started stages
    second = servers(path)
    second.wait_ready(WAIT_S)
    assert_answer(chat(second, "two"), "two")
    assert {n: sp.pid for n, sp in second.orchestrator.supervisor.stages.items()} == {
        n: st.procs[n].pid for n in ("thinker", "decoder")
    }
    assert all(p is None for p in pids.values())  # not processes the server started


# --------------------------------------------------------------------------------------------------
# Liveness: a stage that dies fails its requests and comes back
# --------------------------------------------------------------------------------------------------


def _in_flight_request(srv: ServerThread, content: str) -> tuple[threading.Thread, list]:
    out: list = []
    t = threading.Thread(target=lambda: out.append(chat(srv, content)), daemon=True)
    t.start()
    wait_until(lambda: srv.orchestrator.in_flight == 1, "the request is in flight")
    return t, out


def _serving_a_hung_request(stages, servers, heartbeat_timeout_s: float):
    """Stages and server up, and one request in flight that the fake thinker never finishes."""
    path = write_config(heartbeat_timeout_s=heartbeat_timeout_s)
    st = stages(path)
    st.start()
    srv = servers(path)
    srv.wait_ready(WAIT_S)
    t, out = _in_flight_request(srv, "HANG")
    return st, srv, t, out


def _its_response(t: threading.Thread, out: list) -> httpx.Response:
    t.join(WAIT_S)
    assert not t.is_alive(), "the request hangs after its stage died"
    [resp] = out
    return resp


def test_killed_stage_fails_its_requests_then_serves_again(stages, servers):
    # The heartbeat timeout is far longer than the test: the closed connection reveals the death.
    st, srv, t, out = _serving_a_hung_request(stages, servers, heartbeat_timeout_s=600)
    st.kill("thinker")
    resp = _its_response(t, out)
    assert resp.status_code == 503
    assert "closed its connection" in resp.json()["error"]["message"]
    health = httpx.get(srv.url + "/health", timeout=WAIT_S)
    assert health.status_code == 503 and "closed its connection" in health.json()["stages"]["thinker"]
    assert metric(srv, "omni_cache_stage_up", "thinker") == 0
    refused = chat(srv, "while down")
    assert refused.status_code == 503

    st.start("thinker")
    wait_until(lambda: httpx.get(srv.url + "/health", timeout=WAIT_S).status_code == 200, "the restarted stage is seen")
    assert_answer(chat(srv, "back"), "back")
    assert metric(srv, "omni_cache_stage_up", "thinker") == 1
    assert metric(srv, "omni_cache_stage_restarts", "thinker") == 1


def test_an_announced_stage_the_server_cannot_reach_is_not_up(stages, servers):
    # A thinker that announces itself but whose address refuses the server's connection (it died
    # before the server connected, or a wrong address): marked up, its requests would hang until
    # the deadline and its death would never close a connection; it is reported and refused.
    path = write_config()
    config = load_config(path)
    srv = servers(path)
    thinker = srv.orchestrator.supervisor.stages
    wait_until(
        lambda: "thinker" in thinker and thinker["thinker"].connection_down,
        "the server's connection to the (unbound) thinker address was refused",
    )
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.linger = 0
    sock.connect(config.server.control_address)
    codec = Codec(MESSAGE_TYPES)
    ready = StageReady(
        stage="thinker",
        pid=os.getpid(),
        incarnation="by-hand",
        host="here",
        protocol=PROTOCOL_VERSION,
        config_hash=pipeline_hash(config),
    )
    try:

        def announced() -> bool:
            sock.send_multipart(codec.encode(ready))
            return "announced itself" in srv.orchestrator.not_ready().get("thinker", "")

        wait_until(announced, "the announcement is heard")
        health = httpx.get(srv.url + "/health", timeout=WAIT_S)
        assert health.status_code == 503
        address = config.stages[0].address
        assert f"waiting for the connection to {address}" in health.json()["stages"]["thinker"]
        assert chat(srv, "unreachable").status_code == 503
    finally:
        sock.close(0)
        ctx.term()
    st = stages(path)
    st.start()  # the real thinker binds its address: the connection comes up, and so does it
    srv.wait_ready(WAIT_S)
    assert_answer(chat(srv, "reachable"), "reachable")


def test_a_silent_stage_is_marked_down_then_back(stages, servers):
    # SIGSTOP: the process and its connection stay, only its heartbeats stop (a hung host).
    st, srv, t, out = _serving_a_hung_request(stages, servers, heartbeat_timeout_s=1.0)
    os.kill(st.procs["thinker"].pid, signal.SIGSTOP)
    try:
        resp = _its_response(t, out)
        assert resp.status_code == 503 and "no heartbeat" in resp.json()["error"]["message"]
        assert "no heartbeat" in srv.orchestrator.not_ready()["thinker"]
    finally:
        os.kill(st.procs["thinker"].pid, signal.SIGCONT)
    all_up(srv, "the thinker is back")
    assert_answer(chat(srv, "awake"), "awake")
    assert metric(srv, "omni_cache_stage_restarts", "thinker") == 0  # the same process


def test_an_immediate_restart_fails_what_the_old_process_had(stages, servers):
    # Killed and started again at once: the closed connection or, if the new process announces
    # itself first, its new incarnation reveals the death (the heartbeat timeout cannot: 600 s).
    st, srv, t, out = _serving_a_hung_request(stages, servers, heartbeat_timeout_s=600)
    st.kill("thinker")
    st.start("thinker")
    resp = _its_response(t, out)
    assert resp.status_code == 503
    assert re.search("closed its connection|replaced by a new process", resp.json()["error"]["message"])
    all_up(srv, "the new thinker is up")
    assert_answer(chat(srv, "again"), "again")
    assert metric(srv, "omni_cache_stage_restarts", "thinker") == 1


# --------------------------------------------------------------------------------------------------
# Stage authentication
# --------------------------------------------------------------------------------------------------


def test_curve_receiver_accepts_only_peers_with_the_key(tmp_path):
    good = StageAuth.from_file(new_key(tmp_path / "good.key"))
    bad = StageAuth.from_file(new_key(tmp_path / "bad.key"))
    codec = Codec(MESSAGE_TYPES, max_message_bytes=1 << 20)
    ctx = zmq.Context()
    good.guard(ctx)
    address = f"tcp://127.0.0.1:{free_port()}"
    inbox = Receiver(ctx, address, codec, auth=good)
    try:
        assert inject(ctx, address, codec, None, "no key") != zmq.EVENT_HANDSHAKE_SUCCEEDED
        assert inject(ctx, address, codec, bad, "another key") != zmq.EVENT_HANDSHAKE_SUCCEEDED
        assert inject(ctx, address, codec, good, "member") == zmq.EVENT_HANDSHAKE_SUCCEEDED
        msg, _ = inbox.recv(timeout_ms=int(WAIT_S * 1000))
        assert msg.request_id == "member"
        assert inbox.recv(timeout_ms=300) is None  # nothing of the others came through
    finally:
        inbox.close()
        good.stop()
        ctx.term()


def test_pipeline_with_stage_auth_serves_and_refuses_strangers(tmp_path, stages, servers):
    key = new_key(tmp_path / "stage.key")
    path = write_config(key_file=key)
    st = stages(path)
    st.start()
    srv = servers(path)
    srv.wait_ready(WAIT_S)
    assert_answer(chat(srv, "members only"), "members only")

    thinker = load_config(path).stage("thinker").address
    codec = Codec(MESSAGE_TYPES, max_message_bytes=1 << 20)
    ctx = zmq.Context()
    stranger = StageAuth.from_file(new_key(tmp_path / "other.key"))
    try:
        for auth in (None, stranger):
            assert inject(ctx, thinker, codec, auth, uuid.uuid4().hex) != zmq.EVENT_HANDSHAKE_SUCCEEDED
    finally:
        ctx.term()
    assert_answer(chat(srv, "still fine"), "still fine")
    # the thinker accepted exactly the two requests that came through the server
    assert metric(srv, "omni_cache_stage_requests", "thinker") == 2


def test_stage_key_must_be_long(tmp_path):
    short = tmp_path / "short.key"
    short.write_text("too short\n")
    with pytest.raises(StageAuthError, match="short.key.*at least 32"):
        StageAuth.from_file(short)
    with pytest.raises(StageAuthError, match="cannot read"):
        StageAuth.from_file(tmp_path / "missing.key")
    key = new_key(tmp_path / "k")
    assert key.stat().st_mode & 0o777 == 0o600
    with pytest.raises(FileExistsError):
        new_key(key)


# --------------------------------------------------------------------------------------------------
# Config keys and command lines
# --------------------------------------------------------------------------------------------------


def _variant(tmp_path: Path, server_extra: str = "", stage_extra: str = "") -> Path:
    path = tmp_path / "p.yaml"
    path.write_text(
        textwrap.dedent(f"""
        name: p
        server: {{control_address: "tcp://node-a:5600"{server_extra}}}
        stages:
          - {{name: thinker, kind: generation, model: "tiny:decoder", address: "tcp://node-b:5601",
              final_output: audio{stage_extra}}}
        """)
    )
    return path


@pytest.mark.parametrize(
    "server_extra, stage_extra, key, message",
    [
        ("", ", bind_address: 'ipc:///tmp/x.sock'", "stages[0].bind_address", "a bind address is for tcp"),
        ("", ", bind_address: 'tcp://0.0.0.0'", "stages[0].bind_address", "expected 'tcp://host:port'"),
        (", control_bind_address: 'tcp://*:5600'", "", "server.control_bind_address", "concrete host"),
        (
            ", heartbeat_interval_s: 2, heartbeat_timeout_s: 1",
            "",
            "server.heartbeat_timeout_s",
            "must be longer than server.heartbeat_interval_s",
        ),
        (", stage_auth_key_file: /nonexistent/stage.key", "", "server.stage_auth_key_file", "no such file"),
    ],
)
def test_config_errors_name_the_key(tmp_path, server_extra, stage_extra, key, message):
    path = _variant(tmp_path, server_extra, stage_extra)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    text = str(err.value)
    assert f"{path}: {key}: " in text and message in text


def test_bind_and_advertise_addresses_load(tmp_path):
    path = _variant(
        tmp_path,
        ", control_bind_address: 'tcp://0.0.0.0:5600', allow_unauthenticated_stages: true",
        ", bind_address: 'tcp://0.0.0.0:5601', external: true",
    )
    config = load_config(path)
    assert config.server.control_bind_address == "tcp://0.0.0.0:5600"
    assert config.stages[0].bind_address == "tcp://0.0.0.0:5601" and config.stages[0].external


def test_sockets_beyond_loopback_need_a_key_or_the_opt_out(tmp_path):
    """Before: a tcp://0.0.0.0 bind without a key loaded, and anyone reaching the port could send
    the stages messages."""
    binds = (", control_bind_address: 'tcp://0.0.0.0:5600'", ", bind_address: 'tcp://0.0.0.0:5601', external: true")
    with pytest.raises(ConfigError) as e:
        load_config(_variant(tmp_path, *binds))
    for key, address in [
        ("server.control_bind_address", "tcp://0.0.0.0:5600"),
        ("stages[0].bind_address", "tcp://0.0.0.0:5601"),
    ]:
        assert f"{key}: '{address}' listens beyond loopback" in str(e.value)
    assert "python -m omni_cache.wire.stage_auth new-key FILE" in str(e.value)
    # A host name is reachable from other hosts too; loopback and ipc are not.
    with pytest.raises(ConfigError, match="stages\\[0\\].address: 'tcp://node-b:5601' listens beyond loopback"):
        load_config(_variant(tmp_path))
    key = tmp_path / "stage.key"
    key.write_text("k" * 64)
    assert load_config(_variant(tmp_path, binds[0] + f", stage_auth_key_file: {key}", binds[1]))
    assert load_config(_variant(tmp_path, binds[0] + ", allow_unauthenticated_stages: true", binds[1]))


def test_omni_serve_external_stages_flag(tmp_path, capsys):
    path = write_config(external=False)
    assert cli.main(["--stage-config", str(path), "--check", "--external-stages", "decoder"]) == 0
    out = capsys.readouterr().out
    assert out.count("started:      by hand") == 1
    assert cli.main(["--stage-config", str(path), "--check", "--external-stages", "all"]) == 0
    assert capsys.readouterr().out.count("started:      by hand") == 2
    assert cli.main(["--stage-config", str(path), "--check", "--external-stages", "talkr"]) == 2
    err = capsys.readouterr().err
    assert "config error: --external-stages: unknown stage(s) 'talkr'" in err


def test_hand_started_stage_checks_only_its_own_model_path():
    # The GPU example: every stage's model is a path on its own host, none exists here.
    result = subprocess.run(
        [sys.executable, "-m", "workers", "--stage-config", str(QWEN), "--stage", "decoder"],
        capture_output=True,
        text=True,
        timeout=WAIT_S,
        cwd=REPO,
    )
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if "config error" in line]
    names = [s.name for s in load_config(QWEN, check_paths=False).stages]
    models = [e for e in errors if ".model:" in e]
    assert len(models) == 1, result.stderr  # not the other hosts' models
    assert f"stages[{names.index('decoder')}].model" in models[0] and "--no-path-check" in models[0]
    # the example's stage key file lives on its hosts, not here
    assert [e for e in errors if e not in models] == [
        e for e in errors if "server.stage_auth_key_file: no such file" in e
    ]


def test_hand_started_stage_applies_its_env_and_path_check_flag(tmp_path, monkeypatch):
    import workers.__main__ as workers_main
    import workers.stage_process

    path = tmp_path / "p.yaml"
    path.write_text(
        textwrap.dedent("""
        name: p
        server: {control_address: "tcp://127.0.0.1:8"}
        stages:
          - name: decoder
            kind: generation
            model: /models/on/another/host
            address: tcp://127.0.0.1:9
            final_output: audio
            env: {OMNI_TEST_MARK: from-the-config}
        """)
    )
    assert workers_main.main(["--stage-config", str(path), "--stage", "decoder"]) == 2
    monkeypatch.setenv("OMNI_TEST_MARK", "from-the-shell")  # restored after the test
    seen: dict = {}

    def fake_serve(config, name, **kwargs):
        seen.update(name=name, mark=os.environ.get("OMNI_TEST_MARK"))
        return 0

    monkeypatch.setattr(workers.stage_process, "serve_stage", fake_serve)
    assert workers_main.main(["--stage-config", str(path), "--stage", "decoder", "--no-path-check"]) == 0
    assert seen == {"name": "decoder", "mark": "from-the-config"}


def test_shipped_several_hosts_configs():
    config = load_config(REPO / "stage_configs" / "tiny_omni_hosts.yaml", check_paths=False)
    assert config.server.stage_auth_key_file and config.server.control_address.startswith("tcp://")
    assert config.server.control_bind_address.startswith("tcp://0.0.0.0:")
    for stage in config.stages:
        assert stage.external and stage.address.startswith("tcp://")
        assert stage.bind_address == "tcp://0.0.0.0:" + stage.address.rpartition(":")[2]
    # The GPU example is placed by Ray (addresses from the actors), its stage traffic authenticated.
    example = load_config(REPO / "stage_configs" / "qwen3_omni_example.yaml", check_paths=False)
    assert example.server.stage_auth_key_file and example.server.ray_address == "auto"
    assert all(example.placed_by_ray(s) and s.address is None for s in example.stages)
