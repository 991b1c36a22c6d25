"""A client's JSON body parsed within bounds: how deep it nests is checked before it is parsed.

Python's ``json`` (and msgspec's decoder, which has no depth limit either) recurses once per level
of nesting and ends a deep enough document with ``RecursionError``; pydantic and the chat template
then walk whatever was parsed the same way. No chat request nests anywhere near
:data:`MAX_JSON_DEPTH` (a tool's JSON schema is the deepest part of one), so a body that does is
refused before it is parsed, by :func:`json_shape`, a scan linear in the body's size that can
also bound how many values parsing would build (the Realtime API's events use that).

Every way a body can fail here is a :class:`BodyError` naming what is wrong (the caller answers
it with a 400): not UTF-8, not JSON, too deep, a number Python refuses to read."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["MAX_JSON_DEPTH", "BodyError", "JsonShape", "json_depth", "json_shape", "parse_json"]

#: How deep arrays and objects may nest in a client's JSON body.
MAX_JSON_DEPTH = 64

_STEP = np.zeros(256, np.int8)
_STEP[list(b"[{")] = 1
_STEP[list(b"]}")] = -1
_QUOTE, _BACKSLASH = ord('"'), ord("\\")
_CHUNK = 1 << 20  # bytes scanned at once (bounds the scan's memory)
#: The first chunk's bytes; each next one twice the last, up to _CHUNK. A scan with bounds stops
#: after the chunk that passed one: a nesting attack (megabytes of ``[``) costs a 64 KiB scan.
_FIRST_CHUNK = 64 * 1024
#: Chunks with at most this many quotes are scanned by their runs outside strings (few passes).
_FEW_QUOTES = 64


class BodyError(ValueError):
    """A body that is not a JSON document this server reads; the message says why."""


@dataclass(frozen=True)
class JsonShape:
    """What a scan of a JSON text's bytes finds outside its strings, before anything is parsed."""

    #: How deep its arrays and objects nest.
    depth: int
    #: Its arrays' and objects' members (commas and openings counted: an upper bound on the
    #: values ``json.loads`` would build, each a Python object).
    values: int
    #: Whether every byte was scanned (else the scan stopped past a bound: depth and values are
    #: those of the bytes scanned, lower bounds of the whole text's).
    complete: bool = True


def json_shape(raw: bytes | bytearray, max_depth: int | None = None, max_values: int | None = None) -> JsonShape:
    """The nesting and the number of values of ``raw`` (brackets and commas inside strings do
    not count). Of a body that is not valid JSON: what its brackets reach, read the same way.
    Past ``max_depth`` or ``max_values`` (None: no bound) the scan stops at the end of its chunk
    (``complete`` false): what is refused anyway is not read to its end.

    Vectorized with numpy a chunk at a time (numpy releases the GIL for most of it): a regular
    expression over the strings held the GIL for about a second on 8 MiB of empty strings."""
    scan = _Scan()
    data = np.frombuffer(raw, np.uint8)
    start, size = 0, min(_FIRST_CHUNK, _CHUNK)
    while start < len(data):
        scan.feed(data[start : start + size])
        start, size = start + size, min(2 * size, _CHUNK)
        past_depth = max_depth is not None and scan.deepest > max_depth
        if start < len(data) and (past_depth or (max_values is not None and scan.values > max_values)):
            return JsonShape(depth=scan.deepest, values=scan.values, complete=False)
    return JsonShape(depth=scan.deepest, values=scan.values)


def json_depth(raw: bytes | bytearray) -> int:
    """How deep the arrays and objects of ``raw`` nest (:func:`json_shape`)."""
    return json_shape(raw).depth


