"""Qwen2.5-Omni's token2wav as a streaming decoder: one-codebook codes ``[1, T]`` -> 24 kHz waveform.

The networks are transformers' ``Qwen2_5OmniToken2WavModel`` (a DiT flow-matching mel generator and a
BigVGAN vocoder), built from ``token2wav_config`` of a ``Qwen2_5OmniModel`` folder and loaded with only
its ``token2wav.*`` tensors, in float32 as transformers runs them; the speakers are the folder's
``spk_dict.pt`` (``cond`` and ``ref_mel`` per voice). Used as a library: the DiT's forward, the
reference's RK4 solver and the vocoder are transformers' own; this module only decides what each of
them sees.

Whole sequence (a window over all codes): the DiT integrates the flow from noise ``[1, 2T, 80]`` (mel
frames = ``repeats`` x codes) by RK4 over 10 time points (9 steps), guidance 0.5, sway -1 (transformers' defaults),
then BigVGAN turns the mel into ``2T * 240`` samples. Given the same noise this is transformers'
``Qwen2_5OmniToken2WavModel.forward`` op for op: measured bitwise equal on the tiny checkpoint
(:data:`WHOLE_ATOL`, 1e-6, is the bound the tests hold it to).

Noise and seed: transformers draws ``torch.randn([1, 2T, 80])`` from torch's global generator. Here a
request's noise is the same draw from a ``torch.Generator`` seeded with :attr:`CodeWindow.seed`
(the request's sampling seed, 0 when it has none; the decoder runner copies it onto every window), so
``torch.manual_seed(s)`` before the reference and seed ``s`` here give the same noise. A window needs
only the noise of its own frames: CPU ``normal_`` turns uniforms into normals 16 values at a time, so
draws whose sizes are multiples of 16 (80 per frame) are prefix-consistent (a long draw starts with a
short one's values, and pieces drawn in turn equal one draw; checked by the tests). A window over
frames ``[a, b)`` draws ``b`` frames and keeps ``[a, b)``: one fixed noise for the whole answer,
sliced per window, as the released streaming code keeps one noise tensor and slices it per chunk.

Streaming (the released low-latency code's rule; its code is not used): the DiT attends within blocks
of ``block_size`` mel frames (24 = 12 codes), some layers one block back or ahead. A window's DiT runs
over its emitted codes plus ``PAST_BLOCKS`` (2) blocks of codes before and ``FUTURE_BLOCKS`` (1) after,
block-aligned to the stream's start (``ReceptiveField.block_codes``: the window's blocks are the whole
sequence's blocks), and keeps the mel of the emitted codes. The vocoder runs over that mel plus the
window's own mel of its context, up to the vocoder's receptive field (:attr:`Token2WavDecoder.vocoder_frames`,
a bound computed from the module tree: 41 mel frames for the released upsampling), and the audio is
trimmed to the emitted codes. The reference runs chunks of 3 blocks (36 codes: set the stage's
``chunk_size`` to 36). The hand-off (``talker_to_decoder``) asks for one block first, then twice as
many up to ``chunk_size``, and ``next_window`` keeps windows on whole blocks: the windows emit 12, 24,
then 36 codes, and the first audio needs 24 codes (one block and its lookahead: 480 ms of speech).

Streamed audio is not the whole sequence's, not even in exact arithmetic: every DiT evaluation lets a
frame see one more block ahead and two more back (one look-ahead layer, two look-back layers), and
the 36 evaluations of a decode (9 RK4 steps of 4) carry that far beyond the 2 + 1 blocks of context a
window has; the vocoder also reaches up to 29 mel frames (measured on the tiny checkpoint; 41 is the
computed bound) where a window has 24 frames of future context. Chunked flow matching is an
approximation, exact only where the DiT does not mix frames across blocks.

How far the two part depends on how much the DiT mixes frames, which random weights decide. Measured
on the tiny checkpoint (192 codes = 3.84 s, seeds 0-2, both speakers, waveform std 0.13-0.15, one
code's change moving the audio by 0.07-0.12), streamed against whole-sequence audio:

- format 10 (every DiT linear at 1/sqrt(fan_in)): the hand-off's windows of the time (12, 12, 12, 12,
  24, 36, 36, 36, 12 codes) max |diff| 3.9-6.7e-3, RMS 1.6-2.1e-4; the reference's fixed 36-code chunks max
  3.7-6.7e-3, RMS 1.2-1.5e-4: an RMS error of 0.1-0.15% of the signal's.
- the DiT blocks at std 0.02 (the next tiny init: their gates shut attention out, frames barely mix):
  max 0.6-1.3e-6, RMS 1.1e-7, float32 rounding.
- either init with the DiT blocks redrawn at 1/sqrt(fan_in) (the tests' "mixing" decoder, 120 codes,
  36-code chunks): max 2.0e-4 to 5.1e-3, RMS 6.9e-6 to 1.5e-4; with no left context 0.32-0.49 (RMS
  1.7e-2). Format 10 as is: no left context 0.41, one block 6.9e-3, two (the reference) 4.5e-3, four
  the same as two: what is left comes from the single block of lookahead.

:data:`STREAM_MAX_ABS` (0.02) and :data:`STREAM_RMS` (1e-3) are the bounds the tests hold these to.
The released model was trained for this chunking, so its figure is not any of these and cannot be
measured here without its weights.

The released code vocodes each chunk's mel after the previous chunk's last 40 mel frames and trims 20
frames of audio at each side, so consecutive chunks see the same mel at their seam. A window here is
stateless (it may be batched with other requests' windows, or decoded again alone after a failed
batch), so the vocoder's context is the window's own mel of its past and future codes instead; the
seam then joins two DiT runs' views of the same frames, which differ by the amount measured above.

Speed on this CPU (2-core AMD EPYC, one torch thread, load average 3.6-4.6 from other work; best of 3,
250 codes = 5 s of audio): whole sequence 0.32-0.38 s per second of audio (DiT 0.26, vocoder 0.10);
streamed in 36-code chunks 0.59-0.64 s per second of audio (each chunk's DiT also runs over its 36
codes of context). Two torch threads on the loaded machine made the DiT about 20x slower (OpenMP
threads spinning against other processes).
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import torch

from omni_cache.models.checkpoint_files import load_prefixed
from omni_cache.models.code_windows import CodeWindow, ReceptiveField, check_window, next_window
from omni_cache.models.voices import resolve_voice

__all__ = ["DEFAULT_SPEAKER", "SAMPLE_RATE", "STREAM_MAX_ABS", "STREAM_RMS", "WHOLE_ATOL", "Token2WavDecoder"]

SAMPLE_RATE = 24000  # 100 mel frames a second x 240 samples per frame (the vocoder's upsampling)
# The reference's sampling settings (Qwen2_5OmniToken2WavModel.forward's defaults).
NUM_STEPS, GUIDANCE_SCALE, SWAY_COEFFICIENT = 10, 0.5, -1.0
# The released streaming code's DiT context, in blocks: two before the chunk, one after; chunks of 3.
PAST_BLOCKS, FUTURE_BLOCKS, CHUNK_BLOCKS = 2, 1, 3
# transformers' generate() speaks with this voice unless told otherwise.
DEFAULT_SPEAKER = "Chelsie"
# Whole-window decode vs transformers' forward (same ops: bitwise in practice), and streamed vs
# whole-sequence audio on the tiny checkpoint (chunked flow matching is approximate; see the docstring).
WHOLE_ATOL = 1e-6
STREAM_MAX_ABS, STREAM_RMS = 0.02, 1e-3
_PREFIX = "token2wav."


class Token2WavDecoder:
    """Decodes batches of :class:`CodeWindow` with transformers' token2wav (a
    :class:`~omni_cache.models.code_windows.WindowDecoder`). Each window carries its request's
    ``speaker`` (None: :data:`DEFAULT_SPEAKER`), ``seed`` and ``offset`` (where its codes sit in the
    stream, for the noise)."""

    def __init__(self, module: torch.nn.Module, speakers: dict[str, dict]):
        self.module = module.eval().requires_grad_(False)
        self.dit, self.vocoder = module.code2wav_dit_model, module.code2wav_bigvgan_model
        dit = module.config.dit_config
        self.repeats, self.mel_dim = int(dit.repeats), int(dit.mel_dim)
        if dit.block_size % self.repeats:
            raise ValueError(f"DiT block_size {dit.block_size} is not a whole number of codes (repeats {self.repeats})")
        self.block_codes = dit.block_size // self.repeats
        self.hop = math.prod(module.config.bigvgan_config.upsample_rates)
        self.num_quantizers = 1
        # The DiT embeds num_embeds + 1 ids, but its codebook is num_embeds - 1 codes (released:
        # 8193 for 8192 codes; tiny: 257 for 256): the ids from there on (the tiny talker's pad,
        # 256) are talker specials, which transformers cuts off before token2wav.
        self.codebook_size = int(dit.num_embeds) - 1
        self.samples_per_code = self.repeats * self.hop
        self.sample_rate = SAMPLE_RATE
        self.vocoder_frames = _vocoder_reach(self.vocoder)
        self.chunk_codes = CHUNK_BLOCKS * self.block_codes  # the reference's chunk: the stage's chunk_size
        self.receptive_field = ReceptiveField(
            left_codes=PAST_BLOCKS * self.block_codes,
            conv_codes=-(-self.vocoder_frames // self.repeats),
            right_codes=FUTURE_BLOCKS * self.block_codes,
            tail_samples=0,  # the vocoder's transposed convolutions give exactly hop samples a frame
            block_codes=self.block_codes,
        )
        if not speakers:
            raise ValueError("token2wav needs at least one speaker (spk_dict.pt is empty)")
        # Float32 as transformers' generate() casts them; [1, enc_emb_dim] and [1, frames, mel_dim].
        self.speakers = {
            name: (v["cond"].float().reshape(1, -1), v["ref_mel"].float().reshape(1, -1, self.mel_dim))
            for name, v in speakers.items()
        }
        self.default_speaker = DEFAULT_SPEAKER if DEFAULT_SPEAKER in self.speakers else sorted(self.speakers)[0]

    @classmethod
    def from_pretrained(cls, path: str | Path, device: str | torch.device = "cpu") -> Token2WavDecoder:
        """Build from a Qwen2.5-Omni folder, reading only the ``token2wav.*`` tensors and spk_dict.pt."""
        from transformers.models.qwen2_5_omni.configuration_qwen2_5_omni import Qwen2_5OmniToken2WavConfig
        from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniToken2WavModel

        path = Path(path)
        raw = json.loads((path / "config.json").read_text(encoding="utf-8"))
        if raw.get("model_type") != "qwen2_5_omni" or "token2wav_config" not in raw:
            raise ValueError(
                f"{path}: not a Qwen2.5-Omni checkpoint (config.json needs model_type 'qwen2_5_omni' "
                f"and a token2wav_config; got model_type {raw.get('model_type')!r})"
            )
        config = Qwen2_5OmniToken2WavConfig(**raw["token2wav_config"])
        with torch.device(device):
            module = Qwen2_5OmniToken2WavModel._from_config(config, dtype=torch.float32)
        module.load_state_dict(load_prefixed(path, _PREFIX), strict=True)
        speakers = torch.load(path / "spk_dict.pt", weights_only=True, map_location=device)
        return cls(module.to(device=device, dtype=torch.float32), speakers)

    # ---- speakers and noise ----------------------------------------------------------------------
    def speaker(self, name: str | None) -> str:
        """The voice a window speaks with: ``name``, or the default for None. ValueError naming the
        checkpoint's voices for any other name."""
        return resolve_voice(name or "", list(self.speakers), self.default_speaker)

    def noise(self, seed: int, first: int, last: int) -> torch.Tensor:
        """The request's initial noise for mel frames ``[first, last)``, ``[last - first, mel_dim]``:
        rows of one ``randn([frames, mel_dim])`` drawn from a generator seeded ``seed``."""
        g = torch.Generator().manual_seed(seed)
        # 80 values a frame: every draw is a multiple of 16, so a longer draw's prefix is this one.
        return torch.randn(last * self.mel_dim, generator=g).view(last, self.mel_dim)[first:]

    # ---- decoding --------------------------------------------------------------------------------
    def decode(self, codes: torch.Tensor, speaker: str | None = None, seed: int = 0) -> torch.Tensor:
        """Whole-sequence decode of ``[1, T]`` codes -> ``[T * samples_per_code]`` samples."""
        return self.decode_windows([CodeWindow(codes, 0, codes.shape[-1], speaker=speaker, seed=seed)])[0]

    @torch.no_grad()  # not inference_mode: callers may write into the returned audio
    def decode_windows(self, windows: Sequence[CodeWindow]) -> list[torch.Tensor]:
        """Each window's float32 audio of ``codes[:, start:stop]`` (``(stop - start) *
        samples_per_code`` samples). Windows whose DiT spans are as long and that share a speaker
        go through the DiT in one batch; the vocoder batches equal-length spans the same way."""
        for w in windows:
            check_window(self, w)
            self.speaker(w.speaker)
        spans = [self._dit_span(w) for w in windows]
        mels: list[torch.Tensor | None] = [None] * len(windows)
        groups: dict[tuple[int, str], list[int]] = defaultdict(list)
        for i, (w, (lo, hi)) in enumerate(zip(windows, spans)):
            if w.stop > w.start:
                groups[(hi - lo, self.speaker(w.speaker))].append(i)
        for (_, name), rows in groups.items():
            for i, mel in zip(rows, self._sample_mel([windows[i] for i in rows], [spans[i] for i in rows], name)):
                mels[i] = mel
        return self._vocode(windows, spans, mels)

    def _dit_span(self, w: CodeWindow) -> tuple[int, int]:
        """The window's codes the DiT runs over, ``[lo, hi)`` in the window: all of them, less any
        left context before the first block boundary (a DiT block cut in two would attend
        differently from the whole sequence's), unless that would cut into the emitted codes."""
        lo = -w.offset % self.block_codes
        return (lo if lo <= w.start else 0), w.codes.shape[-1]

    def _sample_mel(self, windows: list[CodeWindow], spans: list[tuple[int, int]], speaker: str) -> torch.Tensor:
        """The DiT's mel ``[B, mel_dim, frames]`` for equally long spans of one speaker's windows:
        the reference's guided RK4 flow from each window's slice of its request's noise."""
        from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import RungeKutta4ODESolver

        device, r = self.dit.proj_out.weight.device, self.repeats
        codes = torch.stack([w.codes[0, lo:hi] for w, (lo, hi) in zip(windows, spans)]).to(device)
        x0 = torch.stack(
            [self.noise(w.seed, (w.offset + lo) * r, (w.offset + hi) * r) for w, (lo, hi) in zip(windows, spans)]
        ).to(device)
        b, frames = x0.shape[:2]
        cond, ref_mel = (t.to(device) for t in self.speakers[speaker])
        speaker_embedding = cond[:, None, :].expand(b, frames, -1)  # one vector per frame, as sample() repeats it
        reference = ref_mel.expand(b, -1, -1)

        def velocity(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
            # Classifier-free guidance: the DiT runs conditioned and unconditioned rows in one batch.
            both = self.dit(
                hidden_states=x,
                condition_vector=reference,
                speaker_embedding=speaker_embedding,
                quantized_code=codes,
                time_step=t,
                apply_cfg=True,
            )
            guided, free = both.chunk(2, dim=0)
            return guided + (guided - free) * GUIDANCE_SCALE

        # Sway sampling: the reference bends the uniform time grid toward t = 0.
        t = torch.linspace(0, 1, NUM_STEPS, device=device, dtype=x0.dtype)
        t = t + SWAY_COEFFICIENT * (torch.cos(torch.pi / 2 * t) - 1 + t)
        return RungeKutta4ODESolver(function=velocity, initial_value=x0).integrate(t)[-1].transpose(1, 2)

    def _vocode(
        self, windows: Sequence[CodeWindow], spans: list[tuple[int, int]], mels: list[torch.Tensor | None]
    ) -> list[torch.Tensor]:
        """Each window's audio: the vocoder over its emitted frames and up to ``vocoder_frames`` of
        its own context frames on each side, trimmed to the emitted frames' samples."""
        r, v, hop = self.repeats, self.vocoder_frames, self.hop
        out: list[torch.Tensor] = [torch.zeros(0)] * len(windows)
        cuts: dict[int, list[tuple[int, torch.Tensor, int, int]]] = defaultdict(list)
        for i, (w, (lo, _), mel) in enumerate(zip(windows, spans, mels)):
            if mel is None:
                continue
            first, last = (w.start - lo) * r, (w.stop - lo) * r  # emitted frames in the DiT's mel
            a, b = max(0, first - v), min(mel.shape[-1], last + v)
            cuts[b - a].append((i, mel[:, a:b], (first - a) * hop, (last - a) * hop))
        for items in cuts.values():
            # The vocoder squeezes its output: one row comes back 1-D, several as [B, samples].
            wav = self.vocoder(torch.stack([m for _, m, _, _ in items])).reshape(len(items), -1)
            for row, (i, _, s0, s1) in enumerate(items):
                out[i] = wav[row, s0:s1].float().clone()
        return out

    # ---- streaming -------------------------------------------------------------------------------
    def next_window(
        self,
        codes: torch.Tensor,
        emitted: int,
        final: bool,
        max_codes: int | None = None,
        left_context: int | None = None,
    ) -> CodeWindow | None:
        """:func:`omni_cache.models.code_windows.next_window` with this decoder's receptive field
        (block-aligned; ``max_codes`` defaults to the reference's chunk of 3 blocks)."""
        return next_window(
            self.receptive_field,
            codes,
            emitted,
            final,
            self.chunk_codes if max_codes is None else max_codes,
            left_context,
        )


def _vocoder_reach(vocoder: torch.nn.Module) -> int:
    """How many mel frames on each side one output sample of BigVGAN depends on (an upper bound, from
    the module tree): the first convolution, then per upsampling stage the transposed convolution
    and the longest residual chain (each link: anti-aliased activation, dilated convolution,
    activation, convolution), then the last activation and convolution; each stage's reach in its
    own samples divided by its rate in samples per mel frame."""
    cfg = vocoder.config

    def act(rate: int) -> float:
        # Up x2 (kernel 12) then down x2 (kernel 12): each filter reaches kernel / 2 samples at the
        # doubled rate, i.e. kernel / 4 at this one; +1 for the filters' odd alignment.
        return (12 / 4 + 12 / 4 + 1) / rate

    def conv(kernel: int, dilation: int = 1) -> int:
        return (kernel - 1) // 2 * dilation

    reach, rate = float(conv(vocoder.conv_pre.kernel_size[0])), 1
    for stride, kernel in zip(cfg.upsample_rates, cfg.upsample_kernel_sizes):
        reach += math.ceil(kernel / stride) / rate  # a transposed conv's output reaches kernel/stride inputs
        rate *= stride
        reach += max(
            sum(2 * act(rate) + (conv(k, d) + conv(k)) / rate for d in dilations)
            for k, dilations in zip(cfg.resblock_kernel_sizes, cfg.resblock_dilation_sizes)
        )
    reach += act(rate) + conv(vocoder.conv_post.kernel_size[0]) / rate
    return math.ceil(reach)
