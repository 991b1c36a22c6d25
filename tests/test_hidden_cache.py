"""The hidden-state prefix cache in a real vLLM engine, on the tiny dense AND the tiny hybrid thinker.

Each scenario runs on a cache-on engine (vLLM prefix caching + our mirror) and on a cache-off engine
(no prefix caching: every latent recomputed) and checks:
- rows served from the cache are bitwise equal to the rows the earlier request computed (what is
  ours: the mirror stores and serves exactly what the model produced);
- every latent row whose inputs are the same in both engines matches the cache-off recompute within
  ROW_RTOL (relative L2 error per row, ||on - off|| / ||off||).

Tolerances (rows whose inputs are the same in both engines; see thinker_harness for the dtypes):
- Dense thinker, float32, ROW_RTOL = 1e-4 (measured worst on an AMD EPYC: 9.6e-7 in this module,
  1.0e-6 in the churn test).
- Hybrid thinker, bfloat16 (vLLM's CPU GatedDeltaNet kernel takes nothing else), HYBRID_ROW_RTOL =
  2**-5 (3.1%): with prefix caching on, vLLM splits every prefill at its last block boundary
  (mamba_cache_mode "align") and resumes the recurrence from the stored state while the cache-off
  engine runs the prompt whole; that alone moves rows after the boundary by ~1.3% of their norm
  (measured worst on an AMD EPYC: 1.6e-2 in this module, 2.3e-3 in the churn test).
In bfloat16 these kernels round a batch differently by batch shape and by CPU (AMX on Intel Xeon,
AVX2 on AMD EPYC). With the tiny hybrid's earlier top-2-of-4 MoE routing, that flipped the expert pair
of tokens whose 2nd and 3rd router logits were nearly tied, and such a row moved by 7-71% (median 18%;
on a Xeon, rows of requests the cache never touched came out up to 21% off). Evidence: transformers'
Qwen3-Next on the same prompts, input embeddings perturbed by one bf16 rounding step: every row off by
more than 3.1% that the perturbation did not reach otherwise had a changed expert pair; with all 4
experts routed (the checkpoint now does that) the worst row moved 7.1% under a perturbation far
larger than kernel noise. In float32 the same perturbation moved no row by more than 1e-6.
A wrong row (another token's, stale after eviction, zero) is off by ~100% and fails either tolerance.

Sampled tokens: cache-on and cache-off engines may still pick a different greedy token where the top
two logits are (nearly) tied. From the first such token on, the two engines feed different inputs, so
rows are compared up to and including the row that produced the first diverging token, and the
divergence itself must be a near-tie: |logprob(a) - logprob(b)| <= the margin in both engines, 1e-3
nats in float32 (rows agree to ~1e-6 there) and 2**-4 in bfloat16 (hybrid rows may differ by up to
3.1%, which moves logits of magnitude ~1 by a few hundredths).

The hybrid thinker (Qwen3-Next: GatedDeltaNet + full attention) runs in vLLM's
mamba_cache_mode="align": a hit needs a recurrent state at a block boundary. vLLM 0.32 ends a
prompt's prefill on its last block boundary and keeps the state there, so a later prompt that
shares at least that much hits it. With `prefix_cache_retention_interval` = one block (as the
shipped hybrid config sets) vLLM also keeps states at the block boundaries a request crosses while
decoding, so multi-turn follow-ups hit into the previous answer. vLLM sizes the hybrid's attention
block so that one page holds a recurrent state (384 or 640 tokens for the tiny hybrid thinker,
depending on the CPU), so hybrid prompts here are a few thousand tokens.
"""

from __future__ import annotations

import random

import pytest
from thinker_harness import Result, run
from thinker_pair import HYBRID, Thinker, assert_bitwise, tokens

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module", params=["thinker", "thinker-hybrid"])
def thinker(request):
    if request.param == "thinker":
        t = Thinker("thinker", block_size=32)
    else:
        # The mirror spans every slot of the shared block pool (recurrent states live in it too),
        # so keep the pool small.
        t = Thinker("thinker-hybrid", **HYBRID)
    yield t
    print(f"\n{request.param}: worst row error against the cache-off engine {t.worst:.2e}")
    t.close()


def test_extended_prompt_hits_and_matches(thinker):
    rng = random.Random(1)
    base = tokens(rng, 3 * thinker.block + 7)
    first_on, first_off = thinker.both({"a": base})
    on, off = thinker.both({"b": base + tokens(rng, 40)})
    a, b = first_on["a"], on["b"]
    assert b.num_cached_tokens >= 3 * thinker.block, "the extended prompt should hit the cache"
    assert_bitwise(b.latents, a.latents, b.num_cached_tokens, "extended vs first")
    thinker.close_to_off(b, off["b"], "extended prompt")
    thinker.close_to_off(a, first_off["a"], "first prompt")


def test_fully_cached_prompt(thinker):
    rng = random.Random(2)
    for length in (4 * thinker.block, 4 * thinker.block + 1):  # block-aligned and not
        prompt = tokens(rng, length)
        first, _ = thinker.both({"x": prompt})
        on, off = thinker.both({"y": prompt})
        y = on["y"]
        # vLLM recomputes at least the last prompt token, so the hit is at most length - 1.
        assert 0 < y.num_cached_tokens <= length - 1
        assert y.latents["hidden"].shape[0] == length + len(y.token_ids) - 1
        assert_bitwise(y.latents, first["x"].latents, y.num_cached_tokens, "repeat vs first")
        thinker.close_to_off(y, off["y"], f"repeated prompt of {length}")


