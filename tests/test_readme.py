"""What the README shows a user must be what the code prints."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from omni_cache.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]


def test_config_error_example_matches_a_real_run(tmp_path):
    """The README's example error comes from the shipped tiny_omni.yaml with the talker's
    block_size quoted; the line number in it must be the real one."""
    readme = (ROOT / "README.md").read_text()
    shown = re.search(r"`(tiny_omni\.yaml: stages\[1\]\.engine_args\.block_size: [^`]*)`", readme)
    assert shown, "the README's config error example is gone"
    lines = (ROOT / "stage_configs" / "tiny_omni.yaml").read_text().splitlines(keepends=True)
    talker_block = [i for i, line in enumerate(lines) if re.match(r"\s+block_size: 32\b", line)][1]
    lines[talker_block] = lines[talker_block].replace("block_size: 32", "block_size: '32'", 1)
    bad = tmp_path / "tiny_omni.yaml"
    bad.write_text("".join(lines))
    with pytest.raises(ConfigError) as info:
        load_config(bad)
    assert str(info.value).endswith(shown.group(1)), (str(info.value), shown.group(1))
