"""Qwen3-Omni's code2wav as a streaming decoder: codes ``[num_quantizers, T]`` -> 24 kHz waveform.

The network is transformers' ``Qwen3OmniMoeCode2Wav``, built from ``code2wav_config`` of a
``Qwen3OmniMoeForConditionalGeneration`` folder and loaded with only its ``code2wav.*`` tensors (the
thinker and talker are never read). Here it is driven in windows so that a stream can be decoded piece
by piece and still give the audio of a whole-sequence decode.

What one output sample depends on (:class:`ReceptiveField`, computed from the module tree):

- Left: the pre-transformer is causal with sliding-window attention (``sliding_window`` keys including
  the query), so ``num_hidden_layers * (sliding_window - 1)`` codes back; then causal convolutions
  (ConvNeXt and residual units, kernel 7 with dilations 1/3/9 at each rate) add about 9 codes. The
  tiny checkpoint (window 24): 2 * 23 + 10 = 56 codes; the released model (8 layers, window 72): 578.
- Right: each decoder block's transposed convolution (kernel ``2 * rate``, trimmed by ``rate`` on both
  sides) makes a sample depend on the next input frame; a T-code decode therefore ends
  ``tail_samples`` short of ``T * samples_per_code`` (555 samples for rates 8/5/4/3) and a sample
  before that point never depends on a later code. One code of lookahead covers it.

A window of codes carries left context, the codes to emit and lookahead (:class:`CodeWindow`). The
transformer runs over the whole window (it is cheap and needs the long context); the convolution
stack, where the cost is (it runs at up to 1920 samples per code), only over the last ``conv_codes``
of left context plus the emitted codes. Chunked audio equals whole-sequence audio mathematically;
numerically it differs by float32 rounding only (other matmul shapes and batch sizes, RoPE at other
absolute positions: the attention scores are invariant to a shift of all positions but their rounding
is not). Measured on the tiny checkpoint: max |diff| up to 3e-6 (chunks of 1 to 100 codes, three
code sequences) on a waveform in [-1, 1] with std 0.2; :data:`CHUNKED_ATOL` (1e-5) is the bound the
tests hold it to. Not bitwise, for the reasons just given.

Less left context than the receptive field is an approximation (transformers' own ``chunked_decode``
uses 25 codes and also drops the last ``tail_samples`` of every chunk): it is the caller's choice
through ``left_context`` of :meth:`Code2WavDecoder.next_window`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

import torch

from omni_cache.models.checkpoint_files import load_prefixed
from omni_cache.models.code_windows import CodeWindow, ReceptiveField, check_window, next_window

__all__ = ["CHUNKED_ATOL", "SAMPLE_RATE", "Code2WavDecoder", "CodeWindow", "ReceptiveField"]

# The released model's output rate (not in its config: fixed by the codec's 12.5 codes per second
# times the total upsampling of 1920).
SAMPLE_RATE = 24000
# Chunked vs whole-sequence decode, float32 (see the module docstring).
CHUNKED_ATOL = 1e-5
_PREFIX = "code2wav."


class Code2WavDecoder:
    """Decodes batches of :class:`CodeWindow` with transformers' ``Qwen3OmniMoeCode2Wav`` (a
    :class:`~omni_cache.models.code_windows.WindowDecoder`)."""

    def __init__(self, module: torch.nn.Module):
        self.module = module.eval().requires_grad_(False)
        cfg = module.config
        self.num_quantizers = int(cfg.num_quantizers)
        self.codebook_size = int(cfg.codebook_size)
        self.samples_per_code = int(module.total_upsample)
        self.sample_rate = SAMPLE_RATE
        self.receptive_field = _receptive_field(module)

    @classmethod
    def from_pretrained(
        cls, path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
    ) -> Code2WavDecoder:
        """Build from a Qwen3-Omni folder, reading only the ``code2wav.*`` tensors."""
        from transformers import AutoConfig
        from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeCode2Wav

        path = Path(path)
        raw = json.loads((path / "config.json").read_text(encoding="utf-8"))
        if raw.get("model_type") != "qwen3_omni_moe" or "code2wav_config" not in raw:
            raise ValueError(
                f"{path}: not a Qwen3-Omni checkpoint (config.json needs model_type 'qwen3_omni_moe' "
                f"and a code2wav_config; got model_type {raw.get('model_type')!r})"
            )
        config = AutoConfig.from_pretrained(path)
        with torch.device(device):
            module = Qwen3OmniMoeCode2Wav._from_config(config.code2wav_config, dtype=dtype)
        module.load_state_dict(load_prefixed(path, _PREFIX), strict=True)
        return cls(module.to(device=device, dtype=dtype))

    # ---- decoding --------------------------------------------------------------------------------
    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """Whole-sequence decode of ``[num_quantizers, T]`` codes -> ``[T * spc - tail]`` samples."""
        return self.decode_windows([CodeWindow(codes, 0, codes.shape[-1])])[0]

    @torch.no_grad()  # not inference_mode: callers may write into the returned audio
    def decode_windows(self, windows: Sequence[CodeWindow]) -> list[torch.Tensor]:
        """One batched forward over ``windows``; returns each window's float32 audio of
        ``codes[:, start:stop]`` (``(stop - start) * samples_per_code`` samples, less
        ``tail_samples`` for a final window)."""
        if not windows:
            return []
        for w in windows:
            check_window(self, w)
        spc, rf = self.samples_per_code, self.receptive_field
        device = self.module.code_embedding.weight.device
        # Right padding is harmless: every layer is causal except the transposed convolutions'
        # one-frame lookahead, which only reaches samples cut below (the last tail_samples). So
        # every window's audio is final up to its codes' end less tail_samples: it is emitted
        # lag_samples (= tail_samples) behind its codes, and no window needs lookahead.
        longest = max(w.codes.shape[-1] for w in windows)
        codes = torch.zeros(len(windows), self.num_quantizers, longest, dtype=torch.long, device=device)
        for i, w in enumerate(windows):
            codes[i, :, : w.codes.shape[-1]] = w.codes.to(device)
        m = self.module
        hidden = m.code_embedding(codes + m.code_offset).mean(1)
        hidden = m.pre_transformer(inputs_embeds=hidden).last_hidden_state  # [B, longest, H]
        # The convolutions need only conv_codes of left context: cut each row to it, left-aligned.
        behind = -(-rf.lag_samples // spc)  # codes the emitted audio reaches back into
        firsts = [max(0, w.start - rf.conv_codes - behind) for w in windows]
        kept = [w.codes.shape[-1] - f for w, f in zip(windows, firsts)]
        conv_in = hidden.new_zeros(len(windows), max(kept), hidden.shape[-1])
        for i, (f, k) in enumerate(zip(firsts, kept)):
            conv_in[i, :k] = hidden[i, f : f + k]
        wav = conv_in.transpose(1, 2)
        for blocks in m.upsample:
            for block in blocks:
                wav = block(wav)
        for block in m.decoder:
            wav = block(wav)
        wav = wav.clamp(min=-1, max=1)[:, 0].float()
        out = []
        for i, (w, f, k) in enumerate(zip(windows, firsts, kept)):
            lo = max(0, (w.start - f) * spc - rf.lag_samples)
            hi = min((w.stop - f) * spc - rf.lag_samples, k * spc - rf.tail_samples)
            out.append(wav[i, lo:hi].clone())
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
        """:func:`omni_cache.models.code_windows.next_window` with this decoder's receptive field."""
        if left_context is None:
            left_context = self.receptive_field.context_codes(self.samples_per_code)
        return next_window(self.receptive_field, codes, emitted, final, max_codes, left_context)


