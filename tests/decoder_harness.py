"""A DecoderRunner wired to a test's own end of the orchestrator socket (test helper, used by
the decoder's and the pacing tests)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import zmq

from omni_cache.config import load_config, resolve_model
from omni_cache.wire.messages import MESSAGE_TYPES, StageStats
from omni_cache.wire.transport import Codec, Receiver
from workers.decoder_runner import DecoderRunner
from workers.outbox import Outbox

ROOT = Path(__file__).resolve().parents[1]
#: Sent after what a test waits for, on the runner's socket to the orchestrator (see sent_so_far).
MARKER = StageStats(stage="decoder", counters={"marker": 1.0})


def make_runner(tmp_path, model: str, max_batch_size: int = 2, pacing=None):
    """A DecoderRunner for `model` whose orchestrator socket is the test's (`runner.inbox`);
    `pacing`: the stage's PacingConfig (tests/test_pacing.py)."""
    config = load_config(ROOT / "stage_configs" / "tiny_omni.yaml")
    stage = config.stage("decoder")
    stage.model = model
    stage.generation.max_batch_size = max_batch_size
    stage.pacing = pacing
    ctx = zmq.Context()
    codec = Codec(MESSAGE_TYPES)
    address = f"ipc://{tmp_path}/orchestrator.sock"
    inbox = Receiver(ctx, address, codec, bind=True)
    outbox = Outbox(ctx, codec, {}, address)
    runner = DecoderRunner(config, stage, resolve_model(stage, config), outbox)
    runner.inbox = inbox  # the test's end of the orchestrator socket
    return runner, lambda: (outbox.close(), inbox.close(), ctx.term())


def sent_so_far(runner: DecoderRunner, timeout_s: float = 60.0) -> list[tuple[Any, dict]]:
    """Every message ``runner`` sent the orchestrator that the test has not received yet, in
    order. ZMQ's I/O thread delivers them in its own time, on a loaded machine seconds later:
    a quiet window of a few hundred ms does not show that all of them came (and one that comes
    later is taken for the next step's). A marker sent after them on the same socket arrives
    after every one of them."""
    runner.outbox.to_orchestrator(MARKER)
    got = []
    deadline = time.monotonic() + timeout_s
    while True:
        item = runner.inbox.recv(timeout_ms=1000)
        if item is None:
            assert time.monotonic() < deadline, f"the marker never came back; received meanwhile: {got}"
            continue
        if item[0] == MARKER:
            return got
        got.append(item)
