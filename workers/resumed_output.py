"""A resumed request's first output, rewritten as the output an undisturbed run would have sent.

A request whose replica died starts again on a live one with the answer its client already has at
the end of its prompt (omni_cache/runtime/resume.py); the autoregressive stage's runner
(workers/ar_runner.py) passes that first output through :func:`resumed_as_undisturbed`, so
downstream stages and the client see one stream, as if nothing had happened.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from workers.spoken_tokens import SpokenDelta

if TYPE_CHECKING:  # annotations only
    from workers.llm_stage import StepOutput

__all__ = ["resumed_as_undisturbed"]


def resumed_as_undisturbed(out: StepOutput, tail: list[int], answer_finished: str) -> None:
    """Rewrite a resumed request's first output (omni_cache.runtime.resume) as the output an
    undisturbed run would have sent by now: its prompt is the client's, and the answer tokens at
    the end of the resumed prompt are generated ones, sent with the new token. vLLM outputs
    nothing before the first token, so this first output holds the whole prefill's rows: one per
    position fed, as an undisturbed run has after sampling as many tokens.

    ``answer_finished``: the answer was complete; the token vLLM sampled now is not part of it,
    and neither is the row of the answer's last token, which an undisturbed run never feeds."""
    k = len(tail)
    out.num_prompt_tokens -= k
    if out.prompt_token_ids:
        out.prompt_token_ids = out.prompt_token_ids[:-k]
    if answer_finished:
        out.token_ids, out.text = list(tail), ""
        out.finished, out.finish_reason = True, answer_finished
        out.latents = {name: rows[:-1] for name, rows in out.latents.items()}
        if out.spoken is not None:
            # The token that stopped the answer is not spoken (its text the client never got).
            out.spoken = SpokenDelta(list(tail[:-1] if answer_finished == "stop" else tail))
    else:
        out.token_ids = [*tail, *out.token_ids]
        if out.spoken is not None:
            out.spoken = SpokenDelta([*tail, *out.spoken.token_ids], out.spoken.text)
