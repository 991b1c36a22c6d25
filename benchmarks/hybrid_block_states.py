"""Hybrid thinker block states: what they cost in prefill time and what they buy in hits.

    python -m benchmarks.hybrid_block_states [--model qwen3.5] [--rounds 7] [--traces 3] [--turns 10] [--json PATH]
    python -m benchmarks.hybrid_block_states --model qwen3.5 --cost-only [--cost-blocks 4,16,32] [--rounds 41]

Engines (in-process vLLM stages with the hidden-state cache on, as the thinker stage runs them;
the tiny hybrid and dense thinkers in bfloat16, as the shipped configs, block size picked by vLLM
for the hybrid and 32 for the dense thinker):
- `block_states`: this project's hybrid thinker, a recurrent state at every block boundary a
  prefill chunk crosses (scheduler/mamba_block_states.py, workers/models/gdn_block_states.py);
- `align`: the same model in vLLM 0.32's plain align mode (states only where a chunk ends);
- `split`: plain align mode with `max_num_batched_tokens` = the block size, so every prefill chunk
  ends on a block boundary: the obvious way to get the same states, and the baseline to beat;
- `fine`: block states plus vLLM's `prefix_match_unit: 32` (hashes every 32 tokens; vLLM then keeps
  a state at the prompt's last 32-token boundary too and hits there), the stretch toward finer hits;
- `dense`: the tiny dense thinker (block 32), for the hit rates a hybrid cannot reach at its block;
- `none`: the hybrid without prefix caching (every request computes its whole prompt).
`--model` picks the hybrid checkpoint: `thinker-hybrid` (Qwen3-Next, the default) or `qwen3.5`.

Part 1, prefill: a fresh 4-block prompt (nothing cached) per engine and round, engines interleaved
in a rotating order, time from submission to the first token (max_tokens=1). Then a request that
shares the first 2.5 blocks of it: the tokens it hits.
Part 2, agent trace: turn 1 is a 700-token prompt; every later turn resends the whole history plus
the model's answer (48 tokens) and a tool output of 100-600 tokens. Hit rate = tokens hit / prompt
tokens over turns 2-10; best = the longest block-aligned prefix shared with the previous turn
(everything the previous turn fed through the model, floored to the engine's block). TTFT per turn.
Part 3, fan-out: after turn 5 of each trace, four sibling requests resend the turn-5 history
(prompt + answer) with different tool outputs of 100-600 tokens, one at a time (parallel tool calls,
retries). Best = the shared history floored to the block; the first sibling can only hit what the
trace itself stored, the others also what earlier siblings stored.
Part 4, shared context: sub-agents that share a system prompt and document (3 blocks + 100 tokens)
and each add their own task of 500-1,000 tokens, one at a time, 3 groups of 4. Best = the shared
context floored to the block, for sub-agents 2-4. vLLM's align mode cannot hit for the second
sub-agent (no state inside the first one's chunk) and stops the second one's chunk at the branch,
which lets the third and fourth hit.
Memory: recurrent-state bytes held per cached token, from the engine's KV-cache spec.
`--cost-only`: the cost on a workload with no reuse instead (benchmarks/hybrid_cost.py): fresh prompts
of each `--cost-blocks` length, engines alternating ABAB/BABA, wall and CPU time, paired ratios.
Every engine runs on `--threads` compute threads (1: this process's CPU time is then the engine's).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from typing import Any

from benchmarks.harness import command_line, machine_info
from benchmarks.hybrid_cost import cost_lines, no_reuse_cost

PROMPT_BLOCKS = 4
ANSWER = 48
FIRST_TURN = 700


def _stage(model: str, *, block_states: bool = True, prefix_cache: bool = True, **engine_args: Any) -> Any:
    from omni_cache.tiny.checkpoints import ensure_checkpoint
    from workers.latent_capture import LatentOptions
    from workers.llm_stage import LLMStage

    args = dict(
        enforce_eager=True,
        gpu_memory_utilization=0.3,
        dtype="bfloat16",
        max_model_len=16384,
        kv_cache_memory_bytes=512 * 2**20,
        max_num_batched_tokens=8192,
    )
    if model != "thinker" and prefix_cache:
        args["prefix_cache_retention_interval"] = None  # as stage_configs/tiny_omni_hybrid.yaml
    if model == "qwen3.5":
        args["limit_mm_per_prompt"] = {"image": 0, "video": 0}  # text prompts only here
    args.update(engine_args)
    return LLMStage(
        str(ensure_checkpoint(model)),
        args,
        prefix_cache=prefix_cache,
        block_states=block_states,
        latents=LatentOptions(hidden=True, cache=prefix_cache),
    )


def _block(stage: Any) -> int:
    return stage.engine.vllm_config.cache_config.block_size


def ask(stage: Any, rid: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """Run one request alone; TTFT, hit tokens and the answer."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    cpu_start = time.process_time()
    start = time.perf_counter()
    stage.add(rid, {"prompt_token_ids": prompt}, params)
    ttft, ttft_cpu, tokens, hit = None, None, [], 0
    while stage.has_work():
        for out in stage.step():
            if out.error is not None:
                raise out.error
            if out.token_ids and ttft is None:
                ttft = time.perf_counter() - start
                ttft_cpu = time.process_time() - cpu_start
            tokens += out.token_ids
            hit = out.num_cached_tokens
    return {"ttft_s": ttft, "ttft_cpu_s": ttft_cpu, "hit": hit, "tokens": tokens}


