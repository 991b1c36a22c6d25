"""The pipeline's stage-config schema, its loader and its validation.

One YAML file describes a whole pipeline: the HTTP server, and the stages (thinker, talker,
decoder, ...), each run in its own process and joined by ZMQ. The file is read with
``yaml.safe_load`` and converted with ``msgspec.convert`` into the typed structs below; unknown keys
are errors. Checks that span fields or stages (the input graph, addresses, hand-off functions,
model references) run after the conversion, in :func:`validate_config`.

Every error names the file, the key path and what was expected::

    stage_configs/x.yaml: stages[1].engine_args.block_size: expected int, got str '32' (line 41)

Nothing here imports vLLM or torch: loading a config is cheap and safe in any process.
"""

from __future__ import annotations

import difflib
import importlib
import json
import os
import re
import types
import typing
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
import yaml
from msgspec import Meta, Struct, field

__all__ = [
    "CHECKPOINTS_ENV",
    "DEFAULT_CHECKPOINT_DIR",
    "TINY_MODELS",
    "ConfigError",
    "ConfigIssue",
    "EngineArgs",
    "GenerationArgs",
    "LatentSpec",
    "PipelineConfig",
    "SamplingDefaults",
    "ServerConfig",
    "StageConfig",
    "checkpoint_root",
    "load_config",
    "parse_config",
    "resolve_handoff",
    "resolve_model",
    "validate_config",
]

#: Environment variable naming where ``tiny:*`` checkpoints are generated (when the config has no
#: ``checkpoint_dir``).
CHECKPOINTS_ENV = "OMNI_CACHE_CHECKPOINTS"
DEFAULT_CHECKPOINT_DIR = Path("~/.cache/omni_cache/checkpoints")

#: The tiny checkpoints the project generates itself (omni_cache.checkpoints), with the stage kind
#: each one can run as.
TINY_MODELS: dict[str, str] = {
    "thinker": "autoregressive",
    "thinker-hybrid": "autoregressive",
    "talker": "autoregressive",
    "decoder": "generation",
}
TINY_PREFIX = "tiny:"

StageKind = Literal["autoregressive", "generation"]
FinalOutput = Literal["text", "audio"]

_STAGE_NAME_RE = r"^[a-z0-9_-]+$"
_DOTTED_RE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)+$")
# Linux's sockaddr_un.sun_path holds 108 bytes including the terminating NUL.
_MAX_IPC_PATH_BYTES = 107

PositiveInt = Annotated[int, Meta(gt=0)]
PositiveFloat = Annotated[float, Meta(gt=0)]


class _Base(Struct, forbid_unknown_fields=True, kw_only=True):
    """Common options: unknown keys are errors, fields are keyword-only."""


# --------------------------------------------------------------------------------------------------
# Schema
# --------------------------------------------------------------------------------------------------


class ServerConfig(_Base, kw_only=True):
    """The HTTP front end (OpenAI-style API) of the orchestrator."""

    host: Annotated[str, Meta(min_length=1)] = "127.0.0.1"
    #: 0 lets the OS pick a free port.
    port: Annotated[int, Meta(ge=0, le=65535)] = 8091
    #: Largest ZMQ message (header + tensor frames) a stage accepts.
    max_message_bytes: PositiveInt = 256 * 1024 * 1024
    #: Deadline of one client request, end to end.
    request_timeout_s: PositiveFloat = 300.0
    #: The model name clients address; ``None`` -> the pipeline's name (filled in on load).
    served_model_name: str | None = None
    #: The orchestrator's ZMQ inbox, where stages send their outputs ("ipc://..." or
    #: "tcp://host:port"); ``None`` -> ipc:///tmp/omni_cache/<pipeline name>/orchestrator.sock.
    #: Stages on other hosts need a tcp address here.
    control_address: str | None = None


