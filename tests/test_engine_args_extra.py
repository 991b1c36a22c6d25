"""``engine_args.extra`` checked against what a stage supports (omni_cache/config/engine_args_extra.py):
every refused key is a config error naming the file and the key, the keys a stage passes on are
accepted, and the static list of vLLM's engine arguments matches the installed vLLM's."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from omni_cache.config import ConfigError, load_config
from omni_cache.config.engine_args_extra import (
    REFUSED,
    REFUSED_PREFIXES,
    ROUTED_HASH_ALGO,
    SET_FOR_TALKER,
    STAGE_ADDITIONAL_CONFIG,
)
from omni_cache.config.vllm_engine_args import ENGINE_ARG_NAMES, VLLM_VERSION

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "stage_configs" / "tiny_omni.yaml"
QWEN3_OMNI = REPO / "stage_configs" / "qwen3_omni.yaml"  # its talker is `submodel: talker`
OMNI_SERVE = Path(sys.executable).parent / "omni-serve"
THINKER, TALKER = 0, 1


def with_extra(tmp_path: Path, stage: int, extra: dict[str, Any], base: Path = TINY) -> Path:
    """``base`` with ``extra`` as stage ``stage``'s ``engine_args.extra``."""
    data = yaml.safe_load(base.read_text())
    data["stages"][stage]["engine_args"]["extra"] = extra
    path = tmp_path / "extra.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def refusal(path: Path) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path)
    return str(info.value)


PREFIXED = sorted(n for n in ENGINE_ARG_NAMES for p in REFUSED_PREFIXES if n.startswith(p))


@pytest.mark.parametrize("key", sorted(REFUSED) + PREFIXED)
def test_a_key_the_stage_sets_or_cannot_run_is_refused(tmp_path: Path, key: str) -> None:
    path = with_extra(tmp_path, THINKER, {key: 1})
    message = refusal(path)
    assert f"{path}: stages[0].engine_args.extra.{key}: not allowed here: " in message, message
    why = REFUSED.get(key) or next(w for p, w in REFUSED_PREFIXES.items() if key.startswith(p))
    assert why in message


@pytest.mark.parametrize("key", ["max_model_len", "block_size", "async_scheduling", "enable_prompt_embeds"])
def test_a_key_engine_args_types_is_refused_in_extra(tmp_path: Path, key: str) -> None:
    path = with_extra(tmp_path, THINKER, {key: 1})
    assert (f"{path}: stages[0].engine_args.extra.{key}: not allowed here: set engine_args.{key} instead") in refusal(
        path
    )


@pytest.mark.parametrize(
    "key, hint", [("max_num_seq", "max_num_seqs"), ("no_such_engine_argument", None), ("_api_process_count", None)]
)
def test_an_unknown_key_is_refused_naming_vllm(tmp_path: Path, key: str, hint: str | None) -> None:
    path = with_extra(tmp_path, THINKER, {key: 1})
    message = refusal(path)
    assert (
        f"{path}: stages[0].engine_args.extra.{key}: unknown vLLM engine argument "
        f"(vllm.EngineArgs {VLLM_VERSION} has no field {key!r})"
    ) in message, message
    if hint:
        assert f"did you mean {hint!r}" in message


@pytest.mark.parametrize("key", SET_FOR_TALKER)
def test_what_the_talker_sets_is_refused_on_a_talker_only(tmp_path: Path, key: str) -> None:
    talker = with_extra(tmp_path, TALKER, {key: {}}, base=QWEN3_OMNI)
    assert (
        f"{talker}: stages[1].engine_args.extra.{key}: not allowed here: the stage sets it for a talker"
    ) in refusal(talker)
    # another stage passes it on to vLLM
    thinker = with_extra(tmp_path, THINKER, {key: {}}, base=QWEN3_OMNI)
    assert key in load_config(thinker).stages[0].engine_args.extra


@pytest.mark.parametrize("key", STAGE_ADDITIONAL_CONFIG)
def test_additional_config_keys_the_stage_writes_are_refused(tmp_path: Path, key: str) -> None:
    path = with_extra(tmp_path, THINKER, {"additional_config": {key: 1, "other": 2}})
    assert (
        f"{path}: stages[0].engine_args.extra.additional_config.{key}: not allowed here: the stage writes it"
    ) in refusal(path)


def test_a_hash_algorithm_prefix_routing_cannot_follow_is_refused(tmp_path: Path) -> None:
    path = with_extra(tmp_path, THINKER, {"prefix_caching_hash_algo": "xxhash"})
    assert (f"{path}: stages[0].engine_args.extra.prefix_caching_hash_algo: 'xxhash' is not supported") in refusal(path)
    ok = with_extra(tmp_path, THINKER, {"prefix_caching_hash_algo": ROUTED_HASH_ALGO})
    assert load_config(ok).stages[0].engine_args.extra == {"prefix_caching_hash_algo": "sha256"}


def test_what_a_stage_passes_on_is_accepted(tmp_path: Path) -> None:
    extra = {
        "limit_mm_per_prompt": {"image": 2},
        "kv_cache_memory_bytes": 2**28,
        "hf_overrides": {"rope_theta": 10000.0},
        "max_logprobs": 5,
        "additional_config": {"mine": 1},
        "num_gpu_blocks_override": 64,
    }
    config = load_config(with_extra(tmp_path, THINKER, extra))
    assert config.stages[0].engine_args.to_vllm_kwargs()["kv_cache_memory_bytes"] == 2**28


def test_omni_serve_check_refuses_naming_file_and_key(tmp_path: Path) -> None:
    path = with_extra(tmp_path, THINKER, {"speculative_config": {"method": "ngram"}})
    result = subprocess.run(
        [str(OMNI_SERVE), "--stage-config", str(path), "--check"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2, result.stdout
    assert (
        f"omni-serve: config error: {path}: stages[0].engine_args.extra.speculative_config: "
        "not allowed here: speculative decoding is not supported"
    ) in result.stderr


def test_the_static_list_is_the_installed_vllms_engine_args() -> None:
    """The list omni_cache.config.vllm_engine_args holds (read without importing vLLM) against
    the dataclass of the vLLM pyproject.toml pins."""
    import vllm
    from vllm.engine.arg_utils import EngineArgs

    assert vllm.__version__ == VLLM_VERSION
    fields = {f.name for f in dataclasses.fields(EngineArgs) if not f.name.startswith("_")}
    assert not fields - ENGINE_ARG_NAMES, f"add to the list: {sorted(fields - ENGINE_ARG_NAMES)}"
    assert not ENGINE_ARG_NAMES - fields, f"drop from the list: {sorted(ENGINE_ARG_NAMES - fields)}"
    # every refused key is one vLLM has: a refusal is for a real argument, not a typo
    assert set(REFUSED) <= fields and set(SET_FOR_TALKER) <= fields
