"""A vLLM stage's warm-up: the paths the pinned vLLM compiles or builds on first use, run once at
start, before the stage announces itself, so that no client's request pays for them.

What vLLM 0.32 (CPU) does lazily, found by sending the first request of each kind to a fresh server
(``python -m benchmarks.first_request``, docs/benchmarks.md):

* log-probabilities: ``Sampler.gather_logprobs`` calls ``batched_count_greater_than``, a
  ``torch.compile`` (inductor) function compiled on the first step that asks for them (~10 s on
  these 2-core machines: long enough for a stage to be judged hung);
* structured outputs: the xgrammar backend (its tokenizer info, the grammar compiler) is built
  with the first request that has a grammar (a named tool is one too);
* sampling with a seed, top-k/top-p and penalties, the builtin logits processors, and each medium
  the stage takes (image, audio, video with limit_mm_per_prompt > 0): first runs of their code,
  cheap but not free.

Each warm-up request runs alone through the stage's own LLMStage (the same add/step path a
client's request takes), with a few tokens of text the warm-up names itself and tiny generated
media. Afterwards nothing of it stays where it could change an answer or a figure: vLLM's prefix
cache is reset (the hidden-state mirror follows vLLM's block hashes, so its rows of the warm-up are
unreachable), the block changes prefix routing would hear of are dropped, and the stage's counters
start from zero. Nothing here copies vLLM code: requests go in through its public engine API.

That is the entry stage's warm-up. A stage fed by a hand-off (the talker) samples only as its
config says: one request with that sampling warms it (zero prompt embeddings and pad rows for
Qwen3-Omni's talker, which has no tokenizer).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from omni_cache.wire.messages import MediaRef
from workers.video_input import video_input

logger = logging.getLogger(__name__)

#: vLLM request ids of the warm-up (never a client's: those are the server's uuids).
REQUEST_PREFIX = "omni-cache-warmup-"
#: Tokens each warm-up request generates: the first decode step is the one that compiles.
WARMUP_TOKENS = 2
#: Seconds one warm-up request may take before the warm-up gives up on it. A deadline, not a
#: step count: a request with a grammar waits, unscheduled, while vLLM compiles the grammar in a
#: thread of its own, and steps that schedule nothing take microseconds (a count of 256 ran out
#: before xgrammar finished on a loaded 2-core machine). First-use compiles take ~10 s here.
MAX_REQUEST_S = 300.0
#: Pause between steps that produced nothing (the request waits for its grammar, not the engine).
IDLE_POLL_S = 0.005
#: The warm-up's own text (a prompt no client shares, so nothing of it could be a prefix hit).
PROMPT = "omni_cache warm-up: a few tokens of text."
#: Frame rate of the warm-up's video (its frames' sampling rate, as the server reports a clip's).
VIDEO_FPS = 2.0
#: A JSON schema for the structured-output path.
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@dataclass(frozen=True)
class WarmupRequest:
    """One request of the warm-up: the path it warms, its prompt and its SamplingParams."""

    path: str
    prompt: dict[str, Any]
    params: Any
    #: Its decode steps read streamed rows (a talker): none come, every step reads a zero pad row.
    streamed: bool = False


@dataclass
class WarmupReport:
    """What the warm-up ran and how long each path took, and the compile count it left: the
    stage reports both with its counters."""

    seconds: dict[str, float] = field(default_factory=dict)
    #: torch.compile frames compiled in this process when the stage was ready to serve.
    compiles_at_ready: int = 0

    @property
    def total_s(self) -> float:
        return sum(self.seconds.values())

    def counters(self) -> dict[str, float]:
        """``warmup_s``, ``warmup_<path>_s`` per path, and ``compiles_while_serving``: frames
        torch.compile compiled since the stage was ready, each a first-use compile some
        client's request waited for (0 while the warm-up covered them)."""
        out = {f"warmup_{path}_s": round(s, 3) for path, s in self.seconds.items()}
        out["warmup_s"] = round(self.total_s, 3)
        out["compiles_while_serving"] = compiled_frames() - self.compiles_at_ready
        return out


