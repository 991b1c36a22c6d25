"""omni-serve's HTTP app over fake stages (tests/fake_stage.py), served from the benchmark's own
process and event loop: the admission flood and the realtime memory benchmark read the server's
RSS, event-loop lag and admission bounds directly, which a server in another process would hide."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

#: The fake stage process (no vLLM): the server's own costs are what these benchmarks measure.
FAKE_STAGE = Path(__file__).resolve().parents[1] / "tests" / "fake_stage.py"


class InProcessServer:
    """``await start()`` brings up the pipeline of ``config`` (a loaded PipelineConfig) and its
    HTTP server on a free loopback port and returns its URL; ``await stop()`` takes both down."""

    def __init__(self, config: Any) -> None:
        import uvicorn

        from omni_cache.runtime.orchestrator import Orchestrator
        from omni_cache.serving.server import create_app, protocol_options

        self.orch = Orchestrator(
            config,
            stage_argv=[sys.executable, str(FAKE_STAGE)],
            start_timeout_s=300,
            shutdown_grace_s=2,
            echo_stage_logs=False,
        )
        self.app = create_app(self.orch, manage_lifecycle=False)
        self._server = uvicorn.Server(
            uvicorn.Config(
                self.app, host="127.0.0.1", port=0, log_level="warning", lifespan="off", **protocol_options(config)
            )
        )
        self._serving: asyncio.Task | None = None

    async def start(self) -> str:
        await self.orch.start()
        self._serving = asyncio.create_task(self._server.serve())
        while not self._server.started:
            await asyncio.sleep(0.05)
        port = self._server.servers[0].sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        self._server.should_exit = True
        if self._serving is not None:
            await self._serving
        await self.orch.close()
