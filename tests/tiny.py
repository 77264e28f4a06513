"""Tiny random-weight checkpoints for tests: a transformers model saved with `save_pretrained` (the reference in
parity tests) and a word-level tokenizer over its vocabulary, so the whole engine runs on it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers

TINY: dict[str, Any] = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2)


def tiny_model(arch: str, seed: int = 0, **overrides: Any) -> transformers.PreTrainedModel:
    """A seeded random model: "llama", "llama3" (Llama 3 RoPE scaling), "mistral" (`sliding_window` from the
    overrides), "qwen2" (q/k/v bias; a window with use_sliding_window / max_window_layers in the overrides)."""
    torch.manual_seed(seed)
    kw = {**TINY, **overrides}
    if arch == "llama":
        model: transformers.PreTrainedModel = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw))
    elif arch == "llama3":
        kw.setdefault("rope_scaling", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 256})
        kw.setdefault("rope_theta", 500000.0)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw))
    elif arch == "mistral":
        model = transformers.MistralForCausalLM(transformers.MistralConfig(**kw))
    elif arch == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**kw))
    else:
        raise AssertionError(arch)
    return perturb_norms(model)


def perturb_norms(model: transformers.PreTrainedModel) -> transformers.PreTrainedModel:
    """Random norms and biases (a fresh model's are ones and zeros) so that parity tests see them; in eval mode."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name:
                p.add_(torch.randn_like(p) * 0.2)
    return model.eval()


def save_wordlevel_tokenizer(folder: Path, vocab_size: int, eos_id: int | None = None) -> None:
    """Tokens "t0" ... "t{V-1}" split on whitespace; t0 is BOS (and unknown), `eos_id` (default V - 1) is EOS."""
    import tokenizers

    eos_id = vocab_size - 1 if eos_id is None else eos_id
    vocab = {f"t{i}": i for i in range(vocab_size)}
    tk = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab=vocab, unk_token="t0"))
    tk.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tk.decoder = tokenizers.decoders.WordPiece(prefix="##")  # joins tokens with spaces
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tk, eos_token=f"t{eos_id}", bos_token="t0", unk_token="t0")
    fast.save_pretrained(folder)


def save_tiny(folder: Path, model: transformers.PreTrainedModel) -> Path:
    """`model` and a word-level tokenizer over its vocabulary in `folder` (an HF checkpoint folder)."""
    model.save_pretrained(folder, safe_serialization=True)
    save_wordlevel_tokenizer(folder, model.config.vocab_size, eos_id=model.config.eos_token_id
                             if isinstance(model.config.eos_token_id, int) else None)
    return folder


def hf_greedy(folder: str, prompts: list[str], max_new_tokens: int = 12) -> list[list[int]]:
    """transformers' own greedy continuation (float32, exactly `max_new_tokens`) of each prompt: the reference."""
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    want = []
    for p in prompts:
        ids = tok(p, return_tensors="pt").input_ids
        out = ref.generate(ids, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False)
        want.append(out[0, ids.shape[1]:].tolist())
    return want
