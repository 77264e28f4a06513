"""A tiny random-weight gpt-oss checkpoint with the real o200k_harmony tokenizer: the fixture of the harmony tests.

Why: what harmony support must get right is the vocabulary and the message format, not the weights. The released
gpt-oss tokenizer.json is o200k_base's 199,998 BPE ranks (byte-level, o200k's split pattern) followed by 21 special
tokens at ids 199998 .. 200018 (`<|startoftext|>`, `<|endoftext|>`, `<|return|>` 200002, `<|constrain|>` 200003,
`<|channel|>` 200005, `<|start|>` 200006, `<|end|>` 200007, `<|message|>` 200008, `<|call|>` 200012, reserved ones,
`<|endofprompt|>` 200018; all special), and the model's embedding has 201,088 rows. Nothing may be downloaded here,
so the ranks come from ../shared/data/tokenizers/tiktoken/o200k_base.tiktoken (the file openai_harmony itself reads:
TIKTOKEN_ENCODINGS_BASE is pointed at that folder, `use_shared_vocabulary`).

The folder `tandem_home()/test-models/tiny-gpt-oss-harmony` (GptOssForCausalLM: hidden 64, 2 layers, 4 experts,
tied embeddings, float32; no chat template: tandem renders gpt-oss chats with harmony) holds tokenizer.json /
tokenizer_config.json (eos `<|return|>`, pad `<|endoftext|>`, bos `<|startoftext|>`) and, as the released
checkpoints, generation_config.json with eos ids [200002, 199999, 200012]. Built once (~10 s on 2 cores, mostly the
BPE merges), atomically under a file lock, and rebuilt when the stamp in `.fixture-version` changes. Random weights
write no harmony: tests push or force the markers (logit_bias, the thinking budget).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

from tests.reasoning.qwen_models import build_lock

NAME = "tiny-gpt-oss-harmony"
FIXTURE_VERSION = "1"
VERSION_FILE = ".fixture-version"
SHARED_TIKTOKEN = (Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "tokenizers" / "tiktoken").resolve()
VOCAB_SIZE = 201088  # embedding rows of the released gpt-oss checkpoints
NUM_RANKS = 199998
O200K_PATTERN = "|".join([
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n/]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])
SPECIAL_TOKENS: tuple[str, ...] = (  # ids 199998 .. 200018, as in the released tokenizer.json
    "<|startoftext|>", "<|endoftext|>", "<|reserved_200000|>", "<|reserved_200001|>", "<|return|>", "<|constrain|>",
    "<|reserved_200004|>", "<|channel|>", "<|start|>", "<|end|>", "<|message|>", "<|reserved_200009|>",
    "<|reserved_200010|>", "<|reserved_200011|>", "<|call|>", "<|reserved_200013|>", "<|reserved_200014|>",
    "<|reserved_200015|>", "<|reserved_200016|>", "<|reserved_200017|>", "<|endofprompt|>",
)
BOS, PAD, RETURN, CONSTRAIN, CHANNEL, START, END, MESSAGE, CALL = (
    199998, 199999, 200002, 200003, 200005, 200006, 200007, 200008, 200012)
GENERATION_EOS = (RETURN, PAD, CALL)  # the released generation_config.json's eos_token_id
MARKERS = (RETURN, CONSTRAIN, CHANNEL, START, END, MESSAGE, CALL)
TINY_GPT_OSS: dict[str, Any] = dict(
    hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=16,
    layer_types=["sliding_attention", "full_attention"], max_position_embeddings=4096, tie_word_embeddings=True,
    rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                     "original_max_position_embeddings": 1024, "rope_theta": 150000.0})


def use_shared_vocabulary() -> Path:
    """Point TIKTOKEN_ENCODINGS_BASE at the shared o200k_base.tiktoken (unless the environment already names a
    folder): the tests never let openai_harmony download it."""
    os.environ.setdefault("TIKTOKEN_ENCODINGS_BASE", str(SHARED_TIKTOKEN))
    return SHARED_TIKTOKEN


def stamp() -> str:
    spec = repr((TINY_GPT_OSS, SPECIAL_TOKENS, GENERATION_EOS, VOCAB_SIZE, O200K_PATTERN))
    return f"{FIXTURE_VERSION} {hashlib.sha256(spec.encode()).hexdigest()[:16]}"


@functools.cache
def harmony_model() -> Path:
    """The fixture's folder, built now unless a current one is cached (safe against concurrent test processes)."""
    from tandem.models.checkpoint import write_folder_atomically
    from tandem.paths import tandem_home

    use_shared_vocabulary()
    folder = tandem_home() / "test-models" / NAME
    if _is_current(folder):
        return folder
    with build_lock(folder):
        if _is_current(folder):
            return folder
        if folder.exists():
            aside = folder.with_name(f".{folder.name}.stale-{stamp().split()[1]}")
            shutil.rmtree(aside, ignore_errors=True)
            folder.rename(aside)
            shutil.rmtree(aside, ignore_errors=True)
        write_folder_atomically(folder, _fill)
    if not _is_current(folder):
        raise RuntimeError(f"{folder} was not built for {stamp()}")
    return folder


def _is_current(folder: Path) -> bool:
    f = folder / VERSION_FILE
    return f.is_file() and f.read_text().strip() == stamp()


def build_tokenizer() -> Any:
    """The HF fast tokenizer: o200k_base's ranks as byte-level BPE, the 21 special tokens at their ids."""
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    tk = TikTokenConverter(vocab_file=str(SHARED_TIKTOKEN / "o200k_base.tiktoken"), pattern=O200K_PATTERN).converted()
    if tk.get_vocab_size(with_added_tokens=False) != NUM_RANKS:
        raise RuntimeError(f"o200k_base.tiktoken: {tk.get_vocab_size(with_added_tokens=False)} ranks, not {NUM_RANKS}")
    for i, content in enumerate(SPECIAL_TOKENS):  # one at a time, in id order: each takes the next id
        tk.add_special_tokens([AddedToken(content, special=True, normalized=False)])
        if tk.token_to_id(content) != NUM_RANKS + i:
            raise RuntimeError(f"{content!r} got id {tk.token_to_id(content)}, expected {NUM_RANKS + i}")
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<|startoftext|>", eos_token="<|return|>",
                                   pad_token="<|endoftext|>", model_max_length=TINY_GPT_OSS["max_position_embeddings"],
                                   clean_up_tokenization_spaces=False)


def _fill(tmp: Path) -> None:
    import torch
    import transformers

    build_tokenizer().save_pretrained(str(tmp))
    torch.manual_seed(0)
    config = transformers.GptOssConfig(**TINY_GPT_OSS, vocab_size=VOCAB_SIZE, bos_token_id=BOS, eos_token_id=RETURN,
                                       pad_token_id=PAD, dtype="float32")
    model = transformers.GptOssForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 1.0)
    model.save_pretrained(str(tmp))
    generation = {"bos_token_id": BOS, "eos_token_id": list(GENERATION_EOS), "pad_token_id": PAD}
    (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    (tmp / VERSION_FILE).write_text(stamp() + "\n")
