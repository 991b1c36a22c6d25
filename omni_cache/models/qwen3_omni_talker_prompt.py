"""Qwen3-Omni's talker inputs, built from what the thinker stage emits, as transformers' reference
`Qwen3OmniMoeForConditionalGeneration.generate(..., return_audio=True)` builds them.

From the thinker, per token: its id, its input embedding (layer tap 0: the embedding row at text
positions, the encoder output at image/audio positions) and its hidden state after the talker's
`accept_hidden_layer`. At a text position the input embedding is the checkpoint's thinker embedding
row of the token (`EmbeddingRows`), bitwise what the thinker's tap holds, so the text of the answer
needs only its token ids. From those:

* the talker prompt: the user turns only (system turns and earlier assistant turns are dropped),
  each position projected into the talker's space, by `hidden_projection` of the accept-layer
  state at image/audio/video positions and by `text_projection` of the input embedding elsewhere;
  then 9 assistant rows: the first three tokens of the last assistant turn, four `tts_pad` rows,
  `tts_bos`, and the turn's fourth token, each plus a codec embedding (nothing for the first three;
  then nothink, think_bos, think_eos, the speaker, codec_pad, codec_bos);
* the text the talker speaks, one row per decode step: `text_projection` of every later token's
  input embedding (`text`), then `tts_eos`, then `tts_pad` for ever.

Torch only (no vLLM): the talker stage's hand-off calls it (`omni_cache.handoff`). Only the tensors
it needs are read from the checkpoint's weight file (two small MLPs and a few embedding rows; the
thinker's embedding rows are read from the memory-mapped file one token at a time).
M-RoPE positions (`positions`): plain positions along the talker's own sequence (user turns, then
the assistant rows), except at an image's tokens, which take its grid's (t, h, w) positions, the
text after it going on from their maximum plus one, as the reference's rope index does. A
video's tokens take its grid's positions likewise, its temporal index scaled to time: patch k at
``int(k * seconds_per_grid * position_id_per_seconds)`` (the talker config's rate, 25 by
default). Audio positions are plain (the reference's too), and so are a video's interleaved with
its sound track (``use_audio_in_video``): the reference talker's rope index is not told of it
and reads such a video (vision_start followed by audio_start) as an audio item.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from omni_cache.cache.latent_rows import layer_name, merged_name
from omni_cache.models.handoff_jobs import FeedJob, GenerateJob, HandoffContext, RowStream, Upstream, codec_logits_args
from omni_cache.models.talker_positions import VisionTokens, talker_positions
from omni_cache.models.talker_projection import Projection, ProjectionMemo

#: How many thinker rows of the assistant turn the talker prompt takes (the rest is its text).
ASSISTANT_PROMPT_ROWS = 4
#: Talker prompt rows after the user turns: 3 role rows, 4 tts_pad, tts_bos, the first text row.
ASSISTANT_ROWS = 9
DEFAULT_SPEAKER = "ethan"


class EmbeddingRows:
    """Rows of one embedding table in a safetensors file, read on demand from the memory-mapped
    file (Qwen3-Omni-30B's thinker table is 0.6 GB; a talker stage reads a few rows per step)."""

    def __init__(self, file: Path, name: str) -> None:
        from safetensors import safe_open

        self._table = safe_open(str(file), "pt").get_slice(name)

    def __call__(self, token_ids: list[int]) -> torch.Tensor:
        """[len(token_ids), dim], in the file's dtype."""
        if not token_ids:
            return self._table[0:0]
        return torch.cat([self._table[t : t + 1] for t in token_ids])


#: The thinker's input embedding table in the checkpoint.
THINKER_EMBEDDINGS = "thinker.model.embed_tokens.weight"


class TalkerPrompt:
    """Everything the talker's inputs need from the checkpoint, loaded once per stage."""

    def __init__(
        self, config: dict, tensors: dict[str, torch.Tensor], dtype: torch.dtype, embedding_rows: EmbeddingRows
    ) -> None:
        thinker, talker = config["thinker_config"], config["talker_config"]
        self.accept_hidden_layer = int(talker["accept_hidden_layer"])
        self.im_start_id = config["im_start_token_id"]
        self.user_id, self.assistant_id = config["user_token_id"], config["assistant_token_id"]
        #: The image, audio and video placeholder ids (a tensor: user_rows tests them with isin).
        self.media_ids = torch.tensor(
            sorted({thinker[k] for k in ("audio_token_id", "image_token_id", "video_token_id")}), dtype=torch.long
        )
        self.vision = VisionTokens(
            image_id=thinker["image_token_id"],
            video_id=thinker["video_token_id"],
            vision_start_id=thinker["vision_start_token_id"],
            spatial_merge_size=int(talker.get("spatial_merge_size", 2)),
            position_id_per_seconds=float(talker.get("position_id_per_seconds", 25)),
        )
        self.tts_pad_id = config["tts_pad_token_id"]
        self.speakers = {name.lower(): i for name, i in talker["speaker_id"].items()}
        self.codec_eos_id = talker["codec_eos_token_id"]
        self.talker_vocab_size = talker["text_config"]["vocab_size"]
        self.text_projection = _projection(tensors, "talker.text_projection", dtype)
        self.hidden_projection = _projection(tensors, "talker.hidden_projection", dtype)
        # A session's every request projects its user turns so far: reuse what was projected.
        self._text_memo, self._media_memo = ProjectionMemo(self.text_projection), ProjectionMemo(self.hidden_projection)
        #: token ids -> the thinker's input embedding rows (its tap 0 at text positions).
        self.embedding_rows = embedding_rows
        tts = embedding_rows([config["tts_bos_token_id"], config["tts_eos_token_id"], config["tts_pad_token_id"]])
        self.tts_bos, self.tts_eos, self.tts_pad = self.text_projection(tts.to(dtype))
        self._codec_table = tensors["talker.model.codec_embedding.weight"].to(dtype)
        self._codec_specials = [
            talker["codec_nothink_id"],
            talker["codec_think_bos_id"],
            talker["codec_think_eos_id"],
            None,
            talker["codec_pad_id"],
            talker["codec_bos_id"],
        ]

    @classmethod
    def load(cls, folder: str | Path, dtype: torch.dtype = torch.float32) -> TalkerPrompt:
        from safetensors import safe_open

        folder = Path(folder)
        config = json.loads((folder / "config.json").read_text())
        wanted = ("talker.text_projection.", "talker.hidden_projection.", "talker.model.codec_embedding.weight")
        tensors: dict[str, torch.Tensor] = {}
        embeddings: EmbeddingRows | None = None
        for file in sorted(folder.glob("*.safetensors")):
            with safe_open(str(file), "pt") as f:
                for name in f.keys():
                    if name == THINKER_EMBEDDINGS:
                        embeddings = EmbeddingRows(file, name)
                    elif name.startswith(wanted):
                        tensors[name] = f.get_tensor(name)
        if embeddings is None:
            raise ValueError(f"{folder}: no {THINKER_EMBEDDINGS} in its safetensors files")
        return cls(config, tensors, dtype, embeddings)

    # ---- the prompt --------------------------------------------------------------------------
    def assistant_start(self, token_ids: list[int]) -> int:
        """Position of the last `<|im_start|>` followed by the assistant role."""
        for i in range(len(token_ids) - 2, -1, -1):
            if token_ids[i] == self.im_start_id and token_ids[i + 1] == self.assistant_id:
                return i
        raise ValueError("the prompt has no assistant turn to speak (no <|im_start|> + assistant role)")

    def rows_needed(self, prompt_token_ids: list[int]) -> int:
        """Thinker rows the talker prompt needs: up to the assistant turn's fourth token."""
        return self.assistant_start(prompt_token_ids) + ASSISTANT_PROMPT_ROWS

    def user_positions(self, prompt_token_ids: list[int]) -> list[int]:
        """Positions of the user turns: from their `<|im_start|>` to the next one."""
        return self.user_index(torch.tensor(prompt_token_ids, dtype=torch.long)).tolist()

    def user_index(self, ids: torch.Tensor) -> torch.Tensor:
        """:meth:`user_positions` of a [n] tensor of token ids, as a tensor. Computed on the whole
        tensor at once: a session's every request has all its user turns so far (2,000 positions
        after five 30 s turns), which a loop over the tokens took 0.5 ms a call to walk."""
        starts = (ids == self.im_start_id).nonzero().squeeze(1)
        if starts.numel() == 0:
            return starts
        follows = starts + 1 < ids.shape[0]
        is_user = torch.zeros_like(follows)
        is_user[follows] = ids[starts[follows] + 1] == self.user_id
        lengths = torch.diff(starts, append=starts.new_tensor([ids.shape[0]]))
        starts, lengths = starts[is_user], lengths[is_user]
        # Turn k's positions are starts[k] + 0 .. lengths[k] - 1: one arange over all of them,
        # each turn's part shifted from where it lands in the arange to where the turn starts.
        shift = starts - (torch.cumsum(lengths, 0) - lengths)
        return torch.arange(int(lengths.sum())) + torch.repeat_interleave(shift, lengths)

    def build(
        self, prompt_token_ids: list[int], embeds: torch.Tensor, accept: torch.Tensor, speaker: str = DEFAULT_SPEAKER
    ) -> torch.Tensor:
        """The talker prompt [L, hidden] from the prompt's ids and the thinker rows 0 ..
        `rows_needed` - 1 (a thinker that stopped earlier gives fewer: the turn's fourth row is
        then missing, as in the reference)."""
        speaker_id = self.speakers.get(speaker.lower())
        if speaker_id is None:
            raise ValueError(f"unknown speaker {speaker!r}; this checkpoint has {sorted(self.speakers)}")
        start = self.assistant_start(prompt_token_ids)
        user_rows = self.user_rows(prompt_token_ids[:start], embeds, accept)
        dtype = self.tts_pad.dtype
        turn = self.text_projection(embeds[start : start + ASSISTANT_PROMPT_ROWS].to(dtype))
        text = torch.cat([turn[:3], self.tts_pad.expand(4, -1), self.tts_bos[None], turn[3:4]])
        codec_ids = [speaker_id if c is None else c for c in self._codec_specials]
        codec = torch.cat([torch.zeros(3, text.shape[-1], dtype=dtype), self._codec_table[torch.tensor(codec_ids)]])
        return torch.cat([user_rows, text + codec[: text.shape[0]]])

    def user_rows(self, token_ids: list[int], embeds: torch.Tensor, accept: torch.Tensor) -> torch.Tensor:
        """The talker rows of the user turns among the positions of ``token_ids`` [n, hidden].

        Row k depends only on thinker row k and on its rank among the text (or media) rows
        (``talker_projection.PROJECTION_BLOCK``), so the rows of a prompt that ends inside a user
        turn (a listening request's talker prompt) are bitwise the first rows of the turn's whole
        prompt, given bitwise equal thinker rows: the talker's prefix cache, which hashes its
        prompt embeddings, then hits them. Whole blocks a recent call projected from bitwise the
        same thinker rows are taken from it (``ProjectionMemo``): a session's every request has
        its conversation's user turns so far."""
        ids = torch.tensor(token_ids, dtype=torch.long)
        index = self.user_index(ids)
        media = torch.isin(ids[index], self.media_ids)
        dtype = self.tts_pad.dtype
        # Text rows through text_projection, media rows through hidden_projection, each projected
        # only where it is used (an image prompt is mostly media rows). index_select and
        # index_copy_ rather than a mask: a long conversation's rows are megabytes, and these
        # copy them several times faster.
        rows = torch.empty(index.shape[0], self.tts_pad.shape[-1], dtype=dtype)
        for memo, source, at in (
            (self._text_memo, embeds, (~media).nonzero().squeeze(1)),
            (self._media_memo, accept, media.nonzero().squeeze(1)),
        ):
            if at.numel():
                rows.index_copy_(0, at, memo(source.index_select(0, index[at]).to(dtype)))
        return rows

    def listening_positions(
        self,
        prompt_token_ids: list[int],
        image_grids: list[list[int]],
        video_grids: list[list[int]] | None = None,
        video_seconds_per_grid: list[float] | None = None,
    ) -> tuple[torch.Tensor, int]:
        """M-RoPE positions of a listening request's talker prompt (:meth:`user_rows` of a thinker
        prompt that ends inside the user's turn): the first positions of the answer's
        talker prompt (a media item's positions depend only on what precedes it)."""
        return talker_positions(
            self._user_ids(prompt_token_ids), self.vision, image_grids, video_grids, video_seconds_per_grid
        )

    def talker_ids(self, prompt_token_ids: list[int]) -> list[int]:
        """The token ids the talker prompt stands for: the user turns' ids, then tts_pad ids for
        the assistant rows (what the reference's rope index reads)."""
        start = self.assistant_start(prompt_token_ids)
        return self._user_ids(prompt_token_ids[:start]) + [self.tts_pad_id] * ASSISTANT_ROWS

    def _user_ids(self, token_ids: list[int]) -> list[int]:
        """The token ids of the user turns among ``token_ids``."""
        ids = torch.tensor(token_ids, dtype=torch.long)
        return ids[self.user_index(ids)].tolist()

    def positions(
        self,
        prompt_token_ids: list[int],
        image_grids: list[list[int]],
        video_grids: list[list[int]] | None = None,
        video_seconds_per_grid: list[float] | None = None,
    ) -> tuple[torch.Tensor, int]:
        """The talker prompt's M-RoPE positions [3, L] and the decode delta (positions of later
        steps are their index plus it): `omni_cache.models.talker_positions`."""
        return talker_positions(
            self.talker_ids(prompt_token_ids), self.vision, image_grids, video_grids, video_seconds_per_grid
        )

    def text(self, embeds: torch.Tensor) -> torch.Tensor:
        """Talker text rows of thinker rows (their input embeddings), one per decode step."""
        if embeds.shape[0] == 0:
            return self.tts_pad.new_zeros(0, self.tts_pad.shape[-1])
        return self.text_projection(embeds.to(self.tts_pad.dtype))


def _projection(tensors: dict[str, torch.Tensor], prefix: str, dtype: torch.dtype) -> Projection:
    try:
        return Projection(
            *(
                tensors[f"{prefix}.{n}"].to(dtype)
                for n in ("linear_fc1.weight", "linear_fc1.bias", "linear_fc2.weight", "linear_fc2.bias")
            )
        )
    except KeyError as exc:
        raise ValueError(f"the checkpoint lacks {exc.args[0]} (not a Qwen3-Omni checkpoint?)") from None


# ---- the stage hand-off (stage_configs/qwen3_omni.yaml: the talker's `handoff`) ----------------
# transformers' reference samples Qwen3-Omni's talker with this repetition penalty (its
# `talker_repetition_penalty` default); the pipeline applies the same rule (workers/codec_logits.py).
TALKER_REPETITION_PENALTY = 1.05


def thinker_to_talker(ctx: HandoffContext, up: Upstream, state: dict) -> list[GenerateJob | FeedJob]:
    """Qwen3-Omni's talker over the thinker's output, as transformers' reference builds it, streamed.

    One talker request per answer. It starts once the thinker's first output (the prompt's rows)
    and the answer's first token are in (the talker prompt: the user turn, then the assistant part
    with the speaker's codec specials; `omni_cache.models.qwen3_omni_talker_prompt`). Every later
    token of the answer is one row of text for one talker decode step, fed to the running request
    as it arrives; when the thinker finishes, the end-of-speech row follows, then pad rows. A
    talker step that is ahead of the thinker waits for its row (scheduler/streamed_rows.py), so
    the codes do not depend on timing.

    Reads the thinker's layer tap 0 (input embeddings) at the prompt's text positions and its
    `accept_hidden_layer` state at image/audio positions, and its prompt token ids (sent with its
    first output): from one merged latent (`latents.merged`, what stage_configs/qwen3_omni.yaml
    emits) or from the two taps (`latents.layers`). The answer's rows are its tokens' input
    embeddings, read by id from the checkpoint (`TalkerPrompt.embedding_rows`; bitwise the
    thinker's tap 0 there): the thinker hands over only the tokens whose text its client has
    (workers/spoken_tokens.py), and the last token of an answer cut by `max_tokens` has no tap row
    (it was never fed through the thinker), so the talker speaks exactly the client's text.
    """
    prompt = _qwen3_omni_prompt(ctx)
    accept_layer = prompt.accept_hidden_layer
    merged = up.latents.get(merged_name(0, accept_layer))
    if merged is not None:
        # TalkerPrompt reads embeddings only at text positions, accept states only at media ones.
        embeds = accept = merged
    else:
        embeds = up.latents.get(layer_name(0))
        accept = up.latents.get(layer_name(accept_layer))
    if embeds is None or accept is None:
        raise ValueError(
            "the Qwen3-Omni talker needs the thinker's latents.merged {layer: 0, media_layer: "
            f"{accept_layer}}} (or latents.layers [0, {accept_layer}]); it sent "
            f"{sorted(up.latents) or 'none'}"
        )
    if not up.prompt_token_ids:
        raise ValueError("the thinker sent no prompt token ids (needed to find the user turn)")
    if up.prefill_only:
        return _listening_job(prompt, embeds, accept, up, state)
    known = len(up.prompt_token_ids) + len(up.token_ids)  # positions whose row is known
    if not state.get("started"):
        need = prompt.rows_needed(up.prompt_token_ids)
        if known < need and not up.finished:
            return []
        token_ids = list(up.prompt_token_ids) + list(up.token_ids)
        head = _qwen3_omni_rows(prompt, embeds, up, 0, min(need, known))
        start = prompt.build(token_ids, head, accept, speaker=up.voice or DEFAULT_SPEAKER)
        positions, delta = prompt.positions(token_ids, up.image_grids, up.video_grids, up.video_seconds_per_grid)
        state["started"] = True
        text, done = _qwen3_omni_text(prompt, _qwen3_omni_rows(prompt, embeds, up, need, known), up.finished)
        state["rows_done"] = max(known, need)
        return [
            GenerateJob(
                prompt_embeds=start,
                stream=RowStream(prompt.tts_pad, text, done),
                last=True,
                stop_token_ids=[prompt.codec_eos_id],
                extra_args=_qwen3_omni_logits(prompt),
                positions=(positions, delta) if delta else None,
            )
        ]
    if state.get("rows_finished"):
        return []
    done_rows = state["rows_done"]
    if known <= done_rows and not up.finished:
        return []
    text, done = _qwen3_omni_text(prompt, _qwen3_omni_rows(prompt, embeds, up, done_rows, known), up.finished)
    state["rows_done"] = max(known, done_rows)
    state["rows_finished"] = done
    return [FeedJob(text, done)]


def _listening_job(
    prompt: TalkerPrompt, embeds: torch.Tensor, accept: torch.Tensor, up: Upstream, state: dict
) -> list[GenerateJob]:
    """A prefill-only request (a realtime session listening, omni_cache/serving/realtime/
    listening.py): the thinker's prompt ends inside the user's turn; the talker prefills the user
    turns' rows so far (one step, its code dropped) and its prefix cache then holds them for the
    turn's answer, whose talker prompt begins with the same rows."""
    n = len(up.prompt_token_ids)
    if state.get("started") or (embeds.shape[0] < n and not up.finished):
        return []
    if embeds.shape[0] < n:
        raise ValueError(f"the thinker sent {embeds.shape[0]} prompt rows of {n}")
    state["started"] = True
    rows = prompt.user_rows(list(up.prompt_token_ids), embeds, accept)
    if rows.shape[0] == 0:
        raise ValueError("a prefill-only talker request needs a user turn in the prompt")
    positions, delta = prompt.listening_positions(
        list(up.prompt_token_ids), up.image_grids, up.video_grids, up.video_seconds_per_grid
    )
    return [
        GenerateJob(
            prompt_embeds=rows,
            # No decode step reads a text row (one code, then the end); pad rows if one did.
            stream=RowStream(prompt.tts_pad, prompt.tts_pad.new_zeros(0, prompt.tts_pad.shape[-1]), done=True),
            max_tokens=1,
            last=True,
            stop_token_ids=[prompt.codec_eos_id],
            extra_args=_qwen3_omni_logits(prompt),
            positions=(positions, delta) if delta else None,
        )
    ]


def _qwen3_omni_rows(prompt: Any, embeds: torch.Tensor, up: Upstream, start: int, stop: int) -> torch.Tensor:
    """The thinker's input-embedding rows of positions start..stop-1: the prompt's from its tap,
    the answer's by token id from the checkpoint (in the tap's dtype)."""
    n_prompt = len(up.prompt_token_ids)
    if stop <= start:
        return embeds[:0]
    if min(stop, n_prompt) > embeds.shape[0]:
        raise ValueError(f"the thinker sent {embeds.shape[0]} prompt rows of {n_prompt}")
    parts = [embeds[start : min(stop, n_prompt)]]
    if stop > n_prompt:
        ids = up.token_ids[max(start - n_prompt, 0) : stop - n_prompt]
        parts.append(prompt.embedding_rows(ids).to(embeds.dtype))
    return torch.cat(parts)


def _qwen3_omni_text(prompt: Any, rows: torch.Tensor, finished: bool) -> tuple[torch.Tensor, bool]:
    """Talker text rows of these thinker rows, plus the end-of-speech row at the end."""
    text = prompt.text(rows)
    if finished:
        text = torch.cat([text, prompt.tts_eos.reshape(1, -1)])
    return text, finished


def _qwen3_omni_prompt(ctx: HandoffContext) -> Any:
    if "qwen3_omni_prompt" not in ctx.resources:
        ctx.resources["qwen3_omni_prompt"] = TalkerPrompt.load(ctx.model_path)
    return ctx.resources["qwen3_omni_prompt"]


def _qwen3_omni_logits(prompt: Any) -> dict[str, Any]:
    # The talker's vocabulary ends with 1,024 control codes transformers never samples but EOS.
    vocab = prompt.talker_vocab_size
    return codec_logits_args(TALKER_REPETITION_PENALTY, (vocab - 1024, vocab), keep=[prompt.codec_eos_id])
