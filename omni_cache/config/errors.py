"""Config errors: one :class:`ConfigIssue` per problem (file, key path, message, line), a
:class:`ConfigError` carrying them, and the collector the loader and the checks add to."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


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


PathTokens = tuple[str | int, ...]
_IDENT_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


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


class IssueCollector:
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
        self.items.append(ConfigIssue(self.source, format_key_path(tokens) or None, message, self.line_of(tokens)))

    def raise_if_any(self) -> None:
        if self.items:
            raise ConfigError(self.items)
