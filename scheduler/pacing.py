"""Playback pacing: streamed spoken answers get their turn when their listener needs it.

A listener of a streamed answer needs its next audio only once it has played what it got. Left
alone, the stages write every answer as fast as they can (about 10x real time on the tiny
pipeline), and a new request's first audio shares every step with answers that are seconds
ahead of their listeners. Pacing reorders the stages' work by who needs audio first:

* Each stage keeps a **playback clock** per streamed spoken answer (:class:`PlaybackClock`): the
  audio it has emitted for the answer, in seconds, against the time since it emitted the first.
  The clock is stage-local: a stage knows what it wrote and when (the talker: its codes, 80 ms
  each at 12.5 codes/s; the decoder: its samples; the thinker: its tokens, each one talker step),
  so no message carries it. A downstream stage never has more of an answer than its upstream
  sent, and starts its clock later, so every stage's clock bounds how far the listener can be
  ahead; the only fact on the wire is whether the client streams (``Submit.stream``).
* An answer more than ``lead_s`` ahead of its playback **yields** its turn (:meth:`Pacer.hold`)
  to the answers that are due: it sits the step out, exactly as a talker request whose thinker
  row has not arrived does (scheduler/streamed_rows.py), so its output does not depend on when
  it ran. Among the rest, answers with no audio yet go first (a new request's prefill and first
  steps), then the least slack (:meth:`Pacer.priority`).
* Nothing starves: when no answer is due, the answers ahead all run. An answer that is due but
  waiting for its input (the talker short of a thinker row, the decoder short of codes) is due
  too: the answers ahead wait for it rather than take the machine from the stage upstream that
  is writing that input; they wait at most until it comes or until they are only ``lead_s``
  ahead. Answers whose client does not stream are never held: they want the whole answer
  soonest.
* Optionally, a cap (``max_lead_s``): an answer further ahead than that waits even when nothing
  else is due, until it is only ``lead_s`` ahead, and the stage idles. Work-conserving pacing
  keeps the closed-loop throughput but fills the cores with audio nobody needs yet; the cap
  leaves them to the next first audio.

``PacingPolicy.enabled = False`` keeps the clocks and counters (slack, underruns, first-audio
steps shared with ahead-of-time work) without changing any order: the benchmark's baseline.

The clocks hang on vLLM's ``Request`` (attribute ``playback_clock``) like the streamed rows, so
vLLM's lifecycle frees them; the stage runner that creates them owns the answer's clock across its
requests (the tiny talker runs several per answer).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

ATTRIBUTE = "playback_clock"

#: Bucket bounds (seconds of slack: audio emitted minus playback time) of the slack histogram.
#: Negative slack is an underrun; the upper bounds reach the lead of an answer written far ahead.
SLACK_BUCKETS: tuple[float, ...] = (-5.0, -1.0, -0.5, -0.2, 0.0, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
#: StageStats counter names (omni_cache/runtime/metrics/pacing_metrics.py renders them).
PACED_REQUESTS = "paced_requests"
UNDERRUNS = "audio_underruns"
SHARED_FIRST_AUDIO_STEPS = "first_audio_shared_steps"
SLACK = "pacing_slack_seconds"

T = TypeVar("T")


@dataclass(frozen=True)
class PacingPolicy:
    """A stage's pacing (``StageConfig.pacing``): the lead an answer may have over its playback
    before it yields, whether it yields at all (False: clocks and counters only), and the lead
    beyond which it waits even when nothing else is due (None: never)."""

    lead_s: float
    enabled: bool = True
    max_lead_s: float | None = None


class PacingStats:
    """A stage's cumulative pacing counters (they travel in StageStats)."""

    def __init__(self) -> None:
        self.paced_requests = 0  # answers that yielded at least once
        self.underruns = 0  # answers whose emitted audio fell behind their playback
        self.shared_first_audio_steps = 0
        self.slack_counts = [0] * (len(SLACK_BUCKETS) + 1)  # last: above every bound

    def observe_slack(self, seconds: float) -> None:
        self.slack_counts[bisect.bisect_left(SLACK_BUCKETS, seconds)] += 1

    def counters(self) -> dict[str, float]:
        """``paced_requests``, ``audio_underruns``, ``first_audio_shared_steps`` and the slack
        histogram as ``pacing_slack_seconds_bucket:<le>`` (cumulative; ``+Inf`` is the count).
        No sum: with negative observations it is not a counter (Prometheus leaves it out)."""
        out: dict[str, float] = {
            PACED_REQUESTS: self.paced_requests,
            UNDERRUNS: self.underruns,
            SHARED_FIRST_AUDIO_STEPS: self.shared_first_audio_steps,
        }
        running = 0
        for bound, n in zip((*SLACK_BUCKETS, float("inf")), self.slack_counts):
            running += n
            out[f"{SLACK}_bucket:{'+Inf' if bound == float('inf') else repr(bound)}"] = running
        return out


