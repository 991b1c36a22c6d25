"""The server imports at start-up what its request path would import on first use
(omni_cache/serving/preload.py), so a fresh server's first request of a kind pays no import.
What libraries import on their own first use is found at run time: tests/test_first_use_imports.py."""

import ast
import subprocess
import sys
from pathlib import Path

from omni_cache.serving.preload import REQUEST_PATH_MODULES

SERVING = Path(__file__).resolve().parents[1] / "omni_cache" / "serving"


def lazy_imports(source: str) -> set[str]:
    """Modules imported inside functions (absolute imports only)."""
    found = set()
    for fn in ast.walk(ast.parse(source)):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, ast.Import):
                    found |= {a.name for a in node.names}
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    found.add(node.module)
    return found


def covered(module: str) -> bool:
    return any(module == m or module.startswith(m + ".") or m.startswith(module + ".") for m in REQUEST_PATH_MODULES)


def test_every_lazy_import_of_the_request_path_is_preloaded():
    lazy = set().union(*(lazy_imports(p.read_text()) for p in SERVING.rglob("*.py")))
    third_party = {m for m in lazy if not m.startswith("omni_cache") and m.split(".")[0] not in sys.stdlib_module_names}
    assert third_party, "found no lazy import at all: the scan is broken"
    assert not sorted(m for m in third_party if not covered(m))


def test_the_scan_sees_imports_inside_functions_only():
    src = "import os\nfrom a.b import c\ndef f():\n    import x.y\n    from z import w\n"
    assert lazy_imports(src) == {"x.y", "z"}


def last_line_of(code: str) -> str:
    """The last line ``code`` prints in a fresh interpreter (nothing imported before it)."""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300)
    return run.stdout.strip().splitlines()[-1]


def test_preload_imports_them_all_in_a_fresh_interpreter():
    code = (
        "import sys; from omni_cache.serving.preload import preload, REQUEST_PATH_MODULES, LIBRARY_FIRST_USE_MODULES; "
        "failed = preload(); "
        "missing = [m for m in REQUEST_PATH_MODULES + LIBRARY_FIRST_USE_MODULES if m not in sys.modules]; "
        "from PIL import Image; from openai.types.realtime import SessionCreatedEvent; "
        "print(failed, missing, Image._initialized, SessionCreatedEvent.__pydantic_complete__)"
    )
    out = last_line_of(code)
    # ... and the SDK's models are built (the SDK defers that to their first use)
    assert out == "[] [] 2 True", out


def test_deferred_models_of_the_named_packages_are_built_and_no_others():
    code = (
        "from openai.types.realtime import SessionCreatedEvent, ConversationItemAdded; "
        "from openai.types.responses import Response; "
        "from omni_cache.serving.preload import build_deferred_models; "
        "before = [SessionCreatedEvent.__pydantic_complete__, ConversationItemAdded.__pydantic_complete__]; "
        "n = build_deferred_models(); again = build_deferred_models(); "
        "print(before, n > 100, again, SessionCreatedEvent.__pydantic_complete__, "
        "ConversationItemAdded.__pydantic_complete__, Response.__pydantic_complete__)"
    )
    out = last_line_of(code)
    # Deferred by the SDK, then built, once; the Responses API's models (not served) are left alone.
    assert out == "[False, False] True 0 True True False", out
