"""Qwen2.5-Omni's talker inputs, built from what the thinker stage emits, as transformers' reference
`Qwen2_5OmniForConditionalGeneration.generate(..., return_audio=True)` builds them.

The talker reads one thinker row per position: the thinker's final hidden state plus its token
embedding, zero at image/audio/video placeholder positions (the reference zeroes the encoder output
there before adding). The embedding is the checkpoint's thinker embedding row of the token, so the
thinker stage emits only its final hidden states (`latents: {hidden: true}`); the hidden-state
cache keeps them, so a prompt prefix the thinker skipped still has its rows. With the thinker's
prompt of L positions and answer tokens a_0, a_1, ...:

* the talker prompt is L + 2 rows: the L prompt rows; the speaker's text-bos embedding (a thinker
  token of the speaker, `spk_dict.pt`'s ``bos_token``) plus the codec pad embedding; the row of a_0
  plus the codec bos embedding. Its M-RoPE positions are the thinker's layout over the prompt ids
  followed by [speaker bos, a_0] (`omni_cache.models.talker_positions`);
* decode step s feeds the code sampled at step s plus text row s: the rows of a_1, a_2, ... (each
  known once the thinker has fed that token, i.e. one step after it was sampled), then the text-eos
  embedding, then the text-pad embedding for ever. The thinker's last token (end of turn, or the
  token that hit max_tokens) is never fed, so it has no row, and the reference does not speak it
  either.

The talker's own prefix cache keys on the speaker by construction: the prompt's rows are equal for
two speakers up to the speaker row, so vLLM's hashes of the prompt embeddings share the blocks
before it and differ from its block on.

Torch only (no vLLM): the talker stage's hand-off (`omni_cache.handoff`) calls it. It reads the
thinker's embedding rows for three tokens, the talker's codec embedding table and the speakers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from omni_cache.cache.latent_rows import HIDDEN
from omni_cache.models.handoff_jobs import FeedJob, GenerateJob, HandoffContext, RowStream, Upstream, codec_logits_args
from omni_cache.models.qwen3_omni_talker_prompt import THINKER_EMBEDDINGS, EmbeddingRows
from omni_cache.models.talker_positions import VisionTokens, talker_positions
from omni_cache.models.voices import load_speakers, resolve_voice

#: The talker's codec embedding table in the checkpoint (thinker-wide rows).
CODEC_EMBEDDINGS = "talker.model.embed_tokens.weight"
#: transformers' `generate` default speaker.
DEFAULT_SPEAKER = "Chelsie"
#: transformers' reference samples the talker with this repetition penalty (its
#: `talker_repetition_penalty` default).
TALKER_REPETITION_PENALTY = 1.05


class Qwen25TalkerInput:
    """Everything the talker's inputs need from the checkpoint, loaded once per stage."""

    def __init__(self, config: dict, codec_table: torch.Tensor, rows: EmbeddingRows, speakers: dict) -> None:
        thinker, talker = config["thinker_config"], config["talker_config"]
        self.vision = VisionTokens(
            image_id=thinker["image_token_index"],
            video_id=thinker["video_token_index"],
            vision_start_id=thinker["vision_start_token_id"],
            spatial_merge_size=int(talker.get("spatial_merge_size", 2)),
            position_id_per_seconds=float(talker.get("position_id_per_seconds", 25)),
            audio_id=thinker["audio_token_index"],
            audio_start_id=thinker["audio_start_token_id"],
            interleave_chunk_s=float(talker.get("seconds_per_chunk", 2)),
        )
        self.codec_pad_id = int(talker["tts_codec_pad_token_id"])
        self.codec_bos_id = int(talker["tts_codec_start_token_id"])
        self.codec_eos_id = int(talker["tts_codec_end_token_id"])
        self.codec_mask_id = int(talker["tts_codec_mask_token_id"])
        self.media_ids = frozenset(
            int(thinker[k]) for k in ("audio_token_index", "image_token_index", "video_token_index")
        )
        self.speakers = {name: int(entry["bos_token"]) for name, entry in speakers.items()}
        self.default_speaker = DEFAULT_SPEAKER if DEFAULT_SPEAKER in self.speakers else sorted(self.speakers)[0]
        self.embedding_rows = rows
        self._codec = codec_table
        eos_pad = rows([int(talker["tts_text_end_token_id"]), int(talker["tts_text_pad_token_id"])])
        self.text_eos, self.text_pad = eos_pad[0], eos_pad[1]

    @classmethod
    def load(cls, folder: str | Path) -> Qwen25TalkerInput:
        from safetensors import safe_open

        folder = Path(folder)
        config = json.loads((folder / "config.json").read_text())
        codec: torch.Tensor | None = None
        rows: EmbeddingRows | None = None
        for file in sorted(folder.glob("*.safetensors")):
            with safe_open(str(file), "pt") as f:
                for name in f.keys():
                    if name == THINKER_EMBEDDINGS:
                        rows = EmbeddingRows(file, name)
                    elif name == CODEC_EMBEDDINGS:
                        codec = f.get_tensor(name)
        if rows is None or codec is None:
            raise ValueError(f"{folder}: no {THINKER_EMBEDDINGS} / {CODEC_EMBEDDINGS} (not a Qwen2.5-Omni checkpoint?)")
        return cls(config, codec, rows, load_speakers(folder))

    def speaker(self, voice: str) -> str:
        """The checkpoint's speaker for a request's voice ("" = the default); ValueError naming the
        valid ones for an unknown name."""
        return resolve_voice(voice, list(self.speakers), self.default_speaker)

    def rows(self, hidden: torch.Tensor, token_ids: list[int]) -> torch.Tensor:
        """The talker's thinker rows of these positions: hidden state plus token embedding, the
        embedding zero at media placeholders (as the reference's `generate` adds them)."""
        embeds = self.embedding_rows(token_ids).to(hidden.dtype)
        media = torch.tensor([t in self.media_ids for t in token_ids], dtype=torch.bool)
        if bool(media.any()):
            embeds[media] = 0
        return hidden + embeds

    def codec_rows(self, ids: list[int], dtype: torch.dtype) -> torch.Tensor:
        return self._codec[torch.tensor(ids)].to(dtype)

    def prompt(self, rows: torch.Tensor, speaker: str) -> torch.Tensor:
        """The talker prompt [L + 2, dim] from the thinker rows of the L prompt positions and of
        the first answer token ([L + 1, dim], from `rows`)."""
        dtype = rows.dtype
        bos = self.embedding_rows([self.speakers[speaker]]).to(dtype)[0]
        pad_bos = self.codec_rows([self.codec_pad_id, self.codec_bos_id], dtype)
        # The reference adds the codec embeddings to the last two rows inside the talker's
        # forward, in the talker's dtype; so do we (same operands, same order).
        return torch.cat([rows[:-1], (bos + pad_bos[0])[None], (rows[-1] + pad_bos[1])[None]])

    def prompt_ids(self, prompt_token_ids: list[int], first_answer_token: int, speaker: str) -> list[int]:
        """The ids the talker prompt stands for (what the reference's rope index reads)."""
        return [*prompt_token_ids, self.speakers[speaker], first_answer_token]

    def positions(
        self,
        ids: list[int],
        image_grids: list[list[int]],
        video_grids: list[list[int]] | None = None,
        video_seconds_per_grid: list[float] | None = None,
    ) -> tuple[torch.Tensor, int]:
        return talker_positions(ids, self.vision, image_grids, video_grids, video_seconds_per_grid)

    def penalized_prompt_ids(self) -> list[int]:
        """The talker's prompt ids as the reference's repetition penalty sees them: codec mask at
        every thinker position, then codec pad and codec bos."""
        return [self.codec_mask_id, self.codec_pad_id, self.codec_bos_id]

    def stop_ids(self) -> list[int]:
        """Where the reference's talker stops: codec pad and codec end (its `talker_eos_token_id`)."""
        return [self.codec_pad_id, self.codec_eos_id]


