"""Hybrid thinker (Qwen3-Next: GatedDeltaNet + attention): prefix hits at every block boundary an
earlier request passed through, not only where its prefill chunk ended.

Each workload below is one row of the issue's table; "best" is the longest block-aligned prefix
shared with an earlier request (B = the block size vLLM picks for the tiny hybrid on this CPU: 384 on
an AVX2-only AMD EPYC, 640 on others). vLLM 0.32's plain align mode gets 0 on the first two rows
(benchmarks/hybrid_block_states.py measures it beside this). Every answer is also checked against a
cache-off engine, row by row (HYBRID_ROW_RTOL, test_hidden_cache.py), and the rows a hit served must
be bitwise the first computation's. The stored states themselves are compared with a float32,
token-by-token (recurrent) run of transformers' Qwen3-Next on the same checkpoint: relative error
<= STATE_RTOL; measured 0.2%-1.4% (the engine runs bfloat16), while the states of neighbouring
boundaries differ by far more (checked, so the comparison can tell positions apart).
"""

from __future__ import annotations

import random

import pytest
import torch
from thinker_harness import close, comparable_rows, make_stage, run
from thinker_pair import HYBRID, HYBRID_ROW_RTOL, HYBRID_TIE_MARGIN, assert_bitwise, assert_close, row_errors

from omni_cache.tiny.checkpoints import ensure_checkpoint

# Starts two in-process vLLM engines (the module fixture): skipped by -m "not vllm".
pytestmark = pytest.mark.vllm

STATE_RTOL = 2.0**-5
# One chunk holds every prompt here, so a single-chunk prefill is what is tested.
ENGINE = dict(HYBRID, max_num_batched_tokens=8192)


class Hybrid:
    def __init__(self) -> None:
        self.on = make_stage("thinker-hybrid", cache=True, **ENGINE)
        self.off = make_stage("thinker-hybrid", cache=False, **ENGINE)
        assert self.on.scheduler.block_states, "block states should be on for the tiny hybrid"
        self.B = self.on.engine.vllm_config.cache_config.block_size

    def ask(self, rid: str, prompt: list[int], max_tokens: int = 4, check_from: int = 0):
        """One request through the cache-on engine, its rows from `check_from` on checked against
        the cache-off engine."""
        on = run(self.on, {rid: prompt}, max_tokens)[rid]
        off = run(self.off, {rid: prompt}, max_tokens)[rid]
        assert_close(on, off, rid, HYBRID_ROW_RTOL, HYBRID_TIE_MARGIN, check_from)
        return on


@pytest.fixture(scope="module")
def hybrid():
    h = Hybrid()
    yield h
    close(h.on)
    close(h.off)


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(256) for _ in range(n)]


def test_branches_after_a_shared_prefix_hit_at_the_branch(hybrid):
    B, rng = hybrid.B, random.Random(11)
    shared = tokens(rng, 2 * B + 1)
    first = hybrid.ask("branch0", shared + tokens(rng, B))
    assert first.num_cached_tokens == 0
    for i in (1, 2):
        r = hybrid.ask(f"branch{i}", shared + tokens(rng, B + 17 * i))
        # vLLM 0.32 align mode: 0 for the second request (no state inside request 1's chunk).
        assert r.num_cached_tokens == 2 * B, f"request {i + 1}: hit {r.num_cached_tokens}, best {2 * B}"
        assert_bitwise(r.latents, first.latents, 2 * B, f"branch {i} vs first")


