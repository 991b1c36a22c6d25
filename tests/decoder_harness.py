"""A DecoderRunner wired to a test's own end of the orchestrator socket (test helper, used by
the decoder's and the pacing tests)."""

from __future__ import annotations

from pathlib import Path

import zmq

from omni_cache.config import load_config, resolve_model
from omni_cache.wire.messages import MESSAGE_TYPES
from omni_cache.wire.transport import Codec, Receiver
from workers.decoder_runner import DecoderRunner
from workers.outbox import Outbox

ROOT = Path(__file__).resolve().parents[1]


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
