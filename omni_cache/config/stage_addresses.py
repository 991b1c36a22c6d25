"""Where a pipeline's stages listen and run: their addresses (tcp/ipc, distinct endpoints, bind
versus advertised), replicas' addresses, hand-started stages' explicit addresses and Ray
placement resources. Part of the config checks (:mod:`omni_cache.config.validation`): every problem
is added to an :class:`~omni_cache.config.errors.IssueCollector` with its key path."""

from __future__ import annotations

import os
from collections.abc import Callable, Collection

from omni_cache.config.errors import IssueCollector
from omni_cache.config.replicas import replica_address, replica_name
from omni_cache.config.schema import PipelineConfig, StageConfig

# Linux's sockaddr_un.sun_path holds 108 bytes including the terminating NUL.
_MAX_IPC_PATH_BYTES = 107


def _parse_address(address: str) -> tuple[str, str, int | None] | str:
    """("ipc", path, None) / ("tcp", host, port), or a message saying what is wrong."""
    if address.startswith("ipc://"):
        path = address[len("ipc://") :]
        if not path:
            return "expected 'ipc:///absolute/path', got an empty path"
        if not (path.startswith("/") or path.startswith("@")):
            return f"ipc path {path!r} must be absolute (ipc:///path), so every process finds the same socket"
        if len(path.encode()) > _MAX_IPC_PATH_BYTES:
            return (
                f"ipc path is {len(path.encode())} bytes, longer than the "
                f"{_MAX_IPC_PATH_BYTES} a Unix socket path may have"
            )
        return ("ipc", os.path.normpath(path) if path.startswith("/") else path, None)
    if address.startswith("tcp://"):
        rest = address[len("tcp://") :]
        host, sep, port_s = rest.rpartition(":")
        if not sep or not host:
            return f"expected 'tcp://host:port', got {address!r}"
        if host.startswith("[") and host.endswith("]"):
            host = host[1:-1]
        if not host or host == "*":
            return (
                f"expected a concrete host in {address!r} (the orchestrator connects to it; "
                "use 0.0.0.0 to listen on every interface)"
            )
        if not port_s.isdigit() or not 1 <= int(port_s) <= 65535:
            return f"expected a port 1..65535 in {address!r}, got {port_s!r}"
        return ("tcp", host.lower(), int(port_s))
    scheme = address.split("://", 1)[0] if "://" in address else None
    got = f"scheme {scheme!r}" if scheme else repr(address)
    return f"expected 'ipc:///path' or 'tcp://host:port', got {got}"


_ANY_HOST = {"0.0.0.0", "::"}


def _same_endpoint(a: tuple[str, str, int | None], b: tuple[str, str, int | None]) -> bool:
    if a[0] != b[0]:
        return False
    if a[0] == "ipc":
        return a[1] == b[1]
    return a[2] == b[2] and (a[1] == b[1] or a[1] in _ANY_HOST or b[1] in _ANY_HOST)


def check_replicas(s: StageConfig, base: tuple[str | int, ...], issues: IssueCollector) -> None:
    if s.replicas > 1 and s.external:
        # The supervisor watches one announcing process per external stage; hand-started
        # replicas would need `python -m workers --replica i` on each host and a watch per replica.
        issues.add(
            (*base, "replicas"),
            f"{s.replicas} replicas of a stage started by hand (external) are not "
            "supported: omni-serve spawns replicas itself; use replicas: 1 or drop external",
        )


