"""Write a workload's prompts as a ``vllm bench serve --dataset-name custom`` JSONL file, so that
vLLM's load generator and ``python -m benchmarks`` send the same text::

    python -m benchmarks.export_prompts --shared-tokens 2000 --unique-tokens 100 --num-requests 16 \\
        --max-tokens 32 --out prompts.jsonl

One line per measured request of the single-turn workloads (``shared-prefix``, ``zero-reuse``):
``{"prompt": system + user, "output_tokens": max_tokens}``, the harness's own seeded stream. vLLM's
openai-chat backend sends a prompt as one user message, so the system text is folded into it; with
the byte-level tiny tokenizer the prompt is then a few template tokens shorter than the harness's
(system + user messages) and its shared part is the same text. Use ``--skip-chat-template``
(the server applies the chat template). ``--num-warmups 1`` warms the server with the first line
(the harness warms up with a request of its own that carries the same shared prefix).
"""

from __future__ import annotations

import argparse
import json
import sys

from benchmarks.workloads import Sizes, build_workload


def prompts(workload: str, sizes: Sizes, seed: int) -> list[dict[str, object]]:
    """The JSONL rows: the measured requests, as the harness sends them."""
    _, sessions = build_workload(workload, sizes, seed)
    return [{"prompt": s.system + s.users[0], "output_tokens": s.max_tokens} for s in sessions]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.export_prompts", description=__doc__.split("\n")[0])
    p.add_argument("--workload", choices=("shared-prefix", "zero-reuse"), default="shared-prefix")
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--shared-tokens", type=int, default=2000)
    p.add_argument("--unique-tokens", type=int, default=100)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="the JSONL file to write")
    args = p.parse_args(argv)
    sizes = Sizes(
        num_requests=args.num_requests,
        shared_tokens=args.shared_tokens,
        unique_tokens=args.unique_tokens,
        max_tokens=args.max_tokens,
    )
    try:
        rows = prompts(args.workload, sizes, args.seed)
    except ValueError as e:
        print(f"benchmarks.export_prompts: {e}", file=sys.stderr)
        return 2
    with open(args.out, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    print(f"wrote {len(rows)} prompts to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
