"""The output oracle of the engine tests (oracle.py) is not vacuous: it passes valid documents and prefixes and
fails a refused token, a prefix claimed complete, and text outside the language."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import GPT2Tokenizer

from tandem.params import StructuredOutputsParams

from .oracle import GrammarOracle, check_text, choice_pattern

SHARED = Path(__file__).resolve().parents[2] / "../shared/data"


@pytest.fixture(scope="module")
def gpt2() -> tuple[GPT2Tokenizer, GrammarOracle]:
    folder = SHARED / "tokenizers" / "gpt2"
    if not folder.is_dir():
        pytest.skip("shared/data GPT-2 tokenizer not present")
    tok = GPT2Tokenizer(str(folder / "vocab.json"), str(folder / "merges.txt"))
    return tok, GrammarOracle(tok, len(tok), [tok.eos_token_id])


def test_matchers_pass_documents_and_prefixes_and_catch_refused_tokens(gpt2: tuple[GPT2Tokenizer, GrammarOracle]) -> None:
    tok, oracle = gpt2
    so = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
                                       "additionalProperties": False})
    doc = tok.encode('{"a":12}')
    oracle.accepts(so, doc + [tok.eos_token_id], complete=True)
    oracle.accepts(so, doc[:3], complete=False)  # a prefix
    with pytest.raises(AssertionError):
        oracle.accepts(so, doc[:3], complete=True)  # a prefix is not a document
    with pytest.raises(AssertionError, match="refuses"):
        oracle.accepts(so, tok.encode('{"b":1}'), complete=False)
    with pytest.raises(AssertionError, match="refuses"):
        oracle.accepts(so, tok.encode('{"a":1') + [tok.eos_token_id], complete=True)  # EOS before the end


def test_text_checks() -> None:
    pattern = choice_pattern(["red", "green"])
    check_text("choice", "gre", complete=False, pattern=pattern)
    check_text("choice", "green", complete=True, pattern=pattern)
    for text, complete in (("gre", True), ("blue", False), ("greenish", False)):
        with pytest.raises(AssertionError):
            check_text("choice", text, complete, pattern=pattern)
    schema = {"type": "object", "required": ["a"]}
    check_text("json", '{"a": 1}', complete=True, schema=schema)
    with pytest.raises(Exception, match="'a' is a required property"):
        check_text("json", '{"b": 1}', complete=True, schema=schema)
