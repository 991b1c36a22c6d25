"""The file formats of a tiny checkpoint, independent of any model: seeded tensors, safetensors and
JSON written byte-for-byte the same every time, and a byte-level BPE tokenizer (token id == byte
value, special tokens from 256). omni_cache.tiny.checkpoints composes them into checkpoints."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import torch

#: Standard deviation of the random weights (a sane init scale).
INIT_STD = 0.02


def tensor_seed(seed: int, ckpt: str, tensor_name: str) -> int:
    # Stable across processes and Python versions (no hash()), independent of creation order.
    key = zlib.crc32(f"{ckpt}/{tensor_name}".encode())
    return (int(seed) * 0x9E3779B1 + key) % (2**63 - 1)


class TensorFactory:
    """Draws each tensor from its own generator seeded by (seed, checkpoint, tensor name)."""

    def __init__(self, ckpt: str, seed: int):
        self.ckpt = ckpt
        self.seed = seed

    def _gen(self, name: str) -> torch.Generator:
        g = torch.Generator(device="cpu")
        g.manual_seed(tensor_seed(self.seed, self.ckpt, name))
        return g

    def normal(self, name: str, shape, std: float = INIT_STD, mean: float = 0.0) -> torch.Tensor:
        t = torch.empty(shape, dtype=torch.float32)
        t.normal_(mean=mean, std=std, generator=self._gen(name))
        return t

    def uniform(self, name: str, shape, low: float, high: float) -> torch.Tensor:
        t = torch.empty(shape, dtype=torch.float32)
        t.uniform_(low, high, generator=self._gen(name))
        return t


def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def save_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    ordered = {k: tensors[k].contiguous() for k in sorted(tensors)}
    save_file(ordered, str(path), metadata={"format": "pt"})


def write_safetensors_index(out: Path, tensors: dict[str, torch.Tensor], filename: str) -> None:
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": {k: filename for k in sorted(tensors)}}
    write_json(out / "model.safetensors.index.json", index)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode symbol map (what ByteLevel pre-tokenizers emit)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def tokenizer_json(special_tokens: tuple[str, ...], fillers: tuple[str, ...] = ()) -> dict:
    """tokenizer.json for a byte-level BPE with no merges: token id == byte value, specials at 256+,
    then `fillers` (plain added tokens, so every id of a larger model vocabulary decodes to text)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {sym: b for b, sym in bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False, byte_fallback=False))
    # No normalizer: arbitrary UTF-8 (including non-NFC text) must round-trip exactly.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special_tokens])
    for i, t in enumerate(special_tokens):
        assert tok.token_to_id(t) == 256 + i, (t, tok.token_to_id(t))
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in fillers])
    return json.loads(tok.to_str())


def write_tokenizer(
    out: Path,
    special_tokens: tuple[str, ...],
    eos: str,
    pad: str,
    bos: str | None,
    chat_template: str | None,
    extra_config: dict | None = None,
    fillers: tuple[str, ...] = (),
    model_max_length: int = 32768,
) -> None:
    write_json(out / "tokenizer.json", tokenizer_json(special_tokens, fillers))
    added = {
        str(256 + i): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": i < len(special_tokens),
        }
        for i, t in enumerate(special_tokens + fillers)
    }
    cfg = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": [t for t in special_tokens if t not in (eos, pad, bos)],
        "bos_token": bos,
        "clean_up_tokenization_spaces": False,
        "eos_token": eos,
        "errors": "replace",
        "model_max_length": model_max_length,
        "pad_token": pad,
        "split_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }
    if chat_template is not None:
        cfg["chat_template"] = chat_template
    cfg.update(extra_config or {})
    write_json(out / "tokenizer_config.json", cfg)
    smap = {
        "additional_special_tokens": cfg["additional_special_tokens"],
        "eos_token": eos,
        "pad_token": pad,
    }
    if bos is not None:
        smap["bos_token"] = bos
    write_json(out / "special_tokens_map.json", smap)


def load_prefixed(path: Path, prefix: str) -> dict[str, torch.Tensor]:
    """The ``prefix``* tensors of a checkpoint folder (one file, or shards named by an index), prefix
    removed: one submodel's weights (code2wav, token2wav) without reading the others."""
    from safetensors import safe_open

    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        files = sorted({f for k, f in weight_map.items() if k.startswith(prefix)})
    else:
        files = ["model.safetensors"]
    state: dict[str, torch.Tensor] = {}
    for name in files:
        with safe_open(str(path / name), framework="pt") as f:
            for key in f.keys():
                if key.startswith(prefix):
                    state[key[len(prefix) :]] = f.get_tensor(key)
    if not state:
        raise ValueError(f"{path} holds no {prefix}* tensors")
    return state
