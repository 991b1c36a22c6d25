"""Malformed chat-completions requests for the body fuzz (tests/test_body_fuzz.py), and a raw
HTTP/1.1 client that sends each exactly as made (a lying ``Content-Length``, bad UTF-8, a weird
content type) and says how the server answered: a status, a reset connection or no answer.

Every case is malformed by construction: each kind breaks the body in a way a chat request must
not survive (bad JSON, a field of the wrong type, a value past its bounds, a body that is not
what its headers say), so the server must answer every one with a 4xx."""

from __future__ import annotations

import json
import random
import re
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass

__all__ = ["Case", "Outcome", "cases", "send"]


@dataclass(frozen=True)
class Case:
    """One request: its body as sent, its headers' content type, the Content-Length it declares
    (None: the true one) and what kind of malformation it is."""

    kind: str
    body: bytes
    content_type: str | None = "application/json"
    declared_length: int | None = None


@dataclass(frozen=True)
class Outcome:
    status: int | None  # None: no status line came back
    error: str = ""  # "reset", "timeout", "closed" when there was no status
    body: bytes = b""


def _base(model: str, rng: random.Random) -> dict:
    return {
        "model": model,
        "max_tokens": rng.randint(1, 8),
        "messages": [{"role": "user", "content": f"hi {rng.randint(0, 999)}"}],
    }


def _nest(depth: int, rng: random.Random) -> object:
    value: object = rng.choice([1, "x", None, True])
    for _ in range(depth):
        value = [value] if rng.random() < 0.5 else {"a": value}
    return value


def _deep(model: str, rng: random.Random, max_body_bytes: int) -> Case:
    """Nesting far past any chat request's, at the top or inside a field (some bodies past
    ``max_body_bytes`` too, none past twice that: the server reads on that far)."""
    depth = rng.choice([70, 200, 1000, 5000, max_body_bytes // 6])
    where = rng.choice(["top", "content", "extra", "tool", "raw"])
    if where == "raw":  # only brackets, open or closed
        opener = rng.choice([b"[", b'{"a":'])
        closer = b"]" if opener == b"[" else b"}"
        return Case("deep", opener * depth + (closer * depth if rng.random() < 0.5 else b""))
    body = _base(model, rng)
    nested = _nest(depth, rng)
    if where == "top":
        return Case("deep", json_dumps_deep(nested))
    if where == "content":
        body["messages"][0]["content"] = "@@"
    elif where == "extra":
        body["metadata"] = "@@"
    else:
        body["tools"] = [{"type": "function", "function": {"name": "f", "parameters": "@@"}}]
    text = json.dumps(body).replace('"@@"', json_dumps_deep(nested).decode())
    return Case("deep", text.encode())


def json_dumps_deep(value: object) -> bytes:
    """``json.dumps`` without recursion (a deep value would overflow the encoder's stack)."""
    out: list[str] = []
    stack: list[object] = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str) and v.startswith("\0"):
            out.append(v[1:])
        elif isinstance(v, list):
            stack.extend(["\0]", v[0], "\0["])
        elif isinstance(v, dict):
            stack.extend(["\0}", v["a"], '\0{"a":'])
        else:
            out.append(json.dumps(v))
    return "".join(out).encode()


def _huge_number(model: str, rng: random.Random) -> Case:
    """Numbers no field takes: thousands of digits, exponents past a double, NaN, negatives."""
    body = _base(model, rng)
    field = rng.choice(
        [
            "max_tokens",
            "temperature",
            "top_p",
            "n",
            "seed",
            "logprobs",
            "top_logprobs",
            "presence_penalty",
            "max_completion_tokens",
        ]
    )
    literal = rng.choice(
        [
            "9" * rng.choice([400, 5000, 50000]),
            "1e999999",
            "-1e999999",
            "NaN",
            "Infinity",
            "-Infinity",
            "-" + "9" * 30,
            "1" + "0" * 40,
            "-1",
            "1e400",
        ]
    )
    if field in ("seed", "presence_penalty") and literal == "-1":  # both take -1
        literal = "-1e400"
    if field == "logprobs":  # a bool field: any number is the wrong type
        literal = "9" * 5000
    body[field] = "@@"
    return Case("huge_number", json.dumps(body).replace('"@@"', literal).encode())


_WRONG = {
    "model": [[], {}, 1, True],
    "messages": ["hi", 1, {}, None, [1], ["x"], [[]], [None]],
    "max_tokens": ["eight", [], {}, 1.5, -3],
    "temperature": ["hot", [], {}, -1],
    "stream": ["maybe", 1.5, [], {}],
    "n": ["one", [], 0],
    "stop": [1, {}, [1, 2]],
    "logit_bias": ["x", [1], {"a": "b"}],
    "tools": ["f", 1, [1], [{"type": "nope"}]],
    "response_format": ["json", 1, {"type": "nope"}],
    "modalities": ["audio", 1, ["video"], {}],
    "audio": ["wav", 1, [], {"voice": "nobody"}],
    "stream_options": ["x", 1],
    "tool_choice": [1, [], {"type": "x"}],
}
_WRONG_MESSAGE = [
    {"role": 1, "content": "x"},
    {"content": "x"},
    {"role": "user", "content": 1},
    {"role": "user", "content": {"a": 1}},
    {"role": "user", "content": [1]},
    {"role": "user", "content": [{"type": "video", "x": 1}]},
    {"role": "user", "content": [{"type": "image_url"}]},
    {"role": "user", "content": [{"type": "image_url", "image_url": "notadict"}]},
    {"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": 1}}]},
    {"role": "user", "content": [{"type": "text", "text": 5}]},
    {"role": "tool", "content": "x", "tool_call_id": 5},
    {"role": "assistant", "tool_calls": "x"},
]


