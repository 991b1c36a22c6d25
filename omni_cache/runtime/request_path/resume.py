"""Resuming a request on live replicas when a replica serving it died.

The orchestrator holds every request until it is answered and knows what its client got: the
answer's token ids and the number of audio samples. When a replica serving a request dies while
its stage has another replica up, the request starts again as a new *attempt* under a new wire id
(``Request.wire_id``): the stages never hear of the old id again, and late outputs of the attempt
it replaces are stale and dropped.

* The entry stage gets the prompt plus the answer tokens the client already has and generates only
  the rest (``Submit.resumed_tokens``), as vLLM recomputes a preempted request. Its first output
  carries those tokens again, rewritten as the stream an undisturbed run would have sent
  (workers/ar_request.py): downstream stages need no notion of resumption, they start afresh.
* When the answer was complete (a talker or decoder replica died after the thinker finished), the
  entry stage only recomputes it (``Submit.answer_finished``: a prefill, no new token kept), so the
  downstream stages get their input again.
* Downstream stages run the request from its start; the orchestrator drops the tokens and the
  audio samples the client already has (``skip_tokens``, ``skip_samples``).
* The text of a resumed attempt is decoded here (:class:`ResumedText`), not taken from the
  stage: vLLM's incremental detokenizer starts from a prompt whose end may be the middle of a
  character (the answer's last bytes), and then writes the prompt's text again.

With greedy sampling a client sees the answer an undisturbed run gives, no token or sample
repeated or skipped, as far as the engine's numerics do not depend on the batch: the resumed
tokens are computed in other batches (the answer so far re-prefilled), and where bfloat16 GEMMs
round by batch shape (AVX512-BF16 CPUs; GPUs) a near tie can go the other way from there on.
With sampling the text still continues from the client's tokens; the speech is sampled again from
its start and only its part past what the client heard is sent, so it is continuous in length but
may change voice texture at the seam.

A request gets at most ``MAX_ATTEMPTS`` attempts: one that was being served by every replica that
died (a request that crashes its replica) fails with 503 rather than taking down every replica.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import msgspec

from omni_cache.wire.messages import Submit

if TYPE_CHECKING:
    import numpy as np

    from omni_cache.runtime.request_path.requests import Request

#: Attempts per request: the first, and two resumptions.
MAX_ATTEMPTS = 3


def next_attempt(req: Request, detokenize: Callable[[Sequence[int]], str]) -> None:
    """Make ``req``'s state that of a new attempt (call once its old attempt's stages were told
    to drop it): a new wire id, nothing finished or received yet, the client's tokens and samples
    to be skipped when the new attempt sends them again, its text decoded here from now on."""
    req.attempt += 1
    req.finished.clear()
    req.latents.clear()  # the new attempt sends every row and code from the start
    req.skip_tokens = len(req.answer_tokens)
    req.skip_samples = req.audio_samples
    if req.resumed_text is None:
        req.resumed_text = ResumedText(detokenize, req.answer_tokens[req.text_tokens :])


def resumed_prompt(req: Request, text_from_entry: bool) -> list[int]:
    """The prompt the entry stage is resumed with: the client's prompt, plus the answer tokens the
    client has when the entry stage writes the answer (else it starts the answer again)."""
    assert req.submit is not None
    tail = req.answer_tokens if text_from_entry else []
    return [*req.submit.prompt_token_ids, *tail]


def resumed_submit(req: Request, *, text_from_entry: bool, answer_finished: str | None) -> Submit:
    """The Submit of ``req``'s current attempt (call after ``req.attempt`` and ``req.route`` were
    set). ``answer_finished``: the entry stage's finish reason when it had finished the answer."""
    base = req.submit
    assert base is not None
    k = len(req.answer_tokens) if text_from_entry else 0
    left = base.sampling.max_tokens - k
    finish = answer_finished if k else None
    if k and left <= 0 and finish is None:
        finish = "length"  # every token was sent; the finished output was lost with the replica
    sampling = msgspec.structs.replace(base.sampling, max_tokens=1 if finish else left)
    return msgspec.structs.replace(
        base,
        request_id=req.wire_id,
        prompt_token_ids=resumed_prompt(req, text_from_entry),
        sampling=sampling,
        route=dict(req.route),
        resumed_tokens=k,
        answer_finished=finish or "",
    )


def new_tokens(req: Request, token_ids: Sequence[int]) -> list[int]:
    """Of an output's token ids, those the client does not have yet (recorded as sent)."""
    drop = min(req.skip_tokens, len(token_ids))
    req.skip_tokens -= drop
    fresh = list(token_ids[drop:])
    req.answer_tokens.extend(fresh)
    return fresh


def new_samples(req: Request, samples: np.ndarray) -> Any:
    """Of an output's audio samples, those the client does not have yet (counted as sent)."""
    drop = min(req.skip_samples, len(samples))
    req.skip_samples -= drop
    fresh = samples[drop:]
    req.audio_samples += len(fresh)
    return fresh


#: What U+FFFD at the end of a decoded text means: bytes that are not (yet) a whole character.
REPLACEMENT = "\ufffd"


class ResumedText:
    """The text of a resumed attempt's new tokens, written by the rule vLLM's incremental
    detokenizer follows for byte-level BPE (chat_stream.py): the text of the tokens since the last
    text written, once it does not end in the middle of a character; bytes still held back when
    the answer ends are not text. ``held``: the answer's last tokens whose text the client does not
    have yet (those after the last delta with text: ``Request.text_tokens``)."""

    def __init__(self, detokenize: Callable[[Sequence[int]], str], held: list[int]) -> None:
        self._detokenize = detokenize
        self._pending = list(held)

    def add(self, token_ids: Sequence[int]) -> str:
        """The text these new tokens complete ("" while it is held back)."""
        if not token_ids:
            return ""
        self._pending.extend(token_ids)
        text = self._detokenize(self._pending)
        if text.endswith(REPLACEMENT):
            return ""
        self._pending.clear()
        return text