class LatentSpec(_Base, kw_only=True):
    """Which per-token latents an autoregressive stage emits (and caches) for the next stage."""

    #: The final hidden states (the input of the LM head).
    hidden: bool = False
    #: Layer taps: outputs of these decoder layers (indices >= 0, unique).
    layers: list[Annotated[int, Meta(ge=0)]] = []
    #: Names of per-token multimodal tensors the model produces.
    multimodal: list[Annotated[str, Meta(min_length=1)]] = []

    def any(self) -> bool:
        """Whether any latent is requested."""
        return bool(self.hidden or self.layers or self.multimodal)

    def describe(self) -> str:
        parts = []
        if self.hidden:
            parts.append("hidden")
        if self.layers:
            parts.append("layers " + ",".join(str(i) for i in self.layers))
        if self.multimodal:
            parts.append("multimodal " + ",".join(self.multimodal))
        return "; ".join(parts) if parts else "none"


class EngineArgs(_Base, kw_only=True):
    """vLLM engine arguments of an autoregressive stage. ``None`` leaves vLLM's default."""

    max_model_len: PositiveInt | None = None
    #: Tokens per KV-cache block: a positive multiple of 16 (vLLM's GPU backends accept 16; the
    #: CPU attention backend needs a multiple of 32 -- not enforced here, vLLM reports it). Leave
    #: it unset for hybrid (Mamba/GatedDeltaNet) models: vLLM picks it from the state size.
    block_size: Annotated[int, Meta(gt=0, multiple_of=16)] | None = None
    max_num_seqs: PositiveInt | None = None
    max_num_batched_tokens: PositiveInt | None = None
    enable_chunked_prefill: bool | None = None
    enforce_eager: bool | None = None
    #: On GPU a fraction of the device's memory; on CPU vLLM reads it as a fraction of one NUMA
    #: node's memory (its default 0.92 fails on small machines: use about 0.3).
    gpu_memory_utilization: Annotated[float, Meta(gt=0, le=1)] | None = None
    dtype: Literal["auto", "bfloat16", "float16", "float32"] | None = None
    seed: int | None = None
    tensor_parallel_size: PositiveInt | None = None
    async_scheduling: bool | None = None
    #: The talker takes the thinker's hidden states as prompt embeddings.
    enable_prompt_embeds: bool | None = None
    trust_remote_code: bool | None = None
    kv_cache_dtype: str | None = None
    #: Hybrid models only (vLLM 0.32 knows "none" and "align"; with prefix caching on it picks
    #: "align" for GatedDeltaNet by itself).
    mamba_cache_mode: str | None = None
    #: Anything else, passed verbatim to ``vllm.EngineArgs``.
    extra: dict[str, Any] = {}

    def to_vllm_kwargs(self) -> dict[str, Any]:
        """The keyword arguments for ``vllm.EngineArgs``: the fields that are set, plus ``extra``.

        ``enable_prefix_caching`` is not among them: it comes from ``StageConfig.prefix_cache``
        (see :meth:`StageConfig.vllm_kwargs`).
        """
        out: dict[str, Any] = {}
        for name in self.__struct_fields__:
            if name == "extra":
                continue
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        out.update(self.extra)
        return out


class SamplingDefaults(_Base, kw_only=True):
    """Sampling used when the request does not say otherwise."""

    temperature: Annotated[float, Meta(ge=0)] = 0.0
    top_p: Annotated[float, Meta(gt=0, le=1)] = 1.0
    max_tokens: PositiveInt = 64
    seed: int | None = None


class GenerationArgs(_Base, kw_only=True):
    """Settings of a non-autoregressive ("generation") stage such as the codec decoder."""

    max_batch_size: PositiveInt = 16
    #: Codec codes per decode chunk (audio is streamed chunk by chunk).
    chunk_size: PositiveInt = 16
    #: torch device string: "cpu", "cuda", "cuda:1", ...
    device: Annotated[str, Meta(min_length=1)] = "cpu"