def no_warmup() -> WarmupReport:
    """The report of a stage whose warm-up is off (``stages[].warmup: false``)."""
    return WarmupReport(compiles_at_ready=compiled_frames())


def compiled_frames() -> int:
    """Frames torch.compile (dynamo) compiled in this process so far."""
    from torch._dynamo.utils import counters

    return int(counters["frames"]["ok"])


def warm_up(llm: Any, sampling: Any, *, entry: bool) -> WarmupReport:
    """Run the warm-up requests of ``llm`` (a workers.llm_stage.LLMStage that holds no request
    yet) one at a time, then leave its caches and counters as a fresh engine has them.
    ``entry``: the stage takes the clients' requests (and their sampling); otherwise it is fed
    by a hand-off and samples as configured: ``sampling`` (schema.Sampling)."""
    report = WarmupReport()
    requests = warmup_requests(llm) if entry else [stage_request(llm, sampling)]
    for i, request in enumerate(requests):
        t0 = time.perf_counter()
        run_alone(llm, f"{REQUEST_PREFIX}{i}-{request.path}", request)
        report.seconds[request.path] = report.seconds.get(request.path, 0.0) + time.perf_counter() - t0
    _forget_warmup(llm)
    report.compiles_at_ready = compiled_frames()
    return report


def _params(**kw: Any) -> Any:
    from vllm import SamplingParams

    return SamplingParams(max_tokens=WARMUP_TOKENS, **kw)


def stage_request(llm: Any, sampling: Any) -> WarmupRequest:
    """A stage fed by a hand-off (a talker): clients choose nothing of its sampling, so one
    request with the stage's configured sampling covers what its requests run. Without a
    tokenizer it takes prompt embeddings and streamed rows (Qwen3-Omni's talker)."""
    params = _params(temperature=sampling.temperature, top_p=sampling.top_p, seed=sampling.seed)
    tokenizer = _tokenizer(llm)
    if tokenizer is not None:
        return WarmupRequest("stage_sampling", {"prompt_token_ids": tokenizer.encode(PROMPT)}, params)
    # As wide as the talker's inputs, which need not be its hidden size (Qwen2.5-Omni's are the thinker's).
    width = llm.engine.vllm_config.model_config.get_inputs_embeds_size()
    return WarmupRequest("stage_sampling", {"prompt_embeds": torch.zeros(4, width)}, params, streamed=True)


def warmup_requests(llm: Any) -> list[WarmupRequest]:
    """The requests that warm what the entry stage's engine builds on first use: every kind of
    sampling a client may ask for, and with a tokenizer (bad words and grammars need one; the
    media's placeholders are text) the logits processors, structured output and each medium."""
    from vllm.sampling_params import StructuredOutputsParams

    params = _params
    tokenizer = _tokenizer(llm)
    ids = tokenizer.encode(PROMPT) if tokenizer is not None else list(range(1, 33))
    text = {"prompt_token_ids": ids}
    sampling = [
        WarmupRequest("greedy", text, params(temperature=0.0)),
        # logprobs=2 also covers top_logprobs: the same compiled function ranks the tokens.
        WarmupRequest("logprobs", text, params(temperature=0.0, logprobs=2)),
        WarmupRequest(
            "penalties",
            text,
            params(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2),
        ),
        WarmupRequest("random_sampling", text, params(temperature=0.8, top_p=0.9, top_k=5)),
        WarmupRequest("seed", text, params(temperature=0.8, seed=0)),
    ]
    if tokenizer is None:
        return sampling
    return [
        *sampling,
        WarmupRequest(
            "logits_processors", text, params(temperature=0.0, min_tokens=1, logit_bias={0: -1.0}, bad_words=["warm"])
        ),
        WarmupRequest(
            "structured_output", text, params(temperature=0.0, structured_outputs=StructuredOutputsParams(json=SCHEMA))
        ),
        *media_requests(llm, tokenizer, params(temperature=0.0)),
    ]


