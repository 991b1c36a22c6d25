"""Architecture rules checked on the source: a leading-underscore name stays in its module.

What another module needs is public and named for what it is. The checker flags, in every .py file
of the repository (``omni_cache/``, ``workers/``, ``scheduler/``, ``benchmarks/``, ``tests/``):

* ``from x import _y`` (also relative imports), dunder names (``__version__``) excepted;
* ``import x`` (or ``import x as m``) of one of this repository's modules, then ``x._y`` (or
  ``m._y``): reaching into a private name through the module object.

Third-party private attributes (``torch._C``) are another project's business and are not flagged;
``from vllm... import _y`` is (it imports a private name all the same).

And the layout: no import cycle between modules or packages, the stage processes' packages
(workers/, scheduler/) import nothing of the server side, no two classes of the product share a
name, and the product's modules stay readable whole (at most 500 lines).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("omni_cache", "workers", "scheduler", "benchmarks", "tests")


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def first_party_modules() -> set[str]:
    """Top-level names that import this repository's code: its packages, plus the modules that
    tests/ and benchmarks/ import by bare name (they are on sys.path when run)."""
    names = set(PACKAGES)
    for folder in ("tests", "benchmarks"):
        names |= {p.stem for p in (ROOT / folder).glob("*.py")}
    return names


def private_imports(source: str, filename: str, first_party: set[str]) -> list[str]:
    """Each place ``source`` takes a private name out of another module, as ``file:line: what``."""
    tree = ast.parse(source, filename)
    found: list[str] = []
    module_aliases: set[str] = set()  # names bound to a first-party module by ``import x``
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            module = "." * node.level + (node.module or "")
            if module == "__future__":
                continue
            for alias in node.names:
                if _private(alias.name):
                    found.append(f"{filename}:{node.lineno}: from {module} import {alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in first_party:
                    # ``import a.b`` binds ``a``; ``import a.b as m`` binds ``m`` to ``a.b``.
                    module_aliases.add(alias.asname or alias.name.split(".")[0])
    if module_aliases:
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or not _private(node.attr):
                continue
            # The leftmost name of ``m._y`` or ``a.b._y``.
            base = node.value
            while isinstance(base, ast.Attribute):
                if _private(base.attr):
                    break
                base = base.value
            if isinstance(base, ast.Name) and base.id in module_aliases:
                found.append(f"{filename}:{node.lineno}: {ast.unparse(node)}")
    return found


def repo_sources() -> list[Path]:
    files: list[Path] = []
    for pkg in PACKAGES:
        files += sorted((ROOT / pkg).rglob("*.py"))
    return files


def test_no_private_name_crosses_a_module() -> None:
    first_party = first_party_modules()
    found: list[str] = []
    for path in repo_sources():
        found += private_imports(path.read_text(), str(path.relative_to(ROOT)), first_party)
    assert not found, "private names imported from another module:\n" + "\n".join(found)


FIRST_PARTY = {"omni_cache", "workers", "tests"}


@pytest.mark.parametrize(
    "source",
    [
        "from omni_cache.runtime.request_path.results import _Request\n",
        "from omni_cache.runtime.request_path.results import RequestError, _Request as R\n",
        "from .errors import _Issues\n",
        "from vllm.utils import _private_helper\n",
        "def f():\n    from omni_cache.cache.latent_store import _launch_rows\n",
        "import omni_cache.runtime.supervision.supervisor as sup\nsup._exit_words(1)\n",
        "import omni_cache.runtime.supervision.supervisor\nomni_cache.runtime.supervisor._exit_words(1)\n",
        "import workers\nx = workers._thing\n",
    ],
)
def test_checker_flags_private_imports(source: str) -> None:
    assert private_imports(source, "sample.py", FIRST_PARTY), source


@pytest.mark.parametrize(
    "source",
    [
        "from __future__ import annotations\n",
        "from omni_cache import __version__\n",
        "from omni_cache.runtime.request_path.results import RequestError\n",
        "import torch\nraw = torch._C\n",  # another project's private attribute: not this rule
        "_local = 1\nprint(_local)\n",
        "class A:\n    def f(self):\n        return self._x\n",
        "import omni_cache\nomni_cache.__name__\n",
    ],
)
def test_checker_accepts_public_use(source: str) -> None:
    assert private_imports(source, "sample.py", FIRST_PARTY) == [], source


# ---- the import graph -------------------------------------------------------------------------------

PRODUCT = ("omni_cache", "workers", "scheduler")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_of(module: str) -> str:
    """The node a module is in the graph of packages: a package (its ``__init__`` and its
    modules), except that a module at the top of ``omni_cache/`` (cli.py, pipeline.py,
    handoff.py, ...) stands for itself: those are layers of their own, not one package."""
    if _is_package(module) or module.count(".") == 1 and module.split(".")[0] == "omni_cache":
        return module
    return module.rpartition(".")[0]


def _is_package(module: str) -> bool:
    return (ROOT / Path(*module.split(".")) / "__init__.py").is_file()


def product_imports() -> dict[str, set[str]]:
    """module -> the product modules it imports (anywhere in it: at the top, in functions, under
    TYPE_CHECKING). ``from pkg import name`` counts as importing ``pkg.name`` when that is a
    module, else ``pkg``."""
    files = [p for pkg in PRODUCT for p in sorted((ROOT / pkg).rglob("*.py"))]
    modules = {module_name(p) for p in files}
    graph: dict[str, set[str]] = {}
    for path in files:
        me = module_name(path)
        here = me if path.name == "__init__.py" else me.rpartition(".")[0]
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = here.split(".")[: len(here.split(".")) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            for t in targets:
                while t and t not in modules:
                    t = t.rpartition(".")[0]
                if t and t != me:
                    found.add(t)
        graph[me] = found
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path that ends where it starts, else None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        path.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return path[path.index(m) :] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        path.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def test_no_import_cycle_between_modules():
    cycle = find_cycle(product_imports())
    assert cycle is None, "modules import each other in a circle: " + " -> ".join(cycle)


def test_no_import_cycle_between_packages():
    packages: dict[str, set[str]] = {}
    for module, targets in product_imports().items():
        mine = package_of(module)
        packages.setdefault(mine, set()).update(p for p in (package_of(t) for t in targets) if p != mine)
    cycle = find_cycle(packages)
    assert cycle is None, "packages import each other in a circle: " + " -> ".join(cycle)


def test_the_checker_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_stage_processes_import_nothing_of_the_server():
    """workers/ and scheduler/ run in the stage processes: the HTTP side and the orchestrator are
    not theirs to import (they would load them into every stage)."""
    server_side = ("omni_cache.serving", "omni_cache.runtime")
    bad = [
        f"{m} imports {t}"
        for m, targets in product_imports().items()
        if m.split(".")[0] in ("workers", "scheduler")
        for t in targets
        if t.startswith(server_side)
    ]
    assert not bad, "\n".join(bad)


def test_no_two_product_classes_share_a_name():
    where: dict[str, list[str]] = {}
    for pkg in PRODUCT:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ClassDef):
                    where.setdefault(node.name, []).append(f"{path.relative_to(ROOT)}:{node.lineno}")
    shared = {name: places for name, places in where.items() if len(places) > 1}
    assert not shared, shared


#: A product module stays small enough to read whole (issue 32: the orchestrator in parts; issue 44:
#: every product package, a file over the cap split by job, not trimmed to fit).
MAX_MODULE_LINES = 500
#: The packages the cap covers, every module under them (subpackages too), and the modules at the
#: top of omni_cache/ (benchmarks/: its own test below).
CAPPED_PACKAGES = (
    "omni_cache/config",
    "omni_cache/runtime",
    "omni_cache/cache",
    "omni_cache/models",
    "omni_cache/serving",
    "omni_cache/wire",
    "workers",
    "scheduler",
)


def long_modules(root: Path, packages: tuple[str, ...], limit: int, *, recursive: bool = True) -> dict[str, int]:
    """path -> line count of each .py file under `packages` (only directly in them when not
    `recursive`) with more than `limit` lines."""
    pattern = "**/*.py" if recursive else "*.py"
    files = (p for pkg in packages for p in sorted((root / pkg).glob(pattern)))
    return {str(p.relative_to(root)): n for p in files if (n := len(p.read_text().splitlines())) > limit}


@pytest.mark.parametrize("package", CAPPED_PACKAGES)
def test_no_product_module_is_over_500_lines(package: str):
    assert (ROOT / package).is_dir(), package
    long = long_modules(ROOT, (package,), MAX_MODULE_LINES)
    assert not long, f"modules over {MAX_MODULE_LINES} lines (split them by job): {long}"


def test_no_top_level_product_module_is_over_500_lines():
    long = long_modules(ROOT, ("omni_cache",), MAX_MODULE_LINES, recursive=False)
    assert not long, f"modules over {MAX_MODULE_LINES} lines (split them by job): {long}"


def test_the_line_cap_check_finds_long_modules(tmp_path: Path):
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    (tmp_path / "pkg" / "short.py").write_text("x = 1\n" * 500)
    (tmp_path / "pkg" / "sub" / "long.py").write_text("x = 1\n" * 501)
    assert long_modules(tmp_path, ("pkg",), 500) == {str(Path("pkg", "sub", "long.py")): 501}
    assert long_modules(tmp_path, ("pkg",), 500, recursive=False) == {}


def imported_test_modules(source: str) -> list[str]:
    """The test modules (``test_*``) a source imports, at any depth of the file."""
    found = []
    for node in ast.walk(ast.parse(source)):
        names = (
            [a.name for a in node.names]
            if isinstance(node, ast.Import)
            else [node.module or ""]
            if isinstance(node, ast.ImportFrom)
            else []
        )
        found += [n for n in names if n.split(".")[-1].startswith("test_")]
    return found


def test_no_test_module_imports_another():
    """Shared test helpers live in helper modules (tests/fake_pipeline.py, tests/thinker_pair.py,
    ...): a test module imported by another runs its module-level code and fixtures twice and
    ties the two together."""
    offenders = {p.name: imported_test_modules(p.read_text()) for p in sorted((ROOT / "tests").glob("*.py"))}
    offenders = {k: v for k, v in offenders.items() if v}
    assert not offenders, f"test modules importing test modules: {offenders}"


def test_the_test_import_check_finds_imports_at_any_depth():
    assert imported_test_modules("def f():\n    from test_x import y\n") == ["test_x"]
    assert imported_test_modules("import tests.test_a\nfrom fake_pipeline import b\n") == ["tests.test_a"]


#: The benchmarks are a package too (pyproject's packages include benchmarks*) and keep the same
#: cap (issue 44): a benchmark that outgrows it is split by job (thinker_cache.py into
#: thinker_specs.py, thinker_prompts.py, ...; harness.py, soak.py, first_audio.py, cache_kernels.py).
MAX_BENCHMARK_MODULE_LINES = 500


def test_no_benchmarks_module_is_over_500_lines():
    files = sorted((ROOT / "benchmarks").rglob("*.py"))
    assert len(files) > 20, files  # the package is where the test looks
    long = {
        str(p.relative_to(ROOT)): n
        for p in files
        if (n := len(p.read_text().splitlines())) > MAX_BENCHMARK_MODULE_LINES
    }
    assert not long, f"benchmarks/ modules over {MAX_BENCHMARK_MODULE_LINES} lines (split them by job): {long}"


#: omni_cache/runtime/'s subpackages, lowest first: a module imports its own subpackage's modules
#: and those of the layers below it, never above (the modules at runtime/'s top compose them all).
RUNTIME_LAYERS = ("metrics", "supervision", "request_path", "routing")


def runtime_layer_violations(root: Path) -> list[str]:
    """Each import in omni_cache/runtime/ from a lower layer to a higher one, as ``file: module``."""
    rank = {name: i for i, name in enumerate(RUNTIME_LAYERS)}
    top = len(RUNTIME_LAYERS)  # runtime/'s own modules (the orchestrator)
    found = []
    for path in sorted((root / "omni_cache" / "runtime").rglob("*.py")):
        parts = path.relative_to(root / "omni_cache" / "runtime").parts
        layer = rank.get(parts[0], top) if len(parts) > 1 else top
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                bits = name.split(".")
                if bits[:2] != ["omni_cache", "runtime"] or len(bits) < 3:
                    continue
                target = rank.get(bits[2], top) if bits[2] in rank else top
                if target > layer:
                    found.append(f"{path.relative_to(root)}: {name}")
    return found


def test_runtime_layers_import_only_downward():
    assert runtime_layer_violations(ROOT) == []


def test_the_layer_check_finds_an_upward_import(tmp_path: Path):
    pkg = tmp_path / "omni_cache" / "runtime"
    (pkg / "metrics").mkdir(parents=True)
    (pkg / "routing").mkdir()
    (pkg / "metrics" / "prometheus.py").write_text("from omni_cache.runtime.routing import route_planner\n")
    (pkg / "routing" / "route_planner.py").write_text("from omni_cache.runtime.metrics import prometheus\n")
    (pkg / "orchestrator.py").write_text("from omni_cache.runtime.routing import route_planner\n")
    found = runtime_layer_violations(tmp_path)
    assert found == [
        "omni_cache/runtime/metrics/prometheus.py: omni_cache.runtime.routing",
        "omni_cache/runtime/metrics/prometheus.py: omni_cache.runtime.routing.route_planner",
    ]


def test_the_import_graph_holds_the_imports_the_product_has():
    """The cycle checks above read product_imports(); a graph that missed imports would pass them
    all. Edges of each kind it must find: a plain ``from pkg.module import name``, a module
    imported from its package (``from pkg import module``), an import inside a function."""
    graph = product_imports()
    assert "omni_cache.models.handoff_jobs" in graph["omni_cache.models.qwen3_omni_talker_prompt"]
    assert "omni_cache.serving.video" in graph["omni_cache.serving.media"]  # from its package, only
    assert "scheduler.streamed_rows" in graph["workers.ar_runner"]  # imported inside _start
    assert sum(map(len, graph.values())) > len(graph)  # more edges than modules, not a few
