"""The pipelines of the routing benchmark (python -m benchmarks.routing): its stage config as two
replicas (or the one-replica reference) of a given KV pool, and that config placed by Ray on a
two-node cluster started on this machine, served from a background thread."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml


@contextlib.contextmanager
def ray_cluster() -> Iterator[str]:
    """Two logical Ray nodes on this machine, offering ``node_a`` and ``node_b``; yields the
    address, and shuts the cluster down whatever happens."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # every Ray process on 127.0.0.1
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 4, "resources": {"node_a": 1}})
    try:
        cluster.add_node(num_cpus=4, resources={"node_b": 1})
        cluster.wait_for_nodes()
        yield cluster.address
    finally:
        with contextlib.suppress(Exception):
            ray.shutdown()
        cluster.shutdown()


def ray_config(src: Path, dst: Path, address: str, tag: str) -> Path:
    """The two-replica config ``src`` placed by Ray at ``address``: the actors pick the addresses,
    thinker#0 goes to node_a and thinker#1 to node_b, the other stages wherever Ray puts them."""
    data = yaml.safe_load(src.read_text(encoding="utf-8"))
    data["name"] = f"bench-{os.getpid()}-{tag}"
    data["server"].update(ray_address=address, port=0, host="127.0.0.1", control_address=None)
    for stage in data["stages"]:
        stage.pop("address", None)
        stage.pop("bind_address", None)
        stage["ray"] = {"num_cpus": 1}
        if not stage.get("inputs"):
            stage["ray"]["replica_resources"] = [{"node_a": 1}, {"node_b": 1}]
    dst.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return dst


class RayServer:
    """The pipeline of ``config`` (Ray-placed) served over HTTP from a background thread, shaped
    like harness.ManagedServer for run_turn."""

    def __init__(self, config: Path, start_timeout_s: float = 900.0) -> None:
        self.config = config
        self.start_timeout_s = start_timeout_s
        self.server: Any = None
        self.url = ""
        self.startup_s = 0.0

    def __enter__(self) -> RayServer:
        from omni_cache.config import load_config
        from omni_cache.runtime.orchestrator import Orchestrator
        from omni_cache.serving.server import ServerThread

        t0 = time.monotonic()
        orch = Orchestrator(load_config(self.config), prefix_cache=True, echo_stage_logs=False)
        self.server = ServerThread(orch, log_level="error").start()
        self.url = self.server.url
        try:
            self.server.wait_ready(self.start_timeout_s)
        except BaseException:
            self.server.stop()
            raise
        self.startup_s = time.monotonic() - t0
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.stop()


def routing_config(
    src: str,
    dst: Path,
    *,
    replicas: int,
    pool_blocks: int,
    dtype: str | None,
    request_timeout_s: float,
    thinker_only: bool = False,
) -> Path:
    """``src`` with the entry stage (the stage without inputs) as ``replicas`` replicas of
    ``pool_blocks`` KV blocks each, ``prefix`` routing, and ``dtype`` for every vLLM stage;
    ``thinker_only``: the entry stage alone (text answers), without warm-up."""
    data = yaml.safe_load(Path(src).read_text(encoding="utf-8"))
    data.setdefault("server", {})["routing"] = "prefix"
    data["server"]["request_timeout_s"] = request_timeout_s
    if data.get("checkpoint_dir") and not os.path.isabs(str(data["checkpoint_dir"])):
        data["checkpoint_dir"] = os.path.abspath(str(data["checkpoint_dir"]))
    entry = [s for s in data["stages"] if not s.get("inputs")]
    if len(entry) != 1:
        raise ValueError(f"{src}: expected one entry stage, found {len(entry)}")
    for stage in data["stages"]:
        if stage.get("kind") == "autoregressive" and dtype:
            stage.setdefault("engine_args", {})["dtype"] = dtype
    thinker = entry[0]
    thinker["replicas"] = replicas
    if thinker_only:
        data["stages"] = [thinker]
        thinker.pop("pacing", None)  # nothing downstream to pace
        thinker["latents"] = {"hidden": False}
        thinker["warmup"] = False  # the benchmark's own warm-up requests run first
    args = thinker.setdefault("engine_args", {})
    # vLLM refuses a pool that cannot hold one request of max_model_len tokens and keeps one
    # block for itself (its null block).
    slots = (pool_blocks - 1) * int(args.get("block_size") or 16)
    if args.get("max_model_len") and args["max_model_len"] > slots:
        args["max_model_len"] = slots
    args.setdefault("extra", {})["num_gpu_blocks_override"] = pool_blocks
    dst.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return dst
