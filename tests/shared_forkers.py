"""One pool of stage forkers for the whole test process (server.stage_launch: fork;
omni_cache/runtime/supervision/stage_forker.py).

The pipelines a test worker starts one after another fork their stages from forkers that
imported vLLM once per worker, not once per pipeline: each forker's imports cost 15-20 s of CPU
on these machines. A config whose stages carry their own environment gets a forker of its own;
at most two forkers without a stage are kept (the least recently used end first). Closed when
the process exits. tests/test_pipeline_e2e.py and tests/test_stage_forker.py start their own
(they kill forkers).
"""

from __future__ import annotations

import atexit

from omni_cache.runtime.supervision.stage_forker import StageForkers

_pool: StageForkers | None = None


def shared_forkers() -> StageForkers:
    global _pool
    if _pool is None:
        _pool = StageForkers(keep_idle=2)
        atexit.register(_pool.close)
    return _pool
