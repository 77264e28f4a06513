"""`speculative_config`: vLLM-shaped dict -> validated `SpeculativeConfig` -> a `Proposer`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from tandem.config import ConfigError
from tandem.spec_decode.proposer import Proposer
from tandem.spec_decode.registry import PROPOSERS, make_proposer

MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """How to speculate: which proposer, how many drafts (K) and where the draft model runs."""

    method: str = "ngram"  # "ngram" | "suffix" | "draft_model"
    num_speculative_tokens: int = 4
    model: str | None = None  # draft checkpoint (draft_model)
    draft_device: str = "cpu"
    draft_dtype: str = "bfloat16"
    draft_threads: int | None = None
    draft_cores: tuple[int, ...] | None = None
    draft_in_process: bool = False
    # the draft proposes among the first ids of its vocabulary only, its output projection cut to those rows (a BPE
    # vocabulary's first 16,384 ids held 95 % of the demo model's MT-Bench answers; the distilled 4-layer draft's
    # projection is two thirds of its weights); None: every id
    draft_vocab_size: int | None = None
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    adaptive: bool = True
    lookahead: bool = True  # draft step t+1 optimistically while the device verifies step t (draft_model)
    # scheduling ahead with a draft model: split the running requests into two groups, the draft worker drafting one
    # while the device verifies the other (True), or every request every step, drafted past the outcome in flight
    # (False); None: whichever measured the better goodput at this batch size
    alternate_groups: bool | None = None
    # scheduling ahead with a cheap proposer (n-gram, suffix): draft the next plan beside the forward in flight, past
    # its outcome (True), or once the outcome is known, before the next launch, as the synchronous step does
    # (False); None: past the outcome unless the forward runs on the host's own cores (a CPU device), where drafting
    # beside it slowed it by about the drafting's time and most optimistic proposals at batch 1 were dropped
    draft_past_outcome: bool | None = None
    suffix_max_depth: int = 64
    suffix_max_cached_requests: int = 1000
    extra: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        known = sorted(PROPOSERS)
        if self.method not in known:
            raise ConfigError(f"speculative method {self.method!r} is unknown; known: {known}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ConfigError(f"num_speculative_tokens must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
        if self.method == "draft_model" and not self.model:
            raise ConfigError("speculative method 'draft_model' needs 'model': the path of a draft checkpoint")
        if self.draft_vocab_size is not None:
            if isinstance(self.draft_vocab_size, bool) or not isinstance(self.draft_vocab_size, int) or self.draft_vocab_size < 1:
                raise ConfigError(f"draft_vocab_size must be a positive integer or None, got {self.draft_vocab_size!r}")
            if self.method != "draft_model":
                raise ConfigError(f"draft_vocab_size applies to method 'draft_model' only, not {self.method!r}")
        for name in ("alternate_groups", "draft_past_outcome"):
            if getattr(self, name) not in (None, True, False):
                raise ConfigError(f"{name} must be true, false or null, got {getattr(self, name)!r}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ConfigError(
                f"need 1 <= prompt_lookup_min ({self.prompt_lookup_min}) <= prompt_lookup_max ({self.prompt_lookup_max})"
            )

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | SpeculativeConfig) -> SpeculativeConfig:
        if isinstance(d, SpeculativeConfig):
            return d
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ConfigError(f"unknown speculative_config keys {unknown}; allowed: {sorted(names - {'extra'})}")
        kw = dict(d)
        if kw.get("draft_cores") is not None:
            kw["draft_cores"] = tuple(int(c) for c in kw["draft_cores"])
        return cls(**kw)

    def proposer_options(self, target_vocab_size: int, tokenizer: Any) -> dict[str, Any]:
        """Keyword options of the registered proposer factory for `method`."""
        if self.method == "ngram":
            return {"prompt_lookup_min": self.prompt_lookup_min, "prompt_lookup_max": self.prompt_lookup_max}
        if self.method == "suffix":
            return {"max_tree_depth": self.suffix_max_depth, "max_cached_requests": self.suffix_max_cached_requests}
        return {
            "model_path": self.model,
            "num_speculative_tokens": self.num_speculative_tokens + 1,  # +1: the guess of the bonus token
            "target_vocab_size": target_vocab_size,
            "target_tokenizer": tokenizer,
            "draft_device": self.draft_device,
            "draft_dtype": self.draft_dtype,
            "draft_threads": self.draft_threads,
            "cpu_cores": self.draft_cores,
            "in_process": self.draft_in_process,
            "draft_vocab_size": self.draft_vocab_size,
            **dict(self.extra),
        }


def build_proposer(config: SpeculativeConfig, target_vocab_size: int, tokenizer: Any) -> Proposer:
    """The proposer `config.method` names, from the registry."""
    return make_proposer(config.method, **config.proposer_options(target_vocab_size, tokenizer))
