"""A fresh server of fake stages in a process of its own that records every module imported and
every pydantic model built after it is ready, with the thread that did it
(tests/test_first_use_imports.py runs it).

    python tests/first_use_server.py

Prints one JSON line when ready (``url``, ``model``), then waits for a line on stdin and prints
the imports as a JSON list of ``{"module", "thread", "by"}`` (``by``: the importing frames, the
innermost last; a model's build is listed as the module ``pydantic model <its class>``). The
server's event loop runs on the thread ``omni-cache-http`` (ServerThread). Its own process, so
that what the test's clients import is not counted, nor hides the server's.
"""

from __future__ import annotations

import json
import sys
import threading
import traceback
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fake_pipeline import API_KEY, make_orchestrator, write_config  # noqa: E402

from omni_cache.serving.preload import preload  # noqa: E402
from omni_cache.serving.server import ServerThread  # noqa: E402


class ImportRecorder:
    """A ``sys.meta_path`` finder that finds nothing and notes each module asked for while armed
    (Python asks the finders only for a module not imported yet)."""

    def __init__(self) -> None:
        self.armed = False
        self.seen: list[dict[str, object]] = []

    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        if self.armed and name not in sys.modules:
            self.note(name)
        return None

    def note(self, what: str) -> None:
        frames = [f for f in traceback.extract_stack()[:-2] if "importlib" not in f.filename]
        self.seen.append(
            {
                "module": what,
                "thread": threading.current_thread().name,
                "by": [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in frames[-6:]],
            }
        )

    def watch_model_builds(self) -> None:
        """Note each deferred pydantic model built while armed: pydantic builds one on its first
        use through ``model_rebuild`` (the OpenAI SDK defers its models' builds)."""
        from pydantic import BaseModel

        rebuild = BaseModel.model_rebuild.__func__
        recorder = self

        def noted(cls: type, *args: object, **kwargs: object) -> object:
            if recorder.armed and not cls.__pydantic_complete__:
                recorder.note(f"pydantic model {cls.__module__}.{cls.__qualname__}")
            return rebuild(cls, *args, **kwargs)

        BaseModel.model_rebuild = classmethod(noted)


def main() -> int:
    recorder = ImportRecorder()
    sys.meta_path.insert(0, recorder)
    recorder.watch_model_builds()
    path = write_config(
        f"first_use_{uuid.uuid4().hex[:8]}",
        token_delay_s=0.002,
        server_extra=", media: {allowed_url_hosts: ['127.0.0.1']}",
    )
    with ServerThread(make_orchestrator(path), api_key=API_KEY) as srv:
        srv.wait_ready(60)
        # The server preloads in a thread while its stages start (omni_cache/serving/preload.py);
        # fake stages are ready within a second, real ones after tens: wait for it as they would.
        preload()
        recorder.armed = True
        print(json.dumps({"url": srv.url, "model": srv.orchestrator.served_model_name, "api_key": API_KEY}), flush=True)
        sys.stdin.readline()
        recorder.armed = False
        print(json.dumps(recorder.seen), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
