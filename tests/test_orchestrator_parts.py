"""The orchestrator's parts on their own (omni_cache/runtime/): admission's checks, output assembly,
the effective config every stage starts with. No processes: a supervisor whose stages are "started
elsewhere" and announce themselves with real StageReady messages."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from omni_cache.config import load_config
from omni_cache.config.addresses import new_run_dir
from omni_cache.config.overrides import with_overrides
from omni_cache.runtime.metrics.prometheus import OrchestratorMetrics
from omni_cache.runtime.request_path.admission import CLOSED, OPEN, Admission
from omni_cache.runtime.request_path.output_assembly import BadOutput, OutputAssembler
from omni_cache.runtime.request_path.requests import Request
from omni_cache.runtime.request_path.results import AudioDelta, Completed, RequestError, TextDelta
from omni_cache.runtime.request_path.topology import Topology
from omni_cache.runtime.supervision.placement import StagePlacement, external_stages_of
from omni_cache.runtime.supervision.supervisor import StageSupervisor
from omni_cache.wire.messages import StageOutput, StageReady

CONFIG = """
name: parts
server: {{host: 127.0.0.1, port: 0}}
stages:
  - name: thinker
    kind: autoregressive
    model: tiny:thinker
    address: ipc://{d}/thinker.sock
    final_output: text
    engine_args: {{max_model_len: 512}}
    sampling: {{max_tokens: 16, temperature: 0.5}}
  - name: decoder
    kind: generation
    model: tiny:decoder
    inputs: [thinker]
    handoff: omni_cache.handoff.talker_to_decoder
    address: ipc://{d}/decoder.sock
    final_output: audio
