"""The checks that span fields or stages, run after a config converted into the schema: the input
graph (unknown inputs, cycles, one entry stage), hand-off functions, kind-specific keys, model
references and the server's limits (addresses and placement: :mod:`.stage_addresses`). Every
problem is added to an :class:`~omni_cache.config.errors.IssueCollector` with its key path."""

from __future__ import annotations

import difflib
import importlib
import re
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

from omni_cache.config.engine_args_extra import extra_problems
from omni_cache.config.errors import IssueCollector
from omni_cache.config.schema import EngineArgs, PipelineConfig, Sampling, StageConfig, find_input_cycle
from omni_cache.config.stage_addresses import check_addresses, check_hand_started, check_ray, check_replicas
from omni_cache.config.stage_exposure import check_stage_exposure
from omni_cache.tiny.registry import TINY_MODELS, TINY_PREFIX

#: True: check every stage's model path (and the stage key file); False: none; a collection of
#: stage names: only those stages' models (and the key file).
CheckPaths = bool | Collection[str]

_DOTTED_RE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)+$")


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
                issues.add((*base, "inputs", j), f"unknown stage {inp!r} (stages: {name_list}){hint}")
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
        _check_model(s, base, issues, check_paths=check_paths is True or (bool(check_paths) and s.name in check_paths))
        _check_sampling(s, base, issues)
        check_replicas(s, base, issues)

    _check_pacing(config, issues)
    check_addresses(config, issues)
    check_hand_started(config, {s.name for s in stages if s.external}, issues)
    check_ray(config, issues)
    check_stage_exposure(config, issues)
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
            "no stage has a final_output: at least one stage must return 'text' or 'audio' to the client",
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
            "missing: a stage with inputs needs a hand-off function (dotted path 'package.module.function')",
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
            issues.add(
                (*base, "latents", "merged"),
                f"layer and media_layer are both {merged.layer}: that is `layers: [{merged.layer}]`, not a merge",
            )
        if s.submodel == "talker":
            if not s.inputs:
                issues.add((*base, "submodel"), "'talker' reads a thinker's output: the stage needs `inputs`")
            if s.latents.any():
                issues.add((*base, "latents"), "the talker emits codes, not latents: leave latents off")
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
            issues.add(
                (*base, "submodel"), "only for autoregressive stages (a generation stage runs its checkpoint's decoder)"
            )
        if s.engine_args is not None:
            issues.add(
                (*base, "engine_args"),
                "not allowed for a kind 'generation' stage (it runs no vLLM engine); use the 'generation' key",
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
            issues.add(
                (*base, "warmup"), "only for autoregressive stages (a generation stage has no vLLM engine to warm up)"
            )


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
            issues.add(
                (*key, "token_audio_s"),
                "missing: an autoregressive stage paces by its "
                "tokens and needs the seconds of audio one token stands for (Qwen3-Omni: 0.08)",
            )
        elif s.kind == "generation" and s.pacing.token_audio_s is not None:
            issues.add(
                (*key, "token_audio_s"),
                "only for autoregressive stages (a generation stage counts the audio samples it emits)",
            )
        if s.kind == "autoregressive" and s.pacing.ahead_batch_size is not None:
            issues.add(
                (*key, "ahead_batch_size"), "only for generation stages (vLLM sizes an autoregressive stage's batches)"
            )
        if s.pacing.max_lead_s is not None and s.pacing.max_lead_s < s.pacing.lead_s:
            issues.add(
                (*key, "max_lead_s"),
                f"{s.pacing.max_lead_s:g} is below lead_s "
                f"({s.pacing.lead_s:g}): an answer yields at lead_s and waits at max_lead_s",
            )
        if not _reaches_audio(config, s.name, names):
            issues.add(
                key,
                f"stage {s.name!r} feeds no audio output (no stage with final_output "
                "'audio' is it or reads from it): there is nothing to pace",
            )


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


def _check_extra(args: EngineArgs, submodel: str | None, base: tuple[str | int, ...], issues: IssueCollector) -> None:
    typed = set(args.__struct_fields__) - {"extra"}
    for key_path, message in extra_problems(args.extra, typed=typed, submodel=submodel):
        issues.add((*base, *key_path), message)


def _check_model(s: StageConfig, base: tuple[str | int, ...], issues: IssueCollector, *, check_paths: bool) -> None:
    key = (*base, "model")
    if s.model.startswith(TINY_PREFIX):
        tiny = s.model[len(TINY_PREFIX) :]
        if tiny not in TINY_MODELS:
            issues.add(
                key,
                f"unknown tiny checkpoint {tiny!r} (known: {', '.join(TINY_PREFIX + n for n in sorted(TINY_MODELS))})",
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


def import_handoff(dotted: str) -> Callable[..., Any]:
    if not isinstance(dotted, str) or not _DOTTED_RE.match(dotted):
        raise ValueError(f"expected a dotted path 'package.module.function', got {dotted!r}")
    module_name, _, attr = dotted.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise ValueError(f"cannot import module {module_name!r} ({e})") from e
    except Exception as e:  # noqa: BLE001 -- whatever the module raised while importing
        raise ValueError(f"importing module {module_name!r} failed: {type(e).__name__}: {e}") from e
    try:
        fn = getattr(module, attr)
    except AttributeError:
        raise ValueError(f"module {module_name!r} has no attribute {attr!r}") from None
    if not callable(fn):
        raise ValueError(f"{dotted!r} is not callable (it is a {type(fn).__name__})")
    return fn


def _check_server(config: PipelineConfig, issues: IssueCollector, *, check_paths: bool) -> None:
    server = config.server
    if server.max_body_bytes_in_flight < server.max_body_bytes:
        issues.add(
            ("server", "max_body_bytes_in_flight"),
            f"must be at least server.max_body_bytes ({server.max_body_bytes}), got "
            f"{server.max_body_bytes_in_flight}: no body of that size could be read",
        )
    if server.heartbeat_timeout_s <= server.heartbeat_interval_s:
        issues.add(
            ("server", "heartbeat_timeout_s"),
            f"must be longer than server.heartbeat_interval_s ({server.heartbeat_interval_s:g} s), "
            f"got {server.heartbeat_timeout_s:g} s",
        )
    if server.realtime.max_message_bytes < server.realtime.max_event_bytes:
        issues.add(
            ("server", "realtime", "max_message_bytes"),
            f"must be at least server.realtime.max_event_bytes ({server.realtime.max_event_bytes}), got "
            f"{server.realtime.max_message_bytes}: events of that size could not be read",
        )
    if server.media.video_min_frames > server.media.video_max_frames:
        issues.add(
            ("server", "media", "video_min_frames"),
            f"must be at most server.media.video_max_frames ({server.media.video_max_frames}), "
            f"got {server.media.video_min_frames}",
        )
    for i, s in enumerate(config.stages):
        # A step shorter than the heartbeat timeout is never long: the limit would judge nothing.
        if s.step_timeout_s is not None and s.step_timeout_s <= server.heartbeat_timeout_s:
            issues.add(
                ("stages", i, "step_timeout_s"),
                f"must be longer than server.heartbeat_timeout_s "
                f"({server.heartbeat_timeout_s:g} s), got {s.step_timeout_s:g} s",
            )
    key_file = server.stage_auth_key_file
    if key_file is not None and check_paths and not Path(key_file).expanduser().is_file():
        issues.add(
            ("server", "stage_auth_key_file"),
            f"no such file {key_file!r} (python -m omni_cache.wire.stage_auth new-key FILE "
            "writes one; --no-path-check skips this check)",
        )