def _receptive_field(module: torch.nn.Module) -> ReceptiveField:
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
        Qwen3OmniMoeCausalConvNet,
        Qwen3OmniMoeCausalTransConvNet,
    )

    cfg = module.config
    attn = cfg.num_hidden_layers * (cfg.sliding_window - 1)
    # Walk the convolution stack in execution order (its registration order), tracking the rate.
    rate, conv_left, length, probe = 1, 0.0, 1000, 1000
    for part in (module.upsample, module.decoder):
        for m in part.modules():
            if isinstance(m, Qwen3OmniMoeCausalTransConvNet):
                s, k = m.conv.stride[0], m.conv.kernel_size[0]
                length = (length - 1) * s + k - m.left_pad - m.right_pad
                rate *= s
            elif isinstance(m, Qwen3OmniMoeCausalConvNet):
                if m.stride != 1:
                    raise ValueError("strided causal convolutions are not expected in code2wav")
                conv_left += m.padding / rate  # left zero padding, in codes
    spc = int(module.total_upsample)
    if rate != spc:
        raise ValueError(f"walked upsampling x{rate} differs from total_upsample x{spc}")
    tail = probe * spc - length
    conv_codes = math.ceil(conv_left)
    return ReceptiveField(
        left_codes=attn + conv_codes,
        conv_codes=conv_codes,
        right_codes=0,  # causal: a window's audio lags its codes instead (code_windows.py)
        tail_samples=tail,
        lag_samples=tail,
    )
