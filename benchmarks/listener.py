"""A streamed answer as a listener hears it: a player that starts after a jitter buffer and stalls
when the audio runs out before the next chunk arrives.

The player starts playing ``jitter_s`` after the first audio chunk arrives and plays the chunks
back to back at real time. When a chunk arrives after everything received so far has been played,
the player has stalled from the moment it ran out until that arrival (it then plays on at once;
no second buffering). Times are a client's arrival times (:class:`benchmarks.client.Sample`:
``audio_times``, seconds after sending, and ``audio_sizes``, 16-bit PCM bytes).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from benchmarks.client import SAMPLE_RATE

__all__ = ["DEFAULT_JITTER_S", "Playback", "listen", "play"]

#: The player's jitter buffer: it starts this long after the first audio arrives.
DEFAULT_JITTER_S = 0.2


@dataclass
class Playback:
    """What the listener of one answer got."""

    ttfa_s: float | None  # first audio after sending
    audio_s: float  # seconds of audio received
    stalls: int  # times the player ran out of audio before the answer's audio ended
    stall_s: float  # seconds spent stalled
    #: How far ahead of the player the received audio was, at its lowest (before the first
    #: stall: the jitter buffer less the worst lateness; negative: it stalled).
    min_buffer_s: float | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def play(times: Sequence[float], seconds: Sequence[float], jitter_s: float = DEFAULT_JITTER_S) -> Playback:
    """The playback of chunks arriving at ``times`` (s, ascending) holding ``seconds`` of audio."""
    chunks = [(t, s) for t, s in zip(times, seconds) if s > 0]
    if not chunks:
        return Playback(None, 0.0, 0, 0.0, None)
    first = chunks[0][0]
    runs_out = first + jitter_s + chunks[0][1]  # when the audio received so far is played
    stalls, stall_s, low = 0, 0.0, float("inf")
    for t, s in chunks[1:]:
        low = min(low, runs_out - t)
        if t > runs_out:
            stalls += 1
            stall_s += t - runs_out
            runs_out = t
        runs_out += s
    return Playback(first, sum(s for _, s in chunks), stalls, stall_s, None if low == float("inf") else low)


def listen(sample: Mapping[str, Any], jitter_s: float = DEFAULT_JITTER_S) -> Playback:
    """The playback of one benchmark sample (a :meth:`Sample.to_dict`)."""
    sizes = sample.get("audio_sizes") or []
    return play(sample.get("audio_times") or [], [b / 2 / SAMPLE_RATE for b in sizes], jitter_s)
