"""Speculative decoding on the CPU: proposers (n-gram prompt lookup, suffix decoding) and the adaptive K choice."""

from __future__ import annotations

from tandem.spec.adaptive import AdaptiveK
from tandem.spec.ngram import NgramProposer
from tandem.spec.proposer import PROPOSERS, DraftRequest, Drafts, Proposer, make_proposer, register_proposer
from tandem.spec.suffix import SuffixProposer, SuffixTree

register_proposer("ngram", NgramProposer)
register_proposer("suffix", SuffixProposer)

__all__ = [
    "PROPOSERS",
    "AdaptiveK",
    "DraftRequest",
    "Drafts",
    "NgramProposer",
    "Proposer",
    "SuffixProposer",
    "SuffixTree",
    "make_proposer",
    "register_proposer",
]