class StageConfig(_Base, kw_only=True):
    """One stage of the pipeline, run in its own process."""

    #: Unique within the pipeline; lowercase letters, digits, '_' and '-'.
    name: Annotated[str, Meta(pattern=_STAGE_NAME_RE)]
    #: "autoregressive": a vLLM engine; "generation": a non-AR network (the codec decoder).
    kind: StageKind
    #: "tiny:<name>" (a checkpoint the project generates) or a filesystem path.
    model: str
    #: engine_input_source: the stages this one takes input from; [] = the client's request.
    inputs: list[str] = []
    #: "package.module.function" building this stage's inputs from its input stages' outputs.
    handoff: str | None = None
    #: Where the stage process listens: "ipc:///abs/path" or "tcp://host:port".
    address: str
    #: Whether (and as what) this stage's output goes back to the client.
    final_output: FinalOutput | None = None
    #: vLLM automatic prefix caching plus the hidden-state prefix cache (autoregressive only).
    prefix_cache: bool = True
    #: Where the hidden-state cache lives: pinned host memory or the accelerator.
    latent_cache_device: Literal["host", "device"] = "host"
    latents: LatentSpec = field(default_factory=LatentSpec)
    #: Required for autoregressive stages, forbidden for generation stages.
    engine_args: EngineArgs | None = None
    sampling: SamplingDefaults = field(default_factory=SamplingDefaults)
    #: Generation stages only; defaults are filled in when omitted.
    generation: GenerationArgs | None = None
    #: Extra environment of the stage process (e.g. VLLM_CPU_KVCACHE_SPACE).
    env: dict[str, str] = {}

    def __post_init__(self) -> None:
        if self.kind == "generation" and self.generation is None:
            self.generation = GenerationArgs()

    @property
    def is_autoregressive(self) -> bool:
        return self.kind == "autoregressive"

    @property
    def uses_prefix_cache(self) -> bool:
        """Whether prefix caching (vLLM APC + the hidden-state cache) is on for this stage."""
        return self.kind == "autoregressive" and self.prefix_cache

    @property
    def is_entry(self) -> bool:
        """Whether this stage takes the client's request."""
        return not self.inputs

    def vllm_kwargs(self, model: str) -> dict[str, Any]:
        """Keyword arguments for ``vllm.EngineArgs`` of this (autoregressive) stage.

        ``model`` is the resolved model path (see :func:`resolve_model`).
        """
        if self.engine_args is None:
            raise ValueError(f"stage {self.name!r} ({self.kind}) has no engine_args")
        kwargs = self.engine_args.to_vllm_kwargs()
        kwargs["model"] = model
        kwargs["enable_prefix_caching"] = self.prefix_cache
        return kwargs


class PipelineConfig(_Base, kw_only=True):
    """A whole pipeline: the server and its stages."""

    name: Annotated[str, Meta(min_length=1)]
    #: Where tiny:* checkpoints are generated; None -> $OMNI_CACHE_CHECKPOINTS or
    #: ~/.cache/omni_cache/checkpoints (see :func:`checkpoint_root`).
    checkpoint_dir: str | None = None
    server: ServerConfig = field(default_factory=ServerConfig)
    stages: Annotated[list[StageConfig], Meta(min_length=1)]

    def __post_init__(self) -> None:
        if self.server.served_model_name is None:
            self.server.served_model_name = self.name

    # -- lookups -----------------------------------------------------------------------------------

    def stage(self, name: str) -> StageConfig:
        """The stage called ``name``; KeyError naming the known stages otherwise."""
        for stage in self.stages:
            if stage.name == name:
                return stage
        raise KeyError(f"no stage {name!r} (stages: {', '.join(self.stage_names())})")

    def stage_names(self) -> list[str]:
        return [s.name for s in self.stages]

    def entry_stage(self) -> StageConfig:
        """The one stage with no inputs: it takes the client's request."""
        entries = [s for s in self.stages if not s.inputs]
        if len(entries) != 1:
            raise ValueError(
                f"pipeline {self.name!r} has {len(entries)} entry stages, expected exactly one"
            )
        return entries[0]

    def upstream(self, name: str) -> list[StageConfig]:
        """The stages ``name`` takes input from, in the order of its ``inputs``."""
        return [self.stage(n) for n in self.stage(name).inputs]

    def downstream(self, name: str) -> list[StageConfig]:
        """The stages that take input directly from ``name``, in config order."""
        self.stage(name)  # KeyError for an unknown name
        return [s for s in self.stages if name in s.inputs]

    def final_stages(self) -> list[StageConfig]:
        """The stages whose output goes to the client."""
        return [s for s in self.stages if s.final_output is not None]

    def topological_order(self) -> list[StageConfig]:
        """All stages, every stage after the stages it takes input from.

        Ties keep config order. ValueError if the input graph has a cycle or an unknown input.
        """
        names = set(self.stage_names())
        for s in self.stages:
            for i in s.inputs:
                if i not in names:
                    raise ValueError(f"stage {s.name!r} takes input from unknown stage {i!r}")
        done: set[str] = set()
        order: list[StageConfig] = []
        remaining = list(self.stages)
        while remaining:
            ready = [s for s in remaining if all(i in done for i in s.inputs)]
            if not ready:
                cycle = _find_cycle(self.stages)
                raise ValueError("input cycle: " + " -> ".join(cycle or []))
            for s in ready:
                order.append(s)
                done.add(s.name)
            remaining = [s for s in remaining if s.name not in done]
        return order


