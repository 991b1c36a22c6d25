"""A streamed chat completion read the way the tests check them: every SSE event, JSON-decoded
(``[DONE]`` kept as the string), appended to a list as it arrives, so another thread can watch
the stream while it is read."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx


def read_events(
    url: str,
    body: dict[str, Any],
    headers: dict[str, str],
    out: list,
    *,
    timeout: float,
    on_event: Callable[[Any], None] | None = None,
) -> None:
    """POST ``body`` to ``url`` (``/v1/chat/completions``) and append each event to ``out``."""
    with httpx.stream("POST", url, json=body, headers=headers, timeout=timeout) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line[len("data: ") :]
                out.append(data if data == "[DONE]" else json.loads(data))
                if on_event is not None:
                    on_event(out[-1])
