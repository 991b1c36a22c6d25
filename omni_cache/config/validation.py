"""The checks that span fields or stages, run after a config converted into the schema: the input
graph (unknown inputs, cycles, one entry stage), hand-off functions, kind-specific keys, model
references and addresses. Every problem is added to an :class:`~omni_cache.config.errors.IssueCollector`
with its key path."""

from __future__ import annotations

import difflib
import importlib
import os
import re
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

from omni_cache.config.engine_args_extra import extra_problems
from omni_cache.config.errors import IssueCollector
from omni_cache.config.schema import (
    EngineArgs, PipelineConfig, Sampling, StageConfig, find_input_cycle,
)
from omni_cache.config.replicas import replica_address, replica_name
from omni_cache.models.tiny import TINY_MODELS, TINY_PREFIX

#: True: check every stage's model path (and the stage key file); False: none; a collection of
#: stage names: only those stages' models (and the key file).
CheckPaths = bool | Collection[str]

_DOTTED_RE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)+$")
# Linux's sockaddr_un.sun_path holds 108 bytes including the terminating NUL.
_MAX_IPC_PATH_BYTES = 107


def validate_config(
    config: PipelineConfig, *, source: str | None = None, check_paths: CheckPaths = True
) -> PipelineConfig:
    """Run the cross-field checks on an already-built config (e.g. after CLI overrides).

    Returns ``config``; raises ConfigError listing every problem found.
    """
    issues = IssueCollector(source)
    collect_config_issues(config, issues, check_paths=check_paths)
    issues.raise_if_any()
    return config