def test_shared_prefix_in_same_step(thinker):
    """Two prompts sharing two whole blocks (and 5 tokens more) arrive together. vLLM lets the
    second hit the blocks the first computes in the same step; on the hybrid also its recurrent
    state at the second block's end (the first's chunk ends there, or crosses it with block
    states: scheduler/mamba_block_states.py). So the second hits exactly two blocks, the first
    nothing, and those 2 blocks of rows are bitwise the first's."""
    rng = random.Random(3)
    shared = tokens(rng, 2 * thinker.block + 5)
    prompts = {"p": shared + tokens(rng, 20), "q": shared + tokens(rng, 30)}
    on, off = thinker.both(prompts)
    for rid in prompts:
        thinker.close_to_off(on[rid], off[rid], f"same step {rid}")
    hits = {rid: on[rid].num_cached_tokens for rid in prompts}
    assert hits == {"p": 0, "q": 2 * thinker.block}, hits
    assert on["q"].latents["hidden"].shape[0] >= 2 * thinker.block
    assert_bitwise(on["q"].latents, on["p"].latents, 2 * thinker.block, "shared prefix rows")


def test_multi_turn_hits_generated_tokens(thinker):
    rng = random.Random(4)
    # Turn 1's answer completes the prompt's second block, so a hit beyond turn 1's prompt
    # covers generated tokens.
    turn1 = tokens(rng, 2 * thinker.block - 5)
    gen = 16
    first, first_off = thinker.both({"t1": turn1}, max_tokens=gen)
    answer = first["t1"].token_ids
    thinker.close_to_off(first["t1"], first_off["t1"], "turn 1")
    served_before = thinker.on.capture.counters.rows_served
    turn2 = turn1 + answer + tokens(rng, 17)
    on, off = thinker.both({"t2": turn2})
    t2 = on["t2"]
    assert t2.num_cached_tokens > len(turn1), "turn 2 should hit beyond turn 1's prompt"
    # The rows of turn 1's generated tokens come from the cache: bitwise what turn 1 computed.
    assert_bitwise(t2.latents, first["t1"].latents, t2.num_cached_tokens, "turn 2 vs turn 1")
    assert thinker.on.capture.counters.rows_served - served_before == t2.num_cached_tokens
    thinker.close_to_off(t2, off["t2"], "turn 2")


def test_counters(thinker):
    counters = thinker.on.counters()
    assert counters["prefix_cache_queried_tokens"] > counters["prefix_cache_hit_tokens"] > 0
    assert counters["latent_rows_served"] >= counters["prefix_cache_hit_tokens"]
    off = thinker.off.counters()
    assert off["prefix_cache_hit_tokens"] == 0 and off["latent_rows_served"] == 0
    assert thinker.off.capture.store is None, "nothing may be allocated with prefix caching off"


def test_a_request_whose_rows_fail_to_assemble_fails_alone(thinker, monkeypatch):
    """LLMStage.step assembles each request's output on its own: a request whose latent rows
    cannot be taken (here: the capture raises for it) gets an output carrying the error, which its
    runner fails and aborts (workers/ar_runner.py); the request beside it in the same steps gets
    every row and token, and nothing of the failed one is left in the engine."""
    from vllm import SamplingParams

    stage = thinker.off  # prefix caching off: nothing earlier tests computed is served here
    drain = stage.capture.drain

    def drain_or_fail(internal_id: str):
        if internal_id.startswith("bad-"):  # vLLM's internal id starts with the request's own
            raise RuntimeError("latent rows 3..4 are missing")
        return drain(internal_id)

    monkeypatch.setattr(stage.capture, "drain", drain_or_fail)
    rng = random.Random(33)
    prompts = {"bad-1": tokens(rng, 40), "good-1": tokens(rng, 48)}
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for rid, prompt in prompts.items():
        stage.add(rid, {"prompt_token_ids": prompt}, params)
    good, errors = Result(), []
    while stage.has_work():
        for out in stage.step():
            if out.error is not None:
                errors.append((out.request_id, str(out.error)))
                stage.abort(out.request_id)  # what the runner does when it fails the request
                continue
            assert out.request_id == "good-1", "output for the failed request after its abort"
            good.token_ids += out.token_ids
            if out.latents:
                good.chunks.append((out.latent_start, out.latents))
    assert errors == [("bad-1", "latent rows 3..4 are missing")]
    assert len(good.token_ids) == 4
    assert all(rows.shape[0] == 48 + 4 - 1 for rows in good.latents.values())
    assert stage.scheduler.get_request_counts() == (0, 0)


def test_a_request_held_for_its_client_makes_no_step_and_goes_on_unchanged(thinker):
    """A request whose streaming client takes nothing is held (LLMStage.hold; wire Hold,
    scheduler/client_hold.py): the engine steps without it while another request runs; let go,
    it finishes with the tokens and rows a request never held has (cache off, one at a time)."""
    from vllm import SamplingParams

    rng = random.Random(9)
    prompt, other = tokens(rng, thinker.block + 5), tokens(rng, 12)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    stage = thinker.on
    stage.add("held", {"prompt_token_ids": prompt}, params)
    got = Result()
    for out in stage.step():  # its prefill and first token
        assert out.request_id == "held"
        got.token_ids += out.token_ids
        got.chunks.append((out.latent_start, out.latents))
    stage.hold("held", True)
    stage.add("other", {"prompt_token_ids": other}, params)
    while stage.has_work():
        assert all(out.request_id == "other" for out in stage.step()), "a held request made a step"
    stage.hold("held", False)
    while stage.has_work():
        for out in stage.step():
            got.token_ids += out.token_ids
            got.chunks.append((out.latent_start, out.latents))
    ref = run(thinker.off, {"ref": prompt}, max_tokens=6)["ref"]
    assert got.token_ids == ref.token_ids
    thinker.close_to_off(got, ref, "held and let go")