def prefill(stages: dict[str, Any], rounds: int, seed: int) -> dict[str, Any]:
    rng = random.Random(f"prefill-{seed}")
    times: dict[str, list[float]] = {name: [] for name in stages}
    cpu: dict[str, list[float]] = {name: [] for name in stages}
    hits: dict[str, list[int]] = {name: [] for name in stages}
    branch_times: dict[str, list[float]] = {name: [] for name in stages}
    names = list(stages)
    for r in range(rounds + 1):  # round 0 warms each engine up and is not counted
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            B = _block(stages["align"])  # without prefix caching vLLM picks another block
            prompt = [rng.randrange(256) for _ in range(PROMPT_BLOCKS * B)]
            first = ask(stages[name], f"p{r}-{name}", prompt, 1)
            branch = prompt[: PROMPT_BLOCKS * B * 5 // 8] + [rng.randrange(256) for _ in range(64)]
            second = ask(stages[name], f"b{r}-{name}", branch, 1)
            if r:
                times[name].append(first["ttft_s"])
                cpu[name].append(first["ttft_cpu_s"])
                hits[name].append(second["hit"])
                branch_times[name].append(second["ttft_s"])
    med = {name: statistics.median(t) for name, t in times.items()}
    paired = lambda xs: {n: statistics.median(a / b for a, b in zip(xs[n], xs["align"])) for n in xs}  # noqa: E731
    return {
        "prompt_tokens": {n: PROMPT_BLOCKS * _block(stages["align"]) for n in stages},
        "prefill_s": times,
        "median_s": med,
        "prefill_cpu_s": cpu,
        "median_cpu_s": {name: statistics.median(t) for name, t in cpu.items()},
        "vs_align": {n: med[n] / med["align"] for n in med},
        # Median of the per-round ratios: each round's engines ran back to back, so a slow spell of
        # this shared VM hits both sides of a ratio. CPU time (this process) ignores time stolen.
        "paired_vs_align": paired(times),
        "paired_cpu_vs_align": paired(cpu),
        "branch_hit_tokens": hits,
        # The branch request's time to first token: a branching workload (it shares 2.5 blocks).
        "branch_ttft_s": branch_times,
        "branch_ttft_p50_s": {n: statistics.median(t) for n, t in branch_times.items()},
        "branch_paired_vs_align": paired(branch_times),
        "branch_best_tokens": {n: 2 * _block(stages["align"]) for n in stages},
    }


def agent_trace(
    stage: Any, traces: int, turns: int, seed: int, fan_out_at: int = 5, siblings: int = 4
) -> dict[str, Any]:
    B = _block(stage)
    per_turn: list[dict[str, Any]] = []
    fan: list[dict[str, Any]] = []
    for t in range(traces):
        rng = random.Random(f"trace-{seed}-{t}")
        prompt = [rng.randrange(256) for _ in range(FIRST_TURN)]
        fed = 0
        for turn in range(1, turns + 1):
            r = ask(stage, f"trace{t}-turn{turn}", prompt, ANSWER)
            best = min(fed // B * B, len(prompt) - 1) if turn > 1 else 0
            per_turn.append(
                {"trace": t, "turn": turn, "prompt": len(prompt), "hit": r["hit"], "best": best, "ttft_s": r["ttft_s"]}
            )
            fed = len(prompt) + len(r["tokens"]) - 1
            history = prompt + r["tokens"]
            if turn == fan_out_at:
                sib_rng = random.Random(f"siblings-{seed}-{t}")
                for i in range(siblings):
                    sibling = history + [sib_rng.randrange(256) for _ in range(sib_rng.randint(100, 600))]
                    s = ask(stage, f"trace{t}-sibling{i}", sibling, 1)
                    fan.append(
                        {
                            "trace": t,
                            "sibling": i,
                            "prompt": len(sibling),
                            "hit": s["hit"],
                            "best": len(history) // B * B,
                            "ttft_s": s["ttft_s"],
                        }
                    )
            prompt = history + [rng.randrange(256) for _ in range(rng.randint(100, 600))]
    later = [p for p in per_turn if p["turn"] > 1]
    prompt_tokens = sum(p["prompt"] for p in later)
    return {
        "block_size": B,
        "turns": per_turn,
        "hit_rate": sum(p["hit"] for p in later) / prompt_tokens,
        "best_rate": sum(p["best"] for p in later) / prompt_tokens,
        "turns_at_best": sum(p["hit"] == p["best"] for p in later),
        "turns_counted": len(later),
        "mean_ttft_s": statistics.mean(p["ttft_s"] for p in later),
        "fan_out": fan,
        "fan_out_hit_rate": sum(f["hit"] for f in fan) / sum(f["prompt"] for f in fan),
        "fan_out_best_rate": sum(f["best"] for f in fan) / sum(f["prompt"] for f in fan),
        "fan_out_at_best": sum(f["hit"] == f["best"] for f in fan),
        "fan_out_mean_ttft_s": statistics.mean(f["ttft_s"] for f in fan),
    }


def shared_context(stage: Any, groups: int, agents: int, seed: int) -> dict[str, Any]:
    B = _block(stage)
    rows = []
    for grp in range(groups):
        rng = random.Random(f"context-{seed}-{grp}")
        context = [rng.randrange(256) for _ in range(3 * 384 + 100)]
        for a in range(agents):
            prompt = context + [rng.randrange(256) for _ in range(rng.randint(500, 1000))]
            r = ask(stage, f"group{grp}-agent{a}", prompt, 1)
            rows.append(
                {
                    "group": grp,
                    "agent": a,
                    "prompt": len(prompt),
                    "hit": r["hit"],
                    "best": len(context) // B * B if a else 0,
                    "ttft_s": r["ttft_s"],
                }
            )
    later = [r for r in rows if r["agent"]]
    return {
        "block_size": B,
        "requests": rows,
        "hit_rate": sum(r["hit"] for r in later) / sum(r["prompt"] for r in later),
        "best_rate": sum(r["best"] for r in later) / sum(r["prompt"] for r in later),
        "at_best": sum(r["hit"] == r["best"] for r in later),
        "counted": len(later),
        "mean_ttft_s": statistics.mean(r["ttft_s"] for r in later),
    }


def state_memory(stage: Any) -> dict[str, Any]:
    """Bytes of recurrent state per cached token when every block holds a state."""
    from vllm.v1.kv_cache_interface import MambaSpec

    config = stage.scheduler.kv_cache_config
    B = _block(stage)
    mamba = [g.kv_cache_spec for g in config.kv_cache_groups if isinstance(g.kv_cache_spec, MambaSpec)]
    layers = sum(len(g.layer_names) for g in config.kv_cache_groups if isinstance(g.kv_cache_spec, MambaSpec))
    attention = [g for g in config.kv_cache_groups if not isinstance(g.kv_cache_spec, MambaSpec)]
    attn_layers = sum(len(g.layer_names) for g in attention)
    spec = mamba[0]
    return {
        "block_size": B,
        "gdn_layers": layers,
        "state_bytes": spec.real_page_size_bytes,
        "page_bytes": spec.page_size_bytes,
        "state_bytes_per_token": layers * spec.page_size_bytes / B,
        "attention_kv_bytes_per_token": attn_layers * attention[0].kv_cache_spec.page_size_bytes / B,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7, help="prefill rounds per engine (after a warm-up)")
    parser.add_argument("--traces", type=int, default=3, help="agent traces per engine")
    parser.add_argument("--turns", type=int, default=10, help="turns per agent trace")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write all figures here")
    parser.add_argument("--prefill-only", action="store_true", help="skip the agent traces")
    parser.add_argument(
        "--engines",
        default="block_states,align,split,fine",
        help="engines of the prefill part or of --cost-only (comma-separated; align is always run)",
    )
    parser.add_argument(
        "--model", default="thinker-hybrid", choices=("thinker-hybrid", "qwen3.5"), help="the hybrid checkpoint"
    )
    parser.add_argument(
        "--cost-only", action="store_true", help="only the no-reuse cost: fresh prompts of each --cost-blocks length"
    )
    parser.add_argument("--cost-blocks", default="4,16,32", help="prompt lengths of --cost-only, in blocks")
    parser.add_argument("--threads", type=int, default=1, help="torch compute threads of the engines")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)  # before vLLM's CPU worker pins it

    result: dict[str, Any] = {"machine": machine_info(), "command": command_line("benchmarks.hybrid_block_states")}
    engines = set(args.engines.split(",")) | {"align"}
    if not (args.prefill_only or args.cost_only):
        engines |= {"block_states", "fine", "dense"}  # the agent traces use them
    model = args.model
    result["model"] = model
    hybrid = {"align": _stage(model, block_states=False)}
    assert not hybrid["align"].scheduler.block_states
    B = _block(hybrid["align"])
    if "block_states" in engines:
        hybrid["block_states"] = _stage(model)
        assert hybrid["block_states"].scheduler.block_states
    if "split" in engines:
        hybrid["split"] = _stage(model, block_states=False, max_num_batched_tokens=B)
    if "fine" in engines:
        hybrid["fine"] = _stage(model, prefix_match_unit=32)
    if "none" in engines:
        hybrid["none"] = _stage(model, prefix_cache=False)
    if args.cost_only:
        lengths = [int(b) * B for b in args.cost_blocks.split(",")]
        run = lambda name, rid, prompt: ask(hybrid[name], rid, prompt, 1)  # noqa: E731
        result["cost"] = no_reuse_cost(run, list(hybrid), lengths, args.rounds, args.seed)
        result["cost"]["threads"] = torch.get_num_threads()
        print("\n".join(cost_lines(result["cost"], B)))
        return _finish(result, args.json)
    result["prefill"] = prefill(hybrid, args.rounds, args.seed)
    p = result["prefill"]
    print(f"prefill of {PROMPT_BLOCKS} x {B} tokens, median of {args.rounds} (s):")
    for name in result["prefill"]["median_s"]:
        print(
            f"  {name:13s} {p['median_s'][name]:.3f}  x{p['vs_align'][name]:.3f} of align "
            f"(paired x{p['paired_vs_align'][name]:.3f}, CPU time paired x{p['paired_cpu_vs_align'][name]:.3f})   "
            f"branch at 2.5 blocks hits {p['branch_hit_tokens'][name]} (best {2 * B}), "
            f"its TTFT p50 {p['branch_ttft_p50_s'][name]:.3f} s "
            f"(paired x{p['branch_paired_vs_align'][name]:.3f} of align)"
        )
    if "block_states" in hybrid:
        result["memory"] = state_memory(hybrid["block_states"])
        print("memory:", result["memory"])
    hybrid.pop("split", None)
    if args.prefill_only:
        hybrid = {}

    result["agent"] = {}
    if hybrid and "dense" in engines:
        hybrid["dense"] = _stage("thinker", block_size=32)
    for name in hybrid:
        a = agent_trace(hybrid[name], args.traces, args.turns, args.seed)
        result["agent"][name] = a
        print(
            f"agent trace {name:13s} block {a['block_size']:4d}: hit rate {a['hit_rate']:.3f} "
            f"(best {a['best_rate']:.3f}, {a['turns_at_best']}/{a['turns_counted']} turns at best), "
            f"mean TTFT turns 2-{args.turns} {a['mean_ttft_s']:.3f} s"
        )
        print(
            f"  fan-out: hit rate {a['fan_out_hit_rate']:.3f} (best {a['fan_out_best_rate']:.3f}, "
            f"{a['fan_out_at_best']}/{len(a['fan_out'])} at best), mean TTFT {a['fan_out_mean_ttft_s']:.3f} s"
        )
        c = shared_context(hybrid[name], 3, 4, args.seed)
        a["shared_context"] = c
        print(
            f"  shared context: hit rate {c['hit_rate']:.3f} (best {c['best_rate']:.3f}, "
            f"{c['at_best']}/{c['counted']} at best), mean TTFT {c['mean_ttft_s']:.3f} s"
        )
    return _finish(result, args.json)


def _finish(result: dict[str, Any], path: str | None) -> int:
    result["machine"]["loadavg_end"] = list(os.getloadavg())
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
