"""Reading a stage config: YAML (duplicate keys refused, a line number for every key path),
conversion into the schema with msgspec, and msgspec's validation errors translated into
``<file>: <key path>: <message> (line N)``. The cross-field checks run afterwards
(:mod:`omni_cache.config.validation`).
"""

from __future__ import annotations

import difflib
import os
import re
import types
import typing
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
import yaml
from msgspec import Struct

from omni_cache.config.errors import ConfigError, ConfigIssue, PathTokens, IssueCollector
from omni_cache.config.schema import PipelineConfig
from omni_cache.config.validation import CheckPaths, collect_config_issues


# --------------------------------------------------------------------------------------------------
# Key paths
# --------------------------------------------------------------------------------------------------


_MSGSPEC_PATH_TOKEN_RE = re.compile(r"\.([^.\[\]]+)|\[(\d+)\]|\[(\.\.\.)\]")
_MISSING = object()

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


def load_config(path: str | os.PathLike[str], *, check_paths: CheckPaths = True,
                overrides: Callable[[PipelineConfig], Any] | None = None) -> PipelineConfig:
    """Read, convert and validate a stage config; ConfigError naming file and key path otherwise.

    ``check_paths=False`` skips the check that a ``model`` path (and the stage key file) exists;
    a set of stage names checks only those stages' models (a stage started by hand checks its
    own). For a config meant for
    another host, such as stage_configs/qwen3_omni_example.yaml).

    ``overrides`` (the command line's) changes the converted config before it is checked, so
    what is checked is what runs (``--ray-address`` makes a stage's ``address`` optional).
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
    return parse_config(text, source=source, check_paths=check_paths, overrides=overrides)


def parse_config(
    text: str, *, source: str = "<config>", check_paths: CheckPaths = True,
    overrides: Callable[[PipelineConfig], Any] | None = None,
) -> PipelineConfig:
    """Like :func:`load_config` for YAML text; ``source`` names it in error messages."""
    data, lines = _read_yaml(text, source)
    issues = IssueCollector(source, lines)
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
    if overrides is not None:
        overrides(config)
    collect_config_issues(config, issues, check_paths=check_paths)
    issues.raise_if_any()
    return config


def _translate_validation_error(text: str, data: Any) -> tuple[list[str | int], str]:
    """msgspec's "Expected `int`, got `str` - at `$.a[1].b`" -> (["a", 1, "b"], "expected int, ...")."""
    body, tokens, key_error = _locate(text, data)
    if key_error:
        return tokens, _non_string_key_message(body, _value_at(data, tokens))
    value = _value_at(data, tokens)
    for pattern, build in _MESSAGES:
        m = pattern.fullmatch(body)
        if m:
            return build(m, tokens, value)
    return tokens, body[:1].lower() + body[1:]


def _locate(text: str, data: Any) -> tuple[str, list[str | int], bool]:
    """Split msgspec's text into (message body, key path, whether a mapping *key* is at fault)."""
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
    return body, tokens, key_error


def _non_string_key_message(body: str, parent: Any) -> str:
    bad = [k for k in parent if not isinstance(k, str)] if isinstance(parent, dict) else []
    m = re.match(r"Expected `([^`]*)`, got `([^`]*)`", body)
    got = f" ({', '.join(_short_repr(k) for k in bad)})" if bad else ""
    what = m.group(2) if m else "another type"
    return f"keys must be strings, got {_type_word(what)}{got}"


# One builder per kind of msgspec message: (match, key path, value there) -> (key path, message).
Builder = Callable[[re.Match[str], list[str | int], Any], tuple[list[str | int], str]]


def _unknown_key(m: re.Match[str], tokens: list[str | int], value: Any) -> tuple[list[str | int], str]:
    key = m.group(1)
    tp = _type_at(tokens)
    hint = ""
    if isinstance(tp, type) and issubclass(tp, Struct):
        known = list(tp.__struct_fields__)
        close = difflib.get_close_matches(key, known, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else f" (known keys: {', '.join(known)})"
    return [*tokens, key], "unknown key" + hint


def _missing_key(m: re.Match[str], tokens: list[str | int], value: Any) -> tuple[list[str | int], str]:
    return [*tokens, m.group(1)], "missing required key"


def _allowed(tp: Any) -> str:
    return ", ".join(repr(a) for a in typing.get_args(tp))


def _invalid_enum(m: re.Match[str], tokens: list[str | int], value: Any) -> tuple[list[str | int], str]:
    tp = _type_at(tokens)
    if typing.get_origin(tp) is Literal:
        return tokens, f"expected one of {_allowed(tp)}, got {m.group(1)}"
    return tokens, f"invalid value {m.group(1)}"


def _wrong_type(m: re.Match[str], tokens: list[str | int], value: Any) -> tuple[list[str | int], str]:
    expected, got = m.groups()
    tp = _type_at(tokens)
    if typing.get_origin(tp) is Literal and got != "null":
        return tokens, f"expected one of {_allowed(tp)}, got {_got_words(got, value)}"
    message = f"expected {_expected_words(expected, got)}, got {_got_words(got, value)}"
    if len(tokens) >= 2 and tokens[-2] == "env":
        message += " (environment values are strings: quote them in YAML)"
    return tokens, message


def _constraint(m: re.Match[str], tokens: list[str | int], value: Any) -> tuple[list[str | int], str]:
    expected, rest = m.groups()
    message = f"expected {_expected_words(expected, None)}{rest}"
    if value is not _MISSING:
        message += f", got {_short_repr(value)}"
    return tokens, message


# Tried in order; the first whose pattern matches the whole message body builds the message.
_MESSAGES: tuple[tuple[re.Pattern[str], Builder], ...] = (
    (re.compile(r"Object contains unknown field `([^`]*)`"), _unknown_key),
    (re.compile(r"Object missing required field `([^`]*)`"), _missing_key),
    (re.compile(r"Invalid enum value (.*)"), _invalid_enum),
    (re.compile(r"Expected `([^`]*)`, got `([^`]*)`"), _wrong_type),
    # Constraint errors: "Expected `int` >= 0", "Expected `str` matching regex '...'",
    # "Expected `array` of length >= 1", ...
    (re.compile(r"Expected `([^`]*)`(.*)", flags=re.S), _constraint),
)
