"""The voices (speakers) a checkpoint folder defines, as the server offers them to clients.

A client picks one with ``audio.voice`` (chat) or the session's ``audio.output.voice`` (realtime);
``default`` is always accepted and means the checkpoint's own default speaker. Names are matched
without regard to case and offered in lower case (OpenAI's voices are lower-case names).

Where each family keeps its speakers (read here without loading any model):

- Qwen2.5-Omni: ``spk_dict.pt`` beside the weights, one entry per speaker (its talker's text-bos
  token and token2wav's conditioning); the reference's default is ``Chelsie``.
- Qwen3-Omni: ``talker_config.speaker_id`` in ``config.json`` (a codec id per speaker).
- Anything else: one unnamed voice, ``default``.
"""

from __future__ import annotations

import json
from pathlib import Path

#: Always accepted: the checkpoint's default speaker. Sent to the stages as "".
DEFAULT_VOICE = "default"
#: Qwen2.5-Omni's speaker file, and the reference's default speaker.
SPEAKER_FILE = "spk_dict.pt"


def checkpoint_voices(model_dir: str | Path) -> tuple[str, ...]:
    """``default`` first, then the folder's speakers in lower case, sorted."""
    folder = Path(model_dir)
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    names: list[str] = []
    if (folder / SPEAKER_FILE).is_file():
        names = list(load_speakers(folder))
    elif isinstance(config.get("talker_config"), dict):
        names = list(config["talker_config"].get("speaker_id") or {})
    return (DEFAULT_VOICE, *sorted({n.lower() for n in names} - {DEFAULT_VOICE}))


def load_speakers(model_dir: str | Path) -> dict:
    """A Qwen2.5-Omni folder's ``spk_dict.pt``: speaker name -> its tensors and text-bos token.
    Loaded with ``weights_only=True``: the file is a pickle, and only tensors and plain values
    may come out of it."""
    import torch

    speakers = torch.load(Path(model_dir) / SPEAKER_FILE, map_location="cpu", weights_only=True)
    if not isinstance(speakers, dict) or not speakers:
        raise ValueError(f"{Path(model_dir) / SPEAKER_FILE}: not a speaker dictionary")
    return speakers


def resolve_voice(voice: str, names: list[str] | tuple[str, ...], default: str) -> str:
    """The checkpoint's speaker name for a requested voice ("" or ``default``: ``default``),
    matched without regard to case; ValueError naming the valid ones otherwise."""
    if not voice or voice.lower() == DEFAULT_VOICE:
        return default
    for name in names:
        if name.lower() == voice.lower():
            return name
    raise ValueError(f"unknown voice {voice!r}; this checkpoint speaks with {', '.join(sorted(names))}")
