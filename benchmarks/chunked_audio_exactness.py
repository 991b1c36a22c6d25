"""Is a turn's audio cut into encoder-window chunks the same audio to Qwen3-Omni? (issue 51)

Qwen3-Omni's audio tower (transformers' ``Qwen3OmniMoeAudioEncoder``, vLLM's copy of it) runs its
convolutions over chunks of ``2 * n_window`` mel frames (100: 1 s), with the sinusoidal position
restarting at every chunk, and attends within windows of ``n_window_infer`` frames (800: 8 s, 104
tokens). So audio cut at multiples of ``n_window_infer`` frames and encoded as separate items gives
the whole clip's encoder output, IF the mel features are the same. They are not quite: the
Whisper-style front end (i) frames the STFT with ``center=True`` reflect padding, so the frame on
each side of a cut sees other samples, and (ii) clamps log-mel to 8 below each item's own maximum.

This script measures, on speech-like audio (benchmarks/speech_clips.py, with silences), for cuts
every ``--chunk-frames`` mel frames:

* mel: chunked (each chunk its own feature-extractor item, as vLLM's processor makes them) vs
  whole: max |diff| and how many frames differ;
* encoder, the whole clip's mel sliced into chunk items vs the whole item: the windowing alone
  (exact when the chunk is a multiple of n_window_infer);
* encoder, each chunk's own mel vs the whole: what the thinker actually receives;

for the tiny checkpoint's encoder (``tiny:qwen3-omni``, 2 layers) and for an encoder of the
released config's size (32 layers, d_model 1280, random weights, seeded) with the same windows.

    PYTHONPATH=. .venv/bin/python -m benchmarks.chunked_audio_exactness --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import numpy as np
import torch

RATE = 16000
HOP = 160

#: The released Qwen3-Omni-30B-A3B audio tower's config (its config.json's thinker_config.audio_config).
REAL_AUDIO_CONFIG = {
    "d_model": 1280,
    "encoder_layers": 32,
    "encoder_attention_heads": 20,
    "encoder_ffn_dim": 5120,
    "num_mel_bins": 128,
    "max_source_positions": 1500,
    "n_window": 50,
    "n_window_infer": 800,
    "conv_chunksize": 500,
    "downsample_hidden_size": 480,
    "output_dim": 2048,
}


def speech_audio(seconds: float, seed: int) -> np.ndarray:
    """A turn at 16 kHz as the session holds it: speech between silences, pcm16 levels."""
    from benchmarks.speech_clips import turn_clip

    x = turn_clip(seconds, seed, rate=RATE)
    return (np.round(x * 32767) / 32767).astype(np.float32)


def chunk_bounds(n_samples: int, chunk_frames: int) -> list[tuple[int, int]]:
    step = chunk_frames * HOP
    return [(a, min(a + step, n_samples)) for a in range(0, n_samples, step)]


def features(fe: Any, clips: list[np.ndarray]) -> list[torch.Tensor]:
    """Each clip's log-mel [mel, frames], as vLLM's Qwen3-Omni processor computes them (one
    feature-extractor call over the request's clips, padded to the longest, clips pre-padded to
    a hop multiple)."""
    padded = [np.pad(c, (0, (-len(c)) % HOP)) for c in clips]
    out = fe(
        padded, sampling_rate=RATE, padding=True, truncation=False, return_attention_mask=True, return_tensors="pt"
    )
    lens = out["attention_mask"].sum(-1).tolist()
    return [out["input_features"][i, :, : int(n)] for i, n in enumerate(lens)]


@torch.no_grad()
def encode(enc: Any, mels: list[torch.Tensor]) -> torch.Tensor:
    """The encoder's output rows of these items (one batch, as vLLM batches a request's clips)."""
    feats = torch.cat(mels, dim=1)
    lens = torch.tensor([m.shape[1] for m in mels], dtype=torch.long)
    return enc(input_features=feats, feature_lens=lens).last_hidden_state


def compare(fe: Any, enc: Any, audio: np.ndarray, chunk_frames: int) -> dict[str, Any]:
    bounds = chunk_bounds(len(audio), chunk_frames)
    (whole_mel,) = features(fe, [audio])
    chunk_mels = features(fe, [audio[a:b] for a, b in bounds])
    cat = torch.cat(chunk_mels, dim=1)
    assert cat.shape == whole_mel.shape, (cat.shape, whole_mel.shape)
    frame_diff = (cat - whole_mel).abs().amax(dim=0)
    # Frames next to a cut (the STFT window straddles it) vs elsewhere (the per-item clamp).
    near_cut = torch.zeros_like(frame_diff, dtype=torch.bool)
    for a, _ in bounds[1:]:
        near_cut[max(0, a // HOP - 2) : a // HOP + 2] = True
    sliced = [whole_mel[:, a // HOP : b // HOP] for a, b in bounds]
    t0 = time.perf_counter()
    whole = encode(enc, [whole_mel])
    t_whole = time.perf_counter() - t0
    windowing = encode(enc, sliced)
    t0 = time.perf_counter()
    chunked = encode(enc, chunk_mels)
    t_chunked = time.perf_counter() - t0
    scale = whole.abs().max().item()
    return {
        "seconds": len(audio) / RATE,
        "chunk_frames": chunk_frames,
        "chunks": len(bounds),
        "tokens": whole.shape[0],
        "mel_max_abs_diff": frame_diff.max().item(),
        "mel_frames_differing": int((frame_diff > 0).sum()),
        "mel_frames": whole_mel.shape[1],
        "mel_frames_differing_at_cuts": int(((frame_diff > 0) & near_cut).sum()),
        "mel_max_abs_diff_away_from_cuts": frame_diff[~near_cut].max().item(),
        "encoder_windowing_max_abs_diff": (windowing - whole).abs().max().item(),
        "encoder_windowing_bitwise_equal": bool(torch.equal(windowing, whole)),
        "encoder_chunked_max_abs_diff": (chunked - whole).abs().max().item(),
        "encoder_chunked_rows_differing": int(((chunked - whole).abs().amax(dim=1) > 1e-6 * scale).sum()),
        "encoder_output_max_abs": scale,
        "encode_whole_s": round(t_whole, 4),
        "encode_chunked_s": round(t_chunked, 4),
    }


def tiny_encoder() -> tuple[Any, Any]:
    from transformers import AutoProcessor, Qwen3OmniMoeForConditionalGeneration

    from omni_cache.tiny import checkpoints as ck
    from omni_cache.tiny.registry import resolve_checkpoint_dir

    path = ck.ensure_checkpoint("qwen3-omni", resolve_checkpoint_dir())
    model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    return AutoProcessor.from_pretrained(path).feature_extractor, model.thinker.audio_tower


def real_size_encoder(fe: Any, layers: int) -> Any:
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeAudioEncoderConfig
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeAudioEncoder

    torch.manual_seed(0)
    cfg = Qwen3OmniMoeAudioEncoderConfig(**{**REAL_AUDIO_CONFIG, "encoder_layers": layers})
    cfg._attn_implementation = "sdpa"
    return Qwen3OmniMoeAudioEncoder(cfg).eval()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, nargs="+", default=[2.0, 9.0, 16.0, 30.0])
    p.add_argument("--chunk-frames", type=int, nargs="+", default=[800, 100])
    p.add_argument("--real-layers", type=int, default=32, help="layers of the released-size encoder (0: skip it)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(2)
    fe, tiny = tiny_encoder()
    encoders = {"tiny": tiny}
    if args.real_layers:
        encoders[f"released-size-{args.real_layers}L"] = real_size_encoder(fe, args.real_layers)
    rows = []
    for name, enc in encoders.items():
        for seconds in args.seconds:
            audio = speech_audio(seconds, seed=int(seconds * 10))
            for cf in args.chunk_frames:
                row = {"encoder": name, **compare(fe, enc, audio, cf)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
