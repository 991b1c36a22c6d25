"""The tiny checkpoints by name, the stage kind each runs as, and where they are generated.

Torch-free on purpose: the config checks ``tiny:NAME`` references and resolves the checkpoint
directory with these, and loading a config must stay cheap in any process. The generator itself
(:mod:`omni_cache.tiny.checkpoints`) needs torch.
"""

from __future__ import annotations

import os
from pathlib import Path

#: How a stage config names a generated checkpoint: ``model: tiny:thinker``.
TINY_PREFIX = "tiny:"

#: The tiny checkpoints the project generates itself, with the stage kinds each one can run as
#: (a Qwen3-Omni folder holds the thinker and talker, run by vLLM, and code2wav, a generation stage).
TINY_MODELS: dict[str, tuple[str, ...]] = {
    "thinker": ("autoregressive",),
    "thinker-hybrid": ("autoregressive",),
    "talker": ("autoregressive",),
    "decoder": ("generation",),
    "qwen3-omni": ("autoregressive", "generation"),
    "qwen3.5": ("autoregressive",),
    "qwen2.5-omni": ("autoregressive", "generation"),
}

#: Environment variable naming where ``tiny:*`` checkpoints are generated (when the config has no
#: ``checkpoint_dir``).
CHECKPOINTS_ENV = "OMNI_CACHE_CHECKPOINTS"
DEFAULT_CHECKPOINT_DIR = Path("~/.cache/omni_cache/checkpoints")


def resolve_checkpoint_dir(configured: str | None = None) -> Path:
    """Where tiny:* checkpoints live: ``configured`` (a config's ``checkpoint_dir``), else
    $OMNI_CACHE_CHECKPOINTS, else ~/.cache/omni_cache/checkpoints (absolute, ``~`` expanded)."""
    raw = configured or os.environ.get(CHECKPOINTS_ENV) or str(DEFAULT_CHECKPOINT_DIR)
    return Path(raw).expanduser().absolute()
