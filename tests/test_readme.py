"""README.md is the front door: the two commands first, then what it is, a picture of a request's
path and where to read on. Everything else lives on the docs site (tests/test_docs.py checks it;
the config error example that used to be pinned here is on docs/configuration.md now)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_readme_opens_with_the_two_commands():
    """The project requires `make serve` and `make test` as the first block, and nothing else in it."""
    first = re.search(r"^```(\w*)\n(.*?)^```", README, flags=re.S | re.M)
    assert first and README[: first.start()].strip() == "# omni_cache"
    commands = [line.split("#")[0].strip() for line in first.group(2).splitlines()]
    assert commands == ["make serve", "make test"]
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^serve: setup$", makefile, re.M) and re.search(r"^test: setup$", makefile, re.M)


def test_readme_links_point_at_files_that_exist():
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README)
    local = [link for link in links if "://" not in link]
    assert "docs/quickstart.md" in local and "docs/configuration.md" in local
    missing = [link for link in local if not (ROOT / link).exists()]
    assert not missing, missing


def test_readme_stays_short():
    """Reference and measurement logs belong on the docs site and in benchmarks/results/."""
    assert len(README.splitlines()) < 100
