"""Frozen configuration: the model's architecture and the engine's cache / scheduler / device settings.

Nothing here reads the environment at import; `EngineConfig` is built from `LLM(...)` arguments.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A configuration value or checkpoint is unusable; the message names what and the allowed values."""


# HF `architectures[0]` / `model_type` -> tandem's family switch
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3",
    "MixtralForCausalLM": "llama",
    "GptOssForCausalLM": "gpt_oss",
}
SUPPORTED_MODEL_TYPES: dict[str, str] = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
                                         "qwen3_moe": "qwen3", "mixtral": "llama", "gpt_oss": "gpt_oss"}


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama-family decoder (Llama 2/3, Mistral, TinyLlama, SmolLM, Qwen2/2.5, Qwen3, gpt-oss), its
    MLP dense or a mixture of experts in `moe_layers` (Qwen3-MoE, Mixtral, gpt-oss)."""

    family: str  # "llama" | "qwen2" | "qwen3" | "gpt_oss"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Mapping[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2, gpt-oss)
    output_bias: bool = False  # o_proj carries a bias (gpt-oss)
    attention_sinks: bool = False  # a learned logit per query head joins each softmax's denominator (gpt-oss)
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3)
    sliding_window: int | None = None  # keys a query sees in the layers below (itself and the window - 1 before it)
    sliding_window_layers: tuple[int, ...] = ()  # the layers that attend through `sliding_window`; the others see all
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None
    num_experts: int = 0  # a mixture of experts in `moe_layers` (0: every MLP dense)
    experts_per_token: int = 0  # top k of the router's softmax
    moe_intermediate_size: int = 0  # each expert's MLP width
    norm_topk_prob: bool = True  # the k routing weights renormalized to sum to 1 (Mixtral always; Qwen3-MoE by config)
    moe_layers: tuple[int, ...] = ()
    expert_names: str = "qwen"  # checkpoint naming: "qwen" (mlp.experts.E.gate_proj ...) | "mixtral" (block_sparse_moe.experts.E.w1 ...)
    # | "gpt_oss" (mlp.router with a bias; mlp.experts.gate_up_proj [E, hidden, 2 I] stacked, gate / up interleaved)
    # logits for the ids below this only (a draft model proposing from the start of its vocabulary, where a BPE
    # vocabulary keeps its most frequent tokens: spec_decode/draft_model.py); None: every id
    output_rows: int | None = None
    swiglu_alpha: float = 1.702  # gpt-oss experts: out = (clamp(up) + 1) * g * sigmoid(alpha * g), g = min(gate, limit)
    swiglu_limit: float = 7.0

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any]) -> ModelConfig:
        """Build from a HF `config.json` dict; raise ConfigError naming an unsupported architecture."""
        archs = list(cfg.get("architectures") or [])
        family = None
        for a in archs:
            family = SUPPORTED_ARCHITECTURES.get(a)
            if family:
                break
        if family is None:
            family = SUPPORTED_MODEL_TYPES.get(str(cfg.get("model_type", "")))
        if family is None:
            raise ConfigError(
                f"unsupported architecture {archs or cfg.get('model_type')!r}; supported: "
                f"{sorted(SUPPORTED_ARCHITECTURES)} (model_type {sorted(SUPPORTED_MODEL_TYPES)})"
            )
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            eos = cfg.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
            rope_theta, rope_scaling = _rope(cfg)
            num_layers = int(cfg["num_hidden_layers"])
            sliding, sliding_layers = _sliding_window(cfg, family, num_layers)
            return cls(
                family=family,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=num_layers,
                num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=float(rope_theta or (150000.0 if family == "gpt_oss" else 10000.0)),
                rope_scaling=dict(rope_scaling) if rope_scaling else None,
                max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=bool(cfg.get("attention_bias", family in ("qwen2", "gpt_oss"))),
                output_bias=family == "gpt_oss" and bool(cfg.get("attention_bias", True)),
                attention_sinks=family == "gpt_oss",
                qk_norm=family == "qwen3",
                sliding_window=sliding,
                sliding_window_layers=sliding_layers,
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=tuple(int(e) for e in eos_ids),
                torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
                **_moe_fields(cfg, num_layers),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"config.json is missing or has a bad value for {e}") from e

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of `layer`'s attention, None where it sees every earlier key."""
        return self.sliding_window if layer in self.sliding_window_layers else None

    @classmethod
    def from_json_file(cls, path: str | Path) -> ModelConfig:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"{p} not found: an HF checkpoint folder needs config.json")
        try:
            return cls.from_hf(json.loads(p.read_text()))
        except json.JSONDecodeError as e:
            raise ConfigError(f"{p} is not valid JSON: {e}") from e


def _rope(cfg: Mapping[str, Any]) -> tuple[Any, Any]:
    """(rope_theta, rope_scaling) from `rope_theta` / `rope_scaling` or transformers >= 5's `rope_parameters`; a
    top-level `original_max_position_embeddings` joins the scaling as transformers moves it there."""
    rope_scaling = cfg.get("rope_scaling")
    rope_theta = cfg.get("rope_theta")
    rope_params = cfg.get("rope_parameters")
    if isinstance(rope_params, Mapping):
        rope_theta = rope_theta or rope_params.get("rope_theta")
        if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
            rope_scaling = dict(rope_params)
    if rope_scaling and cfg.get("original_max_position_embeddings"):
        rope_scaling = {**rope_scaling, "original_max_position_embeddings": cfg["original_max_position_embeddings"]}
    return rope_theta, rope_scaling