def media_requests(llm: Any, tokenizer: Any, params: Any) -> list[WarmupRequest]:
    """One request per medium the stage takes (image, audio, video with a limit_mm_per_prompt
    above 0), each with one tiny item behind the model's own placeholder text (a video with its
    frame rate, as workers/ar_runner.py passes a client's, and without its sound track)."""
    model_config = llm.engine.vllm_config.model_config
    mm = model_config.multimodal_config
    if mm is None:
        return []
    from vllm.model_executor.model_loader import get_model_cls

    model_cls = get_model_cls(model_config)
    video = video_input(llm.engine)
    items = {"image": _image, "audio": _audio, "video": _video}
    out = []
    for modality, make in items.items():
        if mm.get_limit_per_prompt(modality) <= 0:
            continue
        try:
            placeholder = model_cls.get_placeholder_str(modality, 1)
        except ValueError:  # the model does not take this medium
            continue
        if not placeholder:
            continue
        item = make()
        if modality == "video":  # in the form the model takes videos (workers/video_input.py)
            count = int(item.shape[0])  # the whole clip, at its own rate
            ref = MediaRef(
                kind="video",
                tensor="warmup",
                fps=VIDEO_FPS,
                frame_indices=list(range(count)),
                source_fps=VIDEO_FPS,
                source_frames=count,
            )
            item = video.item(item, ref)
        prompt = {
            "prompt_token_ids": tokenizer.encode(f"{placeholder}{PROMPT}"),
            "multi_modal_data": {modality: [item]},
        }
        kwargs = video.processor_kwargs(VIDEO_FPS, False) if modality == "video" else None
        if kwargs:
            prompt["mm_processor_kwargs"] = kwargs
        out.append(WarmupRequest(modality, prompt, params))
    return out


def _image() -> Any:
    from PIL import Image

    rgb = np.random.default_rng(0).integers(0, 255, (56, 56, 3), dtype=np.uint8)
    return Image.fromarray(rgb)


def _audio() -> tuple[np.ndarray, int]:
    """One second of a 440 Hz tone at 16 kHz."""
    t = np.arange(16000, dtype=np.float32) / 16000
    return (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32), 16000


def _video() -> np.ndarray:
    """Four 56 x 56 RGB frames, [T, H, W, 3] uint8 (as the server decodes a clip's frames)."""
    return np.random.default_rng(1).integers(0, 255, (4, 56, 56, 3), dtype=np.uint8)


def _tokenizer(llm: Any) -> Any:
    if llm.engine.vllm_config.model_config.skip_tokenizer_init:
        return None
    return llm.engine.tokenizer


def run_alone(llm: Any, request_id: str, request: WarmupRequest) -> None:
    """Add one request and step the engine until it finished (the stage holds nothing else)."""
    streamed = None
    if request.streamed:
        from scheduler.streamed_rows import StreamedRows

        streamed = StreamedRows(torch.zeros(llm.engine.vllm_config.model_config.get_inputs_embeds_size()))
        streamed.add(None, done=True)
    llm.add(request_id, request.prompt, request.params, streamed=streamed)
    deadline = time.monotonic() + MAX_REQUEST_S
    while time.monotonic() < deadline:
        outputs = llm.step()
        for out in outputs:
            if out.error is not None:
                llm.abort(request_id)
                raise RuntimeError(f"warm-up request {request.path!r} failed: {out.error}") from out.error
            if out.finished:
                return
        if not outputs and not llm.has_work():
            time.sleep(IDLE_POLL_S)
    llm.abort(request_id)
    raise RuntimeError(f"warm-up request {request.path!r} did not finish in {MAX_REQUEST_S:g} s")


def _forget_warmup(llm: Any) -> None:
    """Nothing of the warm-up stays: no prefix-cache block (nor the latent rows the mirror keeps
    at them, reachable only through those blocks), no block change for prefix routing, no count."""
    if not llm.engine.reset_prefix_cache():
        raise RuntimeError("vLLM did not reset its prefix cache after the warm-up")
    if llm.block_events is not None:
        llm.block_events.take()
    llm.reset_counters()
