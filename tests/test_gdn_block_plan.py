"""Unit tests of the block-state plan (workers/models/gdn_block_states.py), of the rule that turns
block states on by what a model's recurrent layers are (scheduler/mamba_block_states.py) and of the
chunk-kernel state extraction (benchmarks/gdn_chunk_states.py); the engine-level tests are in
test_hybrid_block_states.py, the GPU kernel check in benchmarks/gdn_kernel_states.py."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata

from benchmarks.gdn_chunk_states import chunk_state_rows, store_chunk_states
from scheduler.mamba_block_states import recurrent_layers_reason
from workers.models.gdn_block_states import BlockStateGatedDeltaNet, boundary_cuts, plan_segments

B = 128


def batch():
    """A decode row, then prefill A (tokens 0-299 of its prompt), then prefill B (tokens 100-299)."""
    qsl = [0, 1, 301, 501]
    seq_lens = [40, 300, 300]
    running = [5, 7, 9]
    meta = GDNAttentionMetadata(
        num_prefills=2,
        num_prefill_tokens=500,
        num_decodes=1,
        num_decode_tokens=1,
        num_spec_decodes=0,
        num_spec_decode_tokens=0,
        num_actual_tokens=501,
        has_initial_state=torch.tensor([True, False, True]),
        non_spec_query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        non_spec_state_indices_tensor=torch.tensor(running, dtype=torch.int32),
    )
    table = torch.zeros(3, 4, dtype=torch.int32)
    table[1, :3] = torch.tensor([11, 12, 7])  # A: boundaries 128 and 256, running block in col 2
    table[2, :3] = torch.tensor([0, 22, 9])  # B: boundary 128 left null by the manager, 256 kept
    return meta, qsl, seq_lens, running, table


def test_cuts_are_the_non_null_interior_boundaries():
    meta, qsl, seq_lens, running, table = batch()
    cuts = boundary_cuts(seq_lens, qsl, 1, 3, B, table, running)
    # A: 1 + 128 and 1 + 256; B starts at 100: boundary 256 is 156 tokens into its query.
    assert cuts == [(129, 7, 11), (257, 7, 12), (301 + 156, 9, 22)]


def test_segments_tile_the_batch_and_continue_cut_rows():
    meta, qsl, seq_lens, running, table = batch()
    plan = plan_segments(meta, qsl, boundary_cuts(seq_lens, qsl, 1, 3, B, table, running))
    assert [(s.start, s.end) for s in plan.segments] == [(0, 129), (129, 257), (257, 457), (457, 501)]
    assert [s.exports for s in plan.segments] == [((7, 11),), ((7, 12),), ((9, 22),), ()]
    first, second, third, last = (s.metadata for s in plan.segments)
    assert (first.num_decodes, first.num_prefills, first.num_prefill_tokens) == (1, 1, 128)
    assert first.has_initial_state.tolist() == [True, False]  # A's first segment starts from zero
    assert second.has_initial_state.tolist() == [True]  # ... its later ones from the running state
    assert (third.num_decodes, third.num_prefills) == (0, 2)
    assert third.non_spec_query_start_loc.tolist() == [0, 44, 200]
    assert third.non_spec_state_indices_tensor.tolist() == [7, 9]
    assert third.has_initial_state.tolist() == [True, True]
    assert last.num_actual_tokens == 44 and last.has_initial_state.tolist() == [True]
    assert sum(s.metadata.num_actual_tokens for s in plan.segments) == 501
    assert plan.exported_blocks == [11, 12, 22]


def test_a_lone_one_token_piece_runs_as_a_decode():
    """A row cut one token before its chunk's end leaves a one-token segment: it runs as a decode
    (vLLM's rule for one-token chunks; its CPU conv kernel refuses a one-token prefill of Qwen3.5)."""
    meta, qsl, seq_lens, running, table = batch()
    seq_lens[2] = 257  # B: tokens 100-256, so boundary 256 is one token before its end
    qsl[3] = 301 + 157
    meta = replace(
        meta,
        num_prefill_tokens=457,
        num_actual_tokens=458,
        non_spec_query_start_loc=torch.tensor(qsl, dtype=torch.int32),
    )
    plan = plan_segments(meta, qsl, boundary_cuts(seq_lens, qsl, 1, 3, B, table, running))
    last = plan.segments[-1].metadata
    assert (plan.segments[-1].start, plan.segments[-1].end) == (457, 458)
    assert (last.num_decodes, last.num_decode_tokens, last.num_prefills) == (1, 1, 0)
    assert last.non_spec_state_indices_tensor.tolist() == [9]
    middle = plan.segments[-2].metadata  # B's head beside A's tail: two prefill pieces stay prefills
    assert (middle.num_decodes, middle.num_prefills) == (0, 2)


def test_no_cuts_without_blocks():
    meta, qsl, seq_lens, running, table = batch()
    table[1, :2] = 0
    table[2, 1] = 0
    assert boundary_cuts(seq_lens, qsl, 1, 3, B, table, running) == []


def test_chunk_state_rows_and_store():
    rows = chunk_state_rows([256, 100, 192], [[64, 192], [], [128]])
    assert rows == [1, 3, 4 + 2 + 2]
    h = torch.randn(1, 10, 2, 4, 4)
    pool = torch.zeros(6, 2, 4, 4)
    store_chunk_states(h, torch.tensor(rows), pool, torch.tensor([2, 5, 1]))
    assert torch.equal(pool[2], h[0, 1]) and torch.equal(pool[5], h[0, 3]) and torch.equal(pool[1], h[0, 8])
    assert not pool[[0, 3, 4]].any()
    for bad in ([[0]], [[256]], [[100]]):
        with pytest.raises(ValueError, match="chunk edge"):
            chunk_state_rows([256], bad)


def spec(kind: str = "GDN_ATTN", states: int = 2):
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import MambaSpec

    return MambaSpec(
        block_size=B,
        shapes=((3, 64),) * states,
        dtypes=(torch.bfloat16,) * states,
        mamba_type=getattr(MambaAttentionBackendEnum, kind),
        mamba_cache_mode="align",
    )


def test_block_states_turn_on_for_every_replaced_gdn_layer():
    # Qwen3-Next and Qwen3.5 build the same layer class (vLLM's QwenGatedDeltaNetAttention,
    # which the plugin replaces): the rule reads the class, not the model's name.
    names = [f"model.layers.{i}.linear_attn" for i in range(3)]
    assert recurrent_layers_reason({n: spec() for n in names}, {n: BlockStateGatedDeltaNet for n in names}) is None


@pytest.mark.parametrize(
    "layer,kind,why",
    [
        ("qwen", "GDN_ATTN", "replaced by the omni_cache vLLM plugin"),  # plugin not loaded
        ("olmo", "GDN_ATTN", "OlmoHybridGatedDeltaNetAttention"),
        ("kimi", "GDN_ATTN", "KimiGatedDeltaNetAttention"),
        ("mamba2", "MAMBA2", "MambaMixer2"),
        ("ours", "MAMBA2", "state layout"),
    ],
)
def test_block_states_stay_off_for_other_recurrent_layers(layer, kind, why):
    from vllm.model_executor.layers.mamba.gdn.kimi_gdn_linear_attn import KimiGatedDeltaNetAttention
    from vllm.model_executor.layers.mamba.gdn.olmo_gdn_linear_attn import OlmoHybridGatedDeltaNetAttention
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention
    from vllm.model_executor.layers.mamba.mamba_mixer2 import MambaMixer2

    cls = {
        "qwen": QwenGatedDeltaNetAttention,
        "olmo": OlmoHybridGatedDeltaNetAttention,
        "kimi": KimiGatedDeltaNetAttention,
        "mamba2": MambaMixer2,
        "ours": BlockStateGatedDeltaNet,
    }[layer]
    # One such layer beside replaced GDN layers is enough: its boundary blocks would stay empty.
    specs = {"layers.0.linear_attn": spec(), "layers.1.mixer": spec(kind)}
    types = {"layers.0.linear_attn": BlockStateGatedDeltaNet, "layers.1.mixer": cls}
    reason = recurrent_layers_reason(specs, types)
    assert reason is not None and why in reason and "layers.1.mixer" in reason


def test_block_states_off_without_recurrent_layers_or_their_classes():
    assert "no recurrent layers" in recurrent_layers_reason({}, {})
    assert "not built" in recurrent_layers_reason({"layers.0.linear_attn": spec()}, {})
    assert "state layout" in recurrent_layers_reason({"x": spec(states=3)}, {"x": BlockStateGatedDeltaNet})