# --------------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ConfigIssue:
    """One problem in a config: ``<file>: <key path>: <message> (line N)``."""

    file: str | None
    key: str | None
    message: str
    line: int | None = None

    def __str__(self) -> str:
        parts = [p for p in (self.file, self.key) if p]
        text = ": ".join([*parts, self.message])
        if self.line is not None:
            text += f" (line {self.line})"
        return text


class ConfigError(Exception):
    """An invalid or unreadable stage config. ``str()`` gives one issue per line."""

    def __init__(self, issues: str | ConfigIssue | Sequence[ConfigIssue]):
        if isinstance(issues, str):
            issues = [ConfigIssue(None, None, issues)]
        elif isinstance(issues, ConfigIssue):
            issues = [issues]
        self.issues: list[ConfigIssue] = list(issues)
        super().__init__("\n".join(str(i) for i in self.issues))

    @property
    def file(self) -> str | None:
        return self.issues[0].file if self.issues else None

    @property
    def key(self) -> str | None:
        return self.issues[0].key if self.issues else None


# --------------------------------------------------------------------------------------------------
# Key paths
# --------------------------------------------------------------------------------------------------

PathTokens = tuple[str | int, ...]
_IDENT_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_MSGSPEC_PATH_TOKEN_RE = re.compile(r"\.([^.\[\]]+)|\[(\d+)\]|\[(\.\.\.)\]")
_MISSING = object()


def format_key_path(tokens: Iterable[str | int]) -> str:
    """``("stages", 1, "engine_args", "block_size")`` -> ``stages[1].engine_args.block_size``."""
    out = ""
    for tok in tokens:
        if isinstance(tok, int):
            out += f"[{tok}]"
        elif _IDENT_RE.match(tok):
            out += f".{tok}" if out else tok
        else:
            out += f"[{json.dumps(tok)}]"
    return out


def _parse_msgspec_path(path: str) -> list[str | int | None]:
    """``$.stages[1].env[...]`` -> ``["stages", 1, "env", None]`` (None: an unnamed dict key)."""
    tokens: list[str | int | None] = []
    for m in _MSGSPEC_PATH_TOKEN_RE.finditer(path.removeprefix("$")):
        if m.group(1) is not None:
            tokens.append(m.group(1))
        elif m.group(2) is not None:
            tokens.append(int(m.group(2)))
        else:
            tokens.append(None)
    return tokens


def _value_at(data: Any, tokens: Iterable[str | int]) -> Any:
    cur = data
    for tok in tokens:
        if isinstance(tok, int) and isinstance(cur, list) and 0 <= tok < len(cur):
            cur = cur[tok]
        elif isinstance(cur, dict) and tok in cur:
            cur = cur[tok]
        else:
            return _MISSING
    return cur


def _unwrap(tp: Any) -> Any:
    """Strip ``Annotated`` and ``| None`` from a type."""
    while True:
        origin = typing.get_origin(tp)
        if origin is Annotated:
            tp = typing.get_args(tp)[0]
            continue
        if origin in (typing.Union, types.UnionType):
            args = [a for a in typing.get_args(tp) if a is not type(None)]
            if len(args) == 1:
                tp = args[0]
                continue
        return tp