def test_partial_overlap_hits_the_last_shared_boundary(hybrid):
    B, rng = hybrid.B, random.Random(12)
    first = tokens(rng, 5 * B)
    a = hybrid.ask("overlap_a", first)
    b = hybrid.ask("overlap_b", first[: 5 * B // 2] + tokens(rng, B))
    assert b.num_cached_tokens == 2 * B, f"hit {b.num_cached_tokens}, best {2 * B}"
    assert_bitwise(b.latents, a.latents, 2 * B, "overlap vs first")


def test_multi_turn_hits_the_best_block_each_turn(hybrid):
    """Rows a hit serves here were computed by the previous turn's decode steps: they are checked
    bitwise against that computation (itself checked against the cache-off engine's decode). The
    cache-off engine recomputes them by prefill, and in bfloat16 vLLM's GDN decode and prefill
    kernels differ by up to 6.7% on single rows (seen in plain vLLM align mode too, block states
    off), so only the rows this turn computes are compared with the cache-off engine."""
    B, rng = hybrid.B, random.Random(13)
    answer_len = 64
    prompt = tokens(rng, B + 100)
    previous = hybrid.ask("turn1", prompt, max_tokens=answer_len)
    for turn in (2, 3, 4):
        # The previous turn fed its prompt and all but its last answer token through the model.
        fed = len(prompt) + answer_len - 1
        prompt = prompt + previous.token_ids + tokens(rng, 200)
        best = fed // B * B
        r = hybrid.ask(f"turn{turn}", prompt, max_tokens=answer_len, check_from=best)
        assert r.num_cached_tokens == best, f"turn {turn}: hit {r.num_cached_tokens}, best {best}"
        assert_bitwise(r.latents, previous.latents, best, f"turn {turn} vs turn {turn - 1}")
        previous = r


def test_concurrent_prefills_store_their_boundaries(hybrid):
    """Several prefills (and a decode) share steps; each one's boundaries serve a later branch."""
    B, rng = hybrid.B, random.Random(14)
    long_ = {f"c{i}": tokens(rng, (2 + i) * B + 30) for i in range(3)}
    from vllm import SamplingParams

    hybrid.on.add(
        "decoding",
        {"prompt_token_ids": tokens(rng, 50)},
        SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
    )
    hybrid.on.step()  # its prefill; it decodes while the long prompts prefill
    first = run(hybrid.on, long_, background=("decoding",))
    for rid, prompt in long_.items():
        depth = len(prompt) // B * B - B  # a boundary inside that prompt's chunk
        r = hybrid.ask(f"{rid}_branch", prompt[: depth + 5] + tokens(rng, 40))
        assert r.num_cached_tokens == depth, f"{rid}: hit {r.num_cached_tokens}, best {depth}"
        assert_bitwise(r.latents, first[rid].latents, depth, f"{rid} branch vs first")


def _stored_states(stage, rid: str, columns: list[int]) -> dict[tuple[int, int], list[torch.Tensor]]:
    """{(layer, tokens): [conv state, recurrent state]} of a running request's mamba columns."""
    core = stage.engine.engine_core.engine_core
    internal = stage._tracked[rid].internal_id
    layers = stage.engine.vllm_config.compilation_config.static_forward_context
    managers = core.scheduler.kv_cache_manager.coordinator.single_type_managers
    B = core.scheduler.cache_config.block_size
    out = {}
    for manager, group in zip(managers, core.scheduler.kv_cache_config.kv_cache_groups):
        if type(manager).__name__ != "BlockStateMambaManager":
            continue
        blocks = manager.req_to_blocks[internal]
        for name in group.layer_names:
            index = int(name.split("layers.")[1].split(".")[0])
            for col in columns:
                assert not blocks[col].is_null, f"no state block at column {col} of {name}"
                state = [t[blocks[col].block_id].float().clone() for t in layers[name].kv_cache[:2]]
                out[(index, (col + 1) * B)] = state
    return out


def _recurrent_reference(prompt: list[int], positions: set[int]) -> dict[tuple[int, int], list[torch.Tensor]]:
    """transformers' Qwen3-Next in float32, fed one token at a time (its recurrent GDN path).

    Up to 3B (1,920 with B = 640) single-token forward passes of a tiny model: on one thread. With
    the vLLM engines of this process (which bind torch's OpenMP threads) two threads meet at a
    barrier every op; on a loaded 2-core host this test took 380 s on two threads, 27 s on one (per
    token: 116-300 ms on two threads, 17-28 ms on one, load 5-8). vLLM replaces
    torch.set_num_threads with a no-op after its thread binding, hence torch._C's; the count is
    restored for the engines."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(ensure_checkpoint("thinker-hybrid")), dtype=torch.float32).eval()
    out, cache = {}, None
    threads = torch.get_num_threads()
    torch._C.set_num_threads(1)
    try:
        with torch.inference_mode():
            for i in range(max(positions)):
                cache = model(torch.tensor([[prompt[i]]]), past_key_values=cache, use_cache=True).past_key_values
                if i + 1 in positions:
                    for index, layer in enumerate(cache.layers):
                        if getattr(layer, "recurrent_states", None):
                            state = [layer.conv_states[0][0].clone(), layer.recurrent_states[0][0].clone()]
                            out[(index, i + 1)] = state
    finally:
        torch._C.set_num_threads(threads)
    return out


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a - ref).norm() / ref.norm())


def test_stored_states_equal_a_recurrent_reference(hybrid):
    from vllm import SamplingParams

    B, rng = hybrid.B, random.Random(15)
    prompt = tokens(rng, 3 * B + 50)
    hybrid.on.add("states", {"prompt_token_ids": prompt}, SamplingParams(max_tokens=2, temperature=0.0))
    # The whole prompt in one forward pass (vLLM's align mode would stop at 3B, the last boundary):
    # boundaries B, 2B and 3B are inside it.
    first = hybrid.on.step()
    assert any(o.request_id == "states" and o.token_ids for o in first), "prefill took more than one step"
    stored = _stored_states(hybrid.on, "states", [0, 1, 2])
    while hybrid.on.has_work():
        hybrid.on.step()
    reference = _recurrent_reference(prompt, {B, 2 * B, 3 * B})
    assert set(stored) == set(reference)
    for key, (conv, ssm) in stored.items():
        ref_conv, ref_ssm = reference[key]
        # vLLM keeps the last kernel-1 conv inputs, transformers the last kernel.
        ref_conv = ref_conv[..., 1:]
        conv = conv if conv.shape == ref_conv.shape else conv.transpose(-1, -2)
        assert _rel(ssm.reshape(ref_ssm.shape), ref_ssm) <= STATE_RTOL, f"recurrent state {key}"
        assert _rel(conv, ref_conv) <= STATE_RTOL, f"conv state {key}"
        layer, position = key
        other = reference[(layer, position + B if position < 3 * B else position - B)][1]
        assert _rel(ssm.reshape(other.shape), other) > 4 * STATE_RTOL, (
            "states of neighbouring boundaries are indistinguishable"
        )


def test_chunks_ending_mid_block_keep_the_right_states(hybrid):
    """A token budget below the prompt makes vLLM end prefill chunks wherever the budget runs out
    (block states turn off vLLM's block-aligned stops). The block a chunk ended in then holds the
    state at that unaligned position until the next chunk crosses the block's end and writes the
    boundary's state into it; a branch must hit there and match the cache-off engine."""
    B, rng = hybrid.B, random.Random(16)
    budget = B + B // 3
    stage = make_stage("thinker-hybrid", cache=True, **{**ENGINE, "max_num_batched_tokens": budget})
    try:
        assert stage.scheduler.block_states
        prompt = tokens(rng, 5 * B)
        first = run(stage, {"long": prompt}, 2)["long"]
        for depth in (2 * B, 3 * B):  # 2B lies inside the 2nd chunk, 3B inside the 3rd
            branch = prompt[: depth + B // 2] + tokens(rng, 50)
            on = run(stage, {f"at{depth}": branch}, 4)[f"at{depth}"]
            off = run(hybrid.off, {f"at{depth}": branch}, 4)[f"at{depth}"]
            assert on.num_cached_tokens == depth, f"hit {on.num_cached_tokens}, best {depth}"
            assert_bitwise(on.latents, first.latents, depth, f"branch at {depth} vs first")
            rows = comparable_rows(on, off, f"at{depth}", HYBRID_TIE_MARGIN)
            rel = row_errors(on.latents["hidden"][:rows], off.latents["hidden"][:rows])
            assert float(rel.max()) <= HYBRID_ROW_RTOL, f"branch at {depth}: row error {float(rel.max()):.2e}"
    finally:
        close(stage)


def test_finer_hits_with_prefix_match_unit(hybrid):
    """vLLM's `prefix_match_unit` (hash blocks below the attention block) lets a hybrid hit at the
    prompt's last 32-token boundary (vLLM keeps that state as a partial-block tail); with block
    states on as well, every hit lands at least on the best block boundary and rows stay right."""
    B, rng, unit = hybrid.B, random.Random(17), 32
    stage = make_stage("thinker-hybrid", cache=True, **{**ENGINE, "prefix_match_unit": unit})
    try:
        assert stage.scheduler.block_states
        shared = tokens(rng, 2 * B + 1)
        first = run(stage, {"f0": shared + tokens(rng, B)}, 2)["f0"]
        second = run(stage, {"f1": shared + tokens(rng, B)}, 2)["f1"]
        assert second.num_cached_tokens == 2 * B
        assert_bitwise(second.latents, first.latents, 2 * B, "fine branch vs first")
        prompt, previous, previous_prompt, gained = tokens(rng, B + 150), None, [], 0
        for turn in range(3):
            if previous is not None:
                prompt = prompt + previous.token_ids + tokens(rng, 150)
            on = run(stage, {f"t{turn}": prompt}, 32)[f"t{turn}"]
            off = run(hybrid.off, {f"t{turn}": prompt}, 32)[f"t{turn}"]
            if previous is not None:
                block_best = (len(previous_prompt) + 31) // B * B
                assert on.num_cached_tokens % unit == 0 and on.num_cached_tokens >= block_best
                gained += on.num_cached_tokens - block_best
                assert_bitwise(on.latents, previous.latents, on.num_cached_tokens, f"turn {turn}")
            rows = comparable_rows(on, off, f"t{turn}", HYBRID_TIE_MARGIN)
            rel = row_errors(*(r.latents["hidden"][on.num_cached_tokens : rows] for r in (on, off)))
            assert float(rel.max()) <= HYBRID_ROW_RTOL, f"turn {turn}: row error {float(rel.max()):.2e}"
            previous, previous_prompt = on, prompt
        assert gained > 0, "prefix_match_unit gave no hit beyond the block boundaries"
    finally:
        close(stage)


def test_async_scheduling_keeps_block_states(hybrid):
    """With vLLM's async scheduler (a stage's `async_scheduling: true`) the next step is scheduled
    before the last one's output is processed; block states must still be written before anyone
    hits them."""
    B, rng = hybrid.B, random.Random(18)
    stage = make_stage("thinker-hybrid", cache=True, async_scheduling=True, **ENGINE)
    try:
        assert type(stage.scheduler).__name__ == "AsyncOmniScheduler" and stage.scheduler.block_states
        shared, long_ = tokens(rng, 2 * B + 1), tokens(rng, 5 * B)
        first = run(stage, {"a": shared + tokens(rng, B), "long": long_}, 4)
        branches = {"b": shared + tokens(rng, B), "c": long_[: 5 * B // 2] + tokens(rng, B)}
        got = run(stage, branches, 4)
        for rid, source in (("b", "a"), ("c", "long")):
            assert got[rid].num_cached_tokens == 2 * B, f"{rid}: hit {got[rid].num_cached_tokens}"
            assert_bitwise(got[rid].latents, first[source].latents, 2 * B, f"{rid} vs {source}")
            off = run(hybrid.off, {rid: branches[rid]}, 4)[rid]
            rows = comparable_rows(got[rid], off, rid, HYBRID_TIE_MARGIN)
            assert (
                float(row_errors(got[rid].latents["hidden"][:rows], off.latents["hidden"][:rows]).max())
                <= HYBRID_ROW_RTOL
            )
    finally:
        close(stage)
