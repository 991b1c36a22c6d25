"""GPU: block-boundary states from GatedDeltaNet's chunk kernel, checked and timed (device tool).

    python -m benchmarks.gdn_kernel_states --fla DIR [--json PATH]

DIR holds the `fla` package of flash-linear-attention (the kernel vLLM vendors for GatedDeltaNet
prefill on CUDA; vLLM itself cannot be installed on the lent GPU machines, so its vendored copy
cannot be imported there). Nothing of it is in this repository: the device run carries it from a
checkout (docs/benchmarks.md has the command).

For a varlen batch of prefill sequences (bfloat16 q, k, v; float32 log-decays g; random float32
initial states) with block boundaries every `block` tokens:
- correctness: states taken from the kernel's per-chunk `h` at the boundaries
  (benchmarks/gdn_chunk_states.py) against a float32 token-by-token recurrence of the gated
  delta rule from the same initial states; also the kernel's output against the recurrence's;
- cost: median time of fla's `chunk_gated_delta_rule_fwd` (what vLLM runs: no states kept) against
  the same kernels composed here so that `h` is kept and the boundary states are copied into a
  state pool (CUDA events, interleaved, after warm-up).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from benchmarks.gdn_chunk_states import CHUNK, chunk_state_rows, store_chunk_states


def recurrence(q, k, v, g, beta, h0, scale, keep):
    """float32 gated delta rule, one token at a time, one sequence. q,k: [T,H,K]; v: [T,H,V].
    Returns the outputs and the states after the token counts in `keep`."""
    S = h0.float().clone()  # [H, K, V]
    states, out = {}, torch.empty(v.shape, dtype=torch.float32, device=v.device)
    for t in range(q.shape[0]):
        S = S * g[t].float().exp()[:, None, None]
        kt, vt = k[t].float(), v[t].float()
        delta = beta[t].float()[:, None] * (vt - torch.einsum("hk,hkv->hv", kt, S))
        S = S + kt[:, :, None] * delta[:, None, :]
        out[t] = torch.einsum("hk,hkv->hv", q[t].float() * scale, S)
        if t + 1 in keep:
            states[t + 1] = S
    return out, states


def make_inputs(seq_lens, heads, dim, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    T = sum(seq_lens)
    rand = lambda *s, dtype=torch.bfloat16: torch.randn(*s, generator=gen, device="cuda", dtype=torch.float32).to(dtype)  # noqa: E731
    q = torch.nn.functional.normalize(rand(1, T, heads, dim, dtype=torch.float32), dim=-1).to(torch.bfloat16)
    k = torch.nn.functional.normalize(rand(1, T, heads, dim, dtype=torch.float32), dim=-1).to(torch.bfloat16)
    v = rand(1, T, heads, dim)
    g = torch.nn.functional.logsigmoid(rand(1, T, heads, dtype=torch.float32) + 4)  # decays near 1
    beta = rand(1, T, heads, dtype=torch.float32).sigmoid().to(torch.bfloat16)
    h0 = rand(len(seq_lens), heads, dim, dim, dtype=torch.float32) * 0.1
    cu = torch.tensor([0, *torch.tensor(seq_lens).cumsum(0).tolist()], device="cuda", dtype=torch.long)
    return q, k, v, g, beta, h0, cu


def forward_with_states(ops, q, k, v, g, beta, scale, h0, cu, chunk_indices):
    """fla's chunk forward, composed from its stages so that `h` (per-chunk states) is returned."""
    g = ops["cumsum"](g, chunk_size=CHUNK, scale=ops["RCP_LN2"], cu_seqlens=cu, chunk_indices=chunk_indices)
    w, u, _ = ops["intra"](k=k, v=v, g=g, beta=beta, cu_seqlens=cu, chunk_indices=chunk_indices, chunk_size=CHUNK)
    h, v_new, final = ops["fwd_h"](
        k=k,
        w=w,
        u=u,
        g=g,
        initial_state=h0,
        output_final_state=True,
        cu_seqlens=cu,
        chunk_indices=chunk_indices,
        chunk_size=CHUNK,
    )
    o = ops["fwd_o"](
        q=q, k=k, v=v_new, h=h, g=g, scale=scale, cu_seqlens=cu, chunk_indices=chunk_indices, chunk_size=CHUNK
    )
    return o, final, h


