"""A streamed answer whose client has stopped taking it sits out the steps until the client takes again.

The server watches each streamed chat answer's connection, and a realtime session's while a
response streams (omni_cache/serving/send_watch.py): when its client has taken none of what was
sent for a pause while bytes waited, a chat answer's writes wait, and the orchestrator tells the
request's stages (wire ``Hold``). Each stage then skips the
request as it skips one short of a streamed row (scheduler/streamed_rows.py): it keeps its slot,
its blocks and its place, and goes on exactly where it stopped when the client takes bytes again
(``Hold`` with ``held`` false), so what it writes does not depend on the pause. Without this, a
client that stopped reading had its whole answer generated, sent to the server, encoded and
queued until ``server.max_send_stall_s`` cut it: under benchmarks/hostile.py's 16 silent readers,
the largest share of the server's work. A held request still ends at its deadline, at the stall
bound, or when its client goes. A hold is a lease (``Hold.lease_s``, workers/runner.py
``lapse_holds``): not said again in time, it lapses and the request goes on.

The flag hangs on vLLM's ``Request`` (attribute ``client_held``), so vLLM's lifecycle frees it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ATTRIBUTE", "is_held", "set_held"]

ATTRIBUTE = "client_held"


def set_held(request: Any, held: bool) -> None:
    setattr(request, ATTRIBUTE, held)


def is_held(request: Any) -> bool:
    return bool(getattr(request, ATTRIBUTE, False))
