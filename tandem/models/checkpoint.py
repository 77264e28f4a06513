"""What every checkpoint format becomes (`Checkpoint`, its weights a `WeightStore`), and the helpers the readers share.

Weights are read from the file when asked for, with plain reads into fresh tensors: no file mapping stays alive and
nothing is cached, so a model that takes each weight once, repacks it and drops it holds its weights once (the page
cache keeps the file, outside the process's RSS). `WeightStore.stored(name)` is what a model keeps: a dense tensor in
the load dtype, or a `QuantizedTensor` for weights kept quantized (GGUF blocks; int8 with `quantization="int8"`);
`store[name]` is always the dense tensor (dequantized when stored quantized).

Derived folders (a GGUF's tokenizer, a converted llama2.c model) are cached under `tandem_home()` and written
atomically (into a temp folder beside the target, then one `rename`), so concurrent processes never see half a folder.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from tandem.config import DTYPES, ConfigError, ModelConfig
from tandem.layers.quant import QuantizedTensor, quantize_int8

logger = logging.getLogger(__name__)

_DTYPES_BY_NAME: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"


QUANTIZATIONS = ("auto", "none", "int8")  # auto: GGUF blocks kept as stored, others dense; none: all dense; int8


class WeightStore(Mapping[str, torch.Tensor], ABC):
    """HF-named weights of one checkpoint, read on each access (nothing cached). `store[name]`: dense, in `dtype`;
    `stored(name)`: what a model should keep (matrices in `dtype` or a `QuantizedTensor`; vectors in float32)."""

    dtype: torch.dtype
    quantization: str = "auto"

    @abstractmethod
    def names(self) -> list[str]:
        """Every weight name, in file order."""

    @abstractmethod
    def read(self, name: str) -> torch.Tensor | QuantizedTensor:
        """The weight as the file holds it (a dense tensor in the file's dtype, or quantized blocks); KeyError when
        absent."""

    def stored(self, name: str) -> torch.Tensor | QuantizedTensor:
        w = self.read(name)
        if isinstance(w, QuantizedTensor):
            return w.dequantize(self.dtype) if self.quantization == "none" else w
        if w.dim() < 2:
            return w.float() if w.is_floating_point() else w  # norms and biases: the model picks their dtype
        w = w.to(self.dtype)
        if self.quantization == "int8" and is_matrix_weight(name):
            return quantize_int8(w)
        return w

    def __getitem__(self, name: str) -> torch.Tensor:
        w = self.read(name)
        return w.dequantize(self.dtype) if isinstance(w, QuantizedTensor) else w.to(self.dtype)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self.names())

    def __contains__(self, name: object) -> bool:
        return name in set(self.names())


class TensorDict(WeightStore):
    """Weights already in memory (converted formats, tests)."""

    def __init__(self, weights: Mapping[str, torch.Tensor], dtype: torch.dtype, quantization: str = "auto") -> None:
        self._weights = dict(weights)
        self.dtype = dtype
        self.quantization = quantization

    def names(self) -> list[str]:
        return list(self._weights)

    def read(self, name: str) -> torch.Tensor | QuantizedTensor:
        return self._weights[name]


def is_matrix_weight(name: str) -> bool:
    """Projection and embedding matrices (what `quantization="int8"` quantizes); norms, biases and routers stay dense
    (a router's few rows decide which experts run: vLLM and llama.cpp keep them unquantized too)."""
    return name.endswith(".weight") and "norm" not in name and not name.endswith(
        (".mlp.gate.weight", "block_sparse_moe.gate.weight", ".mlp.router.weight"))


def check_quantization(quantization: str | None) -> str:
    q = "auto" if quantization is None else str(quantization).lower()
    if q not in QUANTIZATIONS:
        raise ConfigError(f"quantization must be one of {list(QUANTIZATIONS)} (or None), got {quantization!r}")
    return q


def read_at(path: Path, offset: int, nbytes: int) -> torch.Tensor:
    """`nbytes` bytes of a file from `offset` into a fresh uint8 tensor (a plain read: nothing stays mapped)."""
    out = torch.empty(nbytes, dtype=torch.uint8)
    view = out.numpy().data  # a writable 1-D byte view of the tensor's memory
    with open(path, "rb", buffering=0) as f:
        f.seek(offset)
        got = 0
        while got < nbytes:
            n = f.readinto(view[got:])
            if not n:
                raise ConfigError(f"{path}: file ends at {offset + got} bytes, a tensor needs {offset + nbytes}")
            got += n
    return out


@dataclass
class Checkpoint:
    """A loaded model: architecture, HF-named weights (read on demand), and where its tokenizer lives."""

    config: ModelConfig
    weights: WeightStore  # HF names, e.g. "model.layers.0.self_attn.q_proj.weight" -> [out, in]
    tokenizer_path: Path  # a folder for AutoTokenizer.from_pretrained
    chat_template: str | None
    source: str  # "hf" | "gguf" | "llama2c"


def resolve_dtype(name: str, config: ModelConfig) -> torch.dtype:
    """Map a dtype name to torch; "auto" takes the checkpoint's `torch_dtype` (bfloat16 when unknown)."""
    if name == "auto":
        declared = str(config.torch_dtype or "").removeprefix("torch.")
        return _DTYPES_BY_NAME.get(declared, torch.bfloat16)
    if name not in _DTYPES_BY_NAME:
        raise ConfigError(f"dtype must be one of {list(DTYPES)}, got {name!r}")
    return _DTYPES_BY_NAME[name]


def expected_weight_names(config: ModelConfig) -> list[str]:
    """Every HF parameter name a checkpoint of this architecture must hold (buffers excluded)."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not config.tie_word_embeddings:
        names.append("lm_head.weight")
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        names += [f"{p}self_attn.{x}_proj.weight" for x in ("q", "k", "v", "o")]
        if i in config.moe_layers and config.expert_names == "gpt_oss":
            names += list(stacked_moe_names(i))
        elif i in config.moe_layers:
            router, experts = moe_weight_names(config, i)
            names += [router, *(n for expert in experts for n in expert)]
        else:
            names += [f"{p}mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
        if config.attention_bias:
            names += [f"{p}self_attn.{x}_proj.bias" for x in ("q", "k", "v")]
        if config.output_bias:
            names.append(p + "self_attn.o_proj.bias")
        if config.attention_sinks:
            names.append(p + "self_attn.sinks")
        if config.qk_norm:
            names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
    return names


def moe_weight_names(config: ModelConfig, layer: int) -> tuple[str, list[tuple[str, str, str]]]:
    """HF names of one mixture-of-experts layer: (router [E, hidden], per expert (gate, up, down))."""
    p = f"model.layers.{layer}."
    if config.expert_names == "mixtral":
        b = p + "block_sparse_moe."
        return b + "gate.weight", [(f"{b}experts.{e}.w1.weight", f"{b}experts.{e}.w3.weight", f"{b}experts.{e}.w2.weight")
                                   for e in range(config.num_experts)]
    b = p + "mlp."
    return b + "gate.weight", [tuple(f"{b}experts.{e}.{x}_proj.weight" for x in ("gate", "up", "down"))  # type: ignore[misc]
                               for e in range(config.num_experts)]


@dataclass(frozen=True)
class StackedMoeNames:
    """HF names of one gpt-oss mixture-of-experts layer, every expert in one tensor per part."""

    router: str  # [E, hidden]
    router_bias: str  # [E]
    gate_up: str  # [E, hidden, 2 I]: x @ gate_up[e]; columns 2j (gate) and 2j + 1 (up) interleaved
    gate_up_bias: str  # [E, 2 I], interleaved as well
    down: str  # [E, I, hidden]: y @ down[e]
    down_bias: str  # [E, hidden]

    def __iter__(self) -> Iterator[str]:
        return iter((self.router, self.router_bias, self.gate_up, self.gate_up_bias, self.down, self.down_bias))


def stacked_moe_names(layer: int) -> StackedMoeNames:
    """gpt-oss's expert names in layer `layer` (MXFP4 checkpoints store gate_up / down as `_blocks` + `_scales`,
    which the safetensors reader serves under these names)."""
    m = f"model.layers.{layer}.mlp."
    return StackedMoeNames(m + "router.weight", m + "router.bias", m + "experts.gate_up_proj", m + "experts.gate_up_proj_bias",
                           m + "experts.down_proj", m + "experts.down_proj_bias")


def split_expert_names(layer: int, expert: int) -> tuple[str, str, str]:
    """gpt-oss's expert `expert` of layer `layer` as separate projections: its (gate [I, hidden], up [I, hidden], down
    [hidden, I]) weight names, each with a bias named alike (`expert_bias_name`). GGUF files store gpt-oss's experts
    so, and the safetensors reader serves MXFP4 experts so, one expert at a time and in their blocks; the stacked
    `stacked_moe_names` are what a dense HF checkpoint holds."""
    m = f"model.layers.{layer}.mlp.experts.{expert}."
    return m + "gate_proj.weight", m + "up_proj.weight", m + "down_proj.weight"


def expert_bias_name(weight_name: str) -> str:
    """The bias of a `split_expert_names` weight."""
    return weight_name.removesuffix(".weight") + ".bias"


def interleaved_to_rotate_half(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Reorder q/k projection rows from interleaved RoPE pairs to HF's rotate-half layout.

    Within each head of size D, interleaved layouts (llama.cpp GGUF, llama2.c, Meta) rotate rows (2i, 2i+1) together;
    HF rotates (i, i + D/2). Row 2i + j of a head moves to row j * D/2 + i. Works for weights [H*D, in] and biases [H*D].
    """
    rows = w.shape[0]
    head_dim = rows // num_heads
    # [H, D/2, 2, ...] -> [H, 2, D/2, ...]
    return w.reshape(num_heads, head_dim // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()


def read_chat_template(folder: Path) -> str | None:
    """The chat template saved beside a tokenizer: chat_template.jinja, chat_template.json or tokenizer_config.json."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    for name in ("chat_template.json", "tokenizer_config.json"):
        file = folder / name
        if not file.is_file():
            continue
        try:
            template = json.loads(file.read_text()).get("chat_template")
        except (json.JSONDecodeError, AttributeError):
            continue
        if isinstance(template, str):
            return template
        if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            chosen = named.get("default")
            if isinstance(chosen, str):
                return chosen
    return None


def write_hf_folder(
    out_dir: Path,
    hf_config: Mapping[str, Any],
    weights: Mapping[str, torch.Tensor],
    save_tokenizer: Callable[[Path], None] | None = None,
) -> Path:
    """Write config.json, generation_config.json, model.safetensors and the tokenizer into `out_dir`, atomically.

    Raises ConfigError if `out_dir` already exists and is not empty when called (see `write_folder_atomically`).
    """

    def fill(tmp: Path) -> None:
        (tmp / "config.json").write_text(json.dumps(dict(hf_config), indent=2, sort_keys=True) + "\n")
        generation = {
            k: hf_config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in hf_config
        }
        (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        tensors = {k: v.detach().contiguous() for k, v in weights.items()}
        save_file(tensors, str(tmp / SAFETENSORS_FILE), metadata={"format": "pt"})
        if save_tokenizer is not None:
            save_tokenizer(tmp)

    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise ConfigError(
            f"{out_dir} already exists and is not empty; remove it or choose another output folder"
        )
    return write_folder_atomically(out_dir, fill)


def write_folder_atomically(out_dir: Path, fill: Callable[[Path], None]) -> Path:
    """Create `out_dir` with the files `fill(tmp)` writes: into a temp folder beside it, then one rename.

    If another process published a complete `out_dir` (one with files) meanwhile, that folder is kept and ours
    is discarded; readers therefore never see a half-written folder.
    """
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        fill(tmp)
        try:
            if out_dir.is_dir() and not any(out_dir.iterdir()):
                out_dir.rmdir()
            os.rename(tmp, out_dir)
        except OSError:
            if not (out_dir.is_dir() and any(out_dir.iterdir())):
                raise
            logger.info("%s was written by another process meanwhile; keeping it", out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def file_cache_key(path: Path) -> str:
    """A short hex key naming a file's cached derivatives: changes when its resolved path, size or mtime does."""
    st = path.stat()
    return hashlib.sha256(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]
