"""A small non-autoregressive codec decoder: audio codec codes -> 24 kHz mono waveform.

Architecture (per position ``t`` of a ``[B, T]`` code sequence)::

    Embedding(codebook_size, embed_dim)                      codes -> [B, embed_dim, T]
    num_conv_layers x (Conv1d(kernel_size, padding='same', zero padded) -> ReLU -> quantize)
    Linear(hidden_dim -> samples_per_code) -> softsign       -> [B, T * samples_per_code] in (-1, 1)

Receptive field and chunked decoding
------------------------------------
Each convolution looks ``kernel_size // 2`` codes to either side, so output frame ``t`` depends only on
codes ``t - C .. t + C`` with ``C = num_conv_layers * (kernel_size // 2)`` (:attr:`CodecDecoder.context`;
2 with the default config: 2 convolutions of kernel 3). To decode codes ``[s, e)`` of a longer
sequence exactly as decoding the whole sequence would, feed codes ``[max(0, s - C), min(T, e + C))``
and keep frames ``s - max(0, s - C)`` onwards, ``e - s`` of them (:meth:`CodecDecoder.decode_range`
does this). The result is bitwise equal in float32, not just close: a streaming decoder must
therefore hold back the last ``C`` codes it has received until ``C`` more arrive (or the stream
ends).

Why bitwise and not just close: every weight sits on a 2**-8 grid (|w| <= 0.5), every activation
(embeddings included) on a 2**-5 grid clipped to [-4, 4], biases on the 2**-13 product grid. All products and
partial sums of a layer's dot products are then exactly representable in float32 (<= 22 significant
bits), so no summation order, blocking, thread count or sequence length (nor a bf16 matmul mode: both
factors have <= 8 significant bits) can change a result. The only non-exact operations are
elementwise and correctly rounded (ReLU, round, clamp, abs, add, divide). The output squashing is
softsign ``y / (1 + |y|)`` rather than tanh because ATen's vectorized tanh (SLEEF) and its scalar tail
(libm) may differ by an ulp, and which elements fall into the scalar tail depends on the tensor's
length.

The decoder is deterministic and has no state; weights are random (written by
``omni_cache.tiny.checkpoints``), so the waveform is noise-like, not speech.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from omni_cache.models.code_windows import CodeWindow, ReceptiveField, check_window

__all__ = ["CodecDecoder", "CodecWindowDecoder", "decoder_config", "random_decoder_weights"]

WEIGHT_GRID_BITS = 8  # weights are multiples of 2**-8
WEIGHT_CLIP = 0.5
ACT_GRID_BITS = 5  # activations are multiples of 2**-5
ACT_CLIP = 4.0


def decoder_config() -> dict:
    """The default ``config.json`` of the decoder checkpoint."""
    return {
        "architectures": ["CodecDecoder"],
        "model_type": "omni_cache_codec_decoder",
        "codebook_size": 256,
        "embed_dim": 64,
        "hidden_dim": 64,
        "num_conv_layers": 2,
        "kernel_size": 3,
        "sample_rate": 24000,
        "frame_rate": 12.5,
        "samples_per_code": 1920,  # 24000 Hz / 12.5 codes per second
        "weight_grid_bits": WEIGHT_GRID_BITS,
        "weight_clip": WEIGHT_CLIP,
        "act_grid_bits": ACT_GRID_BITS,
        "act_clip": ACT_CLIP,
        "torch_dtype": "float32",
    }


def _to_grid(x: torch.Tensor, bits: int, clip: float) -> torch.Tensor:
    scale = float(2**bits)
    return torch.clamp(torch.round(x * scale) / scale, -clip, clip)


def random_decoder_weights(
    cfg: dict, normal: Callable[[str, tuple[int, ...], float], torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Random grid-aligned weights for ``cfg``; ``normal(name, shape, std)`` draws float32 N(0, std)."""
    wb, wc = cfg["weight_grid_bits"], cfg["weight_clip"]
    ab, ac = cfg["act_grid_bits"], cfg["act_clip"]
    bias_bits = wb + ab  # exactly representable next to the products
    e, hdim, k = cfg["embed_dim"], cfg["hidden_dim"], cfg["kernel_size"]
    w = {"embed.weight": _to_grid(normal("embed.weight", (cfg["codebook_size"], e), 1.0), ab, ac)}
    cin = e
    for i in range(cfg["num_conv_layers"]):
        std = math.sqrt(2.0 / (cin * k))  # He init for ReLU
        w[f"convs.{i}.weight"] = _to_grid(normal(f"convs.{i}.weight", (hdim, cin, k), std), wb, wc)
        w[f"convs.{i}.bias"] = _to_grid(normal(f"convs.{i}.bias", (hdim,), 0.1), bias_bits, wc)
        cin = hdim
    w["out.weight"] = _to_grid(normal("out.weight", (cfg["samples_per_code"], cin), 1.5 / math.sqrt(cin)), wb, wc)
    w["out.bias"] = _to_grid(normal("out.bias", (cfg["samples_per_code"],), 0.05), bias_bits, wc)
    return w


