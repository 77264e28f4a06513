"""karpathy's llama2.c checkpoints (legacy fp32 `.bin`, e.g. stories260K) -> an HF Llama folder.

Layout: a header of 7 int32 (dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len; a negative
vocab_size means an unshared classifier), then float32 arrays in this order: token embedding [V, dim], attention
norms [L, dim], wq [L, dim, dim], wk [L, kv_dim, dim], wv [L, kv_dim, dim], wo [L, dim, dim], ffn norms [L, dim],
w1 [L, hidden, dim], w2 [L, dim, hidden], w3 [L, hidden, dim], final norm [dim], RoPE tables
(2 x [seq_len, head_dim / 2], ignored), and the classifier [V, dim] when unshared.

llama2.c rotates adjacent pairs (2i, 2i+1) of each head; HF Llama rotates (i, i + D/2), so wq/wk rows are permuted.

The tokenizer is built from the SentencePiece model (`tok512.model`) with the `sentencepiece` library (protobuf is
not needed): its pieces become a byte-fallback BPE vocabulary for transformers' `LlamaTokenizer`.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tandem.config import ConfigError
from tandem.models.checkpoint import Checkpoint, file_cache_key, interleaved_to_rotate_half, write_hf_folder
from tandem.models.hf_loader import load_hf_checkpoint
from tandem.paths import tandem_home

_HEADER = struct.Struct("<7i")
_LEGACY_MAGIC = 0x616B3432  # "ak42": llama2.c's newer export versions, not supported here


@dataclass(frozen=True)
class Llama2cHeader:
    dim: int
    hidden_dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    seq_len: int
    shared_classifier: bool

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    def float_counts(self) -> list[tuple[str, tuple[int, ...]]]:
        """(name, shape) of every float32 array after the header, in file order (RoPE tables included)."""
        L, d, h, kv, v = self.n_layers, self.dim, self.hidden_dim, self.kv_dim, self.vocab_size
        arrays: list[tuple[str, tuple[int, ...]]] = [
            ("tok_embeddings", (v, d)),
            ("attention_norm", (L, d)),
            ("wq", (L, d, d)),
            ("wk", (L, kv, d)),
            ("wv", (L, kv, d)),
            ("wo", (L, d, d)),
            ("ffn_norm", (L, d)),
            ("w1", (L, h, d)),
            ("w2", (L, d, h)),
            ("w3", (L, h, d)),
            ("norm", (d,)),
            ("freq_cis_real", (self.seq_len, self.head_dim // 2)),
            ("freq_cis_imag", (self.seq_len, self.head_dim // 2)),
        ]
        if not self.shared_classifier:
            arrays.append(("output", (v, d)))
        return arrays


def read_header(bin_path: Path) -> Llama2cHeader:
    """Parse and sanity-check the header against the file size; ConfigError when it is not a llama2.c file."""
    with bin_path.open("rb") as f:
        raw = f.read(_HEADER.size)
    if len(raw) < _HEADER.size:
        raise ConfigError(f"{bin_path} is too short to be a llama2.c checkpoint")
    dim, hidden, layers, heads, kv_heads, vocab, seq_len = _HEADER.unpack(raw)
    if dim == _LEGACY_MAGIC:
        raise ConfigError(
            f"{bin_path} is a versioned llama2.c export (magic 'ak42'); only the legacy fp32 format loads"
        )
    header = Llama2cHeader(dim, hidden, layers, heads, kv_heads, abs(vocab), seq_len, vocab > 0)
    ok = min(dim, hidden, layers, heads, kv_heads, abs(vocab), seq_len) > 0 and dim % heads == 0
    expected = _HEADER.size + 4 * sum(int(np.prod(s)) for _, s in header.float_counts()) if ok else -1
    if expected != bin_path.stat().st_size:
        raise ConfigError(
            f"{bin_path} is not a llama2.c fp32 checkpoint (header {header} does not match the file size); "
            "PyTorch .bin pickles are never loaded, for safety: convert them to safetensors"
        )
    return header


def read_llama2c_weights(bin_path: Path, header: Llama2cHeader) -> dict[str, torch.Tensor]:
    """The HF-named float32 weights of a llama2.c checkpoint, q/k rows permuted to HF's rotate-half layout."""
    data = np.fromfile(bin_path, dtype="<f4", offset=_HEADER.size)
    arrays: dict[str, torch.Tensor] = {}
    pos = 0
    for name, shape in header.float_counts():
        n = int(np.prod(shape))
        arrays[name] = torch.from_numpy(data[pos : pos + n].reshape(shape).copy())
        pos += n
    weights = {"model.embed_tokens.weight": arrays["tok_embeddings"], "model.norm.weight": arrays["norm"]}
    if not header.shared_classifier:
        weights["lm_head.weight"] = arrays["output"]
    for i in range(header.n_layers):
        p = f"model.layers.{i}."
        weights[p + "input_layernorm.weight"] = arrays["attention_norm"][i]
        weights[p + "post_attention_layernorm.weight"] = arrays["ffn_norm"][i]
        weights[p + "self_attn.q_proj.weight"] = interleaved_to_rotate_half(arrays["wq"][i], header.n_heads)
        weights[p + "self_attn.k_proj.weight"] = interleaved_to_rotate_half(
            arrays["wk"][i], header.n_kv_heads
        )
        weights[p + "self_attn.v_proj.weight"] = arrays["wv"][i]
        weights[p + "self_attn.o_proj.weight"] = arrays["wo"][i]
        weights[p + "mlp.gate_proj.weight"] = arrays["w1"][i]
        weights[p + "mlp.down_proj.weight"] = arrays["w2"][i]
        weights[p + "mlp.up_proj.weight"] = arrays["w3"][i]
    return {k: v.contiguous() for k, v in weights.items()}


