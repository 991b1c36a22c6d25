"""TEST-ONLY hook: hold a stage's loop inside one model step, so tests can show how the server
tells a long step (busy, heartbeats coming) from a hang (omni_cache/runtime/supervision/hang_watch.py).

Off unless the stage process's environment has :data:`ENV` (tests set it through the stage's
``env`` key; nothing shipped sets it): then, before each model step, the stage looks for the file
it names. When it exists, the stage removes it and sleeps for the seconds it holds inside that
step: its loop stays in one step while its announcer thread keeps beating, as in a first-use
compile. One hold per file written; the test writes the file (atomically: written beside, then
renamed) before the request whose step it wants held.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

logger = logging.getLogger(__name__)

#: The environment variable naming the hold file (tests only).
ENV = "OMNI_CACHE_TEST_HOLD_FILE"


class StepHold:
    def __init__(self, path: Path) -> None:
        self.path = path

    @classmethod
    def from_env(cls) -> StepHold | None:
        """The hook when the test environment asks for it, else None (no cost per step)."""
        path = os.environ.get(ENV)
        return cls(Path(path)) if path else None

    def maybe_hold(self) -> None:
        """Sleep for the seconds the hold file says, once per file written."""
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return
        self.path.unlink(missing_ok=True)
        try:
            seconds = float(text)
        except ValueError:
            logger.error("test hook %s: %s holds %r, not seconds; not held", ENV, self.path, text)
            return
        logger.warning("test hook %s: holding this step for %g s", ENV, seconds)
        time.sleep(seconds)
