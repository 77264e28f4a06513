"""JSON-Schema-Test-Suite (draft2020-12) as an acceptance test of both backends.

For every schema group that compiles, each test instance is written as compact JSON
(`json.dumps(data, separators=(",", ":"))`), tokenized with GPT-2, fed through a fresh matcher followed by EOS,
and "accepted" means every token (EOS included) was taken. That is compared with the suite's `valid`. Groups
whose schema refers to a remote document (http://localhost:1234, the suite's ref server) are skipped.

The counts are pinned below so they cannot regress; docs/structured_conformance.md has the table, made with
    .venv/bin/python tests/structured/test_schema_suite.py
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pytest
from transformers import GPT2Tokenizer

from tandem.structured import GrammarError, GrammarSpec
from tandem.structured.llguidance_backend import LLGuidanceBackend
from tandem.structured.xgrammar_backend import XGrammarBackend

SHARED = Path(__file__).resolve().parents[2] / "../shared/data"
SUITE = SHARED / "schemas/JSON-Schema-Test-Suite/draft2020-12"
REMOTE = "localhost:1234"
FAST_FILES = ("type.json", "enum.json", "const.json", "required.json", "maxLength.json", "minimum.json", "items.json")


@dataclass
class Tally:
    groups: int = 0
    compiled: int = 0
    compile_errors: int = 0
    tests: int = 0  # instances of compiled groups
    passed: int = 0
    false_accept: int = 0
    false_reject: int = 0


def suite_groups(files: tuple[str, ...] | None = None) -> Iterator[tuple[str, dict[str, Any]]]:
    """(file/description, group) for every group of the top-level draft2020-12 files, remote refs skipped."""
    for path in sorted(SUITE.glob("*.json")):
        if files is not None and path.name not in files:
            continue
        for group in json.loads(path.read_text()):
            if REMOTE in json.dumps(group["schema"]):
                continue
            yield f"{path.name}/{group['description']}", group


def run_suite(backend: Any, tokenizer: Any, files: tuple[str, ...] | None = None) -> Tally:
    tally = Tally()
    eos = tokenizer.eos_token_id
    for _name, group in suite_groups(files):
        tally.groups += 1
        try:
            grammar = backend.compile(GrammarSpec("json", json.dumps(group["schema"]), "compact"))
        except GrammarError:
            tally.compile_errors += 1
            continue
        tally.compiled += 1
        for test in group["tests"]:
            tokens = [*tokenizer.encode(json.dumps(test["data"], separators=(",", ":"))), eos]
            matcher = backend.matcher(grammar)
            accepted = matcher.accept(tokens) == len(tokens) and matcher.is_terminated()
            tally.tests += 1
            if accepted == test["valid"]:
                tally.passed += 1
            elif accepted:
                tally.false_accept += 1
            else:
                tally.false_reject += 1
    return tally


def make_backends() -> tuple[Any, dict[str, Any]]:
    tokenizer = GPT2Tokenizer.from_pretrained(SHARED / "tokenizers/gpt2")
    v, eos = len(tokenizer), [tokenizer.eos_token_id]
    return tokenizer, {"xgrammar": XGrammarBackend(tokenizer, v, eos), "llguidance": LLGuidanceBackend(tokenizer, v, eos)}


@pytest.fixture(scope="module")
def setup() -> tuple[Any, dict[str, Any]]:
    if not SUITE.exists():
        pytest.skip("JSON-Schema-Test-Suite not present in ../shared/data")
    return make_backends()


# Measured counts (see docs/structured_conformance.md). Better is allowed, worse fails.
# Measured with xgrammar 0.2.9 and llguidance 1.9.1 on the GPT-2 vocabulary.
FAST_EXPECTED = {
    "xgrammar": Tally(groups=62, compiled=61, compile_errors=1, tests=244, passed=213, false_accept=12, false_reject=19),
    "llguidance": Tally(groups=62, compiled=60, compile_errors=2, tests=242, passed=229, false_accept=0, false_reject=13),
}
FULL_EXPECTED = {
    "xgrammar": Tally(groups=357, compiled=334, compile_errors=23, tests=1188, passed=859, false_accept=273, false_reject=56),
    "llguidance": Tally(groups=357, compiled=164, compile_errors=193, tests=588, passed=561, false_accept=0, false_reject=27),
}


def check(measured: Tally, expected: Tally) -> None:
    assert measured.groups == expected.groups
    assert measured.compiled >= expected.compiled
    assert measured.passed >= expected.passed
    assert measured.false_accept <= expected.false_accept
    assert measured.false_reject <= expected.false_reject


@pytest.mark.parametrize("name", ["xgrammar", "llguidance"])
def test_schema_suite_fast_subset(setup: tuple[Any, dict[str, Any]], name: str) -> None:
    tokenizer, backends = setup
    check(run_suite(backends[name], tokenizer, FAST_FILES), FAST_EXPECTED[name])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["xgrammar", "llguidance"])
def test_schema_suite_full(setup: tuple[Any, dict[str, Any]], name: str) -> None:
    tokenizer, backends = setup
    check(run_suite(backends[name], tokenizer), FULL_EXPECTED[name])


def main() -> None:
    """Print both tallies (full suite and fast subset) as markdown."""
    tokenizer, backends = make_backends()
    for label, files in (("full draft2020-12", None), ("fast subset", FAST_FILES)):
        print(f"\n{label}\n")
        print("| backend | groups | compiled | compile errors | instances | pass | false accept | false reject |")
        print("|---|---|---|---|---|---|---|---|")
        for name, backend in backends.items():
            t = run_suite(backend, tokenizer, files)
            print(f"| {name} | {t.groups} | {t.compiled} | {t.compile_errors} | {t.tests} | {t.passed} | {t.false_accept} | {t.false_reject} |")
            print(f"<!-- {name} {label}: {asdict(t)} -->", file=sys.stderr)


if __name__ == "__main__":
    main()
