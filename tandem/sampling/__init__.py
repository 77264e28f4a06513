"""Sampling: grammar bitmasks, the batched sampler and the speculative-decoding rejection sampler."""

from __future__ import annotations

from tandem.sampling.bitmask import apply_token_bitmask_, bitmask_words, unpack_token_bitmask
from tandem.sampling.rejection import DraftRows, Verified, rejection_sample, residual_probs
from tandem.sampling.sampler import RowLogprobs, Sampler, SamplerOutput, SamplingRow, prompt_logprobs

__all__ = [
    "DraftRows",
    "RowLogprobs",
    "Sampler",
    "SamplerOutput",
    "SamplingRow",
    "Verified",
    "apply_token_bitmask_",
    "bitmask_words",
    "prompt_logprobs",
    "rejection_sample",
    "residual_probs",
    "unpack_token_bitmask",
]
