"""Stage replicas placed by Ray (README "Several replicas, several hosts (Ray)"), end to end.

The test starts its own Ray cluster of two logical nodes on this machine (``ray.cluster_utils``;
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` keeps every Ray process on 127.0.0.1, DESIGN.md), node_a
offering the custom resource ``node_a`` and node_b ``node_b``. The tiny pipeline's thinker has 2
replicas, replica 0 pinned to ``node_a`` and replica 1 to ``node_b`` (``ray.replica_resources``);
the talker and decoder go wherever Ray puts them. ``omni-serve --ray-address <the cluster>`` runs as
its own process: real Ray actors, real stage processes, real ZMQ, the ``openai`` client.

Checked: each thinker actor's Ray node id is the node its resource is on; a text answer and an
audio answer come back; kill -9 of thinker#1's stage process is seen, the process is restarted
through the same actor on the same node and address, and routed to again; so is a killed actor
(replaced by a new one pinned to its node, same address); stopping omni-serve leaves no stage
process behind; the cluster is shut down whatever happened.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from benchmarks.side_processes import stop_omni_serve
from omni_cache.runtime.metrics.prometheus import parse_metrics

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[1]
NAME = "ray_replicas"
API_KEY = "test-key"
HEADERS = {"Authorization": f"Bearer {API_KEY}"}
#: Bounds for a loaded 2-core machine; they decide when a broken build gives up, nothing more.
START_S = 600.0
RESTART_S = 300.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster():
    """Two logical Ray nodes, each with its own custom resource; shut down whatever happens."""
    saved = os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # every Ray process on 127.0.0.1
    import ray
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 4, "resources": {"node_a": 1}})
    try:
        node_b = c.add_node(num_cpus=4, resources={"node_b": 1})
        c.wait_for_nodes()
        ray.init(address=c.address, namespace="omni_cache", log_to_driver=False)
        yield c.address, {"node_a": c.head_node.node_id, "node_b": node_b.node_id}
    finally:
        with __import__("contextlib").suppress(Exception):
            ray.shutdown()
        c.shutdown()
        if saved is None:
            os.environ.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)
        else:
            os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = saved


def pipeline_config(port: int) -> dict:
    data = yaml.safe_load((ROOT / "stage_configs" / "tiny_omni.yaml").read_text())
    data["name"] = NAME
    data["server"]["port"] = port
    data["server"]["routing"] = "round_robin"  # both replicas serve, in turn
    for stage in data["stages"]:
        del stage["address"]  # Ray-placed: the actors pick them
        stage["ray"] = {"num_cpus": 1}
        if stage["kind"] == "autoregressive":
            stage["warmup"] = False  # (placement and restarts are tested here, not first use)
        if stage["name"] == "thinker":
            stage["replicas"] = 2
            stage["env"]["VLLM_CPU_KVCACHE_SPACE"] = "1"  # two engines' pools
            stage["ray"]["replica_resources"] = [{"node_a": 1}, {"node_b": 1}]
    return data


class Server:
    """``omni-serve --ray-address`` as its own process, with its output in a file."""

    def __init__(self, config: Path, ray_address: str, port: int, log: Path) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log
        self.proc = subprocess.Popen(
            [
                str(Path(sys.executable).with_name("omni-serve")),
                "--stage-config",
                str(config),
                "--ray-address",
                ray_address,
                "--api-key",
                API_KEY,
            ],
            stdin=subprocess.DEVNULL,
            stdout=log.open("wb"),
            stderr=subprocess.STDOUT,
        )

    def log(self, lines: int = 60) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def health(self) -> dict | None:
        try:
            r = httpx.get(self.url + "/health", timeout=10)
        except httpx.HTTPError:
            return None
        return {"code": r.status_code, **r.json()}

    def wait_health(self, ok: callable, timeout: float, what: str) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            h = self.health()
            if h is not None and ok(h):
                return h
            if self.proc.poll() is not None:
                raise AssertionError(f"omni-serve exited {self.proc.returncode}:\n{self.log()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"{what} not within {timeout:g} s (last /health {h}):\n{self.log()}")
            time.sleep(0.1)

    def stop(self) -> int:
        return stop_omni_serve(self.proc, 120, 30)


@pytest.fixture(scope="module")
def server(cluster, tmp_path_factory):
    address, _ = cluster
    tmp = tmp_path_factory.mktemp("ray")
    port = free_port()
    config = tmp / f"{NAME}.yaml"
    config.write_text(yaml.safe_dump(pipeline_config(port)))
    srv = Server(config, address, port, tmp / "omni-serve.log")
    srv.stage_pids: list[int] = []
    try:
        srv.wait_health(lambda h: h["code"] == 200 and h.get("status") == "ok", START_S, "every replica ready")
        yield srv
    finally:
        code = srv.stop()
        # No stage process outlives the server (each is owned by an actor the server killed).
        deadline = time.monotonic() + 60
        left = [p for p in srv.stage_pids if _alive(p)]
        while left and time.monotonic() < deadline:
            time.sleep(0.2)
            left = [p for p in left if _alive(p)]
        assert not left, f"stage processes left behind: {left}"
        assert code == 0, srv.log()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie of a dead actor counts as gone
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def actor_where(replica: str) -> dict:
    import ray

    return ray.get(ray.get_actor(f"{NAME}/{replica}", namespace="omni_cache").where.remote(), timeout=30)


def thinker_requests(server: Server) -> dict[str, float]:
    text = httpx.get(server.url + "/metrics", headers=HEADERS, timeout=30).text
    return {
        lab["replica"]: v
        for n, lab, v in parse_metrics(text)
        if n == "omni_cache_stage_requests_total" and lab["stage"] == "thinker"
    }


def test_each_thinker_replica_runs_on_the_node_its_resource_pins_it_to(cluster, server):
    _, nodes = cluster
    where = {r: actor_where(r) for r in ("thinker#0", "thinker#1", "talker", "decoder")}
    assert where["thinker#0"]["node_id"] == nodes["node_a"], (where, nodes)
    assert where["thinker#1"]["node_id"] == nodes["node_b"], (where, nodes)
    assert {w["node_id"] for w in where.values()} <= set(nodes.values())
    assert all(w["stage_pid"] for w in where.values()), where
    server.stage_pids += [w["stage_pid"] for w in where.values()]


def test_the_pipeline_answers_through_the_openai_client(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
    before = thinker_requests(server)
    texts = []
    for _ in range(2):  # round robin: one request on each thinker replica (each on its node)
        r = client.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": "hello from ray"}], max_tokens=8
        )
        texts.append(r.choices[0].message.content)
    after = thinker_requests(server)
    assert {k: after[k] - before.get(k, 0) for k in after} == {"0": 1, "1": 1}
    assert texts[0] and texts[0] == texts[1]  # one checkpoint, greedy: the node does not matter
    r = client.chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": "say it"}],
        max_tokens=6,
        modalities=["text", "audio"],
        audio={"voice": "default", "format": "wav"},
    )
    assert r.choices[0].message.audio.data  # thinker -> talker -> decoder, across actors


def test_a_killed_stage_process_restarts_through_its_actor_at_the_same_address(cluster, server):
    _, nodes = cluster
    before = actor_where("thinker#1")
    old_pid = before["stage_pid"]
    os.kill(old_pid, signal.SIGKILL)
    server.wait_health(lambda h: "thinker#1" in h.get("replicas", {}), 60, "thinker#1 reported down")
    server.wait_health(lambda h: h["code"] == 200 and h.get("status") == "ok", RESTART_S, "thinker#1 back")
    after = actor_where("thinker#1")
    assert after["node_id"] == nodes["node_b"] and after["stage_pid"] not in (None, old_pid)
    server.stage_pids.append(after["stage_pid"])
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
    counts = thinker_requests(server)
    for _ in range(2):
        client.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": "after the restart"}], max_tokens=4
        )
    # the restarted replica's counter started again at 0: it took one of the two
    assert thinker_requests(server)["1"] == 1, counts


def test_a_dead_actor_is_replaced_on_its_node_at_the_same_address(cluster, server):
    """Actor death (what a lost node looks like to the server) takes the same path as a process
    exit: reported down in Ray's words, then a new actor pinned to the same node runs the stage
    at the same address (the talker was started with it)."""
    import ray

    _, nodes = cluster
    old = ray.get_actor(f"{NAME}/thinker#1", namespace="omni_cache")
    old_pid = actor_where("thinker#1")["stage_pid"]
    ray.kill(old, no_restart=True)
    server.wait_health(lambda h: "thinker#1" in h.get("replicas", {}), 60, "thinker#1 reported down")
    server.wait_health(
        lambda h: h["code"] == 200 and h.get("status") == "ok", RESTART_S, "thinker#1 back on a new actor"
    )
    log = server.log_path.read_text(errors="replace")
    assert f"stage thinker#1 (pid {old_pid}) its Ray actor on Ray node" in log, server.log()
    assert "stage thinker#1: new Ray actor on node" in log, server.log()
    after = actor_where("thinker#1")  # the name now belongs to the new actor
    assert after["node_id"] == nodes["node_b"] and after["stage_pid"] not in (None, old_pid)
    server.stage_pids.append(after["stage_pid"])
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
    for _ in range(2):  # round robin: one lands on the new thinker#1, at its old address
        client.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": "after a new actor"}], max_tokens=4
        )
    assert thinker_requests(server)["1"] == 1


def test_ray_placed_stages_take_only_clients_with_the_runs_key(server):
    """Ray-placed stages listen on their nodes' network addresses. With no key file in the config
    the server makes a key for the run and hands it to every actor, so a peer without it cannot
    complete a handshake with any stage (CI's nodes listen beyond loopback: before, the stages
    refused such a config; a plain socket would have reached them)."""
    import re

    import zmq
    from zmq.utils.monitor import recv_monitor_message

    addresses = set(re.findall(r"listens at (tcp://\S+)", server.log_path.read_text(errors="replace")))
    assert len(addresses) == 4, server.log()
    ctx = zmq.Context()
    try:
        for address in sorted(addresses):
            sock = ctx.socket(zmq.DEALER)
            monitor = sock.get_monitor_socket()
            sock.connect(address)
            events = []
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not any(
                e in events for e in (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_SUCCEEDED)
            ):
                if monitor.poll(100):
                    events.append(recv_monitor_message(monitor)["event"])
            assert zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL in events, (address, events)
            assert zmq.EVENT_HANDSHAKE_SUCCEEDED not in events, address
            sock.disable_monitor()
            monitor.close(0)
            sock.close(0)
    finally:
        ctx.term()