def check_addresses(config: PipelineConfig, issues: IssueCollector) -> None:
    # (stage index, replica index, parsed endpoint) of every replica's address so far
    parsed: list[tuple[int, int, tuple[str, str, int | None]]] = []
    server = ("tcp", config.server.host.lower(), config.server.port)

    def owner(j: int, r: int) -> str:
        name = config.stages[j].name
        return f"stages[{j}] ({name!r})" if r == 0 else f"replica {r} of stages[{j}] ({replica_name(name, r, 2)!r})"

    for i, s in enumerate(config.stages):
        key = ("stages", i, "address")
        if config.placed_by_ray(s):
            continue  # its replicas listen where their actors say (check_ray)
        if s.replica_addresses:
            _check_replica_addresses(s, i, parsed, owner, issues)
            continue
        if s.address is None:
            continue  # the server chooses one (omni_cache/config/addresses.py); check_hand_started
        result = _parse_address(s.address)
        if isinstance(result, str):
            issues.add(key, result)
            continue
        for r in range(s.replicas):
            endpoint = result if r == 0 else _replica_endpoint(result, r)
            where = f"{s.address!r}" if r == 0 else f"replica {r}'s address {replica_address(s.address, r)!r}"
            rkey = key if r == 0 else ("stages", i, "replicas")
            if endpoint[0] == "tcp" and endpoint[2] is not None and endpoint[2] > 65535:
                issues.add(rkey, f"{where}: replica i listens on port + i, past 65535")
                break
            if endpoint[0] == "ipc" and len(endpoint[1].encode()) > _MAX_IPC_PATH_BYTES:
                issues.add(
                    rkey,
                    f"{where}: replica i listens at the path + '.i', longer than the "
                    f"{_MAX_IPC_PATH_BYTES} bytes a Unix socket path may have",
                )
                break
            clash = next(((j, q) for j, q, other in parsed if _same_endpoint(endpoint, other)), None)
            if clash is not None:
                issues.add(
                    rkey,
                    f"{where} is also the address of {owner(*clash)}; every stage (and every replica) needs its own",
                )
                break
            if config.server.port and _same_endpoint(endpoint, server):
                issues.add(rkey, f"{where} is the HTTP server's port (server.port)")
                break
            parsed.append((i, r, endpoint))
    for i, s in enumerate(config.stages):
        if s.bind_address is not None and s.address is not None and not config.placed_by_ray(s):
            _check_bind_address(s.bind_address, s.address, ("stages", i, "bind_address"), issues)
            bound = _parse_address(s.bind_address)
            if not isinstance(bound, str) and bound[2] is not None and bound[2] + s.replicas - 1 > 65535:
                issues.add(
                    ("stages", i, "replicas"),
                    f"replica {s.replicas - 1} would bind port {bound[2] + s.replicas - 1} "
                    "(bind_address port + i), past 65535",
                )
    if config.server.control_bind_address is not None:
        key = ("server", "control_bind_address")
        if config.server.control_address is None:
            issues.add(key, "needs server.control_address too (the address stages connect to)")
        else:
            _check_bind_address(config.server.control_bind_address, config.server.control_address, key, issues)
    if config.server.control_address is not None:
        key = ("server", "control_address")
        result = _parse_address(config.server.control_address)
        if isinstance(result, str):
            issues.add(key, result)
        else:
            clash = next(((j, q) for j, q, other in parsed if _same_endpoint(result, other)), None)
            if clash is not None:
                issues.add(key, f"{config.server.control_address!r} is also the address of {owner(*clash)}")


def check_hand_started(
    config: PipelineConfig, names: Collection[str], issues: IssueCollector, *, announces_to_config: bool = True
) -> None:
    """The stages ``names`` are started by hand (``external``): they cannot learn an address the
    server chooses when it starts (omni_cache/config/addresses.py), so each needs its own
    address, the stages it sends to theirs, and (``announces_to_config``: not given on its
    command line) the orchestrator's inbox."""
    why = "the server chooses a missing address when it starts, which a stage started by hand cannot learn"
    for i, s in enumerate(config.stages):
        if s.name not in names:
            continue
        if s.address is None and not s.replica_addresses:
            issues.add(("stages", i, "address"), f"needed for a stage started by hand (external): {why}")
        for j, d in enumerate(config.stages):
            if (
                s.name in d.inputs
                and d.name not in names
                and d.address is None
                and not d.replica_addresses
                and not config.placed_by_ray(d)
            ):
                issues.add(
                    ("stages", j, "address"),
                    f"needed: stage {s.name!r}, started by hand (external), sends to this stage; {why}",
                )
    if (
        names and announces_to_config and config.server.control_address is None and config.server.ray_address is None
    ):  # with Ray: check_ray says so
        issues.add(
            ("server", "control_address"),
            f"needed with stage(s) started by hand ({', '.join(sorted(names))}): they announce themselves there; {why}",
        )


def _check_replica_addresses(
    s: StageConfig,
    i: int,
    parsed: list[tuple[int, int, tuple[str, str, int | None]]],
    owner: Callable[[int, int], str],
    issues: IssueCollector,
) -> None:
    """A stage with explicit per-replica addresses: one each, well-formed, none shared."""
    key = ("stages", i, "replica_addresses")
    if len(s.replica_addresses) != s.replicas:
        issues.add(key, f"{len(s.replica_addresses)} addresses for {s.replicas} replica(s): one per replica")
        return
    if s.bind_address is not None:
        issues.add(("stages", i, "bind_address"), "not with replica_addresses (each replica binds its own address)")
    for r, address in enumerate(s.replica_addresses):
        endpoint = _parse_address(address)
        if isinstance(endpoint, str):
            issues.add((*key, r), endpoint)
            return
        clash = next(((j, q) for j, q, other in parsed if _same_endpoint(endpoint, other)), None)
        if clash is not None:
            issues.add(
                (*key, r),
                f"{address!r} is also the address of {owner(*clash)}; every stage (and every replica) needs its own",
            )
            return
        parsed.append((i, r, endpoint))


#: Ray's own resource names: a stage asks for them through num_cpus / num_gpus, not ``resources``.
_RAY_BUILTIN_RESOURCES = {"CPU": "num_cpus", "GPU": "num_gpus", "memory": None, "object_store_memory": None}


