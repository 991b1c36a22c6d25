"""Stage-config schema, validation, shipped configs and the `omni-serve --check` CLI (no engines)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

from omni_cache import cli
from omni_cache.config import (
    ConfigError,
    EngineArgs,
    PipelineConfig,
    StageConfig,
    checkpoint_root,
    load_config,
    parse_config,
    resolve_handoff,
    resolve_model,
    validate_config,
)
from omni_cache.config.addresses import run_root

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "stage_configs"
TINY = CONFIGS / "tiny_omni.yaml"
HYBRID = CONFIGS / "tiny_omni_hybrid.yaml"
QWEN = CONFIGS / "qwen3_omni_example.yaml"
OMNI_SERVE = Path(sys.executable).parent / "omni-serve"


def with_addresses(text: str) -> str:
    """tiny_omni.yaml's text with every stage's address spelled out (the shipped file leaves them
    to the server): the config the address checks below vary."""
    for stage in ("thinker", "talker", "decoder"):
        text = text.replace(
            DEFAULT_ADDRESS,
            f"    address: ipc:///tmp/omni_cache/tiny_omni/{stage}.sock   # where the stage process listens (ZMQ)",
            1,
        )
    return text


DEFAULT_ADDRESS = (
    "    address: null                                  # where the stage listens "
    "(ZMQ); null -> a socket in this server's own directory"
)


def write_variant(tmp_path: Path, old: str, new: str, *, base: Path = TINY, count: int = 1) -> Path:
    """A copy of a shipped config with ``old`` replaced by ``new`` (``count`` occurrences);
    tiny_omni.yaml with its addresses spelled out (:func:`with_addresses`)."""
    text = with_addresses(base.read_text()) if base == TINY else base.read_text()
    assert text.count(old) >= count, f"{old!r} not in {base.name}"
    path = tmp_path / "bad.yaml"
    path.write_text(text.replace(old, new, count))
    return path


def config_error(path: Path, **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, **kwargs)
    return str(info.value)


# --------------------------------------------------------------------------------------------------
# Shipped configs
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", [TINY, HYBRID])
def test_tiny_configs_load(path: Path) -> None:
    config = load_config(path)
    assert [s.name for s in config.topological_order()] == ["thinker", "talker", "decoder"]
    assert config.entry_stage().name == "thinker"
    thinker, talker, decoder = (config.stage(n) for n in ("thinker", "talker", "decoder"))
    assert thinker.kind == talker.kind == "autoregressive"
    assert decoder.kind == "generation"
    assert thinker.final_output == "text" and decoder.final_output == "audio"
    assert talker.final_output is None
    assert thinker.latents.hidden and thinker.uses_prefix_cache
    assert talker.handoff == "omni_cache.handoff.thinker_to_talker"
    assert decoder.handoff == "omni_cache.handoff.talker_to_decoder"
    assert talker.engine_args is not None and talker.engine_args.enable_prompt_embeds is True
    assert thinker.env == {"VLLM_CPU_KVCACHE_SPACE": "2", "OMP_NUM_THREADS": "1"}
    assert all(s.env.get("OMP_NUM_THREADS") == "1" for s in config.stages)
    assert thinker.sampling.max_tokens == 32 and talker.sampling.max_tokens == 4096
    assert decoder.engine_args is None
    assert decoder.generation is not None
    assert (decoder.generation.max_batch_size, decoder.generation.chunk_size) == (16, 16)
    assert config.server.served_model_name == config.name
    assert all(s.address is None for s in config.stages)  # the server chooses them


def test_tiny_thinker_engine_args() -> None:
    config = load_config(TINY)
    kwargs = config.stage("thinker").engine_args.to_vllm_kwargs()
    assert kwargs == {
        "max_model_len": 8192,
        "block_size": 32,
        "max_num_seqs": 16,
        "enforce_eager": True,
        "gpu_memory_utilization": 0.3,
        "dtype": "bfloat16",
    }


def test_hybrid_thinker_leaves_block_size_to_vllm() -> None:
    thinker = load_config(HYBRID).stage("thinker")
    assert thinker.model == "tiny:thinker-hybrid"
    assert thinker.engine_args.block_size is None
    assert "block_size" not in thinker.engine_args.to_vllm_kwargs()
    # the talker still needs a CPU-friendly block size
    assert load_config(HYBRID).stage("talker").engine_args.block_size == 32


def test_qwen_example_needs_no_path_check() -> None:
    message = config_error(QWEN)
    assert f"{QWEN}: stages[0].model: path '/models/Qwen3-Omni-30B-A3B-Instruct'" in message
    assert "does not exist" in message and "--no-path-check" in message
    config = load_config(QWEN, check_paths=False)
    thinker = config.stage("thinker")
    assert thinker.latents.layers == [] and thinker.latents.merged.media_layer == 24
    talker = config.stage("talker")
    assert talker.submodel == "talker" and talker.model == thinker.model
    assert talker.handoff == "omni_cache.models.qwen3_omni_talker_prompt.thinker_to_talker"
    # Laid out for Ray: two thinker replicas on the thinker_gpu hosts, the audio stages together.
    assert config.server.ray_address == "auto" and all(config.placed_by_ray(s) for s in config.stages)
    assert all(s.address is None and s.ray is not None and s.ray.num_gpus == 1 for s in config.stages)
    assert thinker.replicas == 2 and thinker.ray.for_replica(1) == {"thinker_gpu": 1}
    assert {s.name: s.ray.resources for s in config.stages[1:]} == {
        "talker": {"audio_gpu": 1},
        "decoder": {"audio_gpu": 1},
    }
    assert config.stage("decoder").generation.device == "cuda"
    assert thinker.engine_args.to_vllm_kwargs()["limit_mm_per_prompt"] == {
        "image": 4,
        "audio": 2,
        "video": 1,
    }
    # The same pipeline as the shipped CPU default, laid out on GPU hosts.
    default = load_config(CONFIGS / "qwen3_omni.yaml")
    assert [(s.name, s.handoff, s.submodel) for s in config.stages] == [
        (s.name, s.handoff, s.submodel) for s in default.stages
    ]


@pytest.mark.parametrize("path", [TINY, HYBRID, QWEN], ids=lambda p: p.name)
def test_shipped_configs_comment_every_key(path: Path) -> None:
    lines = path.read_text().splitlines()
    for i, line in enumerate(lines):
        if re.match(r"^\s*(- )?[A-Za-z_]\w*:", line):
            assert "#" in line or lines[i - 1].lstrip().startswith("#"), (
                f"{path.name}:{i + 1}: key without a comment: {line.strip()}"
            )


# --------------------------------------------------------------------------------------------------
# Errors name the file and the exact key path
# --------------------------------------------------------------------------------------------------

BAD_CASES = {
    "wrong_type": (
        "      block_size: 32                               # multiple of 32 for the CPU backend",
        "      block_size: '32'",
        "stages[1].engine_args.block_size: expected int, got str '32'",
    ),
    "unknown_key": (
        "    engine_args:                                   # vLLM engine arguments (unset = vLLM default)\n"
        "      max_model_len: 8192                          # longest prompt + answer",
        "    engne_args:\n      max_model_len: 8192",
        "stages[0].engne_args: unknown key (did you mean 'engine_args'?)",
    ),
    "nested_unknown_key": (
        "      hidden: true ",
        "      hiden: true ",
        "stages[0].latents.hiden: unknown key (did you mean 'hidden'?)",
    ),
    "missing_input_stage": (
        "inputs: [talker]",
        "inputs: [talkr]",
        "stages[2].inputs[0]: unknown stage 'talkr' (stages: thinker, talker, decoder)",
    ),
    "duplicate_names": (
        "  - name: decoder ",
        "  - name: talker ",
        "stages[2].name: duplicate stage name 'talker' (also stages[1].name)",
    ),
    "cycle": (
        "inputs: [thinker]",
        "inputs: [thinker, decoder]",
        "stages[1].inputs: input cycle: talker -> decoder -> talker",
    ),
    "missing_handoff": (
        "    handoff: omni_cache.handoff.talker_to_decoder  # cuts them into decode chunks\n",
        "",
        "stages[2].handoff: missing: a stage with inputs needs a hand-off function",
    ),
    "bad_address_scheme": (
        "ipc:///tmp/omni_cache/tiny_omni/talker.sock",
        "http://127.0.0.1:9000",
        "stages[1].address: expected 'ipc:///path' or 'tcp://host:port', got scheme 'http'",
    ),
    "bad_address_port": (
        "ipc:///tmp/omni_cache/tiny_omni/talker.sock",
        "tcp://127.0.0.1:70000",
        "stages[1].address: expected a port 1..65535 in 'tcp://127.0.0.1:70000', got '70000'",
    ),
    "relative_ipc": (
        "ipc:///tmp/omni_cache/tiny_omni/talker.sock",
        "ipc://talker.sock",
        "stages[1].address: ipc path 'talker.sock' must be absolute",
    ),
    "duplicate_address": (
        "ipc:///tmp/omni_cache/tiny_omni/talker.sock",
        "ipc:///tmp/omni_cache/tiny_omni/thinker.sock",
        "stages[1].address: 'ipc:///tmp/omni_cache/tiny_omni/thinker.sock' is also the address "
        "of stages[0] ('thinker')",
    ),
    "bad_enum": (
        "kind: generation ",
        "kind: generator ",
        "stages[2].kind: expected one of 'autoregressive', 'generation', got 'generator'",
    ),
    "yaml_bool_for_literal": (
        "      dtype: bfloat16 ",
        "      dtype: yes ",
        "stages[0].engine_args.dtype: expected one of 'auto', 'bfloat16', 'float16', 'float32', got bool True",
    ),
    "env_not_string": (
        'VLLM_CPU_KVCACHE_SPACE: "2"',
        "VLLM_CPU_KVCACHE_SPACE: 2",
        "stages[0].env.VLLM_CPU_KVCACHE_SPACE: expected str, got int 2",
    ),
    "out_of_range": (
        "gpu_memory_utilization: 0.3 ",
        "gpu_memory_utilization: 1.5 ",
        "stages[0].engine_args.gpu_memory_utilization: expected float <= 1.0, got 1.5",
    ),
    "block_size_not_multiple_of_16": (
        "block_size: 32 ",
        "block_size: 24 ",
        "stages[0].engine_args.block_size: expected int that's a multiple of 16, got 24",
    ),
    "negative_layer": (
        "layers: []",
        "layers: [3, -1]",
        "stages[0].latents.layers[1]: expected int >= 0, got -1",
    ),
    "repeated_layer": (
        "layers: []",
        "layers: [3, 3]",
        "stages[0].latents.layers: layer indices must be unique, repeated: 3",
    ),
    "missing_required": (
        "    model: tiny:talker                             # generated tiny checkpoint\n",
        "",
        "stages[1].model: missing required key",
    ),
    "bad_stage_name": (
        "  - name: talker ",
        "  - name: Talker ",
        "stages[1].name: expected str matching regex '^[a-z0-9_-]+$', got 'Talker'",
    ),
    "unknown_tiny_model": (
        "tiny:talker",
        "tiny:talkr",
        "stages[1].model: unknown tiny checkpoint 'talkr' (known: tiny:decoder, tiny:qwen2.5-omni, "
        "tiny:qwen3-omni, tiny:qwen3.5, tiny:talker, tiny:thinker, tiny:thinker-hybrid)",
    ),
    "tiny_model_of_other_kind": (
        "tiny:decoder",
        "tiny:talker",
        "stages[2].model: 'tiny:talker' is for a stage of kind 'autoregressive', but this stage's kind is 'generation'",
    ),
    "missing_model_path": (
        "tiny:talker",
        "/nonexistent/omni_cache/talker",
        "stages[1].model: path '/nonexistent/omni_cache/talker' does not exist",
    ),
    "engine_args_on_generation": (
        "    generation:                                    # settings of the generation stage\n",
        "    engine_args: {max_model_len: 64}\n    generation:\n",
        "stages[2].engine_args: not allowed for a kind 'generation' stage",
    ),
    "generation_on_autoregressive": (
        "    sampling:                                      # defaults when the request does not say\n"
        "      temperature: 0.0                             # greedy\n"
        "      top_p: 1.0                                   # no nucleus cut\n"
        "      max_tokens: 4096",
        "    generation: {chunk_size: 8}\n    sampling:\n      max_tokens: 4096",
        "stages[1].generation: only for kind 'generation' stages",
    ),
    "latents_on_generation": (
        "    generation:                                    # settings of the generation stage\n",
        "    latents: {hidden: true}\n    generation:\n",
        "stages[2].latents: only meaningful for autoregressive stages",
    ),
    "two_entry_stages": (
        "    inputs: [talker]                               # reads the talker's codes\n"
        "    handoff: omni_cache.handoff.talker_to_decoder  # cuts them into decode chunks\n",
        "    inputs: []\n",
        "stages[2].inputs: more than one entry stage ('thinker', 'decoder' have no inputs)",
    ),
    "no_final_output": (
        "    final_output: audio ",
        "    final_output: null ",
        None,  # checked below together with the thinker's
    ),
    "handoff_on_entry_stage": (
        "    inputs: []                                     # [] = takes",
        "    handoff: omni_cache.handoff.thinker_to_talker\n    inputs: []   # [] = takes",
        "stages[0].handoff: only meaningful for a stage with inputs",
    ),
    "reserved_extra_key": (
        "      enable_prompt_embeds: true ",
        "      extra: {enable_prefix_caching: true}\n      enable_prompt_embeds: true ",
        "stages[1].engine_args.extra.enable_prefix_caching: not allowed here: set the stage's prefix_cache instead",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_bad_config_names_file_and_key_path(tmp_path: Path, case: str) -> None:
    old, new, expected = BAD_CASES[case]
    if case == "no_final_output":
        path = tmp_path / "bad.yaml"
        text = TINY.read_text().replace("    final_output: audio ", "    final_output: null ")
        path.write_text(text.replace("    final_output: text ", "    final_output: null "))
        expected = "stages: no stage has a final_output"
    else:
        path = write_variant(tmp_path, old, new)
    message = config_error(path)
    assert f"{path}: {expected}" in message, message
    # Every issue line starts with the file name and carries the line it is on.
    for line in message.splitlines():
        assert line.startswith(f"{path}: ")
        assert re.search(r"\(line \d+\)$", line), line


def test_wrong_type_message_is_exact(tmp_path: Path) -> None:
    path = write_variant(
        tmp_path,
        "      block_size: 32                               # multiple of 32 for the CPU backend",
        "      block_size: '32'",
    )
    message = config_error(path)
    line = path.read_text().splitlines().index("      block_size: '32'") + 1
    assert message == (f"{path}: stages[1].engine_args.block_size: expected int, got str '32' (line {line})")


def test_every_semantic_problem_is_reported(tmp_path: Path) -> None:
    text = with_addresses(TINY.read_text())
    text = text.replace("inputs: [talker]", "inputs: [talkr]")
    text = text.replace("ipc:///tmp/omni_cache/tiny_omni/talker.sock", "udp://x:1")
    path = tmp_path / "two.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    keys = sorted(issue.key for issue in info.value.issues)
    assert keys == ["stages[1].address", "stages[2].inputs[0]"]
    assert info.value.file == str(path)


def test_every_schema_problem_is_reported(tmp_path: Path) -> None:
    """The schema is checked key by key: every wrong type, bound, unknown and missing key at once,
    each with its key path and line (msgspec alone stops at the first)."""
    text = TINY.read_text().replace("block_size: 32 ", "block_size: '32' ", 1)
    text = text.replace("kind: generation ", "kind: null ").replace("hidden: true ", "hiden: true ")
    text = text.replace("    model: tiny:talker ", "    #").replace("port: 8091", "port: 70000")
    path = tmp_path / "many.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    got = {issue.key: issue.message for issue in info.value.issues}
    assert got == {
        "server.port": "expected int <= 65535, got 70000",
        "stages[0].latents.hiden": "unknown key (did you mean 'hidden'?)",
        "stages[0].engine_args.block_size": "expected int, got str '32'",
        "stages[1].model": "missing required key",
        "stages[2].kind": "expected one of 'autoregressive', 'generation', got null",
    }
    assert all(issue.line is not None and issue.file == str(path) for issue in info.value.issues)


def test_self_input_is_a_cycle(tmp_path: Path) -> None:
    path = write_variant(tmp_path, "inputs: [talker]", "inputs: [decoder]")
    assert f"{path}: stages[2].inputs: input cycle: decoder -> decoder" in config_error(path)


def test_stage_port_clashing_with_server(tmp_path: Path) -> None:
    path = write_variant(tmp_path, "ipc:///tmp/omni_cache/tiny_omni/talker.sock", "tcp://0.0.0.0:8091")
    assert f"{path}: stages[1].address: 'tcp://0.0.0.0:8091' is the HTTP server's port" in (config_error(path))


def test_yaml_syntax_error_names_file_and_line(tmp_path: Path) -> None:
    path = write_variant(tmp_path, "inputs: [talker]", "inputs: [talker")
    message = config_error(path)
    assert re.match(rf"^{re.escape(str(path))}: line \d+, column \d+: invalid YAML: ", message)


def test_duplicate_yaml_key_is_an_error(tmp_path: Path) -> None:
    path = write_variant(tmp_path, "    final_output: audio ", "    final_output: text\n    final_output: audio ")
    message = config_error(path)
    assert re.match(
        rf"^{re.escape(str(path))}: line (\d+): duplicate key 'final_output' \(first set on line \d+\)$",
        message,
    )


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", "empty config"),
        ("- a\n- b\n", "expected a mapping at the top level, got list"),
        ("name: x\nstages: []\n", "stages: expected list of length >= 1, got []"),
        ("name: x\nstages:\n", "stages: expected list, got null"),
        ("stages: [{name: a}]\n", "stages[0].kind: missing required key"),
        ("checkpoint_dir: null\n", "name: missing required key"),
        (
            "name: x\nstages: [{name: a, kind: generation, model: tiny:decoder, address: "
            "'ipc:///tmp/a', final_output: audio, env: {3: x}}]\n",
            "stages[0].env: keys must be strings, got int (3)",
        ),
        (
            "name: x\nstages: [{name: a, kind: generation, model: tiny:decoder, 7: x}]\n",
            "stages[0]: keys must be strings, got int (7)",
        ),
    ],
)
def test_top_level_problems(tmp_path: Path, text: str, expected: str) -> None:
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    assert f"{path}: {expected}" in config_error(path)


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.yaml"
    assert config_error(path) == f"{path}: no such file"


# --------------------------------------------------------------------------------------------------
# Hand-off resolution
# --------------------------------------------------------------------------------------------------

MINIMAL = """\
name: mini
stages:
  - name: a
    kind: autoregressive
    model: tiny:thinker
    address: ipc:///tmp/omni_cache_test/a.sock
    final_output: text
    engine_args: {{block_size: 32}}
  - name: b
    kind: generation
    model: tiny:decoder
    inputs: [a]
    handoff: {handoff}
    address: ipc:///tmp/omni_cache_test/b.sock
    final_output: audio