def collect_config_issues(config: PipelineConfig, issues: IssueCollector, *, check_paths: CheckPaths) -> None:
    stages = config.stages
    names = [s.name for s in stages]
    known = set(names)
    name_list = ", ".join(names)

    first_index: dict[str, int] = {}
    for i, s in enumerate(stages):
        if s.name in first_index:
            issues.add(
                ("stages", i, "name"),
                f"duplicate stage name {s.name!r} (also stages[{first_index[s.name]}].name)",
            )
        else:
            first_index[s.name] = i

    graph_ok = True
    for i, s in enumerate(stages):
        base: tuple[str | int, ...] = ("stages", i)
        seen_inputs: set[str] = set()
        for j, inp in enumerate(s.inputs):
            if inp not in known:
                graph_ok = False
                close = difflib.get_close_matches(inp, names, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                issues.add(
                    (*base, "inputs", j), f"unknown stage {inp!r} (stages: {name_list}){hint}"
                )
            elif inp in seen_inputs:
                issues.add((*base, "inputs", j), f"stage {inp!r} is listed twice")
            seen_inputs.add(inp)

        if len(s.inputs) > 1:
            issues.add(
                (*base, "inputs"),
                f"{len(s.inputs)} input stages: a stage reads one input stage (its hand-off gets that "
                "stage's stream; merging streams is not supported)",
            )
        _check_handoff(s, base, issues)
        _check_kind_specific(s, base, issues)
        _check_model(s, base, issues,
                     check_paths=check_paths is True or (bool(check_paths) and s.name in check_paths))
        _check_sampling(s, base, issues)
        _check_replicas(s, base, issues)

    _check_pacing(config, issues)
    _check_addresses(config, issues)
    check_hand_started(config, {s.name for s in stages if s.external}, issues)
    _check_ray(config, issues)
    _check_server(config, issues, check_paths=bool(check_paths))

    if graph_ok and len(first_index) == len(stages):
        cycle = find_input_cycle(stages)
        if cycle:
            i = first_index[cycle[0]]
            issues.add(
                ("stages", i, "inputs"),
                "input cycle: " + " -> ".join(cycle) + " (each stage takes input from the one before)",
            )
        entries = [i for i, s in enumerate(stages) if not s.inputs]
        if not entries and not cycle:
            issues.add(("stages",), "no entry stage: exactly one stage must have no inputs")
        elif len(entries) > 1:
            entry_names = ", ".join(repr(stages[i].name) for i in entries)
            for i in entries[1:]:
                issues.add(
                    ("stages", i, "inputs"),
                    f"more than one entry stage ({entry_names} have no inputs): exactly one stage "
                    "takes the client's request; give the others the stages they read from",
                )

    finals = [(i, s) for i, s in enumerate(stages) if s.final_output is not None]
    if not finals:
        issues.add(
            ("stages",),
            "no stage has a final_output: at least one stage must return 'text' or 'audio' "
            "to the client",
        )
    seen_outputs: dict[str, int] = {}
    for i, s in finals:
        assert s.final_output is not None
        if s.final_output in seen_outputs:
            issues.add(
                ("stages", i, "final_output"),
                f"{s.final_output!r} is already the final output of "
                f"stages[{seen_outputs[s.final_output]}] "
                f"({stages[seen_outputs[s.final_output]].name!r}); each kind may come from one stage",
            )
        else:
            seen_outputs[s.final_output] = i


def _check_handoff(s: StageConfig, base: tuple[str | int, ...], issues: IssueCollector) -> None:
    if s.inputs and s.handoff is None:
        issues.add(
            (*base, "handoff"),
            "missing: a stage with inputs needs a hand-off function "
            "(dotted path 'package.module.function')",
        )
    elif not s.inputs and s.handoff is not None:
        issues.add(
            (*base, "handoff"),
            "only meaningful for a stage with inputs (this stage takes the client's request)",
        )
    elif s.handoff is not None:
        try:
            import_handoff(s.handoff)
        except ValueError as e:
            issues.add((*base, "handoff"), str(e))


def _check_kind_specific(s: StageConfig, base: tuple[str | int, ...], issues: IssueCollector) -> None:
    if s.kind == "autoregressive":
        if s.engine_args is None:
            issues.add(
                (*base, "engine_args"),
                "missing: required for an autoregressive stage (vLLM engine arguments)",
            )
        if s.generation is not None:
            issues.add(
                (*base, "generation"),
                "only for kind 'generation' stages (this one is autoregressive)",
            )
        layers = s.latents.layers
        dupes = sorted({x for x in layers if layers.count(x) > 1})
        if dupes:
            issues.add(
                (*base, "latents", "layers"),
                f"layer indices must be unique, repeated: {', '.join(map(str, dupes))}",
            )
        merged = s.latents.merged
        if merged is not None and merged.layer == merged.media_layer:
            issues.add((*base, "latents", "merged"),
                       f"layer and media_layer are both {merged.layer}: that is `layers: "
                       f"[{merged.layer}]`, not a merge")
        if s.submodel == "talker":
            if not s.inputs:
                issues.add((*base, "submodel"),
                           "'talker' reads a thinker's output: the stage needs `inputs`")
            if s.latents.any():
                issues.add((*base, "latents"),
                           "the talker emits codes, not latents: leave latents off")
        if s.engine_args is not None:
            _check_extra(s.engine_args, s.submodel, (*base, "engine_args", "extra"), issues)
            tp = s.engine_args.tensor_parallel_size
            if tp is not None and tp > 1:
                # The stage runs vLLM's engine core and its one worker in its own process, where
                # the worker's latents are read without serializing them (workers/llm_stage.py);
                # a multi-GPU executor puts the workers in other processes.
                issues.add(
                    (*base, "engine_args", "tensor_parallel_size"),
                    f"{tp} is not supported: a stage runs one in-process vLLM worker (1 GPU); "
                    "use a single GPU per stage",
                )
    else:
        if s.submodel is not None:
            issues.add((*base, "submodel"),
                       "only for autoregressive stages (a generation stage runs its checkpoint's decoder)")
        if s.engine_args is not None:
            issues.add(
                (*base, "engine_args"),
                "not allowed for a kind 'generation' stage (it runs no vLLM engine); "
                "use the 'generation' key",
            )
        if s.latents.any():
            issues.add(
                (*base, "latents"),
                "only meaningful for autoregressive stages (a generation stage emits no latents)",
            )
        if s.sampling != Sampling():
            issues.add(
                (*base, "sampling"),
                "only for autoregressive stages (a generation stage does not sample)",
            )
        if not s.prefix_cache:
            issues.add(
                (*base, "prefix_cache"),
                "only for autoregressive stages (a generation stage has no prefix cache)",
            )
        if not s.warmup:
            issues.add((*base, "warmup"),
                       "only for autoregressive stages (a generation stage has no vLLM engine to warm up)")


# (key, type word, bound check, bound text): the words msgspec used when these were schema
# constraints, so the messages read like the schema's own ("expected float >= 0.0, got -1.0").
_SAMPLING_RANGES: tuple[tuple[str, str, Callable[[float], bool], str], ...] = (
    ("temperature", "float", lambda v: v >= 0, ">= 0.0"),
    ("top_p", "float", lambda v: v > 0, "> 0.0"),
    ("top_p", "float", lambda v: v <= 1, "<= 1.0"),
    ("max_tokens", "int", lambda v: v >= 1, ">= 1"),
)


def _check_pacing(config: PipelineConfig, issues: IssueCollector) -> None:
    """A stage paces only answers that become audio, counted in its own units: tokens (stated
    in ``token_audio_s``) for an autoregressive stage, samples for a generation stage."""
    names = {s.name for s in config.stages}
    for i, s in enumerate(config.stages):
        if s.pacing is None:
            continue
        key = ("stages", i, "pacing")
        if s.kind == "autoregressive" and s.pacing.token_audio_s is None:
            issues.add((*key, "token_audio_s"), "missing: an autoregressive stage paces by its "
                       "tokens and needs the seconds of audio one token stands for (Qwen3-Omni: 0.08)")
        elif s.kind == "generation" and s.pacing.token_audio_s is not None:
            issues.add((*key, "token_audio_s"), "only for autoregressive stages (a generation "
                       "stage counts the audio samples it emits)")
        if s.kind == "autoregressive" and s.pacing.ahead_batch_size is not None:
            issues.add((*key, "ahead_batch_size"), "only for generation stages (vLLM sizes an "
                       "autoregressive stage's batches)")
        if s.pacing.max_lead_s is not None and s.pacing.max_lead_s < s.pacing.lead_s:
            issues.add((*key, "max_lead_s"), f"{s.pacing.max_lead_s:g} is below lead_s "
                       f"({s.pacing.lead_s:g}): an answer yields at lead_s and waits at max_lead_s")
        if not _reaches_audio(config, s.name, names):
            issues.add(key, f"stage {s.name!r} feeds no audio output (no stage with final_output "
                       "'audio' is it or reads from it): there is nothing to pace")


def _reaches_audio(config: PipelineConfig, name: str, names: set[str]) -> bool:
    seen, todo = set(), [name]
    while todo:
        current = todo.pop()
        if current in seen or current not in names:
            continue
        seen.add(current)
        if config.stage(current).final_output == "audio":
            return True
        todo.extend(s.name for s in config.stages if current in s.inputs)
    return False


def _check_sampling(s: StageConfig, base: tuple[str | int, ...], issues: IssueCollector) -> None:
    for key, word, ok, bound in _SAMPLING_RANGES:
        value = getattr(s.sampling, key)
        if not ok(value):
            issues.add((*base, "sampling", key), f"expected {word} {bound}, got {value!r}")
            return


def _check_extra(args: EngineArgs, submodel: str | None, base: tuple[str | int, ...],
                 issues: IssueCollector) -> None:
    typed = set(args.__struct_fields__) - {"extra"}
    for key_path, message in extra_problems(args.extra, typed=typed, submodel=submodel):
        issues.add((*base, *key_path), message)


def _check_model(
    s: StageConfig, base: tuple[str | int, ...], issues: IssueCollector, *, check_paths: bool
) -> None:
    key = (*base, "model")
    if s.model.startswith(TINY_PREFIX):
        tiny = s.model[len(TINY_PREFIX):]
        if tiny not in TINY_MODELS:
            issues.add(
                key,
                f"unknown tiny checkpoint {tiny!r} (known: "
                f"{', '.join(TINY_PREFIX + n for n in sorted(TINY_MODELS))})",
            )
        elif s.kind not in TINY_MODELS[tiny]:
            issues.add(
                key,
                f"{s.model!r} is for a stage of kind {' or '.join(map(repr, TINY_MODELS[tiny]))}, "
                f"but this stage's kind is {s.kind!r}",
            )
    elif not s.model.strip():
        issues.add(key, "expected 'tiny:<name>' or a filesystem path, got an empty string")
    elif check_paths and not Path(s.model).expanduser().exists():
        issues.add(
            key,
            f"path {s.model!r} does not exist (expected 'tiny:<name>' or an existing path; "
            "--no-path-check of omni-serve or python -m workers skips this check)",
        )


def _parse_address(address: str) -> tuple[str, str, int | None] | str:
    """("ipc", path, None) / ("tcp", host, port), or a message saying what is wrong."""
    if address.startswith("ipc://"):
        path = address[len("ipc://"):]
        if not path:
            return "expected 'ipc:///absolute/path', got an empty path"
        if not (path.startswith("/") or path.startswith("@")):
            return (
                f"ipc path {path!r} must be absolute (ipc:///path), so every process finds the "
                "same socket"
            )
        if len(path.encode()) > _MAX_IPC_PATH_BYTES:
            return (
                f"ipc path is {len(path.encode())} bytes, longer than the "
                f"{_MAX_IPC_PATH_BYTES} a Unix socket path may have"
            )
        return ("ipc", os.path.normpath(path) if path.startswith("/") else path, None)
    if address.startswith("tcp://"):
        rest = address[len("tcp://"):]
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


def _check_replicas(s: StageConfig, base: tuple[str | int, ...], issues: IssueCollector) -> None:
    if s.replicas > 1 and s.external:
        # The supervisor watches one announcing process per external stage; hand-started
        # replicas would need `python -m workers --replica i` on each host and a watch per replica.
        issues.add((*base, "replicas"),
                   f"{s.replicas} replicas of a stage started by hand (external) are not "
                   "supported: omni-serve spawns replicas itself; use replicas: 1 or drop external")


def _check_addresses(config: PipelineConfig, issues: IssueCollector) -> None:
    # (stage index, replica index, parsed endpoint) of every replica's address so far
    parsed: list[tuple[int, int, tuple[str, str, int | None]]] = []
    server = ("tcp", config.server.host.lower(), config.server.port)

    def owner(j: int, r: int) -> str:
        name = config.stages[j].name
        return (f"stages[{j}] ({name!r})" if r == 0
                else f"replica {r} of stages[{j}] ({replica_name(name, r, 2)!r})")

    for i, s in enumerate(config.stages):
        key = ("stages", i, "address")
        if config.placed_by_ray(s):
            continue  # its replicas listen where their actors say (_check_ray)
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
            where = (f"{s.address!r}" if r == 0
                     else f"replica {r}'s address {replica_address(s.address, r)!r}")
            rkey = key if r == 0 else ("stages", i, "replicas")
            if endpoint[0] == "tcp" and endpoint[2] is not None and endpoint[2] > 65535:
                issues.add(rkey, f"{where}: replica i listens on port + i, past 65535")
                break
            if endpoint[0] == "ipc" and len(endpoint[1].encode()) > _MAX_IPC_PATH_BYTES:
                issues.add(rkey, f"{where}: replica i listens at the path + '.i', longer than the "
                                 f"{_MAX_IPC_PATH_BYTES} bytes a Unix socket path may have")
                break
            clash = next(((j, q) for j, q, other in parsed if _same_endpoint(endpoint, other)), None)
            if clash is not None:
                issues.add(rkey, f"{where} is also the address of {owner(*clash)}; every stage "
                                 "(and every replica) needs its own")
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
                issues.add(("stages", i, "replicas"),
                           f"replica {s.replicas - 1} would bind port {bound[2] + s.replicas - 1} "
                           "(bind_address port + i), past 65535")
    if config.server.control_bind_address is not None:
        key = ("server", "control_bind_address")
        if config.server.control_address is None:
            issues.add(key, "needs server.control_address too (the address stages connect to)")
        else:
            _check_bind_address(config.server.control_bind_address, config.server.control_address,
                                key, issues)
    if config.server.control_address is not None:
        key = ("server", "control_address")
        result = _parse_address(config.server.control_address)
        if isinstance(result, str):
            issues.add(key, result)
        else:
            clash = next(((j, q) for j, q, other in parsed if _same_endpoint(result, other)), None)
            if clash is not None:
                issues.add(key, f"{config.server.control_address!r} is also the address of "
                                f"{owner(*clash)}")


def check_hand_started(config: PipelineConfig, names: Collection[str], issues: IssueCollector, *,
                       announces_to_config: bool = True) -> None:
    """The stages ``names`` are started by hand (``external``): they cannot learn an address the
    server chooses when it starts (omni_cache/config/addresses.py), so each needs its own
    address, the stages it sends to theirs, and (``announces_to_config``: not given on its
    command line) the orchestrator's inbox."""
    why = ("the server chooses a missing address when it starts, which a stage started by hand "
           "cannot learn")
    for i, s in enumerate(config.stages):
        if s.name not in names:
            continue
        if s.address is None and not s.replica_addresses:
            issues.add(("stages", i, "address"),
                       f"needed for a stage started by hand (external): {why}")
        for j, d in enumerate(config.stages):
            if (s.name in d.inputs and d.name not in names and d.address is None
                    and not d.replica_addresses and not config.placed_by_ray(d)):
                issues.add(("stages", j, "address"),
                           f"needed: stage {s.name!r}, started by hand (external), sends to this "
                           f"stage; {why}")
    if names and announces_to_config and config.server.control_address is None \
            and config.server.ray_address is None:  # with Ray: _check_ray says so
        issues.add(("server", "control_address"),
                   f"needed with stage(s) started by hand ({', '.join(sorted(names))}): they "
                   f"announce themselves there; {why}")


def _check_replica_addresses(s: StageConfig, i: int,
                             parsed: list[tuple[int, int, tuple[str, str, int | None]]],
                             owner: Callable[[int, int], str], issues: IssueCollector) -> None:
    """A stage with explicit per-replica addresses: one each, well-formed, none shared."""
    key = ("stages", i, "replica_addresses")
    if len(s.replica_addresses) != s.replicas:
        issues.add(key, f"{len(s.replica_addresses)} addresses for {s.replicas} replica(s): one "
                        "per replica")
        return
    if s.bind_address is not None:
        issues.add(("stages", i, "bind_address"),
                   "not with replica_addresses (each replica binds its own address)")
    for r, address in enumerate(s.replica_addresses):
        endpoint = _parse_address(address)
        if isinstance(endpoint, str):
            issues.add((*key, r), endpoint)
            return
        clash = next(((j, q) for j, q, other in parsed if _same_endpoint(endpoint, other)), None)
        if clash is not None:
            issues.add((*key, r), f"{address!r} is also the address of {owner(*clash)}; every "
                                  "stage (and every replica) needs its own")
            return
        parsed.append((i, r, endpoint))


#: Ray's own resource names: a stage asks for them through num_cpus / num_gpus, not ``resources``.
_RAY_BUILTIN_RESOURCES = {"CPU": "num_cpus", "GPU": "num_gpus", "memory": None,
                          "object_store_memory": None}


def _check_ray(config: PipelineConfig, issues: IssueCollector) -> None:
    """``server.ray_address`` and the stages' ``ray`` keys (omni_cache.runtime.ray_placement)."""
    address = config.server.ray_address
    if address is not None:
        key = ("server", "ray_address")
        host, sep, port = address.rpartition(":")
        if address.startswith("ray://"):
            issues.add(key, f"{address!r}: Ray Client addresses are not supported: the stages "
                            "connect back to this server over ZMQ, so omni-serve runs on a node "
                            "of the cluster; use 'auto' or the head's 'HOST:PORT'")
        elif address != "auto" and not (sep and host and port.isdigit() and 1 <= int(port) <= 65535):
            issues.add(key, f"expected 'auto' or the Ray head's 'HOST:PORT' (ray start --head "
                            f"prints it; 6379 by default), got {address!r}")
        control = config.server.control_address
        hand_started = [st.name for st in config.stages if st.external]
        if control is None and hand_started:
            issues.add(("server", "control_address"),
                       f"needed with server.ray_address and stage(s) started by hand "
                       f"({', '.join(hand_started)}): they announce themselves there (without it "
                       "omni-serve binds a port the OS picks)")
        if control is not None and control.startswith("ipc://"):
            issues.add(("server", "control_address"),
                       f"{control!r}: with server.ray_address the stages may run on other "
                       "hosts; use tcp://HOST:PORT (or leave it unset: omni-serve then binds "
                       "its node's IP on a free port)")
    for i, s in enumerate(config.stages):
        base: tuple[str | int, ...] = ("stages", i)
        if s.ray is not None and s.external:
            issues.add((*base, "ray"), "not for a stage started by hand (external): Ray does not "
                                       "place it; drop external or the ray key")
        if config.placed_by_ray(s):
            if s.replica_addresses:
                issues.add((*base, "replica_addresses"),
                           "not with server.ray_address: the replicas' actors pick their addresses")
            for up in s.inputs:
                upstream = next((u for u in config.stages if u.name == up), None)
                if upstream is not None and upstream.external:
                    issues.add((*base, "inputs"),
                               f"stage {up!r} is started by hand (external) and cannot reach "
                               f"{s.name!r}, whose address Ray decides at start; mark "
                               f"{s.name!r} external too, or let Ray place {up!r}")
            gpus_asked = s.ray is not None and s.ray.num_gpus > 0
            if gpus_asked and "CUDA_VISIBLE_DEVICES" in s.env:
                issues.add((*base, "env", "CUDA_VISIBLE_DEVICES"),
                           "not with ray.num_gpus: Ray gives each replica its GPUs (it sets "
                           "CUDA_VISIBLE_DEVICES for the replica's actor); this would override it")
        if s.ray is None:
            continue
        ray_key = (*base, "ray")
        maps = [("resources", s.ray.resources)] + [
            (("replica_resources", r), m) for r, m in enumerate(s.ray.replica_resources)]
        for where, mapping in maps:
            for name in mapping:
                sub = (where,) if isinstance(where, str) else where
                if not name.strip():
                    issues.add((*ray_key, *sub), "an empty resource name")
                elif mapping[name] <= 0:
                    # checked here, not in the schema, so the message names the resource
                    issues.add((*ray_key, *sub, name),
                               f"expected an amount > 0, got {mapping[name]:g}")
                elif name in _RAY_BUILTIN_RESOURCES:
                    instead = _RAY_BUILTIN_RESOURCES[name]
                    issues.add((*ray_key, *sub, name),
                               f"Ray's own resource: set ray.{instead} instead" if instead else
                               "Ray's own resource: not a placement constraint a stage sets")
        if s.ray.replica_resources and len(s.ray.replica_resources) != s.replicas:
            issues.add((*ray_key, "replica_resources"),
                       f"{len(s.ray.replica_resources)} entries for {s.replicas} replica(s): one "
                       "map per replica (or none)")
        gpus = s.ray.num_gpus
        if gpus > 1 and gpus != int(gpus):
            issues.add((*ray_key, "num_gpus"),
                       f"{gpus:g}: Ray gives fractions of one GPU only; above 1, a whole number")
        if (s.kind == "generation" and s.generation is not None
                and s.generation.device.startswith("cuda") and gpus == 0):
            issues.add((*ray_key, "num_gpus"),
                       f"0, but generation.device is {s.generation.device!r}: ask Ray for the GPU "
                       "the stage runs on (else Ray may place it on a node without one, or on a GPU "
                       "another replica holds)")


def _replica_endpoint(endpoint: tuple[str, str, int | None], index: int) -> tuple[str, str, int | None]:
    """The parsed address of replica ``index`` (the rule of omni_cache.config.replicas)."""
    kind, where, port = endpoint
    if kind == "ipc":
        return (kind, f"{where}.{index}", None)
    assert port is not None
    return (kind, where, port + index)


def import_handoff(dotted: str) -> Callable[..., Any]:
    if not isinstance(dotted, str) or not _DOTTED_RE.match(dotted):
        raise ValueError(f"expected a dotted path 'package.module.function', got {dotted!r}")
    module_name, _, attr = dotted.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise ValueError(f"cannot import module {module_name!r} ({e})") from e
    except Exception as e:  # noqa: BLE001 -- whatever the module raised while importing
        raise ValueError(
            f"importing module {module_name!r} failed: {type(e).__name__}: {e}"
        ) from e
    try:
        fn = getattr(module, attr)
    except AttributeError:
        raise ValueError(f"module {module_name!r} has no attribute {attr!r}") from None
    if not callable(fn):
        raise ValueError(f"{dotted!r} is not callable (it is a {type(fn).__name__})")
    return fn


def _check_bind_address(bind: str, address: str, key: tuple[str | int, ...], issues: IssueCollector) -> None:
    """A bind address is tcp when the advertised one is (ipc paths need no split) and parses."""
    result = _parse_address(bind)
    if isinstance(result, str):
        issues.add(key, result)
    elif result[0] != "tcp" or not address.startswith("tcp://"):
        issues.add(key, f"{bind!r}: a bind address is for tcp (bind tcp://0.0.0.0:PORT, advertise "
                        "tcp://HOST:PORT); with ipc:// bind and connect the same path")


def _check_server(config: PipelineConfig, issues: IssueCollector, *, check_paths: bool) -> None:
    server = config.server
    if server.max_body_bytes_in_flight < server.max_body_bytes:
        issues.add(("server", "max_body_bytes_in_flight"),
                   f"must be at least server.max_body_bytes ({server.max_body_bytes}), got "
                   f"{server.max_body_bytes_in_flight}: no body of that size could be read")
    if server.heartbeat_timeout_s <= server.heartbeat_interval_s:
        issues.add(("server", "heartbeat_timeout_s"),
                   f"must be longer than server.heartbeat_interval_s ({server.heartbeat_interval_s:g} s), "
                   f"got {server.heartbeat_timeout_s:g} s")
    if server.media.video_min_frames > server.media.video_max_frames:
        issues.add(("server", "media", "video_min_frames"),
                   f"must be at most server.media.video_max_frames ({server.media.video_max_frames}), "
                   f"got {server.media.video_min_frames}")
    for i, s in enumerate(config.stages):
        # A step shorter than the heartbeat timeout is never long: the limit would judge nothing.
        if s.step_timeout_s is not None and s.step_timeout_s <= server.heartbeat_timeout_s:
            issues.add(("stages", i, "step_timeout_s"),
                       f"must be longer than server.heartbeat_timeout_s "
                       f"({server.heartbeat_timeout_s:g} s), got {s.step_timeout_s:g} s")
    key_file = server.stage_auth_key_file
    if key_file is not None and check_paths and not Path(key_file).expanduser().is_file():
        issues.add(("server", "stage_auth_key_file"),
                   f"no such file {key_file!r} (python -m omni_cache.wire.stage_auth new-key FILE "
                   "writes one; --no-path-check skips this check)")