class CodecDecoder(nn.Module):
    """Codec codes ``[B, T]`` -> waveform ``[B, T * samples_per_code]`` (see the module docstring)."""

    def __init__(self, config: dict | None = None):
        super().__init__()
        cfg = dict(decoder_config() if config is None else config)
        self.config = cfg
        self.codebook_size = int(cfg["codebook_size"])
        self.samples_per_code = int(cfg["samples_per_code"])
        self.sample_rate = int(cfg["sample_rate"])
        self.kernel_size = int(cfg["kernel_size"])
        if self.kernel_size % 2 != 1:
            raise ValueError("kernel_size must be odd ('same' padding, symmetric context)")
        self.act_grid_bits = int(cfg["act_grid_bits"])
        self.act_clip = float(cfg["act_clip"])
        e, hdim = int(cfg["embed_dim"]), int(cfg["hidden_dim"])
        self.embed = nn.Embedding(self.codebook_size, e)
        self.convs = nn.ModuleList(
            nn.Conv1d(e if i == 0 else hdim, hdim, self.kernel_size, padding=self.kernel_size // 2)
            for i in range(int(cfg["num_conv_layers"]))
        )
        self.out = nn.Linear(hdim, self.samples_per_code)
        self.requires_grad_(False)
        self.eval()

    @property
    def context(self) -> int:
        """Codes of left and of right context a chunk boundary needs for bitwise-exact output."""
        return len(self.convs) * (self.kernel_size // 2)

    @classmethod
    def from_pretrained(cls, path: str | Path, device: str | torch.device = "cpu") -> CodecDecoder:
        from safetensors.torch import load_file

        path = Path(path)
        cfg = json.loads((path / "config.json").read_text(encoding="utf-8"))
        model = cls(cfg)
        state = load_file(str(path / "model.safetensors"))
        model.load_state_dict(state, strict=True)
        # The exactness argument needs grid-aligned weights.
        wscale = float(2 ** int(cfg["weight_grid_bits"]))
        for name, t in state.items():
            if name.endswith(".weight") and name != "embed.weight":
                if not torch.equal(torch.round(t * wscale), t * wscale):
                    raise ValueError(f"{path}: {name} is not on the 2**-{cfg['weight_grid_bits']} grid")
        return model.to(device)

    def _quantize(self, x: torch.Tensor) -> torch.Tensor:
        return _to_grid(x, self.act_grid_bits, self.act_clip)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        if codes.dim() == 1:
            return self.forward(codes.unsqueeze(0)).squeeze(0)
        if codes.dim() != 2:
            raise ValueError(f"codes must be [B, T], got shape {tuple(codes.shape)}")
        if codes.dtype.is_floating_point or codes.dtype == torch.bool:
            raise ValueError(f"codes must be an integer tensor, got {codes.dtype}")
        if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= self.codebook_size):
            raise ValueError(
                f"codec codes must be in [0, {self.codebook_size}); got min {int(codes.min())}, "
                f"max {int(codes.max())} (strip codec bos/eos/pad ids before decoding)"
            )
        b, t = codes.shape
        if t == 0:
            return torch.zeros(b, 0, device=self.embed.weight.device)
        codes = codes.to(device=self.embed.weight.device, dtype=torch.long)
        x = self.embed(codes).transpose(1, 2)  # [B, E, T]
        for conv in self.convs:
            x = self._quantize(F.relu(conv(x)))
        y = self.out(x.transpose(1, 2))  # [B, T, samples_per_code]
        y = y / (1.0 + y.abs())  # softsign, see module docstring
        return y.reshape(b, t * self.samples_per_code)

    def decode_range(self, codes: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """Waveform of codes ``[start, end)`` of ``codes`` ([B, T]), bitwise equal to slicing the
        whole decode, while only running the decoder on ``context`` extra codes each side."""
        t = codes.shape[-1]
        if not 0 <= start <= end <= t:
            raise ValueError(f"bad range [{start}, {end}) for {t} codes")
        lo, hi = max(0, start - self.context), min(t, end + self.context)
        wav = self.forward(codes[..., lo:hi])
        spc = self.samples_per_code
        return wav[..., (start - lo) * spc : (end - lo) * spc]


class CodecWindowDecoder:
    """The tiny codec as a :class:`~omni_cache.models.code_windows.WindowDecoder`: one codebook,
    ``context`` codes of receptive field on each side, no tail (a T-code decode gives exactly
    ``T * samples_per_code`` samples). Its windows decode bitwise as the whole sequence would."""

    num_quantizers = 1

    def __init__(self, codec: CodecDecoder):
        self.codec = codec
        self.codebook_size = codec.codebook_size
        self.samples_per_code = codec.samples_per_code
        self.sample_rate = codec.sample_rate
        c = codec.context
        self.receptive_field = ReceptiveField(left_codes=c, conv_codes=c, right_codes=c, tail_samples=0)

    @torch.no_grad()
    def decode_windows(self, windows: Sequence[CodeWindow]) -> list[torch.Tensor]:
        """Each window's audio of ``codes[0, start:stop]``. Windows of one length share a forward
        pass; lengths differ in separate ones, because padding a final window on the right would
        change its last frames (the convolutions' 'same' padding is not a padded code)."""
        for w in windows:
            check_window(self, w)
        spc = self.samples_per_code
        out: list[torch.Tensor | None] = [None] * len(windows)
        by_len: dict[int, list[int]] = {}
        for i, w in enumerate(windows):
            by_len.setdefault(w.codes.shape[-1], []).append(i)
        for indices in by_len.values():
            wav = self.codec(torch.stack([windows[i].codes[0] for i in indices]).long())
            for row, i in enumerate(indices):
                w = windows[i]
                out[i] = wav[row, w.start * spc : w.stop * spc].float().clone()
        return out
