"""Request timelines: when each request passed the points of its way to the first audio.

Off unless the environment variable ``OMNI_CACHE_TIMELINE_DIR`` names a directory (the end-to-end
benchmark's ``--timeline`` sets it for the servers it starts; stage processes inherit it). Then
every process that marks events (the server, each stage) appends one JSON line per event to
``<dir>/<process>-<pid>.jsonl``: ``{"r": request id, "e": event, "t": time.monotonic()}``. Only
the first occurrence of an event per request is written, so a request costs a handful of lines
however long its answer. ``time.monotonic()`` is one clock for every process of a host
(CLOCK_MONOTONIC), so lines of different processes line up; vLLM's own request timestamps
(``RequestStateStats``: queued, scheduled, first token) are on the same clock.

Events (the stage's name is the file's ``process``):

* server: ``received`` (the HTTP route took the request), ``submitted`` (checked, tokenized and
  routed: handed to the transport for the entry stage), ``text_in`` / ``audio_in`` (the first
  text / audio output reached it);
* thinker and talker (vLLM stages): ``input`` (first input: the Submit, or the upstream's first
  output), ``input<k>`` (the upstream's k-th output, k < 4), ``job`` (the first engine request was
  added), ``queued`` / ``scheduled`` / ``first_token`` (vLLM's timestamps of that request),
  ``out<k>`` (the k-th output, k < 4, as it is sent), ``codes_out`` (a talker's first codes, as
  they are sent);
* decoder: ``codes_in`` (the first codes arrived), ``window_start`` / ``window_end`` (the first
  window's decode), ``audio_out`` (the first audio, as it is sent).

Points marked "as sent" are taken just before the send, so the segment to the receiver's next
point holds the whole transfer.
"""

from __future__ import annotations

import json
import os
import time
from collections import OrderedDict
from typing import IO

TIMELINE_DIR_ENV = "OMNI_CACHE_TIMELINE_DIR"
#: Requests whose marked events are remembered (oldest forgotten first): bounds memory.
MAX_REQUESTS = 4096


class Timeline:
    """One process's request timeline; every method does nothing when it is off."""

    def __init__(self, process: str, directory: str | None = None) -> None:
        directory = directory if directory is not None else os.environ.get(TIMELINE_DIR_ENV)
        self.process = process
        self._file: IO[str] | None = None
        self._seen: OrderedDict[str, set[str]] = OrderedDict()
        if directory:
            os.makedirs(directory, exist_ok=True)
            path = os.path.join(directory, f"{process}-{os.getpid()}.jsonl")
            self._file = open(path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115 -- lives with the process

    @property
    def on(self) -> bool:
        return self._file is not None

    def mark(self, request_id: str, event: str, t: float | None = None) -> None:
        """Record ``event`` of ``request_id`` at ``t`` (default: now), unless already recorded."""
        if self._file is None:
            return
        seen = self._seen.get(request_id)
        if seen is None:
            seen = self._seen[request_id] = set()
            while len(self._seen) > MAX_REQUESTS:
                self._seen.popitem(last=False)
        if event in seen:
            return
        seen.add(event)
        when = time.monotonic() if t is None else t
        self._file.write(json.dumps({"r": request_id, "e": event, "t": round(when, 6)}) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read(directory: str) -> dict[str, dict[str, dict[str, float]]]:
    """Every timeline file under ``directory``: request id -> process -> event -> time."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for name in sorted(os.listdir(directory)) if os.path.isdir(directory) else ():
        if not name.endswith(".jsonl"):
            continue
        process = name[: -len(".jsonl")].rsplit("-", 1)[0]
        with open(os.path.join(directory, name), encoding="utf-8") as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue  # a line cut short by a killed process
                events = out.setdefault(rec["r"], {}).setdefault(process, {})
                events.setdefault(rec["e"], float(rec["t"]))
    return out