# ---- the stage hand-off (stage_configs/qwen2_5_omni.yaml: the talker's `handoff`) --------------
def thinker_to_talker(ctx: HandoffContext, up: Upstream, state: dict) -> list[GenerateJob | FeedJob]:
    """Qwen2.5-Omni's talker over the thinker's output, as transformers' reference builds it, streamed
    (`omni_cache.models.qwen2_5_omni_talker_input` says what each row is).

    One talker request per answer, started once the thinker has sent the row of the answer's first
    token (the thinker's second output): the prompt rows, the speaker row, that row. Every later row
    is one step's text, fed to the running request as it arrives; when the thinker finishes, the
    text-eos row follows, then the text-pad row for ever. A step ahead of the thinker waits for its
    row (scheduler/streamed_rows.py), so the codes do not depend on timing. Reads the thinker's
    final hidden states (`latents: {hidden: true}`) and its prompt ids (sent with its first
    output); each row adds the token's embedding, read by id from the checkpoint.
    """
    talker = _qwen2_5_omni_input(ctx)
    hidden = up.latents.get(HIDDEN)
    if hidden is None:
        raise ValueError(
            f"the Qwen2.5-Omni talker needs the thinker's latents.hidden; it sent {sorted(up.latents) or 'none'}"
        )
    n_prompt = len(up.prompt_token_ids)
    if not n_prompt:
        raise ValueError("the thinker sent no prompt token ids (needed for the talker's rows and positions)")
    ids = [*up.prompt_token_ids, *up.token_ids]
    known = min(hidden.shape[0], len(ids))  # positions whose row is known
    if not state.get("started"):
        if known <= n_prompt and not up.finished:
            return []
        speaker = talker.speaker(up.voice)
        head = min(known, n_prompt + 1)
        rows = talker.rows(hidden[:head], ids[:head])
        if known <= n_prompt:
            # The answer ended before its first token was fed (a one-token answer): its first row
            # is the end of the text, as if the answer were empty.
            rows = torch.cat([rows[:n_prompt], talker.text_eos.to(rows.dtype)[None]])
        first = up.token_ids[0] if up.token_ids else up.prompt_token_ids[-1]
        rope_ids = talker.prompt_ids(list(up.prompt_token_ids), first, speaker)
        positions, delta = talker.positions(rope_ids, up.image_grids, up.video_grids, up.video_seconds_per_grid)
        state.update(started=True, rows_done=max(known, n_prompt + 1))
        text = _qwen2_5_omni_text(talker, hidden, ids, n_prompt + 1, known, up.finished)
        state["rows_finished"] = up.finished
        return [
            GenerateJob(
                prompt_embeds=talker.prompt(rows, speaker),
                stream=RowStream(talker.text_pad.to(rows.dtype), text, up.finished),
                last=True,
                stop_token_ids=talker.stop_ids(),
                extra_args=talker_logits(talker),
                positions=(positions, delta) if delta else None,
            )
        ]
    if state.get("rows_finished") or (known <= state["rows_done"] and not up.finished):
        return []
    text = _qwen2_5_omni_text(talker, hidden, ids, state["rows_done"], known, up.finished)
    state.update(rows_done=max(known, state["rows_done"]), rows_finished=up.finished)
    return [FeedJob(text, up.finished)]


