"""A turn's audio as adjacent encoder-window chunk items in vLLM's Qwen3-Omni thinker (issue 51).

On the tiny checkpoint (``tiny:qwen3-omni``, float32, this project's thinker class registered), for
turns of ``--seconds``:

* ``whole``: the prompt holds the turn as one audio item (``audio_start pad audio_end``), as before;
* ``chunked``: the same turn cut every ``--chunk-frames`` mel frames (800 = n_window_infer, 8 s),
  one item per chunk, their single ``audio_pad`` placeholders adjacent inside one span (vLLM expands
  each to its item's length). Checked: the expanded prompt's token ids equal ``whole``'s; the
  greedy answer and the log-probabilities of the prompt's text after the audio and of the answer
  are compared with ``whole``'s (max |diff|);
* ``listened``: a prefill-only request first (``max_tokens=1``, output dropped) whose prompt is
  the conversation up to the last complete chunk (what is prefilled while the user speaks), then
  the chunked request: its ``num_cached_tokens`` (the prefix cache's hit) and whether its greedy
  answer and the answer's log-probabilities are bitwise those of the cold chunked request.

    PYTHONPATH=. VLLM_ENABLE_V1_MULTIPROCESSING=0 .venv/bin/python -m benchmarks.chunked_audio_vllm
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import numpy as np

from benchmarks.chunked_audio_exactness import RATE, chunk_bounds, speech_audio

ANSWER_TOKENS = 12


def _prompt_ids(tok: Any, n_items: int, history: list[dict] | None = None) -> list[int]:
    messages = list(history or []) + [
        {"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": "What did I say?"}]}
    ]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if not isinstance(ids, list):  # a BatchEncoding
        ids = list(ids["input_ids"])
    pad = tok.convert_tokens_to_ids("<|audio_pad|>")
    at = len(ids) - 1 - ids[::-1].index(pad)  # the new turn's placeholder: the last one
    return ids[:at] + [pad] * n_items + ids[at + 1 :]


def _run(
    llm: Any, prompt_ids: list[int], clips: list[np.ndarray], max_tokens: int, tag: str, prompt_logprobs: bool = True
) -> Any:
    from vllm import SamplingParams

    # A request asking for prompt log-probabilities does not read the prefix cache (vLLM computes
    # its whole prompt), so the listened request asks only for the answer's.
    sp = SamplingParams(
        temperature=0.0,
        max_tokens=max_tokens,
        logprobs=1,
        prompt_logprobs=1 if prompt_logprobs else None,
        ignore_eos=True,
    )
    uuids = [f"{tag}-{i}-{hash(c.tobytes())}" for i, c in enumerate(clips)]
    (out,) = llm.generate(
        {
            "prompt_token_ids": prompt_ids,
            "multi_modal_data": {"audio": [(c, RATE) for c in clips]},
            "multi_modal_uuids": {"audio": uuids},
        },
        sp,
        use_tqdm=False,
    )
    return out


def _logprobs(out: Any) -> tuple[list[float], list[float]]:
    ids = out.prompt_token_ids
    prompt = [lp[t].logprob for t, lp in zip(ids[1:], (out.prompt_logprobs or [])[1:])]
    answer = [lp[t].logprob for t, lp in zip(out.outputs[0].token_ids, out.outputs[0].logprobs)]
    return prompt, answer


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, nargs="+", default=[2.0, 9.0, 16.0, 30.0])
    p.add_argument("--chunk-frames", type=int, default=800)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM

    from omni_cache.tiny import checkpoints as ck
    from omni_cache.tiny.registry import resolve_checkpoint_dir

    path = ck.ensure_checkpoint("qwen3-omni", resolve_checkpoint_dir())
    llm = LLM(
        model=str(path),
        dtype="float32",
        enforce_eager=True,
        block_size=32,
        gpu_memory_utilization=0.3,
        max_model_len=2048,
        max_num_seqs=4,
        seed=0,
        kv_cache_memory_bytes=2**30,
        enable_prefix_caching=True,
        limit_mm_per_prompt={"image": 0, "audio": 8, "video": 0},
    )
    tok = llm.get_tokenizer()
    pad = tok.convert_tokens_to_ids("<|audio_pad|>")
    rows = []
    for seconds in args.seconds:
        audio = speech_audio(seconds, seed=int(seconds * 10) + 1)
        bounds = chunk_bounds(len(audio), args.chunk_frames)
        chunks = [audio[a:b] for a, b in bounds]
        tag = f"s{seconds}"
        llm.reset_prefix_cache()
        whole = _run(llm, _prompt_ids(tok, 1), [audio], ANSWER_TOKENS, tag + "w")
        llm.reset_prefix_cache()
        chunked = _run(llm, _prompt_ids(tok, len(chunks)), chunks, ANSWER_TOKENS, tag + "c")
        wp, wa = _logprobs(whole)
        cp, ca = _logprobs(chunked)
        n_audio = whole.prompt_token_ids.count(pad)
        after = whole.prompt_token_ids.index(pad) + n_audio  # audio_end and the text after it
        row: dict[str, Any] = {
            "seconds": seconds,
            "chunks": len(chunks),
            "audio_tokens": n_audio,
            "prompt_tokens": len(whole.prompt_token_ids),
            "token_ids_equal": whole.prompt_token_ids == chunked.prompt_token_ids,
            "greedy_answer_equal": list(whole.outputs[0].token_ids) == list(chunked.outputs[0].token_ids),
            "text_after_audio_logprob_max_abs_diff": float(
                np.max(np.abs(np.subtract(wp[after - 1 :], cp[after - 1 :])))
            ),
            "answer_logprob_max_abs_diff": float(np.max(np.abs(np.subtract(wa, ca)))),
        }
        if len(chunks) > 1:
            # While the user speaks: the conversation up to the last complete chunk, prefilled.
            done = len(chunks) - 1
            ids = _prompt_ids(tok, len(chunks))
            first_pad = ids.index(pad)
            listen_ids = ids[: first_pad + done]
            llm.reset_prefix_cache()
            _run(llm, listen_ids, chunks[:done], 1, tag + "c", prompt_logprobs=False)
            listened = _run(llm, _prompt_ids(tok, len(chunks)), chunks, ANSWER_TOKENS, tag + "c", prompt_logprobs=False)
            _, la = _logprobs(listened)
            row.update(
                {
                    "listened_prefill_tokens": first_pad + done * 104,
                    "listened_cached_tokens": listened.num_cached_tokens,
                    "listened_answer_bitwise_equal": list(listened.outputs[0].token_ids)
                    == list(chunked.outputs[0].token_ids)
                    and la == ca,
                    "listened_answer_logprob_max_abs_diff": float(np.max(np.abs(np.subtract(la, ca)))),
                }
            )
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
