"""Request parameters: `SamplingParams` and `StructuredOutputsParams` (vLLM-shaped, validated, plain data).

Both are frozen dataclasses of plain Python values, so they pickle and cross a process boundary unchanged.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

_GREEDY_EPS = 1e-5


class ParamError(ValueError):
    """A request parameter has a value outside its allowed range; the message names both."""


class EngineOverloaded(ParamError):
    """The engine cannot take this request now (e.g. the grammar compile queue is full); retry later (HTTP 429)."""


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ParamError(msg)


class RequestOutputKind(enum.IntEnum):
    """Which outputs a request reports while it runs (vLLM's names and values)."""

    CUMULATIVE = 0  # at every step it progressed, everything so far (streaming, `LLMEngine.step` by default)
    FINAL_ONLY = 2  # once, when it has ended (`LLM.generate` / `LLM.chat`, as in vLLM): no output and, without
    # stop strings, no detokenizing while it runs (256 requests: 2-4 ms a step of the engine thread)


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Constrain the output to a JSON schema, any JSON object, a regex, a choice, a grammar or a structural tag.

    Exactly one of `json`, `json_object`, `regex`, `choice`, `grammar`, `structural_tag` must be set. `json` accepts
    a schema dict, its JSON text, or a pydantic model class (converted to its schema here, so only plain data is
    kept). `structural_tag` is vLLM's / xgrammar's structural-tag JSON (`{"type": "structural_tag", "format": ...}`,
    dict or text): tagged segments whose content is a JSON schema, optionally activated by trigger strings inside
    free text (what tool calls in "auto" mode need); both backends accept the subset listed in
    tandem/structured/backend.py (STRUCTURAL_TAG_FORMATS).

    `enable_in_reasoning` (vLLM's name; per request here, engine-wide in `structured_outputs_config` as in vLLM): with
    a reasoning parser, the grammar holds the whole output from its first token, the thinking too, instead of
    starting where the thinking ends; a grammar that must say how the thinking goes (gpt-oss's forced tool calls:
    tools/harmony.py). It leaves no room for a thinking budget's forced end, so the two are refused together. None
    (the default): as the engine's setting says (off unless its structured_outputs_config turns it on); False: after
    the thinking whatever the engine says (the call grammars of text tool formats, built for the answer).
    """

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    whitespace: str = "compact"
    backend: str | None = None
    structural_tag: str | None = None
    enable_in_reasoning: bool | None = None

    def __init__(
        self,
        json: Any = None,
        json_object: bool = False,
        regex: str | None = None,
        choice: Sequence[str] | None = None,
        grammar: str | None = None,
        whitespace: str = "compact",
        backend: str | None = None,
        structural_tag: Any = None,
        enable_in_reasoning: bool | None = None,
    ) -> None:
        object.__setattr__(self, "json", _schema_text(json) if json is not None else None)
        object.__setattr__(self, "json_object", bool(json_object))
        object.__setattr__(self, "regex", regex)
        object.__setattr__(self, "choice", tuple(choice) if choice is not None else None)
        object.__setattr__(self, "grammar", grammar)
        object.__setattr__(self, "whitespace", whitespace)
        object.__setattr__(self, "backend", backend)
        object.__setattr__(self, "structural_tag", _structural_tag_text(structural_tag) if structural_tag is not None else None)
        object.__setattr__(self, "enable_in_reasoning", enable_in_reasoning)
        self._validate()

    def _validate(self) -> None:
        kinds = [k for k in ("json", "regex", "choice", "grammar", "structural_tag") if getattr(self, k) is not None]
        if self.json_object:
            kinds.append("json_object")
        _check(len(kinds) == 1, "structured_outputs needs exactly one of json, json_object, regex, choice, grammar, "
               f"structural_tag; got {kinds or 'none'}")
        _check(self.whitespace in ("compact", "flexible"), f"whitespace must be 'compact' or 'flexible', got {self.whitespace!r}")
        _check(self.enable_in_reasoning is None or isinstance(self.enable_in_reasoning, bool),
               f"enable_in_reasoning must be None or a bool, got {self.enable_in_reasoning!r}")
        _check(self.backend in (None, "auto", "xgrammar", "llguidance"), f"backend must be one of None, 'auto', 'xgrammar', 'llguidance', got {self.backend!r}")
        if self.choice is not None:
            _check(len(self.choice) > 0 and all(isinstance(c, str) and c for c in self.choice), "choice must be a non-empty list of non-empty strings")
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None:
                _check(isinstance(v, str) and v.strip() != "", f"{name} must be a non-empty string")
        _check(_is_unicode(self.grammar_text), f"{self.kind} holds characters that are not valid Unicode (lone surrogates)")

    @property
    def kind(self) -> str:
        """One of 'json', 'json_object', 'regex', 'choice', 'grammar', 'structural_tag'."""
        if self.json_object:
            return "json_object"
        for k in ("json", "regex", "choice", "grammar", "structural_tag"):
            if getattr(self, k) is not None:
                return k
        raise AssertionError("validated above")

    @property
    def grammar_text(self) -> str:
        """The constraint as one string (what the grammar cache is keyed by, with the kind)."""
        kind = self.kind
        if kind == "json_object":
            return "{}"
        if kind == "choice":
            return json.dumps(list(self.choice or ()))
        return str(getattr(self, kind))


def _structural_tag_text(value: Any) -> str:
    """A structural tag given as dict or JSON text -> JSON text of an object with a "format" (ParamError if not)."""
    if isinstance(value, Mapping):
        text, obj = json.dumps(value), value
    elif isinstance(value, str):
        try:
            obj = json.loads(value)
        except json.JSONDecodeError as e:
            raise ParamError(f"structural_tag is not valid JSON: {e}") from e
        text = value
    else:
        raise ParamError(f"structural_tag must be a dict or JSON text, got {type(value).__name__}")
    _check(isinstance(obj, Mapping) and isinstance(obj.get("format"), Mapping),
           'structural_tag must be an object {"type": "structural_tag", "format": {...}}')
    return text


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _schema_text(value: Any) -> str:
    """A JSON schema given as dict, JSON text or pydantic model class -> canonical JSON text."""
    try:
        if isinstance(value, str):
            json.loads(value)
            return value
        if isinstance(value, (Mapping, bool)):
            return json.dumps(value)
        schema_fn = getattr(value, "model_json_schema", None)
        if callable(schema_fn):
            return json.dumps(schema_fn())
    except json.JSONDecodeError as e:
        raise ParamError(f"json schema is not valid JSON: {e}") from e
    except RecursionError as e:  # hostile nesting: Python's own limit, long before any grammar library is asked
        raise ParamError("json schema is nested too deeply") from e
    except (TypeError, ValueError) as e:
        raise ParamError(f"json schema cannot be serialised as JSON: {e}") from e
    raise ParamError(f"json must be a schema dict, JSON text or a pydantic model class, got {type(value).__name__}")


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request's continuation (the fields and defaults of vLLM's `SamplingParams`)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: Mapping[int, float] | None = None
    allowed_token_ids: tuple[int, ...] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # with a reasoning parser: thinking tokens the model may write before the end marker is forced (vLLM's field)
    thinking_token_budget: int | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        stop = self.stop
        if stop is None:
            stop = ()
        elif isinstance(stop, str):
            stop = (stop,)
        elif isinstance(stop, (list, tuple)):
            for s in stop:
                _check(isinstance(s, str), f"stop must be a string or a list of strings, got an element of type {type(s).__name__}")
            stop = tuple(stop)
        else:
            raise ParamError(f"stop must be a string or a list of strings, got {type(stop).__name__}")
        _check(all(s != "" for s in stop), "stop strings must not be empty")
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in (self.stop_token_ids or ())))
        if self.allowed_token_ids is not None:
            object.__setattr__(self, "allowed_token_ids", tuple(int(t) for t in self.allowed_token_ids))
        if self.logit_bias is not None:
            object.__setattr__(self, "logit_bias", {int(k): float(v) for k, v in dict(self.logit_bias).items()})
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        if self.output_kind in tuple(RequestOutputKind):
            object.__setattr__(self, "output_kind", RequestOutputKind(self.output_kind))
        self._validate()

    def _validate(self) -> None:
        _check(isinstance(self.n, int) and self.n >= 1, f"n must be an integer >= 1, got {self.n!r}")
        _check(self.temperature >= 0.0, f"temperature must be >= 0, got {self.temperature}")
        _check(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        _check(isinstance(self.top_k, int) and self.top_k >= 0, f"top_k must be -1, 0 (off) or a positive integer, got {self.top_k}")
        _check(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}")
        _check(-2.0 <= self.presence_penalty <= 2.0, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        _check(-2.0 <= self.frequency_penalty <= 2.0, f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        _check(0.0 < self.repetition_penalty <= 10.0, f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}")
        _check(self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1), f"max_tokens must be None or an integer >= 1, got {self.max_tokens!r}")
        _check(isinstance(self.min_tokens, int) and self.min_tokens >= 0, f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None:
            _check(self.min_tokens <= self.max_tokens, f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            _check(v is None or (isinstance(v, int) and 0 <= v <= 20), f"{name} must be None or an integer in [0, 20], got {v!r}")
        _check(self.seed is None or isinstance(self.seed, int), f"seed must be None or an integer, got {self.seed!r}")
        _check(all(t >= 0 for t in self.stop_token_ids), "stop_token_ids must be non-negative token ids")
        if self.logit_bias:
            _check(all(-100.0 <= v <= 100.0 for v in self.logit_bias.values()), "logit_bias values must be in [-100, 100]")
        if self.allowed_token_ids is not None:
            _check(len(self.allowed_token_ids) > 0, "allowed_token_ids must not be empty")
        _check(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams), "structured_outputs must be a StructuredOutputsParams")
        _check(self.thinking_token_budget is None or (isinstance(self.thinking_token_budget, int) and self.thinking_token_budget >= 0),
               f"thinking_token_budget must be None or an integer >= 0, got {self.thinking_token_budget!r}")
        _check(self.thinking_token_budget is None or self.structured_outputs is None or not self.structured_outputs.enable_in_reasoning,
               "thinking_token_budget cannot end a thinking that the grammar holds too (structured_outputs.enable_in_reasoning): "
               "its forced end would leave the grammar")
        _check(self.output_kind in tuple(RequestOutputKind),
               f"output_kind must be RequestOutputKind.CUMULATIVE (0) or FINAL_ONLY (2), got {self.output_kind!r}")

    @property
    def greedy(self) -> bool:
        """Temperature 0 means argmax (after penalties, bias and masks)."""
        return self.temperature < _GREEDY_EPS

    def check_vocab(self, vocab_size: int) -> None:
        """Raise ParamError when a token id in these params is outside [0, vocab_size)."""
        ids = list(self.stop_token_ids) + list(self.logit_bias or ()) + list(self.allowed_token_ids or ())
        bad = [t for t in ids if not 0 <= t < vocab_size]
        _check(not bad, f"token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")

    def clone(self, **changes: Any) -> SamplingParams:
        return replace(self, **changes)

    def grammar_in_reasoning(self) -> SamplingParams:
        """These params with their grammar (if any) holding the thinking too: what the engine-wide
        `structured_outputs_config={"enable_in_reasoning": True}` makes of each request. ParamError with a thinking
        budget, as for the per-request switch."""
        so = self.structured_outputs
        if so is None or so.enable_in_reasoning is not None:  # the request's own choice stands
            return self
        if self.thinking_token_budget is not None:
            raise ParamError("thinking_token_budget cannot end a thinking that the grammar holds too (the engine's "
                             "structured_outputs_config enable_in_reasoning): its forced end would leave the grammar")
        return self.clone(structured_outputs=replace(so, enable_in_reasoning=True))

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]