class _Scan:
    """The state carried from one chunk to the next: inside a string or not, the backslashes the
    last chunk ended with, the nesting reached."""

    def __init__(self) -> None:
        self.in_string = False
        self.trailing_backslashes = 0
        self.depth = self.deepest = self.values = 0

    def feed(self, chunk: np.ndarray) -> None:
        """Scan ``chunk``. Most large texts have few quotes (base64 audio and images are one long
        string; a nesting attack has none): their bytes outside strings are cut out by the quotes'
        positions and only those are counted, 3 passes over the chunk instead of 12 (a 2 MiB event
        of ``[``: 25 -> 6 ms here, on the realtime parser's threads). Others take every byte."""
        quotes = np.flatnonzero(chunk == _QUOTE)
        if len(quotes) > _FEW_QUOTES:
            self._feed_all(chunk)
            return
        if self.trailing_backslashes or bool((chunk == _BACKSLASH).any()):
            quotes = quotes[~self._escaped(chunk)[quotes]]  # and the run this chunk ends with
        runs, start, inside = [], 0, self.in_string
        for q in quotes.tolist():
            if not inside:
                runs.append(chunk[start:q])
            inside, start = not inside, q + 1
        if not inside:
            runs.append(chunk[start:])
        self.in_string = inside
        outside = np.concatenate(runs) if runs else chunk[:0]
        if not len(outside):
            return
        steps = _STEP[outside]
        levels = np.cumsum(steps, dtype=np.int32) + self.depth
        self.deepest = max(self.deepest, int(levels.max()))
        self.depth = int(levels[-1])
        self.values += int(np.count_nonzero(outside == ord(","))) + int(np.count_nonzero(steps == 1))

    def _feed_all(self, chunk: np.ndarray) -> None:
        quotes = (chunk == _QUOTE) & ~self._escaped(chunk)
        parity = np.cumsum(quotes, dtype=np.int32) + int(self.in_string)
        outside = (parity & 1) == 0  # a quote's own parity does not matter: it is no bracket
        steps = _STEP[chunk] * outside
        levels = np.cumsum(steps, dtype=np.int32) + self.depth
        self.deepest = max(self.deepest, int(levels.max()))
        self.depth = int(levels[-1])
        self.values += int(np.count_nonzero(outside & ((chunk == ord(",")) | (steps == 1))))
        self.in_string = bool(parity[-1] & 1)

    def _escaped(self, chunk: np.ndarray) -> np.ndarray:
        """Whether each byte follows an odd run of backslashes (an escaped quote, inside a string)."""
        backslash = chunk == _BACKSLASH
        if not backslash.any():  # the common case (base64 audio and images): only a carried run
            escaped = np.zeros(len(chunk), bool)
            escaped[0] = self.trailing_backslashes & 1
            self.trailing_backslashes = 0
            return escaped
        index = np.arange(len(chunk), dtype=np.int64)
        last_other = np.maximum.accumulate(np.where(backslash, -1, index))
        run = index - last_other  # backslashes ending at each byte, counted in this chunk
        run[last_other < 0] += self.trailing_backslashes
        before = np.empty_like(run)
        before[0] = self.trailing_backslashes
        before[1:] = run[:-1]
        self.trailing_backslashes = int(run[-1])
        return (before & 1) == 1


def parse_json(
    raw: bytes | bytearray, max_depth: int = MAX_JSON_DEPTH, *, max_values: int | None = None, what: str = "body"
) -> Any:
    """``raw`` as a JSON value; :class:`BodyError` when it nests deeper than ``max_depth``, holds
    more than ``max_values`` values (None: any number), is not UTF-8 (or another encoding
    ``json`` detects) or is not JSON. ``what`` names the document in the messages."""
    shape = json_shape(raw, max_depth, max_values)
    at_least = "" if shape.complete else "at least "
    if shape.depth > max_depth:
        raise BodyError(f"the JSON {what} nests {at_least}{shape.depth} levels deep; at most {max_depth} are read")
    if max_values is not None and shape.values > max_values:
        raise BodyError(f"the JSON {what} holds {at_least}{shape.values} values; at most {max_values} are read")
    try:
        return json.loads(raw)
    except json.JSONDecodeError as e:
        raise BodyError(
            f"the {what} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno} (char {e.pos})"
        ) from None
    except UnicodeDecodeError as e:
        raise BodyError(f"the {what} is not valid UTF-8: {e.reason} at byte {e.start}") from None
    except RecursionError:  # cannot happen below max_depth; kept so it can never be a 500
        raise BodyError(f"the JSON {what} nests too deep; at most {max_depth} levels are read") from None
    except ValueError as e:  # e.g. an integer of more digits than int() converts
        raise BodyError(f"the {what} is not valid JSON: {e}") from None
