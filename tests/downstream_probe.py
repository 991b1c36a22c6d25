"""A talker hand-off that also writes down what the talker stage received (test helper).

``record_then_talk`` is ``omni_cache.handoff.thinker_to_talker`` (the talker runs on the rows as
always) plus, once the thinker's stream for a request has ended, one file in ``$PROBE_DIR_ENV``
holding everything the stage assembled from that stream: each latent the thinker sent (hidden
states, layer taps, per-token media rows) as the hand-off reads it, the prompt the thinker saw
(media placeholders expanded) and its answer. A test pipeline names it as the talker's
``handoff`` and sets the directory in the talker's ``env``; :func:`received` reads the files back,
keyed by prompt. The stage imports this module by its dotted path, so the talker's ``env`` also
puts ``tests/`` on ``PYTHONPATH``.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch

from omni_cache.handoff import HandoffContext, Upstream, thinker_to_talker

PROBE_DIR_ENV = "OMNI_CACHE_DOWNSTREAM_PROBE_DIR"
PROMPT, ANSWER = "_prompt_token_ids", "_token_ids"


def record_then_talk(ctx: HandoffContext, up: Upstream, state: dict) -> list:
    jobs = thinker_to_talker(ctx, up, state)
    if up.finished and not state.get("recorded"):
        state["recorded"] = True
        _write(Path(os.environ[PROBE_DIR_ENV]), up)
    return jobs


def _write(directory: Path, up: Upstream) -> None:
    from safetensors.torch import save_file

    tensors = {name: t.contiguous().clone() for name, t in up.latents.items()}
    tensors[PROMPT] = torch.tensor(up.prompt_token_ids, dtype=torch.int64)
    tensors[ANSWER] = torch.tensor(up.token_ids, dtype=torch.int64)
    name = hashlib.sha256(tensors[PROMPT].numpy().tobytes()).hexdigest()[:24]
    tmp = directory / f".{name}.tmp"
    save_file(tensors, str(tmp))
    tmp.replace(directory / f"{name}.safetensors")  # a reader never sees half a file


def received(directory: Path) -> dict[tuple[int, ...], tuple[list[int], dict[str, torch.Tensor]]]:
    """expanded prompt -> (the thinker's answer, latent name -> rows), as the talker received them."""
    from safetensors.torch import load_file

    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        tensors = load_file(str(path))
        prompt = tuple(tensors.pop(PROMPT).tolist())
        out[prompt] = (tensors.pop(ANSWER).tolist(), tensors)
    return out


def record_qwen2_5_talker_inputs(ctx: HandoffContext, up: Upstream, state: dict) -> list:
    """``omni_cache.models.qwen2_5_omni_talker_input.thinker_to_talker``, writing down the talker inputs it built
    for each request (its prompt embeddings, then every streamed text row, in order) once the
    thinker's stream ended: one file per request, ``<prompt digest>-<n>.safetensors``, n counting
    the requests with that prompt (so a repeat does not overwrite the first)."""
    from omni_cache.handoff import FeedJob, GenerateJob
    from omni_cache.models.qwen2_5_omni_talker_input import thinker_to_talker as qwen2_5_omni_thinker_to_talker

    jobs = qwen2_5_omni_thinker_to_talker(ctx, up, state)
    for job in jobs:
        if isinstance(job, GenerateJob):
            state["probe_prompt"] = job.prompt_embeds.clone()
            state["probe_rows"] = [job.stream.rows.clone()]
        elif isinstance(job, FeedJob):
            state["probe_rows"].append(job.rows.clone())
    if up.finished and not state.get("recorded") and "probe_prompt" in state:
        state["recorded"] = True
        from safetensors.torch import save_file

        directory = Path(os.environ[PROBE_DIR_ENV])
        prompt = torch.tensor(up.prompt_token_ids, dtype=torch.int64)
        digest = hashlib.sha256(prompt.numpy().tobytes()).hexdigest()[:24]
        n = len(list(directory.glob(f"{digest}-*.safetensors")))
        tensors = {"prompt_embeds": state["probe_prompt"], "rows": torch.cat(state["probe_rows"]), PROMPT: prompt}
        tmp = directory / f".{digest}-{n}.tmp"
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp))
        tmp.replace(directory / f"{digest}-{n}.safetensors")
    return jobs


def talker_inputs(directory: Path) -> dict[tuple[int, ...], list[dict[str, torch.Tensor]]]:
    """expanded prompt -> per request in arrival order, the talker inputs recorded for it."""
    from safetensors.torch import load_file

    out: dict[tuple[int, ...], list[dict[str, torch.Tensor]]] = {}
    for path in sorted(
        directory.glob("*-*.safetensors"), key=lambda p: (p.stem.rsplit("-", 1)[0], int(p.stem.rsplit("-", 1)[1]))
    ):
        tensors = load_file(str(path))
        out.setdefault(tuple(tensors.pop(PROMPT).tolist()), []).append(tensors)
    return out
