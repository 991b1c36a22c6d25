"""Decoding codec codes in windows: what the decoder stage needs of a decoder, whichever it is.

A decoder turns codes ``[num_quantizers, T]`` into a waveform; streaming decodes a request's codes
window by window (:class:`CodeWindow`: left context, the codes whose audio is emitted, lookahead),
as far as the decoder's :class:`ReceptiveField` says a sample reaches. :class:`WindowDecoder` is
that contract: the decoder stage (``workers/decoder_runner.py``) and the talker -> decoder hand-off
use only it. Three decoders satisfy it: Qwen3-Omni's code2wav
(:class:`~omni_cache.models.qwen3_omni_code2wav.Code2WavDecoder`), Qwen2.5-Omni's token2wav
(:class:`~omni_cache.models.qwen2_5_omni_token2wav.Token2WavDecoder`: block-aligned windows, and a
window also carries its request's speaker, seed and position in the stream) and the tiny one-codebook
codec through its adapter (:class:`~omni_cache.models.codec_decoder.CodecWindowDecoder`);
:func:`omni_cache.models.window_decoders.load_window_decoder` picks one from a checkpoint
folder's ``config.json``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

__all__ = ["CodeWindow", "ReceptiveField", "WindowDecoder", "check_window", "next_window"]


@dataclass(frozen=True)
class ReceptiveField:
    """How far a sample's dependence reaches, in codes, and what a whole decode never produces."""

    #: Codes before the first emitted code that the decoder reaches: the left context for exact
    #: chunked decoding.
    left_codes: int
    #: Codes of left context the convolution stack alone needs (<= left_codes).
    conv_codes: int
    #: Codes after the last emitted one that a non-final window must carry.
    right_codes: int
    #: A T-code decode yields ``T * samples_per_code - tail_samples`` samples.
    tail_samples: int
    #: Samples a window's audio runs behind its codes. A causal decoder (right_codes 0) has every
    #: sample of a T-code decode final except none: the last ``tail_samples`` are simply not made
    #: until the next code comes. So its windows need no lookahead and emit, for codes
    #: ``[start, stop)``, samples ``[start * spc - lag, stop * spc - lag)`` (from 0 for the first
    #: window); their concatenation is the whole decode, and the first audio needs one code.
    lag_samples: int = 0
    #: Codes per block of a decoder that computes in fixed blocks of codes counted from the stream's
    #: start (Qwen2.5-Omni's DiT attends block-wise): a window that does not end the stream starts
    #: and stops its emitted codes on block boundaries, so its blocks are the whole sequence's
    #: (left_codes and right_codes are then whole blocks too). 1: any boundary.
    block_codes: int = 1

    def context_codes(self, samples_per_code: int) -> int:
        """Left context of a window: what a sample at its first code needs, plus the codes its
        audio runs behind by."""
        return self.left_codes + -(-self.lag_samples // samples_per_code)


@dataclass(frozen=True)
class CodeWindow:
    """Codes ``[num_quantizers, L]`` of one request: ``codes[:, :start]`` is left context,
    ``codes[:, start:stop]`` the codes whose audio is emitted, ``codes[:, stop:]`` lookahead.

    ``stop == L`` marks the end of the stream (or, for a causal decoder, of what has arrived): the
    audio then ends ``tail_samples`` early, as a whole-sequence decode does. Otherwise at least
    ``right_codes`` of lookahead must follow. A causal decoder's audio runs ``lag_samples``
    behind the codes (:class:`ReceptiveField`).
    """

    codes: torch.Tensor
    start: int
    stop: int
    #: Index of ``codes[:, 0]`` in the request's stream (a decoder whose computation depends on the
    #: absolute position, e.g. noise drawn for the whole sequence, needs it).
    offset: int = 0
    #: The request's voice for a decoder conditioned on a speaker; None: the checkpoint's default.
    speaker: str | None = None
    #: Seed of the request's random draws for a decoder that samples (the request's sampling seed).
    seed: int = 0

    @property
    def final(self) -> bool:
        return self.stop == self.codes.shape[-1]


class WindowDecoder(Protocol):
    """What the decoder stage needs of a decoder."""

    num_quantizers: int
    codebook_size: int
    samples_per_code: int
    sample_rate: int
    receptive_field: ReceptiveField

    def decode_windows(self, windows: Sequence[CodeWindow]) -> list[torch.Tensor]:
        """Each window's float32 audio of ``codes[:, start:stop]`` (``(stop - start) *
        samples_per_code`` samples, less ``tail_samples`` for a final window; moved
        ``lag_samples`` earlier for a causal decoder), in one batch."""
        ...


def next_window(
    rf: ReceptiveField,
    codes: torch.Tensor,
    emitted: int,
    final: bool,
    max_codes: int | None = None,
    left_context: int | None = None,
) -> CodeWindow | None:
    """The window that emits the next audio of a stream.

    ``codes`` are all ``[num_quantizers, N]`` codes received so far, ``emitted`` how many of them
    have had their audio sent, ``final`` whether the stream has ended. Emits at most ``max_codes``
    codes; holds back ``right_codes`` until the stream ends. ``left_context`` defaults to the
    receptive field (exact up to rounding; ``ReceptiveField.context_codes``, which needs the
    decoder's samples per code: pass it for a decoder with ``lag_samples``). None when nothing
    can be emitted yet.
    """
    n = codes.shape[-1]
    if not 0 <= emitted <= n:
        raise ValueError(f"emitted={emitted} is outside the {n} codes received")
    ready = n if final else max(emitted, n - rf.right_codes)
    stop = ready if max_codes is None else min(ready, emitted + max_codes)
    if rf.block_codes > 1 and stop < n:
        capped = max_codes is not None and stop == emitted + max_codes
        stop = _block_stop(rf.block_codes, emitted, stop, ready, final, capped)
    if final and n - stop < rf.right_codes:
        stop = n  # too little left to serve as lookahead: finish the stream in this window
    if stop <= emitted:
        return None
    if left_context is None and rf.lag_samples:
        raise ValueError(
            "a decoder whose audio lags its codes needs an explicit left_context (ReceptiveField.context_codes)"
        )
    ctx = rf.left_codes if left_context is None else left_context
    first = max(0, emitted - ctx)
    last = n if stop == n else min(n, stop + rf.right_codes)
    return CodeWindow(codes[:, first:last], emitted - first, stop - first, offset=first)


def _block_stop(block: int, emitted: int, stop: int, ready: int, final: bool, capped: bool) -> int:
    """``stop`` moved to a block boundary: up to the next one when the codes up to it are ready (so
    a cap smaller than a block still emits one block: the smallest first audio such a decoder can
    give); else the rest of a stream that has ended; else, for a window ``max_codes`` capped,
    nothing yet (wait until its last block is there rather than emit less than asked); else down
    to the last ready boundary."""
    up = -(-stop // block) * block
    if up <= ready:
        return up
    if final:
        return ready
    if capped:
        return emitted
    return max(emitted, ready // block * block)


def check_window(decoder: WindowDecoder, w: CodeWindow) -> None:
    """ValueError unless ``w`` is a window ``decoder`` can decode: ``[num_quantizers, L]`` integer
    codes, each in its codebook, a valid emitted range with its lookahead."""
    c, q, size = w.codes, decoder.num_quantizers, decoder.codebook_size
    if c.dim() != 2 or c.shape[0] != q:
        raise ValueError(f"codes must be [num_quantizers={q}, T], got {tuple(c.shape)}")
    if c.dtype.is_floating_point or c.dtype == torch.bool or c.dtype.is_complex:
        raise ValueError(f"codes must be integers, got {c.dtype}")
    if c.numel():
        low, high = c.min(dim=-1).values, c.max(dim=-1).values
        bad = ((low < 0) | (high >= size)).nonzero().flatten()
        if len(bad):
            book = int(bad[0])
            value = int(low[book]) if int(low[book]) < 0 else int(high[book])
            # A code outside the codebook would index past the decoder's embedding table.
            raise ValueError(f"code {value} of codebook {book} is outside the codebook [0, {size})")
    length = c.shape[-1]
    if not 0 <= w.start <= w.stop <= length:
        raise ValueError(f"need 0 <= start <= stop <= {length}, got start={w.start} stop={w.stop}")
    right = decoder.receptive_field.right_codes
    if w.stop < length and length - w.stop < right:
        raise ValueError(
            f"a non-final window needs {right} code(s) of lookahead after stop={w.stop}, got {length - w.stop}"
        )
