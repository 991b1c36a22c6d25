"""A stage's replicas: their names and the addresses each one binds and is reached at.

A stage with ``replicas: N`` runs N identical processes. Each needs its own inbox, so each gets its
own address, derived from the stage's ``address`` (and ``bind_address``):

* replica 0 keeps the configured address unchanged (a one-replica stage is exactly what it was);
* replica i > 0 of an ``ipc:///path`` stage listens at ``ipc:///path.i``;
* replica i > 0 of a ``tcp://host:port`` stage listens at ``tcp://host:port+i``;
* a stage with ``replica_addresses`` (Ray-placed stages: omni-serve fills them with what the
  replicas' actors reported) listens where that list says, and binds the same.

Names: a stage with one replica keeps its plain name (``thinker``) in logs, errors, ``/health``
and pids; a stage with N > 1 replicas calls them ``thinker#0`` .. ``thinker#N-1``. Metrics carry
the index as a ``replica`` label beside ``stage`` in both cases.

Nothing here imports vLLM or torch.
"""

from __future__ import annotations

from typing import NamedTuple

from omni_cache.config.schema import StageConfig


class Replica(NamedTuple):
    """One replica of a stage: which stage, which index, and where it listens."""

    stage: str
    index: int
    #: ``stage`` for a one-replica stage, ``stage#index`` otherwise.
    name: str
    #: What the others connect to.
    address: str
    #: What it binds (None: ``address``).
    bind_address: str | None


def replica_name(stage: str, index: int, count: int) -> str:
    """``thinker`` when the stage has one replica, ``thinker#1`` otherwise."""
    return stage if count == 1 else f"{stage}#{index}"


def replica_address(address: str, index: int) -> str:
    """The address of replica ``index`` of a stage configured at ``address`` (see the module doc).

    The address is assumed well-formed (validation parses it first); ValueError otherwise."""
    if index == 0:
        return address
    if address.startswith("ipc://"):
        return f"{address}.{index}"
    if address.startswith("tcp://"):
        host, sep, port = address.rpartition(":")
        if not sep or not port.isdigit():
            raise ValueError(f"expected tcp://host:port, got {address!r}")
        return f"{host}:{int(port) + index}"
    raise ValueError(f"expected 'ipc://' or 'tcp://', got {address!r}")


def stage_replicas(stage: StageConfig) -> list[Replica]:
    """Every replica of ``stage``, by index. ValueError for a stage whose addresses are not known
    yet (placed by Ray, before its actors reported them)."""
    n = stage.replicas
    if stage.replica_addresses:
        return [
            Replica(stage=stage.name, index=i, name=replica_name(stage.name, i, n), address=address, bind_address=None)
            for i, address in enumerate(stage.replica_addresses)
        ]
    if stage.address is None:
        raise ValueError(
            f"stage {stage.name!r} has no address yet (Ray places it: its replicas' addresses come from their actors)"
        )
    return [
        Replica(
            stage=stage.name,
            index=i,
            name=replica_name(stage.name, i, n),
            address=replica_address(stage.address, i),
            bind_address=(replica_address(stage.bind_address, i) if stage.bind_address is not None else None),
        )
        for i in range(n)
    ]


def reports_blocks(policy: str, stage: str, entry: str, replicas: int, prefix_cache: bool) -> bool:
    """Whether a replica of ``stage`` reports the blocks its prefix cache holds: the entry stage
    with several replicas, prefix caching on and ``prefix`` routing (nobody else reads them)."""
    return policy == "prefix" and stage == entry and replicas > 1 and prefix_cache