"""


@pytest.fixture
def config(tmp_path):
    path = tmp_path / "pipeline.yaml"
    path.write_text(CONFIG.format(d=tmp_path))
    return load_config(path)


class Events:
    def __init__(self) -> None:
        self.up: list[str] = []
        self.down: list[str] = []

    def on_stage_up(self, stage: str) -> None:
        self.up.append(stage)

    def on_stage_down(self, stage: str, why: str) -> None:
        self.down.append(stage)


def supervisor_of(config, up=("thinker", "decoder")) -> StageSupervisor:
    """Every stage "started elsewhere"; those in ``up`` announced themselves."""
    sup = StageSupervisor(Events(), heartbeat_timeout_s=10.0, announce_to="ipc:///nowhere")
    for stage in config.stages:
        sup.add(stage, None, {}, False)
    for name in up:
        sup.on_announcement(StageReady(stage=name, pid=1, incarnation="a", max_model_len=0))
    return sup


def admission_of(config, up=("thinker", "decoder"), state=OPEN) -> Admission:
    adm = Admission(config, Topology.of(config), supervisor_of(config, up))
    adm.state = state
    return adm


# ---- admission -----------------------------------------------------------------------------------


def test_an_admitted_request_has_the_stage_defaults_with_its_overrides(config):
    adm = admission_of(config)
    ok = adm.check([1, 2, 3], max_tokens=4, seed=7, modalities=["audio"])
    assert ok.prompt_token_ids == [1, 2, 3] and ok.modalities == ("text", "audio")
    assert ok.participants == ("thinker", "decoder")
    assert (ok.sampling.max_tokens, ok.sampling.temperature, ok.sampling.seed) == (4, 0.5, 7)
    assert adm.check([1]).participants == ("thinker",)  # text only: the entry stage alone


def test_a_prefill_only_request_passes_the_entry_stage_and_a_talker_only(config):
    # Here the decoder reads the thinker's text directly: it has no prompt to prefill.
    adm = admission_of(config)
    assert adm.check([1], prefill_only=True).participants == ("thinker",)
    with pytest.raises(RequestError) as info:
        adm.check([1], modalities=["audio"], prefill_only=True)
    assert info.value.status == 400 and "talker" in info.value.message
    # Qwen3-Omni: thinker -> talker -> decoder; a listening request stops at the talker.
    q3 = load_config(Path(__file__).resolve().parents[1] / "stage_configs" / "qwen3_omni.yaml")
    topology = Topology.of(q3)
    assert topology.speaker == "talker" and topology.speaker_prefills
    assert topology.participants(("text", "audio"), prefill_only=True) == ("thinker", "talker")
    assert topology.participants(("text", "audio")) == ("thinker", "talker", "decoder")
    assert topology.participants(("text",), prefill_only=True) == ("thinker",)


@pytest.mark.parametrize(
    "prompt, kwargs, status, needle",
    [
        ([], {}, 400, "empty"),
        ([1, -1], {}, 400, "non-negative"),
        ([1, True], {}, 400, "non-negative"),
        ([1, 2.0], {}, 400, "non-negative"),
        ([-3, 1], {}, 400, "non-negative"),
        ([1], {"modalities": ["video"]}, 400, "unknown modality 'video'"),
        ([1], {"max_tokens": 0}, 400, "max_tokens must be at least 1"),
        ([1] * 500, {"max_tokens": 13}, 400, "maximum context length is 512 tokens; the prompt has 500"),
    ],
)
def test_what_the_request_asks_is_refused_with_400(config, prompt, kwargs, status, needle):
    with pytest.raises(RequestError) as info:
        admission_of(config).check(prompt, **kwargs)
    assert info.value.status == status and needle in info.value.message, info.value


def test_prompt_ids_of_numpy_integers_are_taken_as_python_ints(config):
    ids = admission_of(config).check([np.int64(5), 7, np.uint16(9)]).prompt_token_ids
    assert ids == [5, 7, 9] and {type(t) for t in ids} == {int}


def test_the_context_length_the_entry_stage_reported_wins(config):
    adm = admission_of(config)
    adm.context_len = 1024
    assert adm.check([1] * 1000, max_tokens=16).prompt_token_ids == [1] * 1000


def test_what_the_pipeline_cannot_do_now_is_refused_with_503_first(config):
    with pytest.raises(RequestError) as info:  # shutting down: before the prompt is looked at
        admission_of(config, state=CLOSED).check([])
    assert (info.value.status, info.value.message) == (503, "the server is shutting down")
    with pytest.raises(RequestError) as info:
        admission_of(config, state="starting").check([1])
    assert info.value.status == 503 and "still starting" in info.value.message
    adm = admission_of(config, up=("thinker",))
    assert adm.check([1]).participants == ("thinker",)  # text needs no decoder
    with pytest.raises(RequestError) as info:
        adm.check([1], modalities=["audio"])
    assert info.value.status == 503 and info.value.stage == "decoder"
    assert "decoder (started elsewhere, waiting for it to announce itself)" in info.value.message


def test_audio_from_a_pipeline_without_an_audio_stage_is_a_400(config):
    text_only = copy.deepcopy(config)
    text_only.stages = text_only.stages[:1]
    with pytest.raises(RequestError) as info:
        admission_of(text_only, up=("thinker",)).check([1], modalities=["audio"])
    assert info.value.status == 400 and "no audio output stage" in info.value.message


# ---- output assembly -----------------------------------------------------------------------------


def request(participants=("thinker", "decoder"), return_latents=False) -> Request:
    return Request(
        request_id="r",
        prompt_token_ids=[1, 2],
        modalities=("text", "audio"),
        participants=participants,
        t0=0.0,
        deadline=1e9,
        timeout_s=1.0,
        return_latents=return_latents,
    )


def drain(req: Request) -> list:
    out = []
    while not req.queue.empty():
        out.append(req.queue.get_nowait())
    return out


def test_outputs_become_the_clients_events_and_complete_when_every_stage_finished(config):
    topo = Topology.of(config)
    asm = OutputAssembler(topo, OrchestratorMetrics(topo.stage_names))
    thinker, decoder = config.stages
    req = request(return_latents=True)
    hidden = torch.arange(6.0).reshape(3, 2)
    assert not asm.add(
        req,
        thinker,
        StageOutput(request_id="r", stage="thinker", seq=0, token_ids=[5, 6], text="ab"),
        {"hidden": hidden[:2]},
        1.0,
    )
    assert not asm.add(
        req,
        thinker,
        StageOutput(
            request_id="r",
            stage="thinker",
            seq=1,
            token_ids=[7],
            text="c",
            finished=True,
            finish_reason="length",
            num_prompt_tokens=2,
            latent_start=2,
        ),
        {"hidden": hidden[2:]},
        1.1,
    )
    audio = torch.full((240,), 0.5)
    assert asm.add(
        req,
        decoder,
        StageOutput(request_id="r", stage="decoder", seq=0, finished=True, sample_rate=16000),
        {"audio": audio},
        1.2,
    )
    events = drain(req)
    assert [type(e) for e in events] == [TextDelta, TextDelta, AudioDelta]
    assert (events[0].text, events[0].token_ids, events[1].text) == ("ab", [5, 6], "c")
    assert events[2].sample_rate == 16000 and np.array_equal(events[2].audio, audio.numpy())
    assert asm.audio_sample_rate == 16000
    done = asm.completed(req)
    assert isinstance(done, Completed) and done.finish_reason == "length"
    assert done.num_prompt_tokens == 2 and torch.equal(done.latents["hidden"], hidden)


def test_audio_at_an_impossible_rate_is_a_bad_output(config):
    topo = Topology.of(config)
    asm = OutputAssembler(topo, OrchestratorMetrics(topo.stage_names))
    with pytest.raises(BadOutput, match="1 Hz"):
        asm.add(
            request(),
            config.stages[1],
            StageOutput(request_id="r", stage="decoder", seq=0, sample_rate=1),
            {"audio": torch.zeros(4)},
            0.0,
        )


# ---- the effective config ------------------------------------------------------------------------


def test_overrides_apply_to_a_copy(config):
    before = copy.deepcopy(config)
    run = with_overrides(config, checkpoint_dir="/elsewhere", prefix_cache=False)
    assert config == before  # the caller's object is unchanged
    assert run.checkpoint_dir == "/elsewhere" and not run.stages[0].prefix_cache


def test_every_stage_starts_with_one_serialized_config_not_the_file(config, tmp_path):
    run = with_overrides(config, checkpoint_dir=str(tmp_path / "ckpt"))
    run.server.control_address = "ipc:///tmp/x/orchestrator.sock"  # the hand-started decoder's
    placement = StagePlacement(
        run,
        run_dir=new_run_dir(run),
        stage_argv=[sys.executable, "-m", "workers"],
        external=external_stages_of(run, ["decoder"]),
    )
    placement.make_run_dir()
    try:
        runners = placement.runners("ipc:///tmp/x/orchestrator.sock")
        # The file the server was started from changes; the stages' config does not.
        (tmp_path / "pipeline.yaml").write_text("name: edited\n")
        (stage, _, runner, env), (_, _, external, _) = runners
        assert stage.name == "thinker" and external is None  # the decoder is started by hand
        argv = runner.argv  # forked (server.stage_launch: fork) as this command would run
        path = Path(argv[argv.index("--stage-config") + 1])
        assert str(path.parent) == placement.run_dir  # beside the server's own sockets
        assert path.read_text() == placement.config_text
        assert load_config(path) == run  # the run's config, overrides included
        assert argv[argv.index("--orchestrator") + 1] == "ipc:///tmp/x/orchestrator.sock"
        assert "--checkpoint-dir" not in argv and env["PYTHONUNBUFFERED"] == "1"
    finally:
        placement.close()
    assert not path.exists()  # removed on close


def test_external_stages_must_be_known_and_single(config):
    with pytest.raises(ValueError, match="unknown stage"):
        external_stages_of(config, ["nope"])
    several = copy.deepcopy(config)
    several.stages[0].replicas = 2
    with pytest.raises(ValueError, match="several replicas"):
        external_stages_of(several, ["thinker"])