def check_ray(config: PipelineConfig, issues: IssueCollector) -> None:
    """``server.ray_address`` and the stages' ``ray`` keys (omni_cache.runtime.supervision.ray_placement)."""
    address = config.server.ray_address
    if address is not None:
        key = ("server", "ray_address")
        host, sep, port = address.rpartition(":")
        if address.startswith("ray://"):
            issues.add(
                key,
                f"{address!r}: Ray Client addresses are not supported: the stages "
                "connect back to this server over ZMQ, so omni-serve runs on a node "
                "of the cluster; use 'auto' or the head's 'HOST:PORT'",
            )
        elif address != "auto" and not (sep and host and port.isdigit() and 1 <= int(port) <= 65535):
            issues.add(
                key,
                f"expected 'auto' or the Ray head's 'HOST:PORT' (ray start --head "
                f"prints it; 6379 by default), got {address!r}",
            )
        control = config.server.control_address
        hand_started = [st.name for st in config.stages if st.external]
        if control is None and hand_started:
            issues.add(
                ("server", "control_address"),
                f"needed with server.ray_address and stage(s) started by hand "
                f"({', '.join(hand_started)}): they announce themselves there (without it "
                "omni-serve binds a port the OS picks)",
            )
        if control is not None and control.startswith("ipc://"):
            issues.add(
                ("server", "control_address"),
                f"{control!r}: with server.ray_address the stages may run on other "
                "hosts; use tcp://HOST:PORT (or leave it unset: omni-serve then binds "
                "its node's IP on a free port)",
            )
    for i, s in enumerate(config.stages):
        base: tuple[str | int, ...] = ("stages", i)
        if s.ray is not None and s.external:
            issues.add(
                (*base, "ray"),
                "not for a stage started by hand (external): Ray does not place it; drop external or the ray key",
            )
        if config.placed_by_ray(s):
            if s.replica_addresses:
                issues.add(
                    (*base, "replica_addresses"),
                    "not with server.ray_address: the replicas' actors pick their addresses",
                )
            for up in s.inputs:
                upstream = next((u for u in config.stages if u.name == up), None)
                if upstream is not None and upstream.external:
                    issues.add(
                        (*base, "inputs"),
                        f"stage {up!r} is started by hand (external) and cannot reach "
                        f"{s.name!r}, whose address Ray decides at start; mark "
                        f"{s.name!r} external too, or let Ray place {up!r}",
                    )
            gpus_asked = s.ray is not None and s.ray.num_gpus > 0
            if gpus_asked and "CUDA_VISIBLE_DEVICES" in s.env:
                issues.add(
                    (*base, "env", "CUDA_VISIBLE_DEVICES"),
                    "not with ray.num_gpus: Ray gives each replica its GPUs (it sets "
                    "CUDA_VISIBLE_DEVICES for the replica's actor); this would override it",
                )
        if s.ray is None:
            continue
        ray_key = (*base, "ray")
        maps = [("resources", s.ray.resources)] + [
            (("replica_resources", r), m) for r, m in enumerate(s.ray.replica_resources)
        ]
        for where, mapping in maps:
            for name in mapping:
                sub = (where,) if isinstance(where, str) else where
                if not name.strip():
                    issues.add((*ray_key, *sub), "an empty resource name")
                elif mapping[name] <= 0:
                    # checked here, not in the schema, so the message names the resource
                    issues.add((*ray_key, *sub, name), f"expected an amount > 0, got {mapping[name]:g}")
                elif name in _RAY_BUILTIN_RESOURCES:
                    instead = _RAY_BUILTIN_RESOURCES[name]
                    issues.add(
                        (*ray_key, *sub, name),
                        f"Ray's own resource: set ray.{instead} instead"
                        if instead
                        else "Ray's own resource: not a placement constraint a stage sets",
                    )
        if s.ray.replica_resources and len(s.ray.replica_resources) != s.replicas:
            issues.add(
                (*ray_key, "replica_resources"),
                f"{len(s.ray.replica_resources)} entries for {s.replicas} replica(s): one map per replica (or none)",
            )
        gpus = s.ray.num_gpus
        if gpus > 1 and gpus != int(gpus):
            issues.add(
                (*ray_key, "num_gpus"), f"{gpus:g}: Ray gives fractions of one GPU only; above 1, a whole number"
            )
        if s.kind == "generation" and s.generation is not None and s.generation.device.startswith("cuda") and gpus == 0:
            issues.add(
                (*ray_key, "num_gpus"),
                f"0, but generation.device is {s.generation.device!r}: ask Ray for the GPU "
                "the stage runs on (else Ray may place it on a node without one, or on a GPU "
                "another replica holds)",
            )


def _replica_endpoint(endpoint: tuple[str, str, int | None], index: int) -> tuple[str, str, int | None]:
    """The parsed address of replica ``index`` (the rule of omni_cache.config.replicas)."""
    kind, where, port = endpoint
    if kind == "ipc":
        return (kind, f"{where}.{index}", None)
    assert port is not None
    return (kind, where, port + index)


def _check_bind_address(bind: str, address: str, key: tuple[str | int, ...], issues: IssueCollector) -> None:
    """A bind address is tcp when the advertised one is (ipc paths need no split) and parses."""
    result = _parse_address(bind)
    if isinstance(result, str):
        issues.add(key, result)
    elif result[0] != "tcp" or not address.startswith("tcp://"):
        issues.add(
            key,
            f"{bind!r}: a bind address is for tcp (bind tcp://0.0.0.0:PORT, advertise "
            "tcp://HOST:PORT); with ipc:// bind and connect the same path",
        )
