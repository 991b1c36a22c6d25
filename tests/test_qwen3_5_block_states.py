"""Block states on a real hybrid: Qwen3.5 (vLLM's ``Qwen3_5ForConditionalGeneration``: 3 GatedDeltaNet
layers, 1 gated attention layer, Qwen3-VL's vision encoder), issue 43 items 2 and 4.

One engine per mode, reused by every row: ours (block states), vLLM 0.32's plain align mode beside
it (``block_states=False``), and a cache-off engine as the reference. B is the block vLLM picks for
the tiny checkpoint (128 on x86 CPUs). "best" is the longest block-aligned prefix shared with an
earlier request, short of the prompt's last token.

- The hits table of the issue (docs/hybrid-thinkers.md): ours at the best block in every row, media
  included (``[system, image, question A]`` then ``[system, image, question B]`` hits past the image);
  align mode beside it, which misses the branch rows.
- Every answer against the cache-off engine (tokens, and latent rows within HYBRID_ROW_RTOL, as
  tests/test_hybrid_block_states.py) and the rows a hit served bitwise the first computation's.
- Routing (item 4): each engine's own KV-cache events, fed through the stage's collector into the
  router's index, predict exactly the hit the engine then serves, in both modes: the index never
  says "hit" where the engine recomputes.

The seeded branching workload of 100 requests in a pool that evicts runs through a whole pipeline,
a next stage reading the latents, in tests/test_qwen3_5_pipeline_cache.py.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from PIL import Image
from thinker_harness import TAP, Result, close, run
from thinker_pair import HYBRID_ROW_RTOL, HYBRID_TIE_MARGIN, assert_bitwise, assert_close

from omni_cache.runtime.routing.block_hashes import prompt_block_hashes
from omni_cache.runtime.routing.prefix_index import PrefixIndex
from omni_cache.tiny.checkpoints import ensure_checkpoint

# Starts three in-process vLLM engines (the module fixture): skipped by -m "not vllm".
pytestmark = pytest.mark.vllm

MODEL = "qwen3.5"
VISION_START, IMAGE_PAD, VISION_END = 259, 262, 260  # checked against the tokenizer below
# 24 MiB: about 96 pages of the tiny model. A request of ~5 blocks takes ~20 (its attention blocks
# and a state per GatedDeltaNet group at every boundary): the rows here fit, a long workload evicts
# (tests/test_qwen3_5_pipeline_cache.py runs one in a pool of this size).
ENGINE = dict(
    enforce_eager=True,
    gpu_memory_utilization=0.3,
    dtype="bfloat16",
    max_model_len=2048,
    max_num_batched_tokens=2048,
    kv_cache_memory_bytes=24 * 2**20,
    limit_mm_per_prompt={"image": 1, "video": 0},
)


def make(mode: str):
    from workers.latent_capture import LatentOptions
    from workers.llm_stage import LLMStage

    cache = mode != "off"
    args = dict(ENGINE, prefix_cache_retention_interval=None) if cache else dict(ENGINE)
    return LLMStage(
        str(ensure_checkpoint(MODEL)),
        args,
        prefix_cache=cache,
        block_states=mode == "ours",
        report_blocks=cache,
        latents=LatentOptions(hidden=True, layers=(TAP,), cache=cache),
    )


class Engine:
    """One cache-on engine and the router's view of it (its own block events)."""

    def __init__(self, mode: str) -> None:
        self.stage = make(mode)
        self.index = PrefixIndex()
        self.B = self.stage.engine.vllm_config.cache_config.block_size
        self.predictions: list[tuple[int, int]] = []  # (index said, engine hit), text prompts

    def ask(self, rid: str, prompt, max_tokens: int = 4) -> Result:
        text = isinstance(prompt, list)
        if text:
            steps = self.index.block_size.get(0, self.B)
            said = self.index.matched_blocks(0, prompt_block_hashes(prompt, steps), (len(prompt) - 1) // steps) * steps
        result = run(self.stage, {rid: prompt}, max_tokens)[rid]
        if text:
            self.predictions.append((said, result.num_cached_tokens))
        changes = self.stage.block_events.take()
        self.index.apply_report(0, changes)
        return result


class Engines:
    def __init__(self) -> None:
        self.ours, self.align = Engine("ours"), Engine("align")
        self.off = make("off")
        assert self.ours.stage.scheduler.block_states, "block states should be on for Qwen3.5"
        assert not self.align.stage.scheduler.block_states
        self.B = self.ours.B
        self.table: dict[str, list[tuple[int, int, int]]] = {}  # row -> (best, align, ours)

    def row(self, name: str, prompts: list, best: list[int], max_tokens: int = 4) -> list[Result]:
        """Run a table row's requests in order through both cache-on engines, check ours against
        the cache-off engine and its hits bitwise against the first computation."""
        results = []
        for i, (prompt, want) in enumerate(zip(prompts, best)):
            rid = f"{name}{i}"
            ours = self.ours.ask(rid, prompt, max_tokens)
            align = self.align.ask(rid, prompt, max_tokens)
            self.table.setdefault(name, []).append((want, align.num_cached_tokens, ours.num_cached_tokens))
            assert ours.num_cached_tokens == want, f"{rid}: hit {ours.num_cached_tokens}, best {want}"
            off = run(self.off, {rid: prompt}, max_tokens)[rid]
            assert_close(ours, off, rid, HYBRID_ROW_RTOL, HYBRID_TIE_MARGIN)
            if want:
                source = next(r for r in results if common_rows(r, ours) >= want)
                assert_bitwise(ours.latents, source.latents, want, f"{rid} vs an earlier request")
            results.append(ours)
        return results

    def close(self) -> None:
        for stage in (self.ours.stage, self.align.stage, self.off):
            close(stage)


def common_rows(a: Result, b: Result) -> int:
    n = 0
    for x, y in zip(a.prompt_token_ids, b.prompt_token_ids):
        if x != y:
            break
        n += 1
    return n


@pytest.fixture(scope="module")
def engines():
    e = Engines()
    yield e
    print("\nQwen3.5 hits, tokens (best, align mode, ours):", e.table)
    e.close()


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(256) for _ in range(n)]


