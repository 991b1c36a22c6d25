"""The worker's side of a codec talker: what happens around each forward.

vLLM feeds a decode step the code it sampled last (the first codebook, `code0`). A talker instead
feeds, at the position of the s-th sampled code, its codec embedding (`model.codec_input_embeds`)
plus text row s of the thinker (`scheduler/streamed_rows.py`). Qwen2.5-Omni's talker has one
codebook (`model.has_residual_codebooks` False): that is all, its codes are the token ids vLLM
samples. Qwen3-Omni's feeds the sum of the embeddings of ALL its codebooks; the other codebooks come
from the code predictor, which needs the talker's hidden state at the previous position
(`past_hidden`); it decodes greedily for a greedy request and samples (`residual_picker`) for a
sampling one, as the reference does. So, at every step:

1. `adjust_inputs` (called by the model's forward, when vLLM's runner has laid out the batch):
   replace the input embedding of every scheduled position that feeds a sampled code by the sum
   of its codebooks' embeddings and its text row;
2. `after_step` (after `execute_model`; residual codebooks only): keep each request's last hidden
   state as its next `past_hidden`;
3. `after_sampling` (after vLLM sampled; residual codebooks only): run the code predictor (batched
   over the requests) for every code sampled now, and queue its complete codes [num_code_groups]
   for the stage (`drain`).

The code predictor needs the sampled code and the hidden state it came from, not the next text
row, so a code's codebooks are known as soon as it is sampled: they leave with the step that
sampled it (the first audio need not wait for the talker's next step, which waits for the
thinker's next row). A code that ends the request (end of speech, or its last allowed step) is
never fed, and never spoken: `drain(finished=True)` leaves it out, as the reference does.
`adjust_inputs` still predicts a code it finds without codebooks (none, in practice).

Per-request state (`past_hidden`, the codebooks of every code fed so far, needed again when a
preempted request is recomputed) hangs on vLLM's `CachedRequestState` of the request, so vLLM's
request lifecycle frees it. Only codes waiting for the stage to pick them up are kept here, and
the stage drains them after every step (and discards them on abort).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from scheduler import streamed_rows


@dataclass
class TalkerRequestState:
    past_hidden: torch.Tensor | None = None  # talker hidden state at the last computed position
    residual: list[torch.Tensor] = field(default_factory=list)  # per fed code: codebooks 1..G-1


class TalkerSteps:
    """Owned by the worker; the talker model calls `adjust_inputs` from its forward."""

    def __init__(self, runner: Any, model: Any) -> None:
        self.runner, self.model = runner, model
        # Whether a code has codebooks beyond the sampled one (a code predictor writes them).
        self.residual = bool(model.has_residual_codebooks)
        self.scheduler_output: Any = None
        self.pending: dict[str, list[torch.Tensor]] = {}  # req id -> codes [G] per new step

    # ---- around execute_model ----------------------------------------------------------------
    def before_step(self, scheduler_output: Any) -> None:
        self.scheduler_output = scheduler_output
        # vLLM asks the model for each new request's M-RoPE positions in this order, from the
        # prompt alone (`next_prompt_positions`); a stage-given override goes with its request.
        given = getattr(scheduler_output, "prompt_positions", {})
        self.new_positions = [given.get(new.req_id) for new in scheduler_output.scheduled_new_reqs]

    def next_prompt_positions(self, num_tokens: int) -> tuple[torch.Tensor, int] | None:
        """The stage-given positions of the next new request (None: plain text positions)."""
        if not getattr(self, "new_positions", None):
            return None
        given = self.new_positions.pop(0)
        if given is not None and given[0].shape[-1] != num_tokens:
            raise ValueError(f"prompt positions for {given[0].shape[-1]} tokens, prompt has {num_tokens}")
        return given

    def after_step(self, state: Any) -> None:
        """Remember each scheduled request's last hidden state (the row its logits came from)."""
        if not self.residual:
            self.scheduler_output = None  # only the code predictor reads past_hidden
            return
        if state is None or self.scheduler_output is None:
            return
        hidden = state.sample_hidden_states
        ids = self.runner.input_batch.req_ids
        for i, req_id in enumerate(ids[: hidden.shape[0]]):
            req = self.runner.requests.get(req_id)
            if req is not None:
                _state(req).past_hidden = hidden[i].detach().clone()
        self.scheduler_output = None

    # ---- inside the forward ------------------------------------------------------------------
    def adjust_inputs(self, inputs_embeds: torch.Tensor) -> torch.Tensor:
        out = self.scheduler_output
        if out is None:
            return inputs_embeds
        rows, reqs, steps = self._code_positions(out)
        if not rows:
            return inputs_embeds
        code0 = torch.tensor(
            [req.output_token_ids[s] for req, s in zip(reqs, steps)], dtype=torch.long, device=inputs_embeds.device
        )
        residual = self._residual_codes(reqs, steps, code0) if self.residual else None
        embeds = self.model.codec_input_embeds(code0, residual)
        text = torch.stack([self._text_row(out, req, s) for req, s in zip(reqs, steps)])
        index = torch.tensor(rows, dtype=torch.long, device=inputs_embeds.device)
        inputs_embeds[index] = (embeds + text.to(embeds.device)).to(inputs_embeds.dtype)
        return inputs_embeds

    def _code_positions(self, out: Any) -> tuple[list[int], list[Any], list[int]]:
        """Batch rows that feed a sampled code, with their request and decode step."""
        batch = self.runner.input_batch
        starts = self.runner.query_start_loc.np
        rows, reqs, steps = [], [], []
        for i, req_id in enumerate(batch.req_ids):
            n = out.num_scheduled_tokens.get(req_id, 0)
            req = self.runner.requests[req_id]
            computed = int(batch.num_computed_tokens_cpu[i])
            prompt = req.num_prompt_tokens
            for pos in range(max(computed, prompt), computed + n):
                rows.append(int(starts[i]) + pos - computed)
                reqs.append(req)
                steps.append(pos - prompt)
        return rows, reqs, steps

    def after_sampling(self, output: Any) -> None:
        """Codebooks 1..G-1 of every code vLLM sampled in this step (`output`: its
        ModelRunnerOutput), predicted now: one batched code-predictor run."""
        if not self.residual:
            return  # a one-codebook code is its sampled token id: nothing to add
        reqs, steps = [], []
        for i, req_id in enumerate(getattr(output, "req_ids", None) or ()):
            req = self.runner.requests.get(req_id)
            if req is None or i >= len(output.sampled_token_ids) or not output.sampled_token_ids[i]:
                continue  # a prefill chunk that sampled nothing
            step = len(req.output_token_ids) - 1
            if step == len(_state(req).residual):
                reqs.append(req)
                steps.append(step)
        if reqs:
            code0 = torch.tensor([req.output_token_ids[s] for req, s in zip(reqs, steps)], dtype=torch.long)
            self._predict(reqs, steps, code0, list(range(len(reqs))))

    def _predict(self, reqs: list[Any], steps: list[int], code0: torch.Tensor, new: list[int]) -> None:
        """Run the code predictor for the codes `new` (indices into reqs/steps/code0), each the
        next code of its request: keep their codebooks and queue the complete codes."""
        past = []
        for k in new:
            hidden = _state(reqs[k]).past_hidden
            if hidden is None:
                raise RuntimeError(f"talker request {reqs[k].req_id}: no hidden state before step {steps[k]}")
            past.append(hidden)
        predicted = self.model.residual_codes(
            torch.stack(past), code0[new].to(past[0].device), residual_picker([reqs[k] for k in new])
        )
        for j, k in enumerate(new):
            req = reqs[k]
            _state(req).residual.append(predicted[j].cpu())
            codes = torch.cat([code0[k : k + 1].cpu(), predicted[j].cpu()])
            self.pending.setdefault(req.req_id, []).append(codes)

    def _residual_codes(self, reqs: list[Any], steps: list[int], code0: torch.Tensor) -> torch.Tensor:
        """Codebooks 1..G-1 of each fed code: from history (predicted when it was sampled, or
        before a recompute), else predicted now."""
        new = [k for k, (req, s) in enumerate(zip(reqs, steps)) if s == len(_state(req).residual)]
        if new:
            self._predict(reqs, steps, code0, new)
        out = []
        for req, s in zip(reqs, steps):
            history = _state(req).residual
            if s >= len(history):
                raise RuntimeError(f"talker request {req.req_id}: codes of step {s} are unknown")
            out.append(history[s])
        return torch.stack(out).to(code0.device)

    def _text_row(self, out: Any, req: Any, step: int) -> torch.Tensor:
        rows = out.streamed_rows.get(req.req_id) if hasattr(out, "streamed_rows") else None
        if rows is None:
            raise RuntimeError(f"talker request {req.req_id} has no text rows (added without them)")
        if not rows.has(step):
            raise RuntimeError(
                f"talker request {req.req_id}: text row {step} has not arrived (the scheduler should have held it back)"
            )
        return rows.rows(torch.tensor([step]))[0]

    # ---- for the stage -----------------------------------------------------------------------
    def drain(self, req_id: str, finished: bool = False) -> torch.Tensor | None:
        """Codes sampled since the last drain, [G, k] (None when there are none). `finished`:
        the request ended with this step, so its last sampled code is never fed (end of speech,
        or its last allowed code) and is left out."""
        codes = self.pending.pop(req_id, None)
        if codes and finished:
            codes = codes[:-1]
        return torch.stack(codes, dim=1) if codes else None

    def discard(self, req_id: str) -> None:
        self.pending.pop(req_id, None)


