"""The docs site (docs/, mkdocs.yml) says what the code does.

* ``mkdocs build --strict`` passes: no broken link or anchor, no page left out of the nav (so
  ``make test`` fails on a broken page).
* The configuration reference (docs/configuration.md) has a row for every field of the schema's
  msgspec structs (omni_cache/config/schema.py) and no other, each with the schema's default; every
  config key any page names, and every key of every YAML example, exists in the schema.
* Every file path the pages name exists, and the architecture page lists every module.
* The quickstart's commands run: ``omni-serve --check`` here, the ``curl`` blocks against a real
  ``omni-serve`` of the pipeline ``make serve`` serves (that one starts engines: ``vllm`` marker);
  its description of ``make setup`` is the Makefile's.
* The config error the configuration reference shows is the one the loader gives.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import types
import typing
from pathlib import Path
from typing import Any

import msgspec
import pytest
import yaml

from omni_cache.config import ConfigError, load_config
from omni_cache.config.schema import PipelineConfig, StageConfig

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.glob("*.md"))
#: Pages whose paths and config keys are checked: the site, and the READMEs that point into it.
CHECKED = [*PAGES, ROOT / "README.md", ROOT / "benchmarks" / "README.md", ROOT / "benchmarks" / "results" / "README.md"]
OMNI_SERVE = Path(sys.executable).with_name("omni-serve")
MKDOCS_ENV = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}

CODE_SPAN = re.compile(r"`([^`\n]+)`")


def fenced_blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", text, flags=re.S | re.M)


# ---- mkdocs ---------------------------------------------------------------------------------------


def mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config), "--site-dir", str(site)],
        capture_output=True,
        text=True,
        env=MKDOCS_ENV,
        timeout=300,
    )


def test_mkdocs_build_strict(tmp_path):
    result = mkdocs_build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert result.returncode == 0, result.stdout + result.stderr
    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]
    pages = []
    for entry in nav:
        for value in entry.values():
            pages += [v for item in value for v in item.values()] if isinstance(value, list) else [value]
    assert sorted(pages) == sorted(p.name for p in PAGES), "every page in the nav, once"
    for page in pages:
        built = "index.html" if page == "index.md" else f"{page[:-3]}/index.html"
        assert (tmp_path / "site" / built).is_file(), built


def test_mkdocs_strict_build_fails_on_a_broken_link(tmp_path):
    """The build above would catch a broken page: the same site with one bad link fails."""
    shutil.copytree(DOCS, tmp_path / "docs")
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    page = tmp_path / "docs" / "quickstart.md"
    page.write_text(page.read_text() + "\nSee [nowhere](no-such-page.md#here).\n")
    result = mkdocs_build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert result.returncode != 0
    assert "no-such-page.md" in result.stdout + result.stderr


# ---- the configuration reference against the schema -----------------------------------------------


def _unwrap(tp: Any) -> tuple[Any, bool]:
    """The struct (or dict, or leaf type) a field's type leads to, Annotated, Optional and list
    unwrapped, and whether a list was on the way."""
    is_list = False
    while True:
        origin = typing.get_origin(tp)
        if origin is typing.Annotated:
            tp = typing.get_args(tp)[0]
        elif origin in (typing.Union, types.UnionType):
            args = [a for a in typing.get_args(tp) if a is not type(None)]
            if len(args) != 1:
                return tp, is_list
            tp = args[0]
        elif origin is list:
            tp, is_list = typing.get_args(tp)[0], True
        else:
            return tp, is_list


def _inner(tp: Any) -> Any:
    return _unwrap(tp)[0]


def _is_struct(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, msgspec.Struct)


def _is_map(tp: Any) -> bool:
    return tp is dict or typing.get_origin(tp) is dict


def schema_fields(struct: type = PipelineConfig, prefix: str = "") -> dict[str, msgspec.structs.FieldInfo]:
    """Every key of a stage config as the reference writes it (``server.media.max_items``,
    ``stages[].engine_args.block_size``) -> its msgspec field."""
    out: dict[str, msgspec.structs.FieldInfo] = {}
    for f in msgspec.structs.fields(struct):
        key = prefix + f.name
        out[key] = f
        inner, is_list = _unwrap(f.type)
        if _is_struct(inner):
            out.update(schema_fields(inner, key + ("[]." if is_list else ".")))
    return out


REFERENCE_ROW = re.compile(r"^\| `([^`]+)` \| ([^|]*) \| ([^|]*) \| (.*) \|$", re.M)


def reference_rows() -> dict[str, tuple[str, str, str]]:
    rows: dict[str, tuple[str, str, str]] = {}
    for key, type_, default, meaning in REFERENCE_ROW.findall((DOCS / "configuration.md").read_text()):
        if key.startswith(("OMNI_", "VLLM_")):
            continue  # the environment variables' table
        assert key not in rows, f"{key} has two rows"
        rows[key] = (type_.strip(), default.strip(), meaning.strip())
    return rows


def test_schema_fields_walks_every_struct():
    keys = schema_fields()
    for key in (
        "name",
        "server.media.max_items",
        "stages[].latents.merged.media_layer",
        "stages[].engine_args.extra",
        "stages[].ray.replica_resources",
    ):
        assert key in keys


def test_configuration_reference_documents_every_schema_key_and_no_other():
    documented, schema = set(reference_rows()), set(schema_fields())
    assert not schema - documented, f"schema keys without a row in docs/configuration.md: {sorted(schema - documented)}"
    assert not documented - schema, f"rows for keys the schema does not have: {sorted(documented - schema)}"


def test_configuration_reference_defaults_are_the_schemas():
    rows, fields = reference_rows(), schema_fields()
    for key, (_type, default_cell, meaning) in rows.items():
        f = fields[key]
        assert meaning, f"{key}: no meaning"
        if f.required:
            assert default_cell == "required", f"{key} is required in the schema, the docs say {default_cell!r}"
            continue
        value = f.default if f.default is not msgspec.NODEFAULT else f.default_factory()
        if isinstance(value, msgspec.Struct):
            assert default_cell == "all defaults", f"{key}: {default_cell!r}"
            continue
        shown = CODE_SPAN.fullmatch(default_cell)
        assert shown, f"{key}: the default cell {default_cell!r} is not one `value`"
        assert yaml.safe_load(shown.group(1)) == value, f"{key}: docs say {shown.group(1)}, schema {value!r}"


#: A code span that reads as a config key: a dotted path from the top level or from a stage.
_TOP = {f.name for f in msgspec.structs.fields(PipelineConfig)}
_STAGE_STRUCTS = {
    f.name for f in msgspec.structs.fields(StageConfig) if _is_struct(_inner(f.type)) or _is_map(_inner(f.type))
}
KEY_SPAN = re.compile(rf"^(?:{'|'.join(sorted(_TOP | _STAGE_STRUCTS))})(?:\[\d*\])?\.[a-z0-9_.\[\]]+$")


def resolve_key(key: str) -> str | None:
    """None when ``key`` is a config key (from the top or from a stage), else what is wrong."""
    parts = [re.sub(r"\[\d*\]$", "", p) for p in key.split(".")]
    struct: Any = PipelineConfig if parts[0] in _TOP else StageConfig
    for i, part in enumerate(parts):
        fields = {f.name: f for f in msgspec.structs.fields(struct)}
        if part not in fields:
            return f"{struct.__name__} has no field {part!r}"
        inner = _inner(fields[part].type)
        if _is_map(inner):
            return None  # env, engine_args.extra, ray.resources: free-form below
        if i + 1 < len(parts) and not _is_struct(inner):
            return f"{'.'.join(parts[: i + 1])} is a value, not a mapping"
        struct = inner
    return None


def named_keys(text: str) -> set[str]:
    keys = set()
    for span in CODE_SPAN.findall(text):
        candidate = span.split(":")[0].strip() if re.match(r"^[a-z_.\[\]0-9]+:", span) else span
        if KEY_SPAN.match(candidate):
            keys.add(candidate)
    return keys


def test_resolve_key_tells_keys_from_non_keys():
    for good in (
        "server.media.max_items",
        "stages[1].engine_args.block_size",
        "latents.merged.layer",
        "engine_args.extra.kv_cache_memory_bytes",
        "ray.resources.thinker_gpu",
        "env.X",
    ):
        assert resolve_key(good) is None, good
    for bad in (
        "engine_args.kv_cache_memory_bytes",
        "server.media.max_image_size",
        "stages[].sampling.max_tokens.x",
        "server.routing.prefix",
    ):
        assert resolve_key(bad), bad


@pytest.mark.parametrize("page", CHECKED, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_config_key_a_page_names_exists(page):
    text = page.read_text()
    wrong = {key: why for key in named_keys(text) if (why := resolve_key(key))}
    assert not wrong, f"{page.name} names config keys the schema does not have: {wrong}"


def _yaml_keys_problems(data: Any, struct: Any, where: str) -> list[str]:
    if not isinstance(data, dict) or _is_map(struct) or not _is_struct(struct):
        return []
    fields = {f.name: f for f in msgspec.structs.fields(struct)}
    problems = []
    for key, value in data.items():
        if key not in fields:
            problems.append(f"{where}{key}: not a key of {struct.__name__}")
            continue
        inner = _inner(fields[key].type)
        for item in value if isinstance(value, list) else [value]:
            problems += _yaml_keys_problems(item, inner, f"{where}{key}.")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_yaml_example_uses_schema_keys(page):
    for block in fenced_blocks(page.read_text(), "yaml"):
        data = yaml.safe_load(block)
        assert _yaml_keys_problems(data, PipelineConfig, "") == [], block


# ---- paths and modules ----------------------------------------------------------------------------


PATH_SPAN = re.compile(r"^[\w.-]+(?:/[\w.*-]+)+\.(?:py|md|json|yaml|png|toml)$")


@pytest.mark.parametrize("page", CHECKED, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_path_a_page_names_exists(page):
    missing = [
        span for span in CODE_SPAN.findall(page.read_text()) if PATH_SPAN.match(span) and not list(ROOT.glob(span))
    ]
    assert not missing, f"{page.relative_to(ROOT)} names files that do not exist: {missing}"


def test_architecture_page_lists_every_module():
    named = set(CODE_SPAN.findall((DOCS / "architecture.md").read_text()))
    modules = sorted(
        str(p.relative_to(ROOT))
        for package in ("omni_cache", "workers", "scheduler")
        for p in (ROOT / package).rglob("*.py")
        if p.name != "__init__.py"
    )
    assert len(modules) > 40
    missing = [m for m in modules if m not in named]
    assert not missing, f"docs/architecture.md does not list: {missing}"


# ---- the quickstart -------------------------------------------------------------------------------


QUICKSTART = (DOCS / "quickstart.md").read_text()


def quickstart_commands(prefix: str) -> list[str]:
    return [
        line.split("  #")[0].strip()
        for block in fenced_blocks(QUICKSTART, "bash")
        for line in block.splitlines()
        if line.startswith(prefix)
    ]


def test_quickstart_opens_with_the_readmes_two_commands():
    readme_first = fenced_blocks((ROOT / "README.md").read_text(), "bash")[0]
    assert fenced_blocks(QUICKSTART, "bash")[0] == readme_first


@pytest.mark.parametrize("command", quickstart_commands(".venv/bin/omni-serve"))
def test_quickstart_check_commands_run(command):
    argv = shlex.split(command)
    assert "--check" in argv, "a quickstart omni-serve line that is not a --check: serve it below"
    result = subprocess.run([str(OMNI_SERVE), *argv[1:]], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.rstrip().endswith("config OK"), result.stdout


def test_quickstart_has_check_commands():
    assert len(quickstart_commands(".venv/bin/omni-serve")) >= 2


def test_quickstart_setup_is_what_the_makefile_does():
    makefile = (ROOT / "Makefile").read_text()
    extras = re.search(r"-e '\.\[([a-z,]+)\]'", makefile).group(1)
    assert f"extras `{extras}`" in QUICKSTART
    pins = re.findall(r"'((?:torch|torchvision)==[^']+)'", makefile)
    assert [pin.split("==")[0] for pin in pins] == ["torch", "torchvision"], pins  # else the loop checks nothing
    for pin in pins:
        assert f"`{pin}`" in QUICKSTART, pin
    removed = re.search(r"pip uninstall -y -q ([\w ]+?) 2>", makefile).group(1).split()
    assert removed and all(f"`{name}`" in QUICKSTART for name in removed), removed
    config = re.search(r"^CONFIG \?= (\S+)$", makefile, re.M).group(1)
    assert re.search(r"^serve: setup\n(?:\t.*\n)*?\t\.venv/bin/omni-serve --stage-config \$\(CONFIG\)$", makefile, re.M)
    bytecode = re.search(r"^BYTECODE := \$\(PY\) -m (compileall) ", makefile, re.M)
    assert bytecode and f"`python -m {bytecode.group(1)}`" in QUICKSTART
    assert f"`.venv/bin/omni-serve --stage-config {config}`" in QUICKSTART
    # mkdocs comes from the extras make setup installs
    declared = _pyproject_extras()
    installed = [req for extra in extras.split(",") for req in declared.get(extra, [])]
    assert any(r.startswith("mkdocs==") for r in installed)
    assert any(r.startswith("mkdocs-material==") for r in installed)


def test_quickstart_test_command_is_what_the_makefile_runs():
    makefile = (ROOT / "Makefile").read_text()
    pytest_line = re.search(r"^test: setup\n(?:\t.*\n)*?\t\$\(PY\) -m (pytest .*?) \$\(PYTEST_ARGS\)$", makefile, re.M)
    assert pytest_line, "make test's pytest line"
    assert f"`.venv/bin/python -m {pytest_line.group(1)}`" in " ".join(QUICKSTART.split())


def _pyproject_extras() -> dict[str, list[str]]:
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def test_configuration_reference_error_example_matches_a_real_run(tmp_path):
    """The reference's example error comes from the shipped tiny_omni.yaml with the talker's
    block_size quoted; the line number in it must be the real one."""
    shown = re.search(
        r"`(tiny_omni\.yaml: stages\[1\]\.engine_args\.block_size: [^`]*)`", (DOCS / "configuration.md").read_text()
    )
    assert shown, "the configuration reference's config error example is gone"
    lines = (ROOT / "stage_configs" / "tiny_omni.yaml").read_text().splitlines(keepends=True)
    talker_block = [i for i, line in enumerate(lines) if re.match(r"\s+block_size: 32\b", line)][1]
    lines[talker_block] = lines[talker_block].replace("block_size: 32", "block_size: '32'", 1)
    bad = tmp_path / "tiny_omni.yaml"
    bad.write_text("".join(lines))
    with pytest.raises(ConfigError) as info:
        load_config(bad)
    assert str(info.value).endswith(shown.group(1)), (str(info.value), shown.group(1))


CURL_BLOCKS = [b for b in fenced_blocks(QUICKSTART, "bash") if "curl" in b]


@pytest.fixture(scope="module")
def make_serve(tmp_path_factory):
    """``omni-serve`` as ``make serve`` runs it (the Makefile's default CONFIG), under its own
    name, addresses and a free port, answering as model 'qwen3_omni' like the original. With the
    start-up warm-up, as a new user's server has it: the curl blocks are each a first request."""
    from benchmarks.harness import ServerProcess

    config = re.search(r"^CONFIG \?= (\S+)$", (ROOT / "Makefile").read_text(), re.M).group(1)
    data = yaml.safe_load((ROOT / config).read_text())
    name = f"quickstart_{os.getpid()}"
    data["server"].update(port=0, served_model_name=data["name"])
    data["name"] = name
    for stage in data["stages"]:
        stage["address"] = f"ipc:///tmp/omni_cache/{name}/{stage['name']}.sock"
    path = tmp_path_factory.mktemp("quickstart") / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    with ServerProcess(path, start_timeout_s=900) as served:
        yield served


def json_values(text: str) -> list[Any]:
    """The JSON documents written one after another (curl prints bodies without newlines)."""
    decoder, values, i = json.JSONDecoder(), [], 0
    while i < len(text):
        if text[i].isspace():
            i += 1
            continue
        value, i = decoder.raw_decode(text, i)
        values.append(value)
    return values


@pytest.mark.vllm
@pytest.mark.parametrize("block", CURL_BLOCKS, ids=[f"block{i}" for i in range(len(CURL_BLOCKS))])
def test_quickstart_curl_commands_against_make_serve(block, make_serve, tmp_path):
    assert "localhost:8091" in block
    script = block.replace("localhost:8091", make_serve.url.removeprefix("http://"))
    result = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, (script, result.stdout, result.stderr)
    out = result.stdout
    if '"stream": true' in block:
        events = [
            json.loads(line[6:]) for line in out.splitlines() if line.startswith("data: ") and line != "data: [DONE]"
        ]
        assert out.rstrip().endswith("data: [DONE]") and events
        assert not [e for e in events if "error" in e], out
        assert any((e.get("choices") or [{}])[0].get("delta", {}).get("audio") for e in events), "no audio"
        return
    if "/metrics" in block:
        assert re.search(r"^vllm:prefix_cache_hits_total\{", out, re.M), out
        return
    if "answer.wav" in block:
        wav = (tmp_path / "answer.wav").read_bytes()
        assert wav[:4] == b"RIFF" and wav[8:12] == b"WAVE" and len(wav) > 44
        return
    values = json_values(out)
    assert values and not [v for v in values if "error" in v], out
    if "/health" in block:
        assert {"status": "ok"} in values
    if "/v1/models" in block:
        assert any(v.get("data", [{}])[0].get("id") == "qwen3_omni" for v in values)
    if "/v1/chat/completions" in block:
        [answer] = [v for v in values if v.get("object") == "chat.completion"]
        assert isinstance(answer["choices"][0]["message"]["content"], str)
        assert answer["usage"]["prompt_tokens"] > 0


def test_quickstart_curl_blocks_cover_the_routes():
    text = "\n".join(CURL_BLOCKS)
    for route in ("/health", "/v1/models", "/v1/chat/completions", "/metrics", '"stream": true', "answer.wav"):
        assert route in text, route


# ---- the vllm marker ------------------------------------------------------------------------------


#: Calls that start a vLLM engine in the test's process (thinker_harness.make_stage builds one).
ENGINE_CALLS = re.compile(r"\b(?:make_stage|LLMStage)\(")


@pytest.mark.parametrize("module", sorted((ROOT / "tests").glob("test_*.py")), ids=lambda p: p.name)
def test_modules_that_start_engines_carry_the_vllm_marker(module):
    """The quickstart says `-m "not vllm"` skips every module that starts vLLM engines."""
    text = module.read_text()
    if module.name != "test_docs.py" and ENGINE_CALLS.search(text):
        assert re.search(r"pytest\.mark\.vllm\b", text), f"{module.name} starts engines: mark it vllm"