def _wrong_type(model: str, rng: random.Random) -> Case:
    body = _base(model, rng)
    if rng.random() < 0.4:
        body["messages"] = [rng.choice(_WRONG_MESSAGE)]
    else:
        field = rng.choice(sorted(_WRONG))
        body[field] = rng.choice(_WRONG[field])
    if rng.random() < 0.15:  # the body itself is no object
        return Case("wrong_type", json.dumps(rng.choice([[body], "x", 1, None, True])).encode())
    return Case("wrong_type", json.dumps(body).encode())


def _truncated(model: str, rng: random.Random) -> Case:
    text = json.dumps(_base(model, rng)).encode()
    return Case("truncated", text[: rng.randint(0, len(text) - 1)])


def _bad_utf8(model: str, rng: random.Random) -> Case:
    text = json.dumps(_base(model, rng)).encode()
    bad = rng.choice(
        [b"\xff", b"\xc3\x28", b"\xe2\x82", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80", b"\x80", b"\xc0\xaf"]
    )
    at = text.index(b"hi ") + rng.randint(0, 3)  # inside the content string
    if rng.random() < 0.3:
        at = rng.randint(0, len(text))  # anywhere
    return Case("bad_utf8", text[:at] + bad + text[at:])


def _oversized(model: str, rng: random.Random, max_body_bytes: int) -> Case:
    """Past ``server.max_body_bytes`` (by up to 90 %), or numbers past what any field takes."""
    body = _base(model, rng)
    choice = rng.choice(["content", "stop", "logit_bias", "messages", "n", "max_tokens_int"])
    size = int(max_body_bytes * rng.uniform(1.01, 1.9))
    if choice == "content":
        body["messages"][0]["content"] = "x" * size
    elif choice == "stop":
        body["stop"] = ["s" * 20] * (size // 24)
    elif choice == "logit_bias":
        body["logit_bias"] = {f"{i:06d}": 1 for i in range(size // 13 + 1)}  # 13 bytes each
    elif choice == "messages":
        body["messages"] = [{"role": "user", "content": "x"}] * (size // 35)
    elif choice == "n":
        body["n"] = rng.choice([10**6, 2**40])
    else:
        body["max_tokens"] = rng.choice([2**63, 2**64 + 1, 10**30])
    return Case("oversized", json.dumps(body).encode())


def _content_type(model: str, rng: random.Random) -> Case:
    text = json.dumps(_base(model, rng)).encode()
    kind = rng.choice(
        [
            "text/plain",
            None,
            "multipart/form-data; boundary=x",
            "application/x-www-form-urlencoded",
            "application/jsonx",
            "",
            "json",
        ]
    )
    return Case("content_type", text, content_type=kind)


def _lying_length(model: str, rng: random.Random) -> Case:
    """A Content-Length that is not the body's: shorter (the rest arrives as the next
    request's bytes) or longer (the rest never comes)."""
    text = json.dumps(_base(model, rng)).encode()
    declared = rng.choice([rng.randint(0, len(text) - 1), len(text) + rng.randint(1, 500)])
    return Case("lying_length", text, declared_length=declared)


def _garbage(model: str, rng: random.Random) -> Case:
    n = rng.randint(0, 400)
    return Case("garbage", bytes(rng.randrange(256) for _ in range(n)))


def cases(model: str, n: int, seed: int, max_body_bytes: int) -> Iterator[Case]:
    """``n`` malformed requests, the same ones for the same seed."""
    rng = random.Random(seed)
    makers: list[Callable[[str, random.Random], Case]] = [
        lambda m, r: _deep(m, r, max_body_bytes),
        _huge_number,
        _wrong_type,
        _truncated,
        _bad_utf8,
        _content_type,
        _lying_length,
        _garbage,
        lambda m, r: _oversized(m, r, max_body_bytes),
    ]
    for i in range(n):
        yield makers[i % len(makers)](model, rng)


def send(host: str, port: int, case: Case, *, api_key: str | None, timeout: float) -> Outcome:
    """Send ``case`` to ``/v1/chat/completions`` on a connection of its own and read the
    status line and body of the answer (``Connection: close``)."""
    headers = ["POST /v1/chat/completions HTTP/1.1", f"Host: {host}:{port}", "Connection: close"]
    if case.content_type is not None:
        headers.append(f"Content-Type: {case.content_type}")
    if api_key:
        headers.append(f"Authorization: Bearer {api_key}")
    declared = len(case.body) if case.declared_length is None else case.declared_length
    headers.append(f"Content-Length: {declared}")
    head = ("\r\n".join(headers) + "\r\n\r\n").encode()
    try:
        with socket.create_connection((host, port), timeout=timeout) as s:
            try:
                s.sendall(head + case.body)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the server answered (and closed) before reading it all: read that answer
            data = b""
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                data += chunk
    except ConnectionResetError:
        return Outcome(None, "reset")
    except TimeoutError:
        return Outcome(None, "timeout")
    if not data.startswith(b"HTTP/1.1 ") or b"\r\n\r\n" not in data:
        return Outcome(None, "closed", data)
    head, rest = data.split(b"\r\n\r\n", 1)
    length = re.search(rb"(?im)^content-length: *(\d+)", head)
    # The first answer only (a lying Content-Length may have earned a second one)
    return Outcome(int(data[9:12]), "", rest[: int(length.group(1))] if length else rest)
