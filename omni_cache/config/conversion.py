"""Converting a config's YAML data into the schema, each problem named by its key path.

``msgspec.convert`` stops at the first problem and reports it as English text with the path inside
it. Here the data is walked along the schema's structure instead (structs, lists, mappings,
optional parts), so the key path is known at every step and every problem is reported. A value at
a leaf (a number, string, bool or Literal, with its constraints) is accepted exactly when
``msgspec.convert`` accepts it; the message is built from the leaf's declared type as
``msgspec.inspect`` describes it, never from msgspec's message text. Once nothing is wrong,
``msgspec.convert`` builds the config.
"""

from __future__ import annotations

import difflib
import types
import typing
from collections.abc import Sized
from typing import Annotated, Any

import msgspec
import msgspec.inspect as mi
from msgspec import Struct

from omni_cache.config.errors import IssueCollector, PathTokens
from omni_cache.config.schema import PipelineConfig

__all__ = ["convert_config"]


def convert_config(data: dict[Any, Any], issues: IssueCollector) -> PipelineConfig:
    """``data`` as a PipelineConfig; ConfigError (``issues.raise_if_any``) with every problem."""
    _check(data, PipelineConfig, (), issues)
    issues.raise_if_any()
    try:
        return msgspec.convert(data, PipelineConfig)
    except msgspec.ValidationError as e:  # a rule the walk does not model: msgspec's own words
        issues.add((), str(e))
        issues.raise_if_any()
        raise


# --------------------------------------------------------------------------------------------------
# The walk
# --------------------------------------------------------------------------------------------------


def _check(value: Any, tp: Any, path: PathTokens, issues: IssueCollector) -> None:
    """Add the problems of ``value`` (at ``path``) against the declared type ``tp``."""
    inner, optional = _without_none(tp)
    if value is None and optional:
        return
    shape = _strip_annotated(inner)
    origin = typing.get_origin(shape)
    if isinstance(shape, type) and issubclass(shape, Struct):
        _check_struct(value, shape, path, issues)
    elif origin is list and isinstance(value, list):
        _check_list(value, inner, path, issues)
    elif origin is dict and isinstance(value, dict):
        _check_mapping(value, inner, path, issues)
    elif shape is not Any:
        _check_leaf(value, tp, path, issues)


def _check_struct(value: Any, cls: type[Struct], path: PathTokens, issues: IssueCollector) -> None:
    if not isinstance(value, dict):
        issues.add(path, f"expected mapping, got {_got(value)}")
        return
    if not _string_keys(value, path, issues):
        return
    fields = {f.encode_name: f for f in msgspec.structs.fields(cls)}
    for key, item in value.items():
        field = fields.get(key)
        if field is None:
            issues.add((*path, key), "unknown key" + _known_keys_hint(key, list(fields)))
        else:
            _check(item, field.type, (*path, key), issues)
    for key, field in fields.items():
        if field.required and key not in value:
            issues.add((*path, key), "missing required key")


def _check_list(value: list[Any], tp: Any, path: PathTokens, issues: IssueCollector) -> None:
    if _length_ok(value, tp, path, issues):
        (item_type,) = typing.get_args(_strip_annotated(tp))
        for i, item in enumerate(value):
            _check(item, item_type, (*path, i), issues)


def _check_mapping(value: dict[Any, Any], tp: Any, path: PathTokens, issues: IssueCollector) -> None:
    if not (_length_ok(value, tp, path, issues) and _string_keys(value, path, issues)):
        return
    _, value_type = typing.get_args(_strip_annotated(tp))
    for key, item in value.items():
        if path[-1:] == ("env",) and value_type is str and not isinstance(item, str):
            # YAML reads 2 and true as a number and a bool: say how to write the string.
            issues.add((*path, key), _leaf_message(item, str) + " (environment values are strings: quote them in YAML)")
        else:
            _check(item, value_type, (*path, key), issues)


def _check_leaf(value: Any, tp: Any, path: PathTokens, issues: IssueCollector) -> None:
    try:
        msgspec.convert(value, tp)
    except msgspec.ValidationError:
        issues.add(path, _leaf_message(value, tp))


def _string_keys(value: dict[Any, Any], path: PathTokens, issues: IssueCollector) -> bool:
    """Whether every key of a mapping is a string (every mapping of the schema has string keys);
    else one problem naming the others."""
    bad = [k for k in value if not isinstance(k, str)]
    if bad:
        issues.add(path, f"keys must be strings, got {_type_word(bad[0])} ({', '.join(_short_repr(k) for k in bad)})")
    return not bad


def _length_ok(value: Sized, tp: Any, path: PathTokens, issues: IssueCollector) -> bool:
    """Whether a list's or mapping's length meets the ``Meta`` of ``tp``; else one problem."""
    info = mi.type_info(tp)
    bound = _length_bound(len(value), info.min_length, info.max_length)
    if bound:
        issues.add(path, f"expected {_WORDS[type(info)]} {bound}, got {_short_repr(value)}")
    return not bound


