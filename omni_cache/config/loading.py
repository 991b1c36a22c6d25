"""Reading a stage config: YAML (duplicate keys refused, a line number for every key path), then
conversion into the schema (:mod:`omni_cache.config.conversion`: every problem as
``<file>: <key path>: <message> (line N)``), then the cross-field checks
(:mod:`omni_cache.config.validation`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from omni_cache.config.conversion import convert_config
from omni_cache.config.errors import ConfigError, ConfigIssue, IssueCollector, PathTokens
from omni_cache.config.schema import PipelineConfig
from omni_cache.config.validation import CheckPaths, collect_config_issues

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


def load_config(
    path: str | os.PathLike[str],
    *,
    check_paths: CheckPaths = True,
    overrides: Callable[[PipelineConfig], Any] | None = None,
) -> PipelineConfig:
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
    text: str,
    *,
    source: str = "<config>",
    check_paths: CheckPaths = True,
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
    config = convert_config(data, issues)
    if overrides is not None:
        overrides(config)
    collect_config_issues(config, issues, check_paths=check_paths)
    issues.raise_if_any()
    return config
