"""Stage traffic reachable from the network: a socket bound beyond loopback without a CURVE key is
refused at config check.

Stage messages are typed and never unpickled, but a stage takes any well-formed message on its
inbox (a Submit runs a request; an Abort ends one) and the orchestrator's inbox takes any stage's
outputs. Bound to ``tcp://0.0.0.0`` or a host's network address without
``server.stage_auth_key_file``, anyone who reaches the port can send them. Such a config is
refused, with the command that makes a key (:mod:`omni_cache.wire.stage_auth`), unless
``server.allow_unauthenticated_stages`` says the network is trusted (the server then logs a
warning at every start). ipc:// sockets and loopback tcp addresses are reachable only from this
host and need no key. Where Ray places a stage its address is chosen at start, not checked here:
without a key file the server makes a key for the run and gives it to every Ray actor
(:mod:`omni_cache.runtime.supervision.placement`), so those stages' traffic is authenticated too."""

from __future__ import annotations

import ipaddress

from omni_cache.config.errors import IssueCollector
from omni_cache.config.schema import PipelineConfig

__all__ = ["beyond_loopback", "check_stage_exposure", "exposed_sockets"]

_KEY_HELP = (
    "without server.stage_auth_key_file anyone who reaches it can send the pipeline's stages "
    "messages: make a key with 'python -m omni_cache.wire.stage_auth new-key FILE', copy the file "
    "to every host and set server.stage_auth_key_file to it (or bind a loopback or ipc:// address; "
    "server.allow_unauthenticated_stages: true accepts this on a network you trust)"
)


def beyond_loopback(address: str) -> bool:
    """Whether a tcp:// address can be reached from other hosts (0.0.0.0, ::, a network address
    or a host name other than localhost). ipc:// and malformed addresses: False (checked elsewhere)."""
    if not address.startswith("tcp://"):
        return False
    host = address[len("tcp://") :].rpartition(":")[0].strip("[]").lower()
    if host == "localhost":
        return False
    try:
        return not ipaddress.ip_address(host).is_loopback
    except ValueError:
        return bool(host)  # a host name: other hosts resolve it too


def exposed_sockets(config: PipelineConfig) -> list[tuple[tuple[str | int, ...], str]]:
    """``(key path, address)`` of every socket the config binds beyond loopback."""
    found: list[tuple[tuple[str | int, ...], str]] = []
    server = config.server
    control = server.control_bind_address or server.control_address
    if control is not None and beyond_loopback(control):
        found.append(
            (("server", "control_bind_address" if server.control_bind_address else "control_address"), control)
        )
    for i, s in enumerate(config.stages):
        if config.placed_by_ray(s):
            continue
        bound = [("bind_address", s.bind_address)] if s.bind_address else [("address", s.address)]
        bound += [("replica_addresses", a) for a in s.replica_addresses]
        found += [(("stages", i, key), a) for key, a in bound if a is not None and beyond_loopback(a)]
    return found


def check_stage_exposure(config: PipelineConfig, issues: IssueCollector) -> None:
    if config.server.stage_auth_key_file is not None or config.server.allow_unauthenticated_stages:
        return
    for key, address in exposed_sockets(config):
        issues.add(key, f"{address!r} listens beyond loopback; {_KEY_HELP}")
