"""Playback pacing (scheduler/pacing.py) on hand-built states, no engine and no stage process:
the clock and the rule, vLLM's own scheduler (our subclass, a real KV-cache manager) deciding
each step, the decoder stage's batcher with a real decoder, the config's checks and /metrics.

The clocks are placed on purpose far ahead (100 s of audio) or just started, so every verdict
holds whatever the time the test takes.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from omni_cache.config import PacingConfig, load_config, validate_config
from omni_cache.config.errors import ConfigError
from omni_cache.runtime.metrics.prometheus import OrchestratorMetrics, StageSnapshot, parse_metrics
from scheduler import pacing
from scheduler.pacing import SLACK_BUCKETS, Pacer, PacingPolicy, PacingStats, PlaybackClock

ROOT = Path(__file__).resolve().parents[1]
LEAD = 1.0


def just_started(pacer: Pacer, ahead: float) -> PlaybackClock:
    """A clock that started a second ago and is ``ahead`` seconds ahead of its playback."""
    clock = pacer.clock()
    clock.emit(1.0 + ahead, time.monotonic() - 1.0)
    return clock


def far_ahead(pacer: Pacer) -> PlaybackClock:
    return just_started(pacer, ahead=100.0)


# ---- the clock ----------------------------------------------------------------------------------


def test_the_clock_counts_audio_against_time_since_the_first():
    stats = PacingStats()
    clock = PlaybackClock(stats)
    assert not clock.started and clock.ahead(123.0) == 0.0
    clock.emit(0.08, now=10.0)  # first audio: the playback starts here
    assert clock.ahead(10.0) == pytest.approx(0.08)
    clock.emit(2.0, now=10.05)  # slack 0.03 before it
    assert clock.ahead(11.0) == pytest.approx(2.08 - 1.0)
    assert stats.slack_counts[SLACK_BUCKETS.index(0.2)] == 1 and stats.underruns == 0
    clock.emit(0.5, now=14.0)  # the listener ran out at 12.08: an underrun
    clock.emit(0.5, now=20.0)  # again: the answer is counted once
    assert stats.underruns == 1 and clock.underran
    assert stats.counters()["pacing_slack_seconds_bucket:+Inf"] == 3


def test_counters_are_a_cumulative_histogram():
    stats = PacingStats()
    for slack in (-2.0, 0.1, 0.1, 50.0, 1000.0):
        stats.observe_slack(slack)
    c = stats.counters()
    assert c["pacing_slack_seconds_bucket:-1.0"] == 1
    assert c["pacing_slack_seconds_bucket:0.2"] == 3
    assert c["pacing_slack_seconds_bucket:60.0"] == 4
    assert c["pacing_slack_seconds_bucket:+Inf"] == 5


# ---- the rule -----------------------------------------------------------------------------------


def test_an_answer_far_ahead_yields_to_one_without_audio_and_counts_as_paced():
    pacer = Pacer(PacingPolicy(LEAD))
    ahead, new = far_ahead(pacer), pacer.clock()
    assert pacer.hold([("ahead", ahead), ("new", new)], time.monotonic()) == ["ahead"]
    assert ahead.paced and pacer.stats.paced_requests == 1


def test_nothing_starves_when_every_answer_is_ahead():
    pacer = Pacer(PacingPolicy(LEAD))
    assert pacer.hold([("a", far_ahead(pacer)), ("b", far_ahead(pacer))], time.monotonic()) == []
    assert pacer.stats.paced_requests == 0


def test_an_answer_not_streamed_is_due_and_never_held():
    pacer = Pacer(PacingPolicy(LEAD))
    assert pacer.hold([("ahead", far_ahead(pacer)), ("whole", None)], time.monotonic()) == ["ahead"]
    assert pacer.hold([("whole", None)], time.monotonic()) == []


def test_disabled_pacing_holds_nothing():
    pacer = Pacer(PacingPolicy(LEAD, enabled=False))
    assert pacer.hold([("ahead", far_ahead(pacer)), ("new", pacer.clock())], time.monotonic()) == []


def test_an_answer_beyond_max_lead_waits_even_when_nothing_else_is_due():
    pacer = Pacer(PacingPolicy(LEAD, max_lead_s=5.0))
    now = time.monotonic()
    near, far = just_started(pacer, ahead=3.0), far_ahead(pacer)
    assert pacer.hold([("near", near), ("far", far)], now) == ["far"]  # near: ahead, under the cap
    assert pacer.hold([("far", far)], now) == ["far"]  # alone: it waits all the same
    assert pacer.hold([("near", near), ("new", pacer.clock())], now) == ["near"]  # the usual rule
    # It waits until its playback has caught up to lead_s, not only to the cap: then it runs in
    # a burst up to the cap (batched, full windows), not a step each time playback passes it.
    assert pacer.hold([("far", far)], now + 100.0 - 4.0) == ["far"]  # 4 s ahead: under the cap
    assert pacer.hold([("far", far)], now + 100.0 - 0.5) == []  # back under lead_s: it runs
    far.emit(3.0, now + 99.5)  # it wrote 3 s more: 3.5 s ahead
    assert pacer.hold([("far", far)], now + 99.5) == []  # and goes on up to the cap
    far.emit(2.0, now + 99.5)  # 5.5 s ahead
    assert pacer.hold([("far", far)], now + 99.5) == ["far"]  # past it: waits again


def test_order_no_audio_first_then_least_slack():
    pacer = Pacer(PacingPolicy(LEAD))
    now = time.monotonic()
    clocks = {
        "comfortable": just_started(pacer, ahead=0.9),
        "behind": just_started(pacer, ahead=-0.3),
        "new": pacer.clock(),
        "whole": None,
        "tight": just_started(pacer, ahead=0.1),
    }
    order = pacer.order(list(clocks), clocks.get, lambda name: name != "new", now)
    assert order == ["new", "behind", "whole", "tight", "comfortable"]


# ---- vLLM's scheduler deciding ------------------------------------------------------------------


class SchedulerHarness:
    """Our OmniScheduler on a real vLLM KV-cache manager; steps are scheduled by vLLM and
    completed by hand (one sampled token per request that finished its prompt)."""

    def __init__(self, sched) -> None:
        self.sched = sched

    @property
    def running(self) -> list:
        return self.sched.running

    def add(self, rid: str, clock: PlaybackClock | None, starve: bool = False):
        from vllm import SamplingParams
        from vllm.v1.request import Request

        from scheduler.streamed_rows import StreamedRows, attach

        request = Request(
            request_id=rid, prompt_token_ids=[1], sampling_params=SamplingParams(max_tokens=1000), pooling_params=None
        )
        if clock is not None:
            pacing.attach(request, clock)
        if starve:  # a talker request whose thinker rows stop at its prompt
            attach(request, StreamedRows(torch.zeros(4)))
        self.sched.add_request(request)
        return request

    def start(self, rid: str, clock: PlaybackClock | None, starve: bool = False):
        """Add a request and step until it has written a token (it is running then)."""
        request = self.add(rid, clock, starve)
        for _ in range(4):
            self.step()
            if request.num_output_tokens:
                return request
        raise AssertionError(f"{rid} never ran")

    def step(self) -> set[str]:
        from vllm.v1.outputs import ModelRunnerOutput

        out = self.sched.schedule()
        ids = list(out.num_scheduled_tokens)
        self.sched.update_from_output(
            out,
            ModelRunnerOutput(
                req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)}, sampled_token_ids=[[7] for _ in ids]
            ),
        )
        return set(ids)


@pytest.fixture(scope="module")
def make_scheduler(tmp_path_factory):
    pytest.importorskip("vllm")
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    from omni_cache.tiny.checkpoints import ensure_checkpoint
    from scheduler.omni_scheduler import OmniScheduler

    model = ModelConfig(
        model=str(ensure_checkpoint("thinker", tmp_path_factory.mktemp("ckpt"))),
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=256,
    )

    def make(policy: PacingPolicy, max_num_seqs: int = 4):
        cache = CacheConfig(block_size=32)
        cache.num_gpu_blocks = 64
        config = VllmConfig(
            model_config=model,
            cache_config=cache,
            scheduler_config=SchedulerConfig(
                max_num_seqs=max_num_seqs, max_num_batched_tokens=256, max_model_len=256, is_encoder_decoder=False
            ),
        )
        kv = KVCacheConfig(
            num_blocks=64,
            kv_cache_tensors=[],
            kv_cache_groups=[
                KVCacheGroupSpec(
                    ["layer"], FullAttentionSpec(block_size=32, num_kv_heads=1, head_size=16, dtype=torch.float32)
                )
            ],
        )
        sched = OmniScheduler(
            vllm_config=config,
            kv_cache_config=kv,
            block_size=32,
            log_stats=False,
            structured_output_manager=StructuredOutputManager(config),
        )
        sched.pacer = Pacer(policy)
        return SchedulerHarness(sched), sched.pacer

    return make


def test_scheduler_runs_first_audio_before_an_answer_far_ahead(make_scheduler):
    sched, pacer = make_scheduler(PacingPolicy(LEAD))
    ahead = sched.start("ahead", far_ahead(pacer))
    new = sched.add("new", pacer.clock())
    assert sched.step() == {"new"}
    assert ahead in sched.running and pacing.of(ahead).paced
    # The answer that yielded kept its place; it runs again once nothing else is due.
    pacing.of(new).emit(200.0, time.monotonic() - 1.0)  # the new one is far ahead now, too
    assert sched.step() == {"ahead", "new"}
    assert pacer.stats.shared_first_audio_steps == 0


def test_scheduler_without_pacing_shares_the_step_and_counts_it(make_scheduler):
    sched, pacer = make_scheduler(PacingPolicy(LEAD, enabled=False))
    sched.start("ahead", far_ahead(pacer))
    sched.add("new", pacer.clock())
    assert sched.step() == {"ahead", "new"}
    assert pacer.stats.shared_first_audio_steps == 1 and pacer.stats.paced_requests == 0


def test_scheduler_never_starves_an_answer_ahead(make_scheduler):
    sched, pacer = make_scheduler(PacingPolicy(LEAD))
    sched.start("a", far_ahead(pacer))
    sched.start("b", far_ahead(pacer))
    for _ in range(3):
        assert sched.step() == {"a", "b"}  # nothing else is due: the work ahead of time runs


def test_scheduler_idles_rather_than_run_an_answer_beyond_max_lead(make_scheduler):
    sched, pacer = make_scheduler(PacingPolicy(LEAD, max_lead_s=5.0))
    far, near = pacer.clock(), pacer.clock()
    sched.start("far", far)
    sched.start("near", near)
    far.emit(101.0, time.monotonic() - 1.0)  # 100 s ahead of its listener
    near.emit(4.0, time.monotonic() - 1.0)  # 3 s ahead: past lead_s, under the cap
    assert sched.step() == {"near"}  # nothing is due: the answer under the cap runs ahead
    near.emit(100.0, time.monotonic())
    assert not sched.sched.has_runnable_requests()  # the stage waits instead of stepping
    assert sched.step() == set()


def test_answers_ahead_wait_for_a_due_answer_short_of_its_row(make_scheduler):
    """A talker answer that is due but waits for its thinker row is due work: the answer far
    ahead does not take the step (the stage waits for the row instead), and the due one runs
    as soon as its row is there."""
    from scheduler import streamed_rows

    sched, pacer = make_scheduler(PacingPolicy(LEAD))
    sched.start("ahead", far_ahead(pacer))
    due = sched.start("due", just_started(pacer, ahead=0.0), starve=True)
    assert not sched.sched.has_runnable_requests()
    assert sched.step() == set()
    assert due in sched.running  # skipped, not removed: it keeps its slot
    streamed_rows.of(due).add(torch.zeros(1, 4))  # its row arrives
    assert sched.sched.has_runnable_requests() and sched.step() == {"due"}


def test_a_starved_answer_far_ahead_is_no_due_work(make_scheduler):
    sched, pacer = make_scheduler(PacingPolicy(LEAD))
    sched.start("ahead", far_ahead(pacer))
    sched.start("starved", far_ahead(pacer), starve=True)
    assert sched.step() == {"ahead"}


def test_an_unstreamed_answer_goes_before_one_far_ahead(make_scheduler):
    sched, pacer = make_scheduler(PacingPolicy(LEAD))
    sched.start("ahead", far_ahead(pacer))
    sched.start("whole", None)
    assert sched.step() == {"whole"}


def test_no_answer_yields_to_a_request_that_has_no_slot(make_scheduler):
    """With every slot (max_num_seqs) taken, a waiting request cannot run this step: the
    answers ahead run instead of sitting out for nothing, and the running list never grows past
    the slots."""
    sched, pacer = make_scheduler(PacingPolicy(LEAD), max_num_seqs=2)
    sched.start("a", far_ahead(pacer))
    sched.start("b", far_ahead(pacer))
    sched.add("new", pacer.clock())
    assert sched.step() == {"a", "b"}
    assert len(sched.running) == 2


def test_running_requests_go_by_least_slack(make_scheduler):
    """With one token of budget a step, the running answer with the least slack gets it (vLLM
    alone would give it to the first one that arrived)."""
    sched, pacer = make_scheduler(PacingPolicy(LEAD))
    sched.start("comfortable", just_started(pacer, ahead=0.8))
    sched.start("tight", just_started(pacer, ahead=0.05))
    sched.sched.max_num_scheduled_tokens = 1
    assert sched.step() == {"tight"}
    assert [r.request_id for r in sched.running] == ["tight", "comfortable"]


def test_a_request_held_for_its_client_sits_out_and_goes_on_where_it_was(make_scheduler):
    """A request whose streaming client takes nothing (scheduler/client_hold.py) sits out the
    steps, keeps its slot, and is no due work (others do not yield to it, a stage with only it
    waits instead of stepping); let go, it runs again."""
    from scheduler import client_hold

    sched, pacer = make_scheduler(PacingPolicy(LEAD))
    sched.start("ahead", far_ahead(pacer))
    held = sched.start("held", just_started(pacer, ahead=0.0))
    assert sched.step() == {"held"}  # due: the answer far ahead yields to it
    client_hold.set_held(held, True)
    assert sched.step() == {"ahead"}  # the answer far ahead does not yield to the held one
    assert held in sched.running
    client_hold.set_held(sched.sched.requests["ahead"], True)
    assert not sched.sched.has_runnable_requests() and sched.step() == set()
    client_hold.set_held(held, False)
    tokens = held.num_output_tokens
    assert sched.step() == {"held"} and held.num_output_tokens == tokens + 1


# ---- the decoder stage's batcher ----------------------------------------------------------------


@pytest.fixture
def decoder(tmp_path):
    from decoder_harness import make_runner

    runner, close = make_runner(tmp_path, "tiny:decoder", max_batch_size=4, pacing=PacingConfig(lead_s=LEAD))
    yield runner, runner.inbox
    close()


def stream_codes(runner, rid: str, seq: int, n: int, stream: bool = True) -> None:
    """The talker's codes for ``rid``; its stream opens with a StreamStart saying whether the
    client streams."""
    from omni_cache.wire.messages import StageOutput, StreamStart

    ids = torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seq)).tolist()
    msg = StageOutput(request_id=rid, stage="talker", seq=seq, token_ids=ids)
    if seq == 0:
        msg = StreamStart.opening(msg, stream=stream)
    runner.guarded(rid, lambda: runner.accept(msg, {}))


def emitted_in_next_step(runner, inbox) -> set[str]:
    """The requests whose audio the next step sends (all of it received: sent_so_far)."""
    from decoder_harness import sent_so_far

    runner.step()
    return {msg.request_id for msg, _ in sent_so_far(runner)}


def test_decoder_serves_the_due_answer_while_answers_far_ahead_wait(decoder):
    runner, inbox = decoder
    for rid in ("a", "b", "due"):
        stream_codes(runner, rid, seq=0, n=40)
    assert emitted_in_next_step(runner, inbox) == {"a", "b", "due"}  # first windows: clocks start
    for rid in ("a", "b"):
        runner.requests[rid].clock.emit(100.0, time.monotonic())  # far ahead of their listeners
    for rid in ("a", "b", "due"):
        stream_codes(runner, rid, seq=1, n=80)
    assert emitted_in_next_step(runner, inbox) == {"due"}
    assert runner.pacer.stats.paced_requests == 2
    # The due answer goes on until it is a lead ahead; then nothing is due and all of them run.
    runner.requests["due"].clock.emit(100.0, time.monotonic())
    assert emitted_in_next_step(runner, inbox) == {"a", "b", "due"}


def test_decoder_runs_work_ahead_of_time_in_small_batches_least_slack_first(decoder):
    """With nothing due, the answers ahead run ahead_batch_size windows a batch (a window that
    becomes due waits for at most that), those closest to their playback first."""
    runner, inbox = decoder
    runner.stage.pacing.ahead_batch_size = 2
    for rid in ("a", "b", "c", "d"):
        stream_codes(runner, rid, seq=0, n=40)
    assert len(emitted_in_next_step(runner, inbox)) == 4  # first windows: alone, all of them
    for rid, extra in (("a", 30.0), ("b", 10.0), ("c", 20.0), ("d", 40.0)):
        runner.requests[rid].clock.emit(extra, time.monotonic())
        stream_codes(runner, rid, seq=1, n=80)
    assert emitted_in_next_step(runner, inbox) == {"b", "c"}
    for rid in ("b", "c"):
        runner.requests[rid].clock.emit(100.0, time.monotonic())
    assert emitted_in_next_step(runner, inbox) == {"a", "d"}


def test_decoder_waits_for_the_codes_of_a_due_answer(decoder):
    """An answer that is due with no window ready (its codes are on the way) is due work: the
    answer far ahead waits (the stage has no work) until its window is there."""
    runner, inbox = decoder
    for rid in ("ahead", "due"):
        stream_codes(runner, rid, seq=0, n=4)  # one window: 1 code and its 2 of lookahead
    assert emitted_in_next_step(runner, inbox) == {"ahead", "due"}
    assert not runner.requests["due"].jobs
    runner.requests["ahead"].clock.emit(100.0, time.monotonic())
    stream_codes(runner, "ahead", seq=1, n=40)
    assert not runner.has_work()
    stream_codes(runner, "due", seq=1, n=4)
    assert runner.has_work() and emitted_in_next_step(runner, inbox) == {"due"}


def test_decoder_has_no_work_while_every_answer_is_beyond_max_lead(decoder):
    runner, inbox = decoder
    runner.pacer.policy = PacingPolicy(LEAD, max_lead_s=5.0)
    stream_codes(runner, "a", seq=0, n=40)
    assert emitted_in_next_step(runner, inbox) == {"a"}  # the first window starts its clock
    runner.requests["a"].clock.emit(100.0, time.monotonic())
    stream_codes(runner, "a", seq=1, n=80)
    assert not runner.has_work()  # its next window waits until playback is back to lead_s
    runner.requests["a"].clock.started_at -= 97.0  # as if its listener had played 97 s: 3 s ahead
    assert not runner.has_work()
    runner.requests["a"].clock.started_at -= 2.5  # 0.5 s ahead
    assert runner.has_work()


def test_decoder_holds_the_windows_of_an_answer_whose_client_takes_nothing(decoder):
    runner, inbox = decoder
    for rid in ("held", "other"):
        stream_codes(runner, rid, seq=0, n=40)
    runner.hold("held", True)
    assert emitted_in_next_step(runner, inbox) == {"other"}
    stream_codes(runner, "held", seq=1, n=40)  # its codes still arrive
    runner.requests["other"].jobs.clear()
    assert not runner.has_work()
    runner.hold("held", False)
    assert runner.has_work() and emitted_in_next_step(runner, inbox) == {"held"}
    assert runner.counters()["client_holds"] == 1


def test_a_hold_not_said_again_within_its_lease_lapses(decoder):
    """A hold is a lease (wire Hold.lease_s): renewed, it lasts; not renewed (the orchestrator's
    "go on" was lost), the request goes on once it passes, counted as a lapse."""
    runner, inbox = decoder
    stream_codes(runner, "held", seq=0, n=40)
    t0 = time.monotonic()
    runner.hold("held", True, lease_s=3.0)
    runner.expire(t0 + 2.0)
    assert runner.requests["held"].held
    runner.hold("held", True, lease_s=10.0)  # said again: lasts from now, past the first lease
    runner.expire(t0 + 5.0)
    assert runner.requests["held"].held and not runner.has_work()
    runner.expire(time.monotonic() + 10.0)
    assert not runner.requests["held"].held and emitted_in_next_step(runner, inbox) == {"held"}
    assert runner.counters()["client_holds"] == 1 and runner.counters()["client_hold_lapses"] == 1
    runner.hold("held", True)  # no lease (an in-process caller): held until told otherwise
    runner.expire(time.monotonic() + 3600.0)
    assert runner.requests["held"].held and runner.counters()["client_hold_lapses"] == 1


def test_decoder_keeps_no_clock_for_an_answer_not_streamed(decoder):
    runner, inbox = decoder
    stream_codes(runner, "whole", seq=0, n=20, stream=False)
    assert emitted_in_next_step(runner, inbox) == {"whole"}
    assert (
        runner.requests["whole"].clock is None
        and runner.pacer.stats.counters()["pacing_slack_seconds_bucket:+Inf"] == 0
    )


# ---- config and /metrics ------------------------------------------------------------------------


def pipeline_with(tmp_path, stage: str, pacing: str):
    import yaml

    data = yaml.safe_load((ROOT / "stage_configs" / "qwen3_omni.yaml").read_text())
    for s in data["stages"]:
        s.pop("pacing", None)
        if s["name"] == stage:
            s["pacing"] = yaml.safe_load(pacing)
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize(
    "stage,pacing,message",
    [
        ("talker", "{lead_s: 1.0}", "stages[1].pacing.token_audio_s: missing"),
        ("decoder", "{token_audio_s: 0.08}", "stages[2].pacing.token_audio_s: only for autoregressive"),
        ("talker", "{lead_s: 0, token_audio_s: 0.08}", "lead_s"),
        ("talker", "{lead: 1}", "lead"),
        (
            "talker",
            "{token_audio_s: 0.08, ahead_batch_size: 2}",
            "stages[1].pacing.ahead_batch_size: only for generation stages",
        ),
        (
            "talker",
            "{token_audio_s: 0.08, lead_s: 3.0, max_lead_s: 2.0}",
            "stages[1].pacing.max_lead_s: 2 is below lead_s (3)",
        ),
    ],
)
def test_bad_pacing_names_the_key(tmp_path, stage, pacing, message):
    with pytest.raises(ConfigError) as e:
        load_config(pipeline_with(tmp_path, stage, pacing))
    assert message in str(e.value) and "p.yaml" in str(e.value)


def test_pacing_a_stage_that_feeds_no_audio_is_refused():
    config = load_config(ROOT / "stage_configs" / "qwen3_omni_thinker.yaml")
    config.stages[0].pacing = PacingConfig(lead_s=1.0, token_audio_s=0.08)
    with pytest.raises(ConfigError, match="feeds no audio output"):
        validate_config(config, check_paths=False)


def test_metrics_render_pacing_per_stage_that_reports_it():
    stats = PacingStats()
    stats.paced_requests, stats.underruns = 3, 1
    for slack in (-0.3, 0.5, 4.0):
        stats.observe_slack(slack)
    m = OrchestratorMetrics(["talker", "decoder"])
    text = m.render(
        {
            "talker": StageSnapshot(up=True, counters={"requests": 1, **stats.counters()}),
            "decoder": StageSnapshot(up=True, counters={"requests": 1}),
        },
        in_flight=0,
    )
    got = {(n, lab.get("stage"), lab.get("le")): v for n, lab, v in parse_metrics(text)}
    assert got[("omni_cache_stage_paced_requests_total", "talker", None)] == 3
    assert got[("omni_cache_stage_audio_underruns_total", "talker", None)] == 1
    assert got[("omni_cache_stage_pacing_slack_seconds_bucket", "talker", "0.0")] == 1
    assert got[("omni_cache_stage_pacing_slack_seconds_bucket", "talker", "+Inf")] == 3
    assert got[("omni_cache_stage_first_audio_shared_steps_total", "talker", None)] == 0
    assert not [n for n, stage, _ in got if stage == "decoder" and ("pac" in n or "underrun" in n)]
    assert not any(n.startswith("omni_cache_stage_pacing_slack_seconds_bucket:") for n, _, _ in got)