class PlaybackClock:
    """One streamed spoken answer as one stage sees it: audio emitted vs time since the first."""

    def __init__(self, stats: PacingStats) -> None:
        self.stats = stats
        self.started_at: float | None = None  # time.monotonic() of the first audio emitted
        self.emitted_s = 0.0
        self.paced = False
        self.underran = False
        self.capped = False  # past max_lead_s, and not yet back to lead_s (Pacer.is_capped)

    @property
    def started(self) -> bool:
        return self.started_at is not None

    def ahead(self, now: float) -> float:
        """Seconds of audio emitted beyond what a listener who started at the first audio has
        played by ``now`` (negative: behind); 0 before the first audio."""
        if self.started_at is None:
            return 0.0
        return self.emitted_s - (now - self.started_at)

    def emit(self, seconds: float, now: float) -> None:
        """The stage emitted ``seconds`` more audio of the answer at ``now``. Its slack just
        before (how long the listener could still play) goes into the histogram; a negative one
        makes the answer an underrun."""
        if seconds <= 0:
            return
        if self.started_at is None:
            self.started_at = now
        else:
            slack = self.ahead(now)
            self.stats.observe_slack(slack)
            if slack < 0 and not self.underran:
                self.underran = True
                self.stats.underruns += 1
        self.emitted_s += seconds

    def yielded(self) -> None:
        if not self.paced:
            self.paced = True
            self.stats.paced_requests += 1


class Pacer:
    """One stage's pacing rule and counters."""

    def __init__(self, policy: PacingPolicy) -> None:
        self.policy = policy
        self.stats = PacingStats()

    def clock(self) -> PlaybackClock:
        """A new answer's clock, counting into this stage's stats."""
        return PlaybackClock(self.stats)

    def is_ahead(self, clock: PlaybackClock | None, now: float) -> bool:
        return clock is not None and clock.started and clock.ahead(now) > self.policy.lead_s

    def is_capped(self, clock: PlaybackClock | None, now: float) -> bool:
        """Waits whatever else there is to do: from when it gets more than ``max_lead_s`` ahead
        until its playback has caught up to ``lead_s``. The way down to ``lead_s`` makes it run
        in bursts (a decoder window of full length, talker steps batched with the other answers'),
        not one step each time playback passes the cap, which costs several times the work."""
        cap = self.policy.max_lead_s
        if cap is None or clock is None or not clock.started:
            return False
        ahead = clock.ahead(now)
        if ahead > cap:
            clock.capped = True
        elif ahead <= self.policy.lead_s:
            clock.capped = False
        return clock.capped

    def priority(self, clock: PlaybackClock | None, has_output: bool, now: float) -> tuple[int, float]:
        """Sort key, lowest first: answers with no audio yet (or, unclocked, no output yet), then
        by slack. An answer that is not paced (no clock) counts as due now (slack 0)."""
        if clock is None:
            return (1 if has_output else 0, 0.0)
        if not clock.started:
            return (0, 0.0)
        return (1, clock.ahead(now))

    def hold(
        self,
        runnable: Sequence[tuple[T, PlaybackClock | None]],
        now: float,
        waiting: Iterable[PlaybackClock | None] = (),
    ) -> list[T]:
        """Of the work that could run now (item, its answer's clock or None), what yields: the
        answers more than ``lead_s`` ahead, if anything else is due; nothing when pacing is off or
        when nothing else is due (then the ahead-of-time work runs: nothing starves).

        ``waiting``: the answers that cannot run now because their input has not arrived (a
        talker request short of its thinker row, a decoder request short of codes). One that is
        due is due work too: the answers ahead yield to it even if the stage then has nothing to
        run, because on a shared machine their steps would slow down the upstream stage that is
        writing its input. They wait at most until its input comes or until they are no more than
        ``lead_s`` ahead themselves (then they are due): nothing starves.

        With ``max_lead_s``, an answer more than that ahead waits even when nothing else is due
        (the stage may then idle) until its playback has caught up to ``lead_s``."""
        if not self.policy.enabled:
            return []
        capped = [self.is_capped(clock, now) for _, clock in runnable]  # every call: the way back
        ahead = [(item, clock) for item, clock in runnable if self.is_ahead(clock, now)]
        due_waiting = any(not self.is_ahead(clock, now) for clock in waiting)
        if len(ahead) == len(runnable) and not due_waiting:
            ahead = [(item, clock) for (item, clock), cap in zip(runnable, capped) if cap]
        for _, clock in ahead:
            assert clock is not None
            clock.yielded()
        return [item for item, _ in ahead]

    def order(self, items: Iterable[T], clock_of: Any, has_output: Any, now: float) -> list[T]:
        """``items`` by :meth:`priority` (stable: ties keep their order)."""
        return sorted(items, key=lambda it: self.priority(clock_of(it), has_output(it), now))

    def note_step(self, clocks: Iterable[PlaybackClock | None], now: float) -> None:
        """Count a step that ran a streamed answer's first-audio work beside another answer's
        ahead-of-time work (never, with pacing on: that work yields)."""
        clocks = [c for c in clocks if c is not None]
        if any(not c.started for c in clocks) and any(self.is_ahead(c, now) for c in clocks):
            self.stats.shared_first_audio_steps += 1


def of(request: Any) -> PlaybackClock | None:
    """The playback clock hung on a vLLM request, if its answer is paced."""
    return getattr(request, ATTRIBUTE, None)


def attach(request: Any, clock: PlaybackClock) -> None:
    setattr(request, ATTRIBUTE, clock)
