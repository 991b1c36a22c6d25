"""What the worker does with a step's latents: write them to the mirror, gather prefix hits, hand
them to the stage.

The stage runs vLLM's engine core in its own process (no engine-core subprocess), so the worker,
the scheduler and the stage loop share one process and latents reach the stage through this object
without any serialization. Per step and request, `pending` gets up to two `LatentChunk`s: the rows
gathered from the mirror for a prefix vLLM skipped, then the rows this step computed.

Copies, per step: on CPU the computed rows are views of the model's fresh output tensor (no copy);
one `index_copy_` per latent name writes them into the mirror; a hit costs one `index_select` per
latent name over the prefix's blocks (`LatentStore.gather_prefix`). A merged latent
(`LatentOptions.merged`) is one `torch.where` over its two taps in a step with media placeholders,
the tap itself otherwise. On CUDA the computed rows are also copied to host once, because they
leave the process.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch

from omni_cache.cache.latent_rows import HIDDEN, LatentChunk, layer_name, merged_name

logger = logging.getLogger(__name__)


def media_token_ids(hf_config: Any) -> tuple[int, ...]:
    """The placeholder ids whose input embeddings a multimodal model replaces with its encoders'
    outputs (image, audio, video), read from the model's config or its thinker's."""
    ids = set()
    for cfg in (hf_config, getattr(hf_config, "thinker_config", None)):
        for key in ("image_token_id", "audio_token_id", "video_token_id"):
            value = getattr(cfg, key, None)
            if isinstance(value, int):
                ids.add(value)
    return tuple(sorted(ids))


def reused_storages(runner: Any) -> frozenset[int]:
    """The storages of the tensors a model runner keeps from step to step: its plain tensor
    attributes and both sides of its CPU/device buffers (vLLM's `CpuGpuBuffer`)."""
    ptrs = set()
    for value in vars(runner).values():
        for t in (value, getattr(value, "cpu", None), getattr(value, "gpu", None)):
            if isinstance(t, torch.Tensor) and t.numel() > 0:
                ptrs.add(t.untyped_storage().data_ptr())
    return frozenset(ptrs)


@dataclass(frozen=True)
class LatentOptions:
    """The `additional_config["omni_cache"]` block the stage passes to vLLM (see llm_stage.py)."""

    hidden: bool = True
    layers: tuple[int, ...] = ()
    #: (layer, media_layer): one latent whose row is tap `layer`'s, except at prompt positions
    #: holding an image/audio/video placeholder, where it is tap `media_layer`'s. Qwen3-Omni's
    #: talker reads exactly that (tap 0 at text, the accept-layer state at media positions), so
    #: it costs half of emitting, mirroring and gathering both taps.
    merged: tuple[int, int] | None = None
    cache: bool = False  # mirror vLLM's prefix cache (only meaningful with enable_prefix_caching)
    storage: str = "host"  # "host" | "device"

    @classmethod
    def from_vllm_config(cls, vllm_config: Any) -> LatentOptions | None:
        raw = (vllm_config.additional_config or {}).get("omni_cache")
        if raw is None:
            return None
        return cls(
            hidden=bool(raw.get("hidden", True)),
            layers=tuple(int(i) for i in raw.get("layers", ())),
            merged=tuple(int(i) for i in raw["merged"]) if raw.get("merged") else None,
            cache=bool(raw.get("cache", False)) and bool(vllm_config.cache_config.enable_prefix_caching),
            storage=str(raw.get("storage", "host")),
        )

    @property
    def names(self) -> tuple[str, ...]:
        merged = (merged_name(*self.merged),) if self.merged else ()
        return ((HIDDEN,) if self.hidden else ()) + tuple(layer_name(i) for i in self.layers) + merged

    @property
    def taps(self) -> tuple[int, ...]:
        """The layers the model must return states of, ascending (vLLM's aux-state order)."""
        return tuple(sorted(set(self.layers) | set(self.merged or ())))


@dataclass
class LatentCounters:
    rows_served: int = 0  # latent rows gathered from the mirror instead of recomputed
    rows_computed: int = 0
    steps: int = 0


@dataclass
class LatentCapture:
    options: LatentOptions
    dims: dict[str, tuple[int, torch.dtype]]
    device: torch.device
    counters: LatentCounters = field(default_factory=LatentCounters)
    pending: dict[str, list[LatentChunk]] = field(default_factory=lambda: defaultdict(list))
    store: Any = None  # omni_cache.cache.latent_store.LatentStore when the mirror is on
    group_id: int = -1  # the mirrored full-attention KV-cache group
    layer_name: str = ""  # one attention layer of that group: its slot mapping is the group's
    block_size: int = 0
    #: Storages of the buffers the model runner reuses every step (its input-embeddings buffer,
    #: ...). A latent that is a view into one of them (layer tap 0 of a model fed embeddings is
    #: the runner's `inputs_embeds` buffer itself) is copied before the step returns: the next
    #: step overwrites it while the stage may still hold the rows (see `reused_storages`).
    reused: frozenset[int] = frozenset()
    #: The model's media placeholder ids (`media_token_ids`), for `options.merged`.
    media_ids: torch.Tensor | None = None

    # ---- set-up ----------------------------------------------------------------------------
    def bind_kv_cache(self, kv_cache_config: Any, max_step_tokens: int | None = None) -> None:
        """Allocate the mirror of the full-attention KV-cache group, if the cache is on."""
        if not self.options.cache:
            return
        from vllm.v1.kv_cache_interface import FullAttentionSpec

        from omni_cache.cache.latent_store import LatentStore

        for gid, group in enumerate(kv_cache_config.kv_cache_groups):
            if isinstance(group.kv_cache_spec, FullAttentionSpec):
                self.group_id, self.layer_name = gid, group.layer_names[0]
                self.block_size = group.kv_cache_spec.block_size
                break
        else:
            raise RuntimeError("hidden-state cache: the model has no full-attention KV-cache group")
        # On CUDA with host storage, one step's rows must fit one entry of the copy ring.
        staging = max_step_tokens if self.device.type == "cuda" else None
        self.store = LatentStore(
            self.dims,
            kv_cache_config.num_blocks,
            self.block_size,
            storage=self.options.storage,
            device=self.device,
            staging_tokens=staging,
        )
        logger.info(
            "hidden-state cache: mirroring KV group %d (%d blocks x %d slots), latents %s, %.1f MiB in %s memory",
            self.group_id,
            kv_cache_config.num_blocks,
            self.block_size,
            ", ".join(f"{n}[{d}]" for n, (d, _) in self.dims.items()),
            self.store.nbytes / 2**20,
            self.options.storage,
        )

    # ---- per step --------------------------------------------------------------------------
    def on_step(
        self, sched: Any, state: Any, req_ids: list[str], token_ids: torch.Tensor | None = None, prompt_lens: Any = None
    ) -> None:
        """Called after the forward pass, before sampling. `state` is the runner's
        ExecuteModelState; `req_ids` the batch order its token rows follow; `token_ids` the step's
        input ids in that order and `prompt_lens[i]` the prompt length of `req_ids[i]` (read only
        for `options.merged`)."""
        num_tokens = sched.total_num_scheduled_tokens
        if num_tokens == 0:
            return
        start_of = self._start_positions(sched)
        media = None
        if self.options.merged is not None:
            media = self._media_rows(token_ids[:num_tokens], sched, req_ids, prompt_lens, start_of)
        computed = self._step_latents(state, num_tokens, media)
        if self.store is not None:
            # A hit that ends inside a block (prefix_match_unit below the block size) gets a private
            # copy of the shared block: vLLM copies its KV before this step's forward, the mirror
            # copies its rows before this step's writes, or the copy's rows would be stale.
            copies = getattr(sched, "kv_cache_block_copies", None) or ()
            self.store.copy_blocks([(c.src_block_id, c.dst_block_id) for c in copies])
            # All of the step's writes go before any gather: a request admitted in this step may
            # hit blocks that another request of the same step is computing right now.
            self.store.write(state.slot_mappings[self.layer_name][:num_tokens], computed)
            hits = self._admitted_with_hits(sched)
        else:
            hits = {}
        if computed and computed[next(iter(computed))].device.type != "cpu":
            computed = {n: t.to("cpu") for n, t in computed.items()}
        offset = 0
        for req_id in req_ids:
            n = sched.num_scheduled_tokens.get(req_id, 0)
            if n == 0:
                continue
            rows = {name: t[offset : offset + n] for name, t in computed.items()}
            if req_id in hits:
                self.pending[req_id].append(self._gather_with(*hits[req_id], rows))
            else:
                self.pending[req_id].append(LatentChunk(start_of[req_id], rows))
            offset += n
        self.counters.rows_computed += num_tokens
        self.counters.steps += 1

    def drain(self, req_id: str) -> list[LatentChunk]:
        return self.pending.pop(req_id, [])

    def discard(self, req_id: str) -> None:
        self.pending.pop(req_id, None)

    # ---- helpers ---------------------------------------------------------------------------
    def _step_latents(self, state: Any, num_tokens: int, media: torch.Tensor | None) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        if self.options.hidden:
            out[HIDDEN] = state.hidden_states[:num_tokens]
        # vLLM returns aux hidden states in ascending layer order.
        taps = {idx: t[:num_tokens] for idx, t in zip(self.options.taps, state.aux_hidden_states or ())}
        for idx in self.options.layers:
            out[layer_name(idx)] = taps[idx]
        if self.options.merged is not None:
            layer, media_layer = self.options.merged
            rows = taps[layer]
            if media is not None:
                # A fresh tensor: no longer a view of a buffer the runner reuses.
                rows = torch.where(media.to(rows.device)[:, None], taps[media_layer], rows)
            out[merged_name(layer, media_layer)] = rows
        return {name: self._owned(t) for name, t in out.items()}

    def _media_rows(
        self, token_ids: torch.Tensor, sched: Any, req_ids: list[str], prompt_lens: Any, start_of: dict[str, int]
    ) -> torch.Tensor | None:
        """Which of the step's rows are prompt positions holding a media placeholder (None: none).
        Only prompt positions: a generated token is embedded as text even if it is a placeholder
        id (vLLM places encoder outputs at the prompt's placeholder runs alone)."""
        mask = torch.isin(token_ids, self.media_ids)
        if not bool(mask.any()):
            return None
        offset = 0
        for i, req_id in enumerate(req_ids):
            n = sched.num_scheduled_tokens.get(req_id, 0)
            if n == 0:
                continue
            # A decode step, or a resumed request re-prefilling its prompt and its answer so far.
            generated_from = offset + max(0, int(prompt_lens[i]) - start_of[req_id])
            mask[generated_from : offset + n] = False
            offset += n
        return mask

    def _owned(self, rows: torch.Tensor) -> torch.Tensor:
        """`rows`, copied if they live in a buffer the runner reuses next step."""
        if self.reused and rows.untyped_storage().data_ptr() in self.reused:
            return rows.clone()
        return rows

    def _admitted_with_hits(self, sched: Any) -> dict[str, tuple[list[int], int]]:
        """Requests that got (new) block tables with num_computed_tokens > 0: vLLM skipped their
        first num_computed_tokens tokens, so their latents come from the mirror."""
        hits = {}
        for req in sched.scheduled_new_reqs:
            if req.num_computed_tokens > 0:
                hits[req.req_id] = (req.block_ids[self.group_id], req.num_computed_tokens)
        cached = sched.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            if req_id in cached.resumed_req_ids and cached.num_computed_tokens[i] > 0:
                block_ids = cached.new_block_ids[i]
                if block_ids is not None:
                    hits[req_id] = (block_ids[self.group_id], cached.num_computed_tokens[i])
        return hits

    def _gather_with(self, block_ids: list[int], num_tokens: int, step_rows: dict[str, torch.Tensor]) -> LatentChunk:
        """One chunk from position 0: the `num_tokens` prefix rows vLLM skipped, gathered from the
        mirror, followed by the rows this step computed for the request (which start right at
        `num_tokens`). One buffer per latent, in host memory since the rows leave the process:
        handing prefix and step rows out as two chunks would cost a second copy of the whole
        prefix when the stage joins them for its first message."""
        out = {}
        for name, (dim, dtype) in self.store.specs.items():
            n = step_rows[name].shape[0]
            out[name] = torch.empty(num_tokens + n, dim, dtype=dtype)
            out[name][num_tokens:].copy_(step_rows[name])
        self.store.gather_prefix(block_ids, num_tokens, {name: t[:num_tokens] for name, t in out.items()})
        self.counters.rows_served += num_tokens
        return LatentChunk(0, out)

    @staticmethod
    def _start_positions(sched: Any) -> dict[str, int]:
        start = {r.req_id: r.num_computed_tokens for r in sched.scheduled_new_reqs}
        cached = sched.scheduled_cached_reqs
        start.update(zip(cached.req_ids, cached.num_computed_tokens))
        return start
