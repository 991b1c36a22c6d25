"""GatedDeltaNet that also stores its recurrent and conv states at block boundaries inside a chunk.

Why: in vLLM 0.32's "align" prefix-cache mode a hybrid model keeps a recurrent state only where a
scheduled prefill chunk ended on a block boundary. A prompt prefilled in one chunk leaves a single
state at its end, so a later request that shares only part of it (a branch, the next turn of an
agent) cannot hit: the attention KV is there, the recurrent state at the branch is not.

How: the KV-cache manager (scheduler/mamba_block_states.py) gives every block boundary a chunk
crosses a real state block in the mamba group's position-indexed block table (vLLM leaves those
columns null). The metadata builder here turns those columns into a plan: cut the step's tokens at
each such boundary. The layer projects the whole chunk once, runs vLLM's own GDN core op segment
by segment (each segment starts from the state the previous one left in the request's running
state block), copies the running state into the boundary's block after the segment that ends
there, and applies the output projection once. Every other layer of the model runs once for the
whole chunk; only the recurrence is cut, and it is sequential anyway (vLLM's CPU kernel loops over
64-token chunks). What a piece costs is fixed per call, so it is kept small: running the whole layer
per piece (projections and gated norm too) and calling the op through torch's dispatcher cost
~0.6 ms of CPU per piece, +12% on a cold 32-block prefill of tiny:qwen3.5 against align mode.

Lockstep: the worker writes exactly the interior columns whose block is not null, and only the
manager puts blocks there, so a block is never hashed without its state being written. The
scheduler turns the manager on only where this layer runs (see `block_states_supported`).

Scope: vLLM's CPU path, eager mode (the plan is Python control flow around vLLM's custom op; under
torch.compile it would be traced once and frozen). On CUDA vLLM runs flash-linear-attention's chunk
kernel, whose per-64-token states give the same boundaries without cutting (not wired here).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from itertools import accumulate

import torch
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention
from vllm.model_executor.layers.mamba.ops.cpu.gdn_attention import cpu_gdn_attention_core
from vllm.v1.attention.backends.gdn_attn import GDNAttentionBackend, GDNAttentionMetadata, GDNAttentionMetadataBuilder
from vllm.v1.attention.backends.utils import NULL_BLOCK_ID


@dataclass(frozen=True)
class Segment:
    """Tokens [start, end) of the step, with the GDN metadata that describes only them."""

    start: int
    end: int
    metadata: GDNAttentionMetadata
    # (running state block, boundary block): copy after this segment, the state it ends on.
    exports: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class BlockStatePlan:
    segments: tuple[Segment, ...]

    @property
    def exported_blocks(self) -> list[int]:
        return [dst for s in self.segments for _, dst in s.exports]


@dataclass
class BlockStateGDNMetadata(GDNAttentionMetadata):
    block_states: BlockStatePlan | None = None


def boundary_cuts(
    seq_lens: list[int],
    query_start_loc: list[int],
    first_prefill: int,
    num_rows: int,
    block_size: int,
    block_table: torch.Tensor,
    running: list[int],
) -> list[tuple[int, int, int]]:
    """(token index in the step, running state block, boundary block) for every block boundary
    strictly inside a prefill row's chunk whose block-table column holds a block.

    Column c of an align-mode mamba row holds the state after (c + 1) * block_size tokens.
    """
    cuts = []
    for row in range(first_prefill, num_rows):
        q_start, q_end = query_start_loc[row], query_start_loc[row + 1]
        seq_end = seq_lens[row]
        seq_start = seq_end - (q_end - q_start)
        boundary = (seq_start // block_size + 1) * block_size
        while boundary < seq_end:
            block = int(block_table[row, boundary // block_size - 1])
            if block != NULL_BLOCK_ID and block != running[row]:
                cuts.append((q_start + boundary - seq_start, running[row], block))
            boundary += block_size
    return cuts


def plan_segments(
    meta: GDNAttentionMetadata, query_start_loc: list[int], cuts: list[tuple[int, int, int]]
) -> BlockStatePlan:
    """Split a non-speculative batch (decode rows first, then prefill rows) at the cuts."""
    num_rows = meta.num_decodes + meta.num_prefills
    total = query_start_loc[num_rows]
    state_indices = meta.non_spec_state_indices_tensor[:num_rows].tolist()
    has_initial = meta.has_initial_state[:num_rows].tolist()
    edges = sorted({0, total, *(t for t, _, _ in cuts)})
    exports_at: dict[int, list[tuple[int, int]]] = {}
    for t, src, dst in cuts:
        exports_at.setdefault(t, []).append((src, dst))
    segments = []
    tensor = _TensorMemo(meta.non_spec_state_indices_tensor.device)
    for start, end in zip(edges, edges[1:]):
        rows = [r for r in range(num_rows) if query_start_loc[r] < end and query_start_loc[r + 1] > start]
        lens, init, states, decodes = [], [], [], 0
        for r in rows:
            lo, hi = max(query_start_loc[r], start), min(query_start_loc[r + 1], end)
            lens.append(hi - lo)
            # A row cut earlier in this step continues from the state the last segment left.
            init.append(bool(has_initial[r]) or lo > query_start_loc[r])
            states.append(state_indices[r])
            decodes += r < meta.num_decodes
        if len(lens) - decodes == 1 and lens[decodes] == 1:
            # A lone one-token prefill piece (a chunk cut one token before its end) runs as a
            # decode, as vLLM classifies any one-token chunk: its CPU conv kernel refuses a
            # one-token prefill taken from Qwen3.5's unfused projection ("expect x to be
            # transposed"). The piece always continues its row's state (it follows a cut).
            decodes += 1
        segments.append(
            Segment(
                start, end, _segment_metadata(meta, lens, init, states, decodes, tensor), tuple(exports_at.get(end, ()))
            )
        )
    return BlockStatePlan(tuple(segments))


class _TensorMemo:
    """One tensor per distinct list of values within a plan. The segments of a long prompt are
    mostly alike (one row, B tokens, continuing its running state), so a 32-block prefill needs a
    handful of small tensors instead of ~200 (each torch.tensor call costs ~6 us of CPU, three GDN
    groups plan every step). The kernels only read these index tensors."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.made: dict[tuple, torch.Tensor] = {}

    def __call__(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        key = (dtype, *values)
        if key not in self.made:
            self.made[key] = torch.tensor(values, dtype=dtype, device=self.device)
        return self.made[key]


def _segment_metadata(
    meta: GDNAttentionMetadata,
    lens: list[int],
    init: list[bool],
    states: list[int],
    num_decodes: int,
    tensor: _TensorMemo,
) -> GDNAttentionMetadata:
    offsets = [0, *accumulate(lens)]
    qsl = tensor(offsets, torch.int32)
    state_dtype = meta.non_spec_state_indices_tensor.dtype
    state_idx, has_init = tensor(states, state_dtype), tensor(init, torch.bool)
    num_decode_tokens = offsets[num_decodes]
    return replace(
        meta,
        num_decodes=num_decodes,
        num_decode_tokens=num_decode_tokens,
        num_prefills=len(lens) - num_decodes,
        num_prefill_tokens=sum(lens) - num_decode_tokens,
        num_actual_tokens=sum(lens),
        has_initial_state=has_init,
        non_spec_query_start_loc=qsl,
        non_spec_state_indices_tensor=state_idx,
        prefill_query_start_loc=tensor([o - num_decode_tokens for o in offsets[num_decodes:]], torch.int32),
        prefill_state_indices=tensor(states[num_decodes:], state_dtype),
        prefill_has_initial_state=tensor(init[num_decodes:], torch.bool),
        # Precomputed kernel layouts describe the whole batch; the CPU path rebuilds its own.
        chunk_indices=None,
        chunk_offsets=None,
        nums_dict=None,
        batch_ptr=None,
        token_chunk_offset_ptr=None,
        aiter_prefill_metadata=None,
        checkpoint=None,
    )


class BlockStateGDNMetadataBuilder(GDNAttentionMetadataBuilder):
    def build(self, common_prefix_len, common_attn_metadata, *args, **kwargs):  # type: ignore[override]
        meta = super().build(common_prefix_len, common_attn_metadata, *args, **kwargs)
        m = common_attn_metadata
        if (
            self.vllm_config.cache_config.mamba_cache_mode != "align"
            or meta.num_prefills == 0
            or meta.num_spec_decodes > 0
            or m.block_table_tensor.device.type != "cpu"
        ):
            return meta
        num_rows = meta.num_decodes + meta.num_prefills
        qsl = m.query_start_loc_cpu[: num_rows + 1].tolist()
        running = meta.non_spec_state_indices_tensor[:num_rows].tolist()
        cuts = boundary_cuts(
            m.seq_lens.tolist(),
            qsl,
            meta.num_decodes,
            num_rows,
            self.kv_cache_spec.block_size,
            m.block_table_tensor,
            running,
        )
        if not cuts:
            return meta
        plan = plan_segments(meta, qsl, cuts)
        return BlockStateGDNMetadata(**{f.name: getattr(meta, f.name) for f in fields(meta)}, block_states=plan)


class BlockStateGDNBackend(GDNAttentionBackend):
    @staticmethod
    def get_builder_cls() -> type[GDNAttentionMetadataBuilder]:
        return BlockStateGDNMetadataBuilder


class BlockStateGatedDeltaNet(QwenGatedDeltaNetAttention):
    """vLLM's Qwen GatedDeltaNet layer (Qwen3-Next, Qwen3.5) plus block-boundary states.

    Registered as the out-of-tree replacement of `QwenGatedDeltaNetAttention` (vLLM's
    PluggableLayer mechanism, see workers/models/__init__.py); it adds no weights or state.
    """

    #: What the scheduler checks for (scheduler/mamba_block_states.py) to know the layer that
    #: writes block states is the one registered, without importing this package.
    WRITES_BLOCK_STATES = True

    def get_attn_backend(self):
        return BlockStateGDNBackend

    def forward_cpu(self, hidden_states: torch.Tensor) -> torch.Tensor:
        context = get_forward_context()
        metadata = context.attn_metadata
        meta = metadata.get(self.prefix) if isinstance(metadata, dict) else None
        plan = getattr(meta, "block_states", None)
        if plan is None:
            return super().forward_cpu(hidden_states)
        # Contiguous once here rather than per segment inside the op (one copy instead of one per piece).
        mixed_qkv, z, b, a = self._project(hidden_states)
        mixed_qkv, b, a = mixed_qkv.contiguous(), b.contiguous(), a.contiguous()
        core_attn_out = torch.zeros(
            (hidden_states.shape[0], self.num_v_heads // self.tp_size, self.head_v_dim),
            dtype=hidden_states.dtype,
            device=hidden_states.device,
        )
        last = len(plan.segments) - 1
        try:
            for i, segment in enumerate(plan.segments):
                metadata[self.prefix] = segment.metadata
                # The last segment also carries any padding rows past the batch's real tokens.
                rows = slice(segment.start, hidden_states.shape[0] if i == last else segment.end)
                # The op writes its rows of core_attn_out in place (a view of the whole). Called as
                # the Python function the custom op registers, not through torch.ops: the
                # dispatcher cost ~0.15 ms a call, and eager mode (required) gains nothing from it.
                cpu_gdn_attention_core(mixed_qkv[rows], b[rows], a[rows], core_attn_out[rows], self.prefix)
                self._export(segment.exports)
        finally:
            metadata[self.prefix] = meta
        return self._output_projection(core_attn_out, z)

    def _project(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(mixed_qkv, z, b, a) of the whole chunk, as vLLM's `forward_cpu` computes them before
        its core op, from the layer's own projections and reordering."""
        mixed_qkvz, _ = self.in_proj_qkvz(hidden_states)
        ba, _ = self.in_proj_ba(hidden_states)
        if self.gqa_interleaved_layout:  # Qwen3-Next
            query, key, value, z, b, a = self.fix_query_key_value_ordering(mixed_qkvz, ba)
            mixed_qkv = torch.cat([x.flatten(1) for x in (query, key, value)], dim=-1)
            return mixed_qkv, z, b, a
        # Qwen3.5: the projections are already in [q, k, v, z] and [b, a] order.
        qkv_size = (self.key_dim * 2 + self.value_dim) // self.tp_size
        mixed_qkv, z = mixed_qkvz.split([qkv_size, self.value_dim // self.tp_size], dim=-1)
        b, a = ba.chunk(2, dim=-1)
        return mixed_qkv, z.reshape(z.size(0), -1, self.head_v_dim), b, a

    def _export(self, exports: tuple[tuple[int, int], ...]) -> None:
        for src, dst in exports:
            for state in self.kv_cache[:2]:  # conv state, recurrent state
                state[dst].copy_(state[src])