def _qwen2_5_omni_text(
    talker: Any, hidden: torch.Tensor, ids: list[int], start: int, stop: int, finished: bool
) -> torch.Tensor:
    """Text rows start..stop-1 (hidden state plus embedding), then text-eos once finished."""
    rows = talker.rows(hidden[start:stop], ids[start:stop]) if stop > start else hidden[:0]
    return torch.cat([rows, talker.text_eos.to(rows.dtype)[None]]) if finished else rows


def _qwen2_5_omni_input(ctx: HandoffContext) -> Any:
    if "qwen2_5_omni_input" not in ctx.resources:
        ctx.resources["qwen2_5_omni_input"] = Qwen25TalkerInput.load(ctx.model_path)
    return ctx.resources["qwen2_5_omni_input"]


def talker_logits(talker: Any) -> dict[str, Any]:
    """The reference's talker `generate` rule for `talker` (a `Qwen25TalkerInput`): HF's repetition
    penalty 1.05 over its input ids (a prompt of embeddings has none, so the reference's codec mask,
    pad and bos are given) and the generated codes; codec bos suppressed (workers/codec_logits.py)."""
    bos = talker.codec_bos_id
    return codec_logits_args(
        TALKER_REPETITION_PENALTY, (bos, bos + 1), keep=[], prompt_ids=talker.penalized_prompt_ids()
    )
