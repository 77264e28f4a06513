"""llama2.c stories260K -> HF folder, checked by running transformers' own Llama on it (not tandem's model code)."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, LlamaForCausalLM

from tandem.config import ConfigError
from tandem.models.llama2c import convert_llama2c
from tandem.models.loader import load_checkpoint

STORIES = Path(__file__).resolve().parents[2] / "../shared/data/models/stories260K"
BIN, TOKENIZER = STORIES / "stories260K.bin", STORIES / "tok512.model"
# greedy from BOS, temperature 0 (shared/data/README.md)
KNOWN_STORY = (
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the park. One day, she saw a "
    "big, red ball. She wanted to play with it, but it was too high"
)

pytestmark = pytest.mark.skipif(not BIN.is_file(), reason="shared/data stories260K not present")


@pytest.fixture(scope="module")
def converted(stories_dir: Path) -> Path:
    """stories260K converted by `convert_llama2c` (conftest's session fixture)."""
    return stories_dir


def test_convert_refuses_a_non_empty_output_folder(tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("x")
    with pytest.raises(ConfigError, match="already exists"):
        convert_llama2c(BIN, TOKENIZER, tmp_path / "out")


def test_config_of_converted_folder(converted: Path) -> None:
    cfg = load_checkpoint(converted, torch.float32, progress=False).config
    shape = (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size, cfg.head_dim)
    assert shape == (64, 5, 8, 4, 512, 8)
    assert (cfg.max_position_embeddings, cfg.bos_token_id, cfg.eos_token_ids) == (512, 1, (2,))
    assert cfg.tie_word_embeddings


def test_transformers_greedy_story_from_bos(converted: Path) -> None:
    model = LlamaForCausalLM.from_pretrained(str(converted), dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(converted))
    with torch.no_grad():
        out = model.generate(torch.tensor([[1]]), max_new_tokens=48, do_sample=False, eos_token_id=None)
    text = str(tokenizer.decode(out[0].tolist(), skip_special_tokens=True))
    assert text.startswith(
        "Once upon a time, there was a little girl named Lily. She loved to play outside in the park."
    )
    assert KNOWN_STORY.startswith(text) or text.startswith(KNOWN_STORY)


def test_tokenizer_matches_sentencepiece(converted: Path) -> None:
    sentencepiece = pytest.importorskip("sentencepiece")
    sp = sentencepiece.SentencePieceProcessor(model_file=str(TOKENIZER))
    tokenizer = AutoTokenizer.from_pretrained(str(converted))
    text = "Once upon a time, there was a little girl named Lily. Zebra? 42!"
    assert tokenizer.encode(text, add_special_tokens=False) == sp.encode(text)
    assert tokenizer.encode("Lily")[0] == 1  # BOS added
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (1, 2)


def test_load_checkpoint_on_bin_converts_into_tandem_home(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, converted: Path
) -> None:
    home = tmp_path / "home"
    monkeypatch.setenv("TANDEM_HOME", str(home))
    local = tmp_path / "m"
    local.mkdir()
    (local / "stories260K.bin").symlink_to(BIN)
    (local / "tok512.model").symlink_to(TOKENIZER)
    ckpt = load_checkpoint(local / "stories260K.bin", torch.float32, progress=False)
    assert ckpt.source == "llama2c"
    assert ckpt.tokenizer_path.parent == home / "models"
    reference = load_checkpoint(converted, torch.float32, progress=False).weights
    assert ckpt.weights.keys() == reference.keys()
    assert all(torch.equal(ckpt.weights[k], reference[k]) for k in reference)
    # a second load reuses the cache folder
    again = load_checkpoint(local / "stories260K.bin", torch.bfloat16, progress=False)
    assert again.tokenizer_path == ckpt.tokenizer_path and len(list((home / "models").iterdir())) == 1


def test_bin_that_is_not_llama2c_is_refused(tmp_path: Path) -> None:
    bogus = tmp_path / "pytorch_model.bin"
    bogus.write_bytes(struct.pack("<7i", 64, 128, 2, 4, 4, 100, 32) + b"\0" * 40)
    with pytest.raises(ConfigError, match="not a llama2.c fp32 checkpoint.*pickles are never loaded"):
        load_checkpoint(bogus)
