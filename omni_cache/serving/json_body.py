"""A client's JSON body parsed within bounds: how deep it nests is checked before it is parsed.

Python's ``json`` (and msgspec's decoder, which has no depth limit either) recurses once per level
of nesting and ends a deep enough document with ``RecursionError``; pydantic and the chat template
then walk whatever was parsed the same way. No chat request nests anywhere near
:data:`MAX_JSON_DEPTH` (a tool's JSON schema is the deepest part of one), so a body that does is
refused before it is parsed, by :func:`json_depth`, a scan linear in the body's size.

Every way a body can fail here is a :class:`BodyError` naming what is wrong (the caller answers
it with a 400): not UTF-8, not JSON, too deep, a number Python refuses to read."""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np

__all__ = ["MAX_JSON_DEPTH", "BodyError", "json_depth", "parse_json"]

#: How deep arrays and objects may nest in a client's JSON body.
MAX_JSON_DEPTH = 64

# A JSON string: up to its closing quote, or, unterminated, to the end of the body (so that every
# attempt at a quote matches and the scan stays linear: an attempt that failed at each of many
# escaped quotes would scan the rest of the body again from each). Possessive: no backtracking.
_STRING = re.compile(rb'"[^"\\]*+(?:\\.[^"\\]*+)*+(?:"|\\?\Z)', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_STEP = np.zeros(256, np.int8)
_STEP[list(b"[{")] = 1
_STEP[list(b"]}")] = -1
_CHUNK = 1 << 20  # brackets summed at once (bounds the scan's memory)


class BodyError(ValueError):
    """A body that is not a JSON document this server reads; the message says why."""


def json_depth(raw: bytes | bytearray) -> int:
    """How deep the arrays and objects of ``raw`` nest (brackets inside strings do not count).
    Of a body that is not valid JSON: the deepest its brackets reach, read the same way."""
    brackets = _STRING.sub(b"", raw).translate(None, _NOT_BRACKETS)
    steps = _STEP[np.frombuffer(brackets, np.uint8)]
    depth = deepest = 0
    for start in range(0, len(steps), _CHUNK):
        levels = np.cumsum(steps[start : start + _CHUNK], dtype=np.int64) + depth
        deepest = max(deepest, int(levels.max()))
        depth = int(levels[-1])
    return deepest


def parse_json(raw: bytes | bytearray, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """``raw`` as a JSON value; :class:`BodyError` when it nests deeper than ``max_depth``, is not
    UTF-8 (or another encoding ``json`` detects) or is not JSON."""
    depth = json_depth(raw)
    if depth > max_depth:
        raise BodyError(f"the JSON body nests {depth} levels deep; at most {max_depth} are read")
    try:
        return json.loads(raw)
    except json.JSONDecodeError as e:
        raise BodyError(
            f"the body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno} (char {e.pos})"
        ) from None
    except UnicodeDecodeError as e:
        raise BodyError(f"the body is not valid UTF-8: {e.reason} at byte {e.start}") from None
    except RecursionError:  # cannot happen below max_depth; kept so it can never be a 500
        raise BodyError(f"the JSON body nests too deep; at most {max_depth} levels are read") from None
    except ValueError as e:  # e.g. an integer of more digits than int() converts
        raise BodyError(f"the body is not valid JSON: {e}") from None