"""


@pytest.fixture
def handoff_pkg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A temporary importable module with good and bad hand-off attributes."""
    name = "omni_cache_test_handoffs"
    (tmp_path / f"{name}.py").write_text(
        textwrap.dedent(
            """
            def a_to_b(outputs):
                return outputs
            NOT_CALLABLE = 3
            """
        )
    )
    (tmp_path / f"{name}_broken.py").write_text("raise RuntimeError('boom at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for mod in (name, f"{name}_broken"):
        monkeypatch.delitem(sys.modules, mod, raising=False)
    return name


def test_handoff_resolves_from_temporary_module(handoff_pkg: str) -> None:
    config = parse_config(MINIMAL.format(handoff=f"{handoff_pkg}.a_to_b"), source="mini.yaml")
    fn = resolve_handoff(config.stage("b").handoff)
    assert fn([1, 2]) == [1, 2]


@pytest.mark.parametrize(
    ("handoff", "expected"),
    [
        ("{pkg}.missing", "module '{pkg}' has no attribute 'missing'"),
        ("{pkg}.NOT_CALLABLE", "'{pkg}.NOT_CALLABLE' is not callable (it is a int)"),
        ("{pkg}_nope.fn", "cannot import module '{pkg}_nope' (No module named '{pkg}_nope')"),
        ("{pkg}_broken.fn", "importing module '{pkg}_broken' failed: RuntimeError: boom at import"),
        ("a_to_b", "expected a dotted path 'package.module.function', got 'a_to_b'"),
    ],
)
def test_bad_handoff(handoff_pkg: str, handoff: str, expected: str) -> None:
    handoff = handoff.format(pkg=handoff_pkg)
    expected = expected.format(pkg=handoff_pkg)
    with pytest.raises(ConfigError) as info:
        parse_config(MINIMAL.format(handoff=handoff), source="mini.yaml")
    assert f"mini.yaml: stages[1].handoff: {expected}" in str(info.value)
    with pytest.raises(ConfigError, match=re.escape(expected)):
        resolve_handoff(handoff)


# --------------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------------


def test_graph_helpers_follow_inputs_not_file_order(handoff_pkg: str) -> None:
    text = f"""\
name: fan
stages:
  - name: sink
    kind: generation
    model: tiny:decoder
    inputs: [mid]
    handoff: {handoff_pkg}.a_to_b
    address: tcp://127.0.0.1:5703
    final_output: audio
  - name: mid
    kind: autoregressive
    model: tiny:talker
    inputs: [src]
    handoff: {handoff_pkg}.a_to_b
    address: tcp://127.0.0.1:5702
    engine_args: {{}}
  - name: src
    kind: autoregressive
    model: tiny:thinker
    address: tcp://127.0.0.1:5701
    final_output: text
    engine_args: {{}}
"""
    config = parse_config(text, source="fan.yaml")
    assert [s.name for s in config.topological_order()] == ["src", "mid", "sink"]
    assert config.entry_stage().name == "src"
    assert [s.name for s in config.downstream("src")] == ["mid"]
    assert [s.name for s in config.downstream("sink")] == []
    assert [s.name for s in config.upstream("sink")] == ["mid"]
    assert [s.name for s in config.final_stages()] == ["sink", "src"]
    with pytest.raises(KeyError, match="no stage 'nope' \\(stages: sink, mid, src\\)"):
        config.stage("nope")


def test_engine_args_to_vllm_kwargs() -> None:
    args = EngineArgs(block_size=32, enforce_eager=True, extra={"max_logprobs": 5})
    assert args.to_vllm_kwargs() == {"block_size": 32, "enforce_eager": True, "max_logprobs": 5}
    assert EngineArgs().to_vllm_kwargs() == {}
    assert "enable_prefix_caching" not in args.to_vllm_kwargs()


def test_programmatic_config_validates() -> None:
    config = PipelineConfig(
        name="p",
        stages=[
            StageConfig(
                name="only",
                kind="generation",
                model="tiny:decoder",
                address="ipc:///tmp/omni_cache_test/only.sock",
                final_output="audio",
            )
        ],
    )
    assert config.server.served_model_name == "p"
    assert config.stages[0].generation is not None  # defaults filled in
    assert validate_config(config) is config
    config.stages[0].address = "ipc://relative.sock"
    with pytest.raises(ConfigError, match=r"^stages\[0\]\.address: ipc path"):
        validate_config(config)


def test_checkpoint_root_order(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    config = load_config(TINY)
    monkeypatch.delenv("OMNI_CACHE_CHECKPOINTS", raising=False)
    assert checkpoint_root(config) == Path("~/.cache/omni_cache/checkpoints").expanduser()
    monkeypatch.setenv("OMNI_CACHE_CHECKPOINTS", str(tmp_path / "env"))
    assert checkpoint_root(config) == tmp_path / "env"
    config.checkpoint_dir = str(tmp_path / "cfg")
    assert checkpoint_root(config) == tmp_path / "cfg"


def test_resolve_model(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    calls = []

    def ensure_checkpoint(name, root=None, seed=0):
        calls.append((name, Path(root)))
        return Path(root) / name

    fake = types.ModuleType("omni_cache.tiny.checkpoints")
    fake.ensure_checkpoint = ensure_checkpoint
    monkeypatch.setitem(sys.modules, "omni_cache.tiny.checkpoints", fake)
    config = load_config(TINY)
    config.checkpoint_dir = str(tmp_path)
    assert resolve_model(config.stage("thinker"), config) == str(tmp_path / "thinker")
    assert calls == [("thinker", tmp_path)]

    model_dir = tmp_path / "real"
    model_dir.mkdir()
    stage = config.stage("talker")
    stage.model = str(model_dir)
    assert resolve_model(stage, config) == str(model_dir)
    assert len(calls) == 1


# --------------------------------------------------------------------------------------------------
# omni-serve
# --------------------------------------------------------------------------------------------------


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    assert OMNI_SERVE.exists(), f"{OMNI_SERVE} missing: install the package (pip install -e .)"
    env = {k: v for k, v in os.environ.items() if k != "OMNI_CACHE_API_KEY"}
    return subprocess.run([str(OMNI_SERVE), *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


def test_cli_help_lists_every_flag() -> None:
    result = run_cli("--help")
    assert result.returncode == 0, result.stderr
    for flag in (
        "--stage-config",
        "--check",
        "--no-path-check",
        "--host",
        "--port",
        "--api-key",
        "--checkpoint-dir",
        "--no-prefix-cache",
        "--log-level",
    ):
        assert flag in result.stdout
    assert "OMNI_CACHE_API_KEY" in result.stdout and "OMNI_CACHE_CHECKPOINTS" in result.stdout


def test_cli_check_shipped_config() -> None:
    result = run_cli("--stage-config", "stage_configs/tiny_omni.yaml", "--check")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "pipeline: tiny_omni" in out
    assert "server:       http://127.0.0.1:8091" in out
    for stage in ("thinker", "talker", "decoder"):
        assert f"stage {stage}:" in out
        assert (f"address:      chosen at start: ipc://{run_root()}/<name>-<pid>-<random>/{stage}.sock") in out
    assert "prefix cache: on" in out and "latents:      hidden" in out
    assert "final output: text" in out and "final output: audio" in out
    assert "inputs:       thinker (handoff omni_cache.handoff.thinker_to_talker)" in out
    assert out.rstrip().endswith("config OK")


def test_cli_check_bad_config(tmp_path: Path) -> None:
    path = write_variant(tmp_path, "inputs: [talker]", "inputs: [talkr]")
    result = run_cli("--stage-config", str(path), "--check")
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.startswith(f"omni-serve: config error: {path}: stages[2].inputs[0]: unknown stage 'talkr'")


def test_cli_missing_config_file(tmp_path: Path) -> None:
    result = run_cli("--stage-config", str(tmp_path / "none.yaml"), "--check")
    assert result.returncode == 2
    assert f"omni-serve: config error: {tmp_path / 'none.yaml'}: no such file" in result.stderr


def test_cli_no_path_check_for_qwen_example() -> None:
    assert run_cli("--stage-config", str(QWEN), "--check").returncode == 2
    result = run_cli("--stage-config", str(QWEN), "--check", "--no-path-check")
    assert result.returncode == 0, result.stderr
    assert "latents:      layer 0, layer 24 at media positions (one latent)" in result.stdout
    assert "model:        /models/Qwen3-Omni-30B-A3B-Instruct (its talker)" in result.stdout
    assert "http://0.0.0.0:8091" in result.stdout


def test_cli_overrides(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    rc = cli.main(
        [
            "--stage-config",
            str(TINY),
            "--check",
            "--no-prefix-cache",
            "--host",
            "0.0.0.0",
            "--port",
            "9000",
            "--checkpoint-dir",
            str(tmp_path),
            "--api-key",
            "secret",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    assert "http://0.0.0.0:9000" in out
    assert "prefix cache: on" not in out and out.count("prefix cache: off") == 2
    assert f"checkpoints:  {tmp_path}" in out
    assert "secret" not in out and "api key:      required" in out


def test_cli_override_revalidated(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = write_variant(tmp_path, "ipc:///tmp/omni_cache/tiny_omni/talker.sock", "tcp://127.0.0.1:9100")
    rc = cli.main(["--stage-config", str(path), "--check", "--port", "9100"])
    err = capsys.readouterr().err
    assert rc == 2
    want = f"omni-serve: config error: {path}: stages[1].address: 'tcp://127.0.0.1:9100' is the HTTP server's port"
    assert want in err


def test_cli_usage_error_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--check"]) == 2  # --stage-config is required
    assert "--stage-config" in capsys.readouterr().err
    assert cli.main(["--stage-config", str(TINY), "--port", "70000"]) == 2


def test_cli_calls_server(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    seen = {}
    fake = types.ModuleType("omni_cache_test_fake_server")

    def serve(config, args, stage_forkers):
        seen["config"], seen["args"], seen["forkers"] = config, args, stage_forkers.started
        return 0

    fake.serve = serve
    monkeypatch.setitem(sys.modules, fake.__name__, fake)
    monkeypatch.setattr(cli, "SERVER_MODULE", fake.__name__)
    assert cli.main(["--stage-config", str(TINY), "--log-level", "WARNING"]) == 0
    assert seen["config"].name == "tiny_omni"
    assert seen["args"].stage_config == str(TINY) and seen["args"].log_level == "warning"
    # The stages' forker was started before the server module loaded, and ended after it returned.
    [forker] = seen["forkers"]  # the three stages' environments differ only in VLLM_CPU_KVCACHE_SPACE
    assert forker.proc.poll() is not None


# --------------------------------------------------------------------------------------------------
# Keys that would be accepted and then fail or do nothing: refused, each named
# --------------------------------------------------------------------------------------------------


def assert_refused_naming(path: Path, key: str, words: str) -> None:
    """The config at `path` is refused with an error naming the file, `key` and `words`, both by
    the loader and by `omni-serve --check` (exit 2)."""
    message = config_error(path)
    assert f"{path}: {key}: " in message and words in message, message
    assert cli.main(["--stage-config", str(path), "--check"]) == 2


@pytest.mark.parametrize(
    "old,new,key,words",
    [
        (
            "      max_num_seqs: 16                             # most requests per step\n"
            "      enforce_eager: true                          # no torch.compile",
            "      max_num_seqs: 16\n      tensor_parallel_size: 2\n      enforce_eager: true  #",
            "stages[0].engine_args.tensor_parallel_size",
            "2 is not supported",
        ),
        ("inputs: [talker]", "inputs: [talker, thinker]", "stages[2].inputs", "a stage reads one input stage"),
        (
            "      device: cpu                                  # torch device",
            "      device: cpu\n    sampling: {temperature: 0.5}  #",
            "stages[2].sampling",
            "only for autoregressive stages",
        ),
        (
            "      device: cpu                                  # torch device",
            "      device: cpu\n    prefix_cache: false  #",
            "stages[2].prefix_cache",
            "only for autoregressive stages",
        ),
    ],
)
def test_keys_that_would_do_nothing_are_refused(tmp_path: Path, old: str, new: str, key: str, words: str) -> None:
    assert_refused_naming(write_variant(tmp_path, old, new), key, words)


def test_no_prefix_cache_leaves_the_generation_stage_alone() -> None:
    """--no-prefix-cache turns the cache off where there is one; the config stays valid."""
    assert cli.main(["--stage-config", str(TINY), "--check", "--no-prefix-cache"]) == 0


# --------------------------------------------------------------------------------------------------
# Replicas and routing
# --------------------------------------------------------------------------------------------------

THINKER_ADDRESS = "    address: ipc:///tmp/omni_cache/tiny_omni/thinker.sock   # where the stage process listens (ZMQ)"
HOSTS = CONFIGS / "tiny_omni_hosts.yaml"


def test_replicas_get_their_own_names_and_addresses(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from omni_cache.config.replicas import stage_replicas

    path = write_variant(tmp_path, THINKER_ADDRESS, THINKER_ADDRESS + "\n    replicas: 3  #")
    config = load_config(path)
    assert config.server.routing == "prefix"  # the default
    replicas = stage_replicas(config.stage("thinker"))
    assert [(r.name, r.index, r.address) for r in replicas] == [
        ("thinker#0", 0, "ipc:///tmp/omni_cache/tiny_omni/thinker.sock"),
        ("thinker#1", 1, "ipc:///tmp/omni_cache/tiny_omni/thinker.sock.1"),
        ("thinker#2", 2, "ipc:///tmp/omni_cache/tiny_omni/thinker.sock.2"),
    ]
    # a one-replica stage keeps its name and address
    [talker] = stage_replicas(config.stage("talker"))
    assert (talker.name, talker.address) == ("talker", config.stage("talker").address)
    # tcp: port + i, bind address too
    hosts = HOSTS.read_text().replace("    external: true ", "    external: false ")
    hosts = hosts.replace("    address: tcp://127.0.0.1:5603 ", "    replicas: 2\n    address: tcp://127.0.0.1:5603 ")
    tcp = tmp_path / "tcp.yaml"
    tcp.write_text(hosts)
    decoder = stage_replicas(load_config(tcp, check_paths=False).stage("decoder"))
    assert [(r.address, r.bind_address) for r in decoder] == [
        ("tcp://127.0.0.1:5603", "tcp://0.0.0.0:5603"),
        ("tcp://127.0.0.1:5604", "tcp://0.0.0.0:5604"),
    ]
    assert cli.main(["--stage-config", str(path), "--check"]) == 0
    out = capsys.readouterr().out
    assert "replicas:     3: thinker#0 at ipc:///tmp/omni_cache/tiny_omni/thinker.sock," in out
    assert "routing:      prefix (the thinker replica holding the longest prefix" in out


@pytest.mark.parametrize(
    "old,new,key,words",
    [
        (THINKER_ADDRESS, THINKER_ADDRESS + "\n    replicas: 0  #", "stages[0].replicas", "expected int >= 1, got 0"),
        (
            THINKER_ADDRESS,
            THINKER_ADDRESS + "\n    replicas: two  #",
            "stages[0].replicas",
            "expected int, got str 'two'",
        ),
        (
            THINKER_ADDRESS,
            THINKER_ADDRESS + "\n    replicas: 2\n    external: true  #",
            "stages[0].replicas",
            "2 replicas of a stage started by hand (external) are not supported",
        ),
        (
            "  control_address: null ",
            "  routing: random\n  control_address: null ",
            "server.routing",
            "expected one of 'prefix', 'round_robin', 'least_loaded'",
        ),
    ],
)
def test_bad_replicas_and_routing_are_refused(tmp_path: Path, old: str, new: str, key: str, words: str) -> None:
    assert_refused_naming(write_variant(tmp_path, old, new), key, words)


def test_a_replica_address_clashing_with_another_stage_is_named(tmp_path: Path) -> None:
    hosts = HOSTS.read_text().replace("    external: true ", "    external: false ")
    hosts = hosts.replace("    address: tcp://127.0.0.1:5601 ", "    replicas: 2\n    address: tcp://127.0.0.1:5601 ")
    path = tmp_path / "clash.yaml"
    path.write_text(hosts)
    message = config_error(path, check_paths=False)
    assert (
        f"{path}: stages[1].address: 'tcp://127.0.0.1:5602' is also the address of replica 1 of stages[0] ('thinker#1')"
    ) in message, message


def test_replicas_of_a_hand_started_stage_are_refused_from_the_command_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_variant(tmp_path, THINKER_ADDRESS, THINKER_ADDRESS + "\n    replicas: 2  #")
    assert cli.main(["--stage-config", str(path), "--check", "--external-stages", "thinker"]) == 2
    assert "stages[0].replicas: 2 replicas of a stage started by hand" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------------
# Ray placement (server.ray_address, a stage's ray key)
# --------------------------------------------------------------------------------------------------

CONTROL_NULL = "  control_address: null "
THINKER_RAY = (
    THINKER_ADDRESS + "\n    replicas: 2\n    ray: {num_cpus: 1, replica_resources: [{node_a: 1}, {node_b: 1}]}  #"
)


def test_ray_placement_is_read_and_summarised(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Pinned replicas load; without a Ray address the stages are spawned here (ray unused), with
    --ray-address (or server.ray_address) a stage needs no address and the summary says where
    each replica is placed."""
    path = write_variant(tmp_path, THINKER_ADDRESS, THINKER_RAY)
    thinker = load_config(path).stage("thinker")
    assert thinker.ray is not None and thinker.ray.num_gpus == 0
    assert [thinker.ray.for_replica(i) for i in (0, 1)] == [{"node_a": 1}, {"node_b": 1}]
    assert cli.main(["--stage-config", str(path), "--check"]) == 0
    assert "ray:          used only with --ray-address" in capsys.readouterr().out
    no_address = tmp_path / "no_address.yaml"
    no_address.write_text(
        path.read_text()
        .replace(THINKER_ADDRESS + "\n", "")
        .replace(CONTROL_NULL, "  ray_address: auto\n" + CONTROL_NULL)
    )
    assert load_config(no_address).server.ray_address == "auto"
    assert cli.main(["--stage-config", str(no_address), "--check"]) == 0
    out = capsys.readouterr().out
    assert "placed by:    Ray (auto): one actor per replica, asking 1 CPU, 0 GPU" in out
    assert "resources:    thinker#1: node_b=1" in out
    # the flag does the same for a file without the key, and overrides the key
    assert cli.main(["--stage-config", str(path), "--check", "--ray-address", "10.0.0.1:6379"]) == 0
    assert "placed by:    Ray (10.0.0.1:6379)" in capsys.readouterr().out
    no_key = tmp_path / "no_key.yaml"
    no_key.write_text(no_address.read_text().replace("  ray_address: auto\n", ""))
    assert cli.main(["--stage-config", str(no_key), "--check"]) == 0  # the server chooses one
    assert "thinker#0, thinker#1 (each its own socket in that directory)" in capsys.readouterr().out
    assert cli.main(["--stage-config", str(no_key), "--check", "--ray-address", "auto"]) == 0


@pytest.mark.parametrize(
    "old,new,key,words",
    [
        (
            THINKER_ADDRESS,
            "    external: true  #",
            "stages[0].address",
            "needed for a stage started by hand (external)",
        ),
        (
            CONTROL_NULL,
            "  ray_address: ray://head:10001\n" + CONTROL_NULL,
            "server.ray_address",
            "Ray Client addresses are not supported",
        ),
        (
            CONTROL_NULL,
            "  ray_address: head\n" + CONTROL_NULL,
            "server.ray_address",
            "expected 'auto' or the Ray head's 'HOST:PORT'",
        ),
        (
            CONTROL_NULL,
            "  ray_address: auto\n  control_address: ipc:///tmp/x.sock #",
            "server.control_address",
            "with server.ray_address the stages may run on other hosts",
        ),
        (
            THINKER_ADDRESS,
            THINKER_ADDRESS + "\n    ray: {resources: {thinker_gpu: 1}}\n    external: true  #",
            "stages[0].ray",
            "not for a stage started by hand (external)",
        ),
        (
            THINKER_ADDRESS,
            THINKER_ADDRESS + "\n    replicas: 3\n    ray: {replica_resources: [{node_a: 1}]}  #",
            "stages[0].ray.replica_resources",
            "1 entries for 3 replica(s)",
        ),
        (
            THINKER_ADDRESS,
            THINKER_ADDRESS + "\n    ray: {resources: {GPU: 1}}  #",
            "stages[0].ray.resources.GPU",
            "Ray's own resource: set ray.num_gpus instead",
        ),
        (
            THINKER_ADDRESS,
            THINKER_ADDRESS + "\n    ray: {num_gpus: 1.5}  #",
            "stages[0].ray.num_gpus",
            "above 1, a whole number",
        ),
        (
            THINKER_ADDRESS,
            THINKER_ADDRESS + "\n    ray: {num_cpus: -1}  #",
            "stages[0].ray.num_cpus",
            "expected float >= 0.0, got -1",
        ),
        (
            THINKER_ADDRESS,
            THINKER_ADDRESS + "\n    ray: {resources: {node_a: 0}}  #",
            "stages[0].ray.resources.node_a",
            "expected an amount > 0, got 0",
        ),
        (
            THINKER_ADDRESS,
            THINKER_ADDRESS + "\n    ray: {gpus: 1}  #",
            "stages[0].ray.gpus",
            "unknown key (did you mean 'num_gpus'?)",
        ),
        (
            "      device: cpu                                  # torch device",
            "      device: cuda\n    ray: {num_cpus: 1}  #",
            "stages[2].ray.num_gpus",
            "ask Ray for the GPU the stage runs on",
        ),
    ],
)
def test_bad_ray_placement_is_refused(tmp_path: Path, old: str, new: str, key: str, words: str) -> None:
    assert_refused_naming(write_variant(tmp_path, old, new), key, words)


def test_a_hand_started_stage_cannot_feed_a_ray_placed_one(tmp_path: Path) -> None:
    """The talker's address is decided by Ray at start: a thinker started by hand would not know it."""
    path = write_variant(tmp_path, CONTROL_NULL, "  ray_address: auto\n" + CONTROL_NULL)
    assert cli.main(["--stage-config", str(path), "--check"]) == 0
    path.write_text(path.read_text().replace(THINKER_ADDRESS, THINKER_ADDRESS + "\n    external: true  #"))
    assert_refused_naming(path, "stages[1].inputs", "'thinker' is started by hand (external) and cannot reach 'talker'")
    assert_refused_naming(
        path, "server.control_address", "needed with server.ray_address and stage(s) started by hand (thinker)"
    )


def test_explicit_replica_addresses(tmp_path: Path) -> None:
    """What omni-serve writes for Ray-placed stages: one address per replica, each its own."""
    from omni_cache.config.replicas import stage_replicas

    both = "\n    replicas: 2\n    replica_addresses: [tcp://127.0.0.1:7000, tcp://127.0.0.2:7000]  #"
    path = write_variant(tmp_path, THINKER_ADDRESS, both)
    assert [r.address for r in stage_replicas(load_config(path).stage("thinker"))] == [
        "tcp://127.0.0.1:7000",
        "tcp://127.0.0.2:7000",
    ]
    assert_refused_naming(
        write_variant(tmp_path, THINKER_ADDRESS, both.replace("127.0.0.2", "127.0.0.1")),
        "stages[0].replica_addresses[1]",
        "is also the address of stages[0]",
    )
    assert_refused_naming(
        write_variant(tmp_path, THINKER_ADDRESS, "\n    replicas: 3" + both.split("replicas: 2")[1]),
        "stages[0].replica_addresses",
        "2 addresses for 3 replica(s)",
    )


def test_ray_assigns_the_gpus_of_a_placed_stage(tmp_path: Path) -> None:
    """A GPU replica's devices come from Ray; a CUDA_VISIBLE_DEVICES in its env would override
    them (refused only when Ray places the stage: spawned locally, it is how a GPU is chosen)."""
    path = write_variant(
        tmp_path, '      OMP_NUM_THREADS: "1" ', '      CUDA_VISIBLE_DEVICES: "0"\n    ray: {num_gpus: 1}\n      #'
    )
    assert cli.main(["--stage-config", str(path), "--check"]) == 0
    path.write_text(path.read_text().replace(CONTROL_NULL, "  ray_address: auto\n" + CONTROL_NULL))
    assert_refused_naming(path, "stages[0].env.CUDA_VISIBLE_DEVICES", "not with ray.num_gpus")


def test_step_timeout_must_exceed_the_heartbeat_timeout(tmp_path: Path) -> None:
    # A step that may last no longer than silence is allowed could never be reported busy.
    vllm_stage = "    kind: autoregressive"  # the thinker and the talker
    path = write_variant(tmp_path, vllm_stage, vllm_stage + "\n    step_timeout_s: 10", count=2)
    message = config_error(path)
    for i in (0, 1):
        assert (
            f"{path}: stages[{i}].step_timeout_s: must be longer than server.heartbeat_timeout_s (10 s), got 10 s"
        ) in message
    ok = write_variant(tmp_path, vllm_stage, vllm_stage + "\n    step_timeout_s: 10.5", count=2)
    assert [s.step_timeout_s for s in load_config(ok).stages] == [10.5, 10.5, None]