#: How the reference draws codebooks 1..G-1 when the talker samples (transformers' talker passes
#: these to its code predictor's generate; temperature stays 1): top-k, then nucleus top-p.
RESIDUAL_TOP_K = 50
RESIDUAL_TOP_P = 0.8


def residual_picker(reqs: list[Any]) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """How to pick each request's residual codes from the code predictor's logits [B, V]:
    greedy for a request whose talker decodes greedily (temperature 0), as the reference does,
    else sampled with RESIDUAL_TOP_K / RESIDUAL_TOP_P from the request's own generator (vLLM
    seeds it from `seed`, so a seeded request's codes repeat). None when all are greedy."""
    from vllm.sampling_params import SamplingType

    sampled = [
        k
        for k, req in enumerate(reqs)
        if req.sampling_params is not None and req.sampling_params.sampling_type != SamplingType.GREEDY
    ]
    if not sampled:
        return None

    def pick(logits: torch.Tensor) -> torch.Tensor:
        codes = logits.argmax(dim=-1)
        for k in sampled:
            codes[k] = sample_top_k_top_p(logits[k], RESIDUAL_TOP_K, RESIDUAL_TOP_P, reqs[k].generator)
        return codes

    return pick


def sample_top_k_top_p(
    logits: torch.Tensor, top_k: int, top_p: float, generator: torch.Generator | None = None
) -> torch.Tensor:
    """One id from `logits` [V]: keep the top_k largest, then the smallest set of those whose
    probability reaches top_p (at least one), renormalise and draw."""
    values, ids = logits.float().topk(min(top_k, logits.shape[-1]))
    probs = values.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass of the ids ranked above each one
    probs = probs.masked_fill(before >= top_p, 0.0)
    choice = torch.multinomial(probs, 1, generator=generator)
    return ids[choice[0]]


def _state(req: Any) -> TalkerRequestState:
    state = getattr(req, "talker_state", None)
    if state is None:
        state = TalkerRequestState()
        req.talker_state = state
    return state


__all__ = ["TalkerSteps", "TalkerRequestState", "streamed_rows"]
