"""Speculative decoding on the CPU: proposers (n-gram prompt lookup, suffix decoding, a draft model), their registry
and the adaptive choice of K. The engine's side of it (drafting, look-ahead, learning) is engine/speculation.py."""

from __future__ import annotations

from tandem.spec_decode.adaptive import AdaptiveK
from tandem.spec_decode.ngram import NgramProposer
from tandem.spec_decode.proposer import DraftRequest, Drafts, Proposer
from tandem.spec_decode.registry import PROPOSERS, make_proposer, register_proposer
from tandem.spec_decode.suffix import SuffixProposer, SuffixTree

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
