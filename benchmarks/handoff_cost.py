"""Per-message cost of the thinker -> talker hand-off on the talker's side (CPU, no engines).

    .venv/bin/python -m benchmarks.handoff_cost [--hidden 2048] [--prompts 1024,4096,16384]

For each prompt length: the thinker's first message carries the prompt's hidden rows, then one
message per generated token carries one row. Per message the talker appends the rows and runs
`thinker_to_talker` (which starts a segment every SEGMENT_TOKENS rows and projects only the new
rows). Timed per message after the first (median): `buffer` is what the talker does (LatentBuffer: rows
appended in place, the hand-off reads views); `concat` re-concatenates every row received so far
for every message (what `LatentRows.all()` per message did), for comparison.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from omni_cache.cache.latent_rows import LatentBuffer, LatentChunk, LatentRows
from omni_cache.handoff import HandoffContext, Upstream, thinker_to_talker

TALKER_HIDDEN = 1024  # Qwen3-Omni's talker width


def run(prompt: int, hidden: int, messages: int, mode: str) -> float:
    """Median seconds per message (messages after the prompt's). The median leaves out the one
    message that starts the first talker segment, which projects the whole prompt once."""
    ctx = HandoffContext(model_path=None)
    gen = torch.Generator().manual_seed(0)
    ctx.resources["projection"] = (
        torch.randn(TALKER_HIDDEN, hidden, generator=gen, dtype=torch.float64) / hidden**0.5,
        torch.zeros(TALKER_HIDDEN, dtype=torch.float64),
        {},
    )
    rows = torch.randn(prompt + messages, hidden, generator=gen).to(torch.bfloat16)
    up = Upstream("thinker", [], {}, prompt, False)
    state: dict = {}
    held: LatentBuffer | LatentRows = LatentBuffer(("hidden",)) if mode == "buffer" else LatentRows(("hidden",))
    times = []
    for i in range(messages + 1):
        start, n = (0, prompt) if i == 0 else (prompt + i - 1, 1)
        chunk = LatentChunk(start, {"hidden": rows[start : start + n].clone()})
        t0 = time.perf_counter()
        held.add(chunk)
        up.latents = held.view() if mode == "buffer" else held.all()
        up.finished = i == messages
        thinker_to_talker(ctx, up, state)
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.handoff_cost", description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--prompts", default="1024,4096,16384")
    parser.add_argument("--messages", type=int, default=64, help="messages after the prompt's")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(
        f"hidden {args.hidden} (bf16), talker width {TALKER_HIDDEN}, {args.messages} messages "
        "of one row after the prompt's; median per message"
    )
    print(f"{'prompt tokens':>14} {'buffer (ms)':>12} {'concat (ms)':>12}")
    for prompt in (int(p) for p in args.prompts.split(",")):
        buffer = run(prompt, args.hidden, args.messages, "buffer")
        concat = run(prompt, args.hidden, args.messages, "concat")
        print(f"{prompt:>14} {buffer * 1e3:>12.3f} {concat * 1e3:>12.3f}")


if __name__ == "__main__":
    main()