def llama2c_hf_config(header: Llama2cHeader) -> dict[str, Any]:
    """The HF LlamaConfig dict of a llama2.c model (RMSNorm eps 1e-5, RoPE theta 10000, bos 1, eos 2)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": header.vocab_size,
        "hidden_size": header.dim,
        "intermediate_size": header.hidden_dim,
        "num_hidden_layers": header.n_layers,
        "num_attention_heads": header.n_heads,
        "num_key_value_heads": header.n_kv_heads,
        "head_dim": header.head_dim,
        "max_position_embeddings": header.seq_len,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": header.shared_classifier,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    }


def save_sentencepiece_tokenizer(model_path: Path, out_dir: Path) -> None:
    """Save a transformers LlamaTokenizer (byte-fallback BPE) built from a SentencePiece BPE model into out_dir."""
    import sentencepiece as spm
    from transformers import LlamaTokenizer
    from transformers.convert_slow_tokenizer import generate_merges

    sp = spm.SentencePieceProcessor(model_file=str(model_path))
    vocab = {sp.id_to_piece(i): i for i in range(sp.get_piece_size())}
    tokenizer = LlamaTokenizer(
        vocab=vocab,
        merges=generate_merges(vocab),
        unk_token=sp.id_to_piece(sp.unk_id()),
        bos_token=sp.id_to_piece(sp.bos_id()),
        eos_token=sp.id_to_piece(sp.eos_id()),
        add_bos_token=True,
        add_prefix_space=True,
    )
    tokenizer.save_pretrained(str(out_dir))


def convert_llama2c(bin_path: str | Path, tokenizer_model_path: str | Path, out_dir: str | Path) -> Path:
    """Write an HF Llama folder (float32 safetensors, config, tokenizer) from a llama2.c `.bin` + SentencePiece model.

    Written atomically; `out_dir` must not exist or be empty.
    """
    src, tok = Path(bin_path).expanduser(), Path(tokenizer_model_path).expanduser()
    for p in (src, tok):
        if not p.is_file():
            raise ConfigError(f"{p} does not exist")
    header = read_header(src)
    weights = read_llama2c_weights(src, header)
    return write_hf_folder(
        Path(out_dir), llama2c_hf_config(header), weights, lambda tmp: save_sentencepiece_tokenizer(tok, tmp)
    )


def find_tokenizer_model(bin_path: Path) -> Path:
    """The SentencePiece model beside a .bin: `tokenizer.model`, else the only `*.model` file there."""
    beside = bin_path.parent / "tokenizer.model"
    if beside.is_file():
        return beside
    candidates = sorted(bin_path.parent.glob("*.model"))
    if len(candidates) == 1:
        return candidates[0]
    raise ConfigError(
        f"{bin_path}: need exactly one SentencePiece .model file beside it (found {len(candidates)}); "
        "or convert it with tandem.models.llama2c.convert_llama2c(bin, tokenizer_model, out_dir)"
    )


def load_llama2c_checkpoint(bin_path: Path, dtype: torch.dtype, *, progress: bool = True) -> Checkpoint:
    """Convert once into tandem_home()/models/<stem>-<key> (key: both files' path, size, mtime), then load that."""
    read_header(bin_path)  # reject non-llama2.c files before looking for a tokenizer
    tok = find_tokenizer_model(bin_path)
    key = f"{file_cache_key(bin_path)}{file_cache_key(tok)}"[:16]
    folder = tandem_home() / "models" / f"{bin_path.stem}-{key}"
    if not (folder / "config.json").is_file():
        try:
            convert_llama2c(bin_path, tok, folder)
        except ConfigError:
            if not (folder / "config.json").is_file():  # not a lost race with another converting process
                raise
    ckpt = load_hf_checkpoint(folder, dtype, progress=progress)
    ckpt.source = "llama2c"
    return ckpt