def _type_at(tokens: Iterable[str | int | None]) -> Any:
    """The declared type at a key path of a PipelineConfig, or None if unknown."""
    tp: Any = PipelineConfig
    for tok in tokens:
        tp = _unwrap(tp)
        origin = typing.get_origin(tp)
        if isinstance(tp, type) and issubclass(tp, Struct) and isinstance(tok, str):
            hints = typing.get_type_hints(tp, include_extras=True)
            if tok not in hints:
                return None
            tp = hints[tok]
        elif origin is list and (isinstance(tok, int) or tok is None):
            tp = typing.get_args(tp)[0]
        elif origin is dict:
            tp = typing.get_args(tp)[1]
        else:
            return None
    return _unwrap(tp)


def _short_repr(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


_TYPE_WORDS = {"object": "mapping", "array": "list"}


def _type_word(name: str) -> str:
    return _TYPE_WORDS.get(name, name)


def _expected_words(expected: str, got: str | None) -> str:
    # "int | null" -> "int": an optional key is only reported when something else was given.
    parts = [p.strip() for p in expected.split("|")]
    if got != "null":
        parts = [p for p in parts if p != "null"] or parts
    return " or ".join(_type_word(p) for p in parts)


def _got_words(got: str, value: Any) -> str:
    word = _type_word(got)
    if value is not _MISSING and isinstance(value, (str, int, float, bool)):
        return f"{word} {_short_repr(value)}"
    return word


# --------------------------------------------------------------------------------------------------
# YAML reading with line numbers
# --------------------------------------------------------------------------------------------------


class _DuplicateKey(Exception):
    def __init__(self, key: Any, line: int, first_line: int):
        self.key, self.line, self.first_line = key, line, first_line


class _Loader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys (plain safe_load keeps the last one silently)."""

    def construct_mapping(self, node, deep=False):  # type: ignore[override]
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    hash(key)
                except TypeError:
                    continue  # the base class reports unhashable keys
                line = key_node.start_mark.line + 1
                if key in seen:
                    raise _DuplicateKey(key, line, seen[key])
                seen[key] = line
        return super().construct_mapping(node, deep=deep)


def _line_map(node: yaml.Node | None) -> dict[PathTokens, int]:
    """Key path -> 1-based line where that key (or list item) starts."""
    lines: dict[PathTokens, int] = {}

    def walk(n: yaml.Node, path: PathTokens, depth: int) -> None:
        if depth > 64:
            return
        if isinstance(n, yaml.MappingNode):
            for k, v in n.value:
                if k.tag == "tag:yaml.org,2002:merge":
                    walk(v, path, depth + 1)
                    continue
                if not isinstance(k, yaml.ScalarNode):
                    continue
                key: str | int = k.value
                sub = (*path, key)
                lines.setdefault(sub, k.start_mark.line + 1)
                walk(v, sub, depth + 1)
        elif isinstance(n, yaml.SequenceNode):
            for i, item in enumerate(n.value):
                sub = (*path, i)
                lines.setdefault(sub, item.start_mark.line + 1)
                walk(item, sub, depth + 1)

    if node is not None:
        lines[()] = node.start_mark.line + 1
        walk(node, (), 0)
    return lines


def _read_yaml(text: str, source: str) -> tuple[Any, dict[PathTokens, int]]:
    loader = _Loader(text)
    loader.name = source
    try:
        node = loader.get_single_node()
        data = loader.construct_document(node) if node is not None else None
    except _DuplicateKey as e:
        raise ConfigError(
            ConfigIssue(
                source,
                f"line {e.line}",
                f"duplicate key {e.key!r} (first set on line {e.first_line})",
            )
        ) from None
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else None
        what = ": ".join(p for p in (e.context, e.problem) if p) or "syntax error"
        raise ConfigError(ConfigIssue(source, where, f"invalid YAML: {what}")) from None
    except yaml.YAMLError as e:
        raise ConfigError(ConfigIssue(source, None, f"invalid YAML: {e}")) from None
    finally:
        loader.dispose()
    return data, _line_map(node)


# --------------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------------


class _Issues:
    """Collects issues of one file, with the line of each key path where known."""

    def __init__(self, source: str | None, lines: dict[PathTokens, int] | None = None):
        self.source = source
        self.lines = lines or {}
        self.items: list[ConfigIssue] = []

    def line_of(self, tokens: PathTokens) -> int | None:
        for n in range(len(tokens), -1, -1):
            line = self.lines.get(tuple(tokens[:n]))
            if line is not None:
                return line
        return None

    def add(self, tokens: Sequence[str | int], message: str) -> None:
        tokens = tuple(tokens)
        self.items.append(
            ConfigIssue(self.source, format_key_path(tokens) or None, message, self.line_of(tokens))
        )

    def raise_if_any(self) -> None:
        if self.items:
            raise ConfigError(self.items)


def load_config(path: str | os.PathLike[str], *, check_paths: bool = True) -> PipelineConfig:
    """Read, convert and validate a stage config; ConfigError naming file and key path otherwise.

    ``check_paths=False`` skips the check that a ``model`` path exists (for a config meant for
    another host, such as stage_configs/qwen3_omni_example.yaml).
    """
    source = os.fspath(path)
    try:
        text = Path(source).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(ConfigIssue(source, None, "no such file")) from None
    except IsADirectoryError:
        raise ConfigError(ConfigIssue(source, None, "is a directory, expected a YAML file")) from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(ConfigIssue(source, None, f"cannot read: {e}")) from None
    return parse_config(text, source=source, check_paths=check_paths)


def parse_config(
    text: str, *, source: str = "<config>", check_paths: bool = True
) -> PipelineConfig:
    """Like :func:`load_config` for YAML text; ``source`` names it in error messages."""
    data, lines = _read_yaml(text, source)
    issues = _Issues(source, lines)
    if data is None:
        issues.add((), "empty config: expected a mapping with keys name, stages, ...")
        issues.raise_if_any()
    if not isinstance(data, dict):
        issues.add((), f"expected a mapping at the top level, got {type(data).__name__}")
        issues.raise_if_any()
    try:
        config = msgspec.convert(data, PipelineConfig)
    except msgspec.ValidationError as e:
        tokens, message = _translate_validation_error(str(e), data)
        issues.add(tokens, message)
        issues.raise_if_any()
        raise AssertionError("unreachable")  # pragma: no cover
    _validate(config, issues, check_paths=check_paths)
    issues.raise_if_any()
    return config


def _translate_validation_error(text: str, data: Any) -> tuple[list[str | int], str]:
    """msgspec's "Expected `int`, got `str` - at `$.a[1].b`" -> (["a", 1, "b"], "expected int, ...")."""
    at_key_in = re.fullmatch(r"(?s)(.*) - at `key` in `(\$[^`]*)`", text)
    at = re.fullmatch(r"(?s)(.*) - at `(\$[^`]*)`", text)
    if at_key_in:
        body, raw_path = at_key_in.groups()
        key_error = True
    elif at:
        body, raw_path = at.groups()
        key_error = False
    else:
        body, raw_path, key_error = text, "$", False
    ptoks = _parse_msgspec_path(raw_path)

    # Name the dict key msgspec leaves out ("env[...]"): the first entry whose value fails.
    tokens: list[str | int] = []
    for i, tok in enumerate(ptoks):
        if tok is None:
            parent = _value_at(data, tokens)
            tp = _type_at(ptoks[: i + 1])
            found = None
            if isinstance(parent, dict) and tp is not None:
                for k, v in parent.items():
                    try:
                        msgspec.convert(v, tp)
                    except (msgspec.ValidationError, TypeError):
                        found = k
                        break
            tokens.append(found if found is not None else "...")
        else:
            tokens.append(tok)
    value = _value_at(data, tokens)

    if key_error:
        parent = _value_at(data, tokens)
        bad = [k for k in parent if not isinstance(k, str)] if isinstance(parent, dict) else []
        m = re.match(r"Expected `([^`]*)`, got `([^`]*)`", body)
        got = f" ({', '.join(_short_repr(k) for k in bad)})" if bad else ""
        what = m.group(2) if m else "another type"
        return tokens, f"keys must be strings, got {_type_word(what)}{got}"

    m = re.fullmatch(r"Object contains unknown field `([^`]*)`", body)
    if m:
        key = m.group(1)
        tokens.append(key)
        tp = _type_at(tokens[:-1])
        hint = ""
        if isinstance(tp, type) and issubclass(tp, Struct):
            known = list(tp.__struct_fields__)
            close = difflib.get_close_matches(key, known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else f" (known keys: {', '.join(known)})"
        return tokens, "unknown key" + hint

    m = re.fullmatch(r"Object missing required field `([^`]*)`", body)
    if m:
        tokens.append(m.group(1))
        return tokens, "missing required key"

    m = re.fullmatch(r"Invalid enum value (.*)", body)
    if m:
        tp = _type_at(tokens)
        if typing.get_origin(tp) is Literal:
            allowed = ", ".join(repr(a) for a in typing.get_args(tp))
            return tokens, f"expected one of {allowed}, got {m.group(1)}"
        return tokens, f"invalid value {m.group(1)}"

    m = re.fullmatch(r"Expected `([^`]*)`, got `([^`]*)`", body)
    if m:
        expected, got = m.groups()
        tp = _type_at(tokens)
        if typing.get_origin(tp) is Literal and got != "null":
            allowed = ", ".join(repr(a) for a in typing.get_args(tp))
            return tokens, f"expected one of {allowed}, got {_got_words(got, value)}"
        message = f"expected {_expected_words(expected, got)}, got {_got_words(got, value)}"
        if len(tokens) >= 2 and tokens[-2] == "env":
            message += " (environment values are strings: quote them in YAML)"
        return tokens, message

    # Constraint errors: "Expected `int` >= 0", "Expected `str` matching regex '...'",
    # "Expected `array` of length >= 1", ...
    m = re.fullmatch(r"Expected `([^`]*)`(.*)", body, flags=re.S)
    if m:
        expected, rest = m.groups()
        message = f"expected {_expected_words(expected, None)}{rest}"
        if value is not _MISSING:
            message += f", got {_short_repr(value)}"
        return tokens, message

    message = body[:1].lower() + body[1:]
    return tokens, message


# --------------------------------------------------------------------------------------------------
# Semantic validation
# --------------------------------------------------------------------------------------------------


def validate_config(
    config: PipelineConfig, *, source: str | None = None, check_paths: bool = True
) -> PipelineConfig:
    """Run the cross-field checks on an already-built config (e.g. after CLI overrides).

    Returns ``config``; raises ConfigError listing every problem found.
    """
    issues = _Issues(source)
    _validate(config, issues, check_paths=check_paths)
    issues.raise_if_any()
    return config


def _validate(config: PipelineConfig, issues: _Issues, *, check_paths: bool) -> None:
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

        _check_handoff(s, base, issues)
        _check_kind_specific(s, base, issues)
        _check_model(s, base, issues, check_paths=check_paths)

    _check_addresses(config, issues)

    if graph_ok and len(first_index) == len(stages):
        cycle = _find_cycle(stages)
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


def _check_handoff(s: StageConfig, base: tuple[str | int, ...], issues: _Issues) -> None:
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
            _import_handoff(s.handoff)
        except ValueError as e:
            issues.add((*base, "handoff"), str(e))


def _check_kind_specific(s: StageConfig, base: tuple[str | int, ...], issues: _Issues) -> None:
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
        if s.engine_args is not None:
            _check_extra(s.engine_args, (*base, "engine_args", "extra"), issues)
    else:
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


_EXTRA_RESERVED = {
    "enable_prefix_caching": "set the stage's prefix_cache instead",
    "model": "set the stage's model instead",
}


def _check_extra(args: EngineArgs, base: tuple[str | int, ...], issues: _Issues) -> None:
    typed = set(args.__struct_fields__) - {"extra"}
    for key in args.extra:
        if key in _EXTRA_RESERVED:
            issues.add((*base, key), f"not allowed here: {_EXTRA_RESERVED[key]}")
        elif key in typed:
            issues.add((*base, key), f"not allowed here: set engine_args.{key} instead")


def _check_model(
    s: StageConfig, base: tuple[str | int, ...], issues: _Issues, *, check_paths: bool
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
        elif TINY_MODELS[tiny] != s.kind:
            issues.add(
                key,
                f"{s.model!r} is for a stage of kind {TINY_MODELS[tiny]!r}, "
                f"but this stage's kind is {s.kind!r}",
            )
    elif not s.model.strip():
        issues.add(key, "expected 'tiny:<name>' or a filesystem path, got an empty string")
    elif check_paths and not Path(s.model).expanduser().exists():
        issues.add(
            key,
            f"path {s.model!r} does not exist (expected 'tiny:<name>' or an existing path; "
            "omni-serve --no-path-check skips this check)",
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


def _check_addresses(config: PipelineConfig, issues: _Issues) -> None:
    parsed: list[tuple[int, tuple[str, str, int | None]]] = []
    server = ("tcp", config.server.host.lower(), config.server.port)
    for i, s in enumerate(config.stages):
        key = ("stages", i, "address")
        result = _parse_address(s.address)
        if isinstance(result, str):
            issues.add(key, result)
            continue
        clash = next((j for j, other in parsed if _same_endpoint(result, other)), None)
        if clash is not None:
            issues.add(
                key,
                f"{s.address!r} is also the address of stages[{clash}] "
                f"({config.stages[clash].name!r}); every stage needs its own",
            )
        elif config.server.port and _same_endpoint(result, server):
            issues.add(key, f"{s.address!r} is the HTTP server's port (server.port)")
        parsed.append((i, result))
    if config.server.control_address is not None:
        key = ("server", "control_address")
        result = _parse_address(config.server.control_address)
        if isinstance(result, str):
            issues.add(key, result)
        else:
            clash = next((j for j, other in parsed if _same_endpoint(result, other)), None)
            if clash is not None:
                issues.add(key, f"{config.server.control_address!r} is also the address of "
                                f"stages[{clash}] ({config.stages[clash].name!r})")


def _find_cycle(stages: Sequence[StageConfig]) -> list[str] | None:
    """A cycle in the input graph in data-flow order (``a -> b -> a``: b reads a, a reads b)."""
    by_name = {s.name: s for s in stages}
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    stack: list[str] = []

    def visit(name: str) -> list[str] | None:
        state[name] = 1
        stack.append(name)
        for inp in by_name[name].inputs:
            if inp not in by_name:
                continue
            if state.get(inp) == 1:
                cycle = stack[stack.index(inp):] + [inp]
                return list(reversed(cycle))  # stack follows "reads from"; report data flow
            if inp not in state:
                found = visit(inp)
                if found:
                    return found
        stack.pop()
        state[name] = 2
        return None

    for s in stages:
        if s.name not in state:
            found = visit(s.name)
            if found:
                return found
    return None


# --------------------------------------------------------------------------------------------------
# Resolution
# --------------------------------------------------------------------------------------------------


def _import_handoff(dotted: str) -> Callable[..., Any]:
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


def resolve_handoff(dotted: str) -> Callable[..., Any]:
    """Import ``package.module.function`` and return the function; ConfigError saying why not."""
    try:
        return _import_handoff(dotted)
    except ValueError as e:
        raise ConfigError(f"handoff {dotted!r}: {e}") from e.__cause__


def checkpoint_root(config: PipelineConfig | None = None) -> Path:
    """Where tiny:* checkpoints live: config.checkpoint_dir, else $OMNI_CACHE_CHECKPOINTS, else
    ~/.cache/omni_cache/checkpoints (absolute, ``~`` expanded)."""
    raw = config.checkpoint_dir if config is not None else None
    if not raw:
        raw = os.environ.get(CHECKPOINTS_ENV) or str(DEFAULT_CHECKPOINT_DIR)
    return Path(raw).expanduser().absolute()


def resolve_model(stage: StageConfig, config: PipelineConfig) -> str:
    """The model path a stage loads.

    ``tiny:NAME`` generates the checkpoint if needed (``omni_cache.checkpoints.ensure_checkpoint``
    under :func:`checkpoint_root`); a path is returned absolute, with ``~`` expanded.
    """
    if stage.model.startswith(TINY_PREFIX):
        name = stage.model[len(TINY_PREFIX):]
        if name not in TINY_MODELS:
            raise ConfigError(f"stage {stage.name!r}: unknown tiny checkpoint {name!r}")
        from omni_cache.checkpoints import ensure_checkpoint  # lazy: it imports torch

        return str(ensure_checkpoint(name, checkpoint_root(config)))
    return str(Path(stage.model).expanduser().absolute())