def _known_keys_hint(key: str, known: list[str]) -> str:
    close = difflib.get_close_matches(key, known, n=1)
    return f" (did you mean {close[0]!r}?)" if close else f" (known keys: {', '.join(known)})"


# --------------------------------------------------------------------------------------------------
# Types
# --------------------------------------------------------------------------------------------------


def _strip_annotated(tp: Any) -> Any:
    while typing.get_origin(tp) is Annotated:
        tp = typing.get_args(tp)[0]
    return tp


def _without_none(tp: Any) -> tuple[Any, bool]:
    """``X | None`` -> ``(X, True)``; anything else -> ``(tp, False)`` (other unions stay leaves)."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0], True
    return tp, False


# --------------------------------------------------------------------------------------------------
# Messages
# --------------------------------------------------------------------------------------------------

#: How a message names each kind of declared type.
_WORDS: dict[type, str] = {
    mi.IntType: "int",
    mi.FloatType: "float",
    mi.StrType: "str",
    mi.BoolType: "bool",
    mi.NoneType: "null",
    mi.ListType: "list",
    mi.DictType: "mapping",
    mi.StructType: "mapping",
}


def _leaf_message(value: Any, tp: Any) -> str:
    """Why msgspec refused ``value`` for the declared type ``tp``."""
    info = mi.type_info(tp)
    options = list(info.types) if isinstance(info, mi.UnionType) else [info]
    if value is not None:
        options = [t for t in options if not isinstance(t, mi.NoneType)]
    same_kind = [t for t in options if _is_kind(value, t)]
    literals = _literal_values(tp)
    if same_kind and not isinstance(same_kind[0], mi.LiteralType):  # the kind is right: a bound
        kind = same_kind[0]
        return f"expected {_WORDS[type(kind)]} {_bound(value, kind)}, got {_short_repr(value)}"
    if literals:
        got = _short_repr(value) if same_kind else _got(value)
        return f"expected one of {', '.join(repr(v) for v in literals)}, got {got}"
    return f"expected {' or '.join(_WORDS.get(type(t), 'value') for t in options)}, got {_got(value)}"


def _literal_values(tp: Any) -> list[Any]:
    """The values of the Literals in ``tp``, in the order declared (msgspec.inspect sorts them)."""
    tp = _strip_annotated(tp)
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return list(typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return [v for arg in typing.get_args(tp) for v in _literal_values(arg)]
    return []


def _is_kind(value: Any, info: mi.Type) -> bool:
    """Whether ``value`` is of the kind ``info`` declares (right kind, wrong value: a bound)."""
    if isinstance(value, bool):
        return isinstance(info, mi.BoolType)
    if isinstance(info, mi.LiteralType):
        return any(type(v) is type(value) for v in info.values)
    kinds = {mi.IntType: int, mi.FloatType: (int, float), mi.StrType: str}
    return isinstance(value, kinds.get(type(info), ()))


def _bound(value: Any, info: mi.Type) -> str:
    """The constraint of ``info`` that ``value`` breaks, in msgspec's notation."""
    if isinstance(info, mi.StrType):
        return _length_bound(len(value), info.min_length, info.max_length) or f"matching regex {info.pattern!r}"
    # An int's exclusive bounds are said as the inclusive ones one step in: "> 0" is ">= 1".
    is_int = isinstance(info, mi.IntType)

    def num(bound: float) -> str:
        return str(bound) if is_int else repr(float(bound))

    if info.gt is not None and value <= info.gt:
        return f">= {info.gt + 1}" if is_int else f"> {num(info.gt)}"
    if info.ge is not None and value < info.ge:
        return f">= {num(info.ge)}"
    if info.lt is not None and value >= info.lt:
        return f"<= {info.lt - 1}" if is_int else f"< {num(info.lt)}"
    if info.le is not None and value > info.le:
        return f"<= {num(info.le)}"
    return f"that's a multiple of {info.multiple_of}"


def _length_bound(n: int, min_length: int | None, max_length: int | None) -> str:
    """``of length >= N`` / ``of length <= N`` when ``n`` breaks that bound, else ""."""
    if min_length is not None and n < min_length:
        return f"of length >= {min_length}"
    if max_length is not None and n > max_length:
        return f"of length <= {max_length}"
    return ""


def _type_word(value: Any) -> str:
    """What a message calls the YAML type of ``value``."""
    if value is None:
        return "null"
    if isinstance(value, dict):
        return "mapping"
    if isinstance(value, list):
        return "list"
    return type(value).__name__


def _got(value: Any) -> str:
    """``str '32'``, ``int 2``, ``null``, ``mapping``: the type, and a scalar's value."""
    word = _type_word(value)
    if isinstance(value, (str, int, float, bool)):
        return f"{word} {_short_repr(value)}"
    return word


def _short_repr(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