def _moe_fields(cfg: Mapping[str, Any], num_layers: int) -> dict[str, Any]:
    """The mixture-of-experts fields as transformers reads them: Qwen3-MoE (`num_experts` or `num_local_experts`, `moe_intermediate_size`,
    `norm_topk_prob`, experts in every `decoder_sparse_step`-th layer not in `mlp_only_layers`), Mixtral
    (`num_local_experts` in every layer, the top k always renormalized); {} for a dense model."""
    if cfg.get("model_type") == "mixtral" or "MixtralForCausalLM" in (cfg.get("architectures") or []):
        return {"num_experts": int(cfg["num_local_experts"]), "experts_per_token": _top_k(cfg, int(cfg["num_local_experts"])),
                "moe_intermediate_size": int(cfg["intermediate_size"]), "norm_topk_prob": True,
                "moe_layers": tuple(range(num_layers)), "expert_names": "mixtral"}
    if cfg.get("model_type") == "gpt_oss" or "GptOssForCausalLM" in (cfg.get("architectures") or []):
        return _gpt_oss_moe(cfg, num_layers)
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)  # transformers >= 5 writes the latter
    if experts <= 0:
        return {}
    step, dense = int(cfg.get("decoder_sparse_step") or 1), set(cfg.get("mlp_only_layers") or [])
    layers = tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)
    return {"num_experts": experts, "experts_per_token": _top_k(cfg, experts),
            "moe_intermediate_size": int(cfg["moe_intermediate_size"]), "norm_topk_prob": bool(cfg.get("norm_topk_prob", False)),
            "moe_layers": layers, "expert_names": "qwen"}


def _top_k(cfg: Mapping[str, Any], experts: int) -> int:
    """`num_experts_per_tok`, checked against the layer's `experts` (a named ConfigError at load, not a failure in
    the router's topk on the first step)."""
    k = int(cfg["num_experts_per_tok"])
    if not 0 < k <= experts:
        raise ConfigError(f"num_experts_per_tok must be in [1, {experts}] (the experts), got {k}")
    return k


def _gpt_oss_moe(cfg: Mapping[str, Any], num_layers: int) -> dict[str, Any]:
    """gpt-oss: experts in every layer, each `intermediate_size` wide; the top k router logits softmaxed."""
    experts = int(cfg["num_local_experts"])
    return {"num_experts": experts, "experts_per_token": _top_k(cfg, experts), "moe_intermediate_size": int(cfg["intermediate_size"]),
            "norm_topk_prob": True, "moe_layers": tuple(range(num_layers)), "expert_names": "gpt_oss",
            "swiglu_alpha": float(cfg.get("swiglu_alpha", 1.702)), "swiglu_limit": float(cfg.get("swiglu_limit", 7.0))}


def _sliding_window(cfg: Mapping[str, Any], family: str, num_layers: int) -> tuple[int | None, tuple[int, ...]]:
    """The sliding window and the layers that use it, as transformers reads the config: Mistral (family "llama"):
    every layer when `sliding_window` is set; Qwen2 / Qwen3: only with `use_sliding_window`, the layers `layer_types`
    marks "sliding_attention" (transformers >= 4.53 writes it), else those from `max_window_layers` on; gpt-oss: the
    layers `layer_types` marks, else every even one (transformers' default)."""
    window = cfg.get("sliding_window")
    if not window or not cfg.get("use_sliding_window", family in ("llama", "gpt_oss")):
        return None, ()
    if family == "llama":
        return int(window), tuple(range(num_layers))
    types = cfg.get("layer_types")
    if isinstance(types, list) and len(types) == num_layers:
        layers = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    elif family == "gpt_oss":
        layers = tuple(range(0, num_layers, 2))
    else:
        layers = tuple(range(int(cfg.get("max_window_layers", 28)), num_layers))
    return (int(window), layers) if layers else (None, ())


DTYPES = ("float32", "bfloat16", "float16", "auto")


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: block size in tokens and a memory budget (bytes, or a fraction of free memory)."""

    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes; None: sized to the work, capped (`runner.plan_kv_cache`)
    memory_fraction: float | None = None  # cap: this fraction of what is free; None: 0.5, on the host also HOST_KV_DEFAULT
    share: float = 1.0  # of the host's memory and default pool, this engine's (data-parallel replicas split them)
    enable_prefix_caching: bool = True
    num_blocks: int | None = None  # overrides the budget (tests)

    def __post_init__(self) -> None:
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128, 256):
            raise ConfigError(f"block_size must be a power of two in [1, 256], got {self.block_size}")
        if self.memory_fraction is not None and not 0.0 < self.memory_fraction <= 0.95:
            raise ConfigError(f"memory_fraction must be in (0, 0.95], got {self.memory_fraction}")
        if not 0.0 < self.share <= 1.0:
            raise ConfigError(f"share must be in (0, 1], got {self.share}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ConfigError(f"kv_cache_memory must be a positive number of bytes, got {self.kv_cache_memory}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ConfigError(f"num_blocks must be >= 1, got {self.num_blocks}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int = 2048

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ConfigError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_model_len < 2:
            raise ConfigError(f"max_model_len must be >= 2, got {self.max_model_len}")


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs; built once by `LLM`."""

    model: str | None
    model_config: ModelConfig
    dtype: str = "bfloat16"
    device: str = "cpu"
    seed: int = 0
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    num_threads: int | None = None  # torch intra-op threads for the forward; None: all cores the process may use
