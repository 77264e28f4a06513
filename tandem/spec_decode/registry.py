"""The one registry of speculative drafters: method name -> factory of a `Proposer`.

The built-in methods import their modules only when built (the draft model pulls in a model runner); tests and
plug-ins add their own with `register_proposer`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tandem.spec_decode.proposer import Proposer

ProposerFactory = Callable[..., Proposer]


def _ngram(**options: Any) -> Proposer:
    from tandem.spec_decode.ngram import NgramProposer

    return NgramProposer(**options)


def _suffix(**options: Any) -> Proposer:
    from tandem.spec_decode.suffix import SuffixProposer

    return SuffixProposer(**options)


def _draft_model(**options: Any) -> Proposer:
    from tandem.spec_decode.draft_model import make_draft_model_proposer

    return make_draft_model_proposer(**options)


PROPOSERS: dict[str, ProposerFactory] = {"ngram": _ngram, "suffix": _suffix, "draft_model": _draft_model}


def register_proposer(method: str, factory: ProposerFactory) -> None:
    """Make `make_proposer(method, ...)` build proposers with `factory` (replaces an earlier registration)."""
    PROPOSERS[method] = factory


def make_proposer(method: str, **options: Any) -> Proposer:
    """Build the proposer registered as `method` with `options`; ValueError names the known methods."""
    factory = PROPOSERS.get(method)
    if factory is None:
        raise ValueError(f"unknown speculative decoding method {method!r}; known methods: {', '.join(sorted(PROPOSERS))}")
    return factory(**options)
