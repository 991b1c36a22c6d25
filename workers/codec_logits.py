"""The codec talkers' logits rules, as transformers' reference `generate` applies them.

Two rules, on the first codebook's logits, per request (a vLLM logits processor, the engine's
documented extension point, registered through the `logits_processors` engine argument):
- a repetition penalty over the codes this request generated so far (transformers' rule: a
  positive logit is divided by the penalty, a negative one multiplied). vLLM's own
  `repetition_penalty` also counts the prompt's token ids, which a prompt of embeddings does not
  have (vLLM would read whatever ids its batch slot held before), so it cannot be used here;
- suppressed ids: the talker's vocabulary ends with 1,024 control codes that are never sampled,
  except the end-of-speech code.

Qwen2.5-Omni's talker (`omni_cache.models.qwen2_5_omni_talker_input.talker_logits`) uses
the same two rules with other arguments: its reference penalises the ids of its prompt as well
(codec mask, pad and bos: `prompt_ids`), and suppresses only codec bos.

A request opts in through `SamplingParams.extra_args` (`omni_cache.handoff.codec_logits_args`;
the stage's hand-off fills it from the checkpoint).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

from omni_cache.handoff import CODEC_LOGITS_KEY


class CodecLogits(AdapterLogitsProcessor):
    def is_argmax_invariant(self) -> bool:
        return False

    def new_req_logits_processor(self, params: Any) -> Any:
        args = (params.extra_args or {}).get(CODEC_LOGITS_KEY)
        if not args:
            return None
        first, end = args["suppress"]
        suppressed = torch.ones(end - first, dtype=torch.bool)
        for keep in args["keep"]:
            if first <= keep < end:
                suppressed[keep - first] = False
        ids = torch.arange(first, end)[suppressed]
        return partial(_apply, float(args["penalty"]), ids, frozenset(args.get("prompt_ids", ())))


def _apply(
    penalty: float, suppressed: torch.Tensor, prompt_ids: frozenset[int], output_ids: list[int], logits: torch.Tensor
) -> torch.Tensor:
    if penalty != 1.0 and (output_ids or prompt_ids):
        seen = torch.tensor(sorted(prompt_ids.union(output_ids)), dtype=torch.long, device=logits.device)
        scores = logits[seen]
        logits[seen] = torch.where(scores < 0, scores * penalty, scores / penalty)
    logits[suppressed.to(logits.device)] = float("-inf")
    return logits