def load_fla(path: str) -> dict:
    sys.path.insert(0, path)
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h
    from fla.ops.common.chunk_o import chunk_fwd_o
    from fla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule_fwd
    from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_intra
    from fla.ops.utils import chunk_local_cumsum
    from fla.ops.utils.constant import RCP_LN2
    from fla.ops.utils.index import prepare_chunk_indices

    return {
        "fwd": chunk_gated_delta_rule_fwd,
        "fwd_h": chunk_gated_delta_rule_fwd_h,
        "fwd_o": chunk_fwd_o,
        "intra": chunk_gated_delta_rule_fwd_intra,
        "cumsum": chunk_local_cumsum,
        "RCP_LN2": RCP_LN2,
        "chunk_indices": prepare_chunk_indices,
    }


def rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def case(ops, seq_lens, block, heads, dim, reps, check, seed=0):
    q, k, v, g, beta, h0, cu = make_inputs(seq_lens, heads, dim, seed)
    scale = dim**-0.5
    chunk_indices = ops["chunk_indices"](cu, CHUNK)
    boundaries = [list(range(block, n, block)) for n in seq_lens]
    rows = torch.tensor(chunk_state_rows(seq_lens, boundaries), device="cuda")  # once per step
    pool = torch.zeros(len(rows) + 1, heads, dim, dim, device="cuda", dtype=torch.bfloat16)
    blocks = torch.arange(1, len(rows) + 1, device="cuda")
    out = {"seq_lens": seq_lens, "block": block, "heads": heads, "dim": dim, "boundaries": len(rows)}

    o, final, h = forward_with_states(ops, q, k, v, g, beta, scale, h0, cu, chunk_indices)
    store_chunk_states(h, rows, pool, blocks)
    ref_o = ops["fwd"](q, k, v, g, beta, scale, h0, True, cu_seqlens=cu, chunk_indices=chunk_indices)[1]
    out["composed_vs_fla_output_rel"] = rel(o, ref_o)
    if check:
        errs, out_errs, final_errs = [], [], []
        i = 0
        for s, n in enumerate(seq_lens):
            a, b = int(cu[s]), int(cu[s + 1])
            r_out, r_states = recurrence(
                q[0, a:b], k[0, a:b], v[0, a:b], g[0, a:b], beta[0, a:b], h0[s], scale, {*boundaries[s], n}
            )
            for offset in boundaries[s]:
                errs.append(rel(pool[blocks[i]], r_states[offset]))
                i += 1
            out_errs.append(rel(o[0, a:b], r_out))
            final_errs.append(rel(final[s], r_states[n]))
        out.update(
            state_rel_max=max(errs),
            state_rel_median=statistics.median(errs),
            output_rel_max=max(out_errs),
            final_state_rel_max=max(final_errs),
        )

    def timed(fn):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end)

    plain = lambda: ops["fwd"](q, k, v, g, beta, scale, h0, True, cu_seqlens=cu, chunk_indices=chunk_indices)  # noqa: E731
    composed = lambda: forward_with_states(ops, q, k, v, g, beta, scale, h0, cu, chunk_indices)  # noqa: E731

    def with_states():
        *_, hh = forward_with_states(ops, q, k, v, g, beta, scale, h0, cu, chunk_indices)
        store_chunk_states(hh, rows, pool, blocks)

    times = {"fla_fwd": [], "composed": [], "composed_with_states": []}
    for _ in range(5):
        plain(), composed(), with_states()
    for r in range(reps):
        fns = [("fla_fwd", plain), ("composed", composed), ("composed_with_states", with_states)]
        for name, fn in fns[r % 3 :] + fns[: r % 3]:
            times[name].append(timed(fn))
    med = {name: statistics.median(t) for name, t in times.items()}
    out["median_ms"] = med
    out["with_states_over_fla"] = med["composed_with_states"] / med["fla_fwd"]
    out["with_states_over_composed"] = med["composed_with_states"] / med["composed"]
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fla", required=True, help="directory holding the fla package")
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    ops = load_fla(args.fla)
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "cases": [],
    }
    # Qwen3-Next-80B's GatedDeltaNet per GPU at TP 1: 32 value heads (keys repeated to match), 128.
    for seq_lens, block, check in (
        ([4096, 2048, 1536, 512], 512, True),
        ([16384], 1024, False),
        ([1024] * 8, 256, False),
    ):
        c = case(ops, seq_lens, block, 32, 128, args.reps, check)
        result["cases"].append(c)
        print(json.dumps(c))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
