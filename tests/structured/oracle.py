"""Checking a guided request's output after the fact, whatever it ended with.

* `GrammarOracle.accepts`: every emitted token (EOS included) is accepted by a *fresh* matcher of each backend that
  can compile the spec: the one that did not generate the output is an independent implementation of the grammar;
  an output cut by max_tokens or a stop string is then a checked prefix of a valid document, not a skipped case.
* `check_text`: the text against Python's own reference, `json` + `jsonschema` for complete documents and the
  `regex` module's partial matching for prefixes of regex / choice / expression-grammar outputs.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import jsonschema
import regex

from tandem.params import StructuredOutputsParams
from tandem.structured import GrammarSpec
from tandem.structured.llguidance_backend import LLGuidanceBackend
from tandem.structured.xgrammar_backend import XGrammarBackend


class GrammarOracle:
    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self.eos = set(eos_token_ids)
        self.backends = {
            "xgrammar": XGrammarBackend(hf_tokenizer, vocab_size, eos_token_ids),
            "llguidance": LLGuidanceBackend(hf_tokenizer, vocab_size, eos_token_ids),
        }
        self._compiled: dict[tuple[str, GrammarSpec], Any] = {}

    def accepts(self, params: StructuredOutputsParams, token_ids: Sequence[int], complete: bool) -> None:
        """Fresh matchers accept all of `token_ids`; `complete`: the grammar ended it (EOS accepted, terminated)."""
        spec = GrammarSpec.from_params(params)
        for name, backend in self.backends.items():
            if name == "xgrammar" and spec.kind == "grammar" and not _is_gbnf(spec.text):
                continue  # Lark: llguidance only
            key = (name, spec)
            if key not in self._compiled:
                self._compiled[key] = backend.compile(spec)
            m = backend.matcher(self._compiled[key])
            taken = m.accept(list(token_ids))
            assert taken == len(token_ids), f"{name} refuses token {taken} of {list(token_ids)}"
            if complete:
                assert token_ids and token_ids[-1] in self.eos and m.is_terminated(), name


def _is_gbnf(text: str) -> bool:
    return "::=" in text


def check_text(kind: str, text: str, complete: bool, *, schema: Any = None, pattern: str | None = None) -> None:
    """`text` is a whole valid document (`complete`) or a prefix of one."""
    if kind in ("json", "json_object"):
        if complete:
            value = json.loads(text)
            if kind == "json":
                jsonschema.validate(value, schema)
            else:
                assert isinstance(value, dict)
        return  # a JSON prefix: the matchers above are the check
    assert pattern is not None
    m = regex.fullmatch(pattern, text, partial=not complete)
    assert m is not None, (pattern, text, complete)


def choice_pattern(choices: Sequence[str]) -> str:
    return "|".join(regex.escape(c) for c in choices)