def test_the_image_tokens_are_the_tokenizers():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(ensure_checkpoint(MODEL)))
    ids = tok.convert_tokens_to_ids(["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"])
    assert ids == [VISION_START, IMAGE_PAD, VISION_END]


def test_shared_prefix_then_different_suffixes(engines):
    B, rng = engines.B, random.Random(21)
    shared = tokens(rng, 2 * B + 1)
    engines.row("shared", [shared + tokens(rng, B + 9 * i) for i in range(3)], [0, 2 * B, 2 * B])
    # vLLM's align mode: no state inside the first request's chunk, so the second one misses.
    assert engines.table["shared"][1][1] < 2 * B


def test_a_branch_inside_a_prompt(engines):
    B, rng = engines.B, random.Random(22)
    first = tokens(rng, 5 * B)
    engines.row("branch", [first, first[: 5 * B // 2] + tokens(rng, B)], [0, 2 * B])
    assert engines.table["branch"][1][1] < 2 * B


def test_an_image_then_different_questions_hits_past_the_image(engines):
    B, rng = engines.B, random.Random(23)
    pixels = np.random.default_rng(23).integers(0, 256, (256, 256, 3), dtype=np.uint8)
    image = Image.fromarray(pixels)  # 256 x 256: 64 image tokens after the 2 x 2 merge
    system, context = tokens(rng, 90), tokens(rng, 150)
    # Questions longer than a block: the branch lies before the first prompt's last boundary,
    # where vLLM's align mode keeps its only state (a shorter question hits there in both modes).
    ids = [system + [VISION_START, IMAGE_PAD, VISION_END] + context + tokens(rng, B + 40 + 7 * i) for i in range(3)]
    prompts = [{"prompt_token_ids": p, "multi_modal_data": {"image": image}} for p in ids]
    shared = 90 + 2 + 64 + 150  # expanded: system, start/end, the image's 64 tokens, context
    best = shared // B * B
    assert best > 90 + 2 + 64, "the best block should lie past the image"
    engines.row("image", prompts, [0, best, best])
    assert engines.table["image"][1][1] < best


def test_multi_turn(engines):
    """Each turn resends the history, the answer and new text. Rows a hit serves here were computed
    by the previous turn's decode steps: compared bitwise with those; the cache-off engine recomputes
    them by prefill, and vLLM's GDN decode and prefill kernels differ in bfloat16 (see
    tests/test_hybrid_block_states.py), so only the rows this turn computes are compared with it."""
    B, rng = engines.B, random.Random(24)
    answer = 16
    prompt = tokens(rng, B + 60)
    previous = engines.ours.ask("turn0", prompt, answer)
    engines.align.ask("turn0", prompt, answer)
    for turn in (1, 2):
        fed = len(prompt) + answer - 1  # the previous turn fed its prompt and all but its last token
        prompt = prompt + previous.token_ids + tokens(rng, 90)
        best = fed // B * B
        rid = f"turn{turn}"
        ours = engines.ours.ask(rid, prompt, answer)
        align = engines.align.ask(rid, prompt, answer)
        engines.table.setdefault("multi-turn", []).append((best, align.num_cached_tokens, ours.num_cached_tokens))
        assert ours.num_cached_tokens == best, f"{rid}: hit {ours.num_cached_tokens}, best {best}"
        assert_bitwise(ours.latents, previous.latents, best, f"{rid} vs the previous turn")
        off = run(engines.off, {rid: prompt}, answer)[rid]
        assert_close(ours, off, rid, HYBRID_ROW_RTOL, HYBRID_TIE_MARGIN, check_from=best)
        previous = ours


def test_the_routing_index_predicts_every_hit(engines):
    """Every text request so far: what the router's index said the replica holds (from the engine's
    own block events) against what the engine hit. Align mode is the case where attention blocks
    alone would have said "hit" on the branch rows."""
    for engine in (engines.ours, engines.align):
        assert engine.index.recurrent == {0}
        assert engine.predictions and all(said == hit for said, hit in engine.predictions), engine.predictions
    assert any(hit > 0 for _, hit in engines.align.predictions)
