"""OpenAI-shaped request and response bodies (pydantic), and their mapping onto `SamplingParams`.

Requests accept the OpenAI fields plus vLLM's extras (top_k, min_p, repetition_penalty, min_tokens, ignore_eos,
structured_outputs, guided_*, and for reasoning models chat_template_kwargs, reasoning_effort, include_reasoning,
thinking_token_budget); unknown fields are ignored, as vLLM does. Every numeric field carries the bounds the
engine enforces, so the OpenAPI document describes what is accepted and a fuzzer's out-of-range values get a 400.
"""

from __future__ import annotations

import abc
import time
import uuid
from typing import Annotated, Any, Literal, Union, get_args

from pydantic import BaseModel, ConfigDict, Field

from tandem.params import ParamError, SamplingParams, StructuredOutputsParams
from tandem.server.engine_client import PromptEcho

MAX_N = 128  # completions per request
MAX_LOGPROBS = 20  # the engine's bound on top logprobs
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high"]
REASONING_EFFORTS: tuple[str, ...] = get_args(ReasoningEffort)

TokenId = Annotated[int, Field(ge=0)]
TextPrompt = Annotated[str, Field(min_length=1)]
TokenPrompt = Annotated[list[TokenId], Field(min_length=1)]
PromptInput = Union[  # noqa: UP007 - a runtime alias
    TextPrompt, TokenPrompt, Annotated[list[TextPrompt], Field(min_length=1)], Annotated[list[TokenPrompt], Field(min_length=1)]
]


class APIError(Exception):
    """An error that becomes an OpenAI-shaped error body with `status_code`."""

    def __init__(
        self,
        message: str,
        status_code: int = 400,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return ErrorResponse(
            error=ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        ).model_dump()


# ---------------------------------------------------------------------------------------------------------- errors
class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# ---------------------------------------------------------------------------------------------- request pieces
class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class StreamOptions(_Lenient):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class JSONSchemaFormat(_Lenient):
    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Lenient):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputsRequest(_Lenient):
    """vLLM's `structured_outputs` body field: exactly one of the constraint kinds."""

    json_: dict[str, Any] | str | bool | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)] | None = None
    grammar: str | None = None
    whitespace: Literal["compact", "flexible"] | None = None
    backend: Literal["auto", "xgrammar", "llguidance"] | None = None


class TextContentPart(_Lenient):
    type: Literal["text"] = "text"
    text: str


class FunctionCallIn(_Lenient):
    name: str
    arguments: str = "{}"


class ToolCallIn(_Lenient):
    """An assistant message's earlier tool call, as clients send it back in the history."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class FunctionDefinition(_Lenient):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(_Lenient):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Lenient):
    name: str


class NamedToolChoice(_Lenient):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning: str | None = None  # an assistant turn's thinking (vLLM's name; `reasoning_content` the older one)
    reasoning_content: str | None = None

    def text(self) -> str:
        """The content as one string (text parts joined)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class _SamplingRequest(_Lenient):
    """Fields shared by chat and completion requests."""

    model: str | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=100.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    user: str | None = None
    # vLLM extras
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=10.0)
    min_tokens: int = Field(default=0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | str | bool | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: Literal["auto", "xgrammar", "llguidance"] | None = None
    thinking_token_budget: int | None = Field(default=None, ge=0)  # reasoning models: thinking tokens before the end is forced

    @abc.abstractmethod
    def _max_tokens(self) -> int | None:
        """The endpoint's max-tokens field(s) resolved to one value."""

    @abc.abstractmethod
    def _num_logprobs(self) -> int | None:
        """The endpoint's logprobs field(s) resolved to a top-n count (None: no logprobs)."""

    def sampling_params(self) -> SamplingParams:
        """The engine's parameters for this body; raises ParamError for values the engine refuses."""
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            min_p=self.min_p or 0.0,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            seed=self.seed,
            stop=(self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ()),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            max_tokens=self._max_tokens(),
            min_tokens=self.min_tokens,
            logprobs=self._num_logprobs(),
            logit_bias=_logit_bias(self.logit_bias),
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            structured_outputs=self.structured_outputs_params(),
            thinking_token_budget=self.thinking_token_budget,
        )

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """response_format, structured_outputs and guided_* -> one StructuredOutputsParams (at most one source)."""
        sources: list[tuple[str, dict[str, Any]]] = []  # (request field, StructuredOutputsParams keywords)
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            sources.append(("response_format", {"json_object": True}))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.json_schema is None:
                raise APIError("response_format json_schema needs json_schema.schema", param="response_format")
            sources.append(("response_format", {"json": rf.json_schema.json_schema}))
        so = self.structured_outputs
        if so is not None:
            kw: dict[str, Any] = {
                k: v
                for k, v in (
                    ("json", so.json_),
                    ("json_object", so.json_object or None),
                    ("regex", so.regex),
                    ("choice", so.choice),
                    ("grammar", so.grammar),
                )
                if v is not None
            }
            sources.append(("structured_outputs", kw))
        for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"), ("guided_grammar", "grammar")):
            value = getattr(self, name)
            if value is not None:
                sources.append((name, {key: value}))
        if not sources:
            return None
        if len(sources) > 1:
            names = [s for s, _ in sources]
            raise APIError(f"give at most one structured-output constraint, got {names}", param=names[1])
        param, kw = sources[0]
        whitespace = (so.whitespace if so is not None else None) or "compact"
        backend = (so.backend if so is not None else None) or self.guided_decoding_backend
        try:
            return StructuredOutputsParams(**kw, whitespace=whitespace, backend=backend)
        except ParamError as e:
            raise APIError(str(e), param=param) from e


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    if not bias:
        return None
    out: dict[int, float] = {}
    for k, v in bias.items():
        try:
            out[int(k)] = float(v)
        except ValueError as e:
            raise APIError(f"logit_bias keys must be token ids, got {k!r}", param="logit_bias") from e
    return out


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # over --default-chat-template-kwargs
    reasoning_effort: ReasoningEffort | None = None  # "none": no thinking
    include_reasoning: bool = True  # false: the thinking is left out of the response

    def _max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def _num_logprobs(self) -> int | None:
        if not self.logprobs:
            if self.top_logprobs:
                raise APIError("top_logprobs needs logprobs=true", param="top_logprobs")
            return None
        return self.top_logprobs or 0

    def conversation(self) -> list[dict[str, Any]]:
        """The messages as plain dicts (text content; tool calls and tool-call ids kept where present)."""
        out = []
        for m in self.messages:
            d: dict[str, Any] = {"role": m.role, "content": m.text()}
            if m.tool_calls:
                d["tool_calls"] = [c.model_dump() for c in m.tool_calls]
            if m.tool_call_id is not None:
                d["tool_call_id"] = m.tool_call_id
            if m.name is not None:
                d["name"] = m.name
            thought = m.reasoning_content if m.reasoning_content is not None else m.reasoning
            if m.role == "assistant" and thought is not None:  # both names: templates read `reasoning_content`
                d["reasoning"] = d["reasoning_content"] = thought
            out.append(d)
        return out

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    def tool_choice_value(self) -> Any:
        tc = self.tool_choice
        return tc.model_dump() if isinstance(tc, NamedToolChoice) else tc


class CompletionRequest(_SamplingRequest):
    prompt: PromptInput
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False

    def _max_tokens(self) -> int | None:
        return self.max_tokens

    def _num_logprobs(self) -> int | None:
        return self.logprobs

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a batch: text or token ids each; raises APIError when empty."""
        p = self.prompt
        if isinstance(p, str):
            batch: list[str | list[int]] = [p]
        elif not p:
            raise APIError("prompt must not be empty", param="prompt")
        elif all(isinstance(t, int) for t in p):
            batch = [list(p)]  # type: ignore[arg-type]
        else:
            batch = list(p)  # type: ignore[arg-type]
        if not batch or any(len(b) == 0 for b in batch):
            raise APIError("prompt must not be empty", param="prompt")
        return batch


# ------------------------------------------------------------------------------------------------------ responses
class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    completion_tokens_details: CompletionTokensDetails | None = None  # with a reasoning parser


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class FunctionCallOut(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCallOut] = Field(default_factory=list)
    reasoning: str | None = None  # the thinking (reasoning parser), under vLLM's name and the older one
    reasoning_content: str | None = None


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


def _now() -> int:
    return int(time.time())


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None


class ChatCompletionStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "tandem"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


# ------------------------------------------------------------------------------------------------ conversions
LogprobPositions = list[list[tuple[int, float, int | None, str | None]]]  # per token: [(id, logprob, rank, text)]
OMITTED_WHEN_NULL = ("role", "tool_calls", "reasoning", "reasoning_content")  # of a message or delta, as OpenAI


def body_dict(body: ChatCompletionResponse | ChatCompletionChunk | CompletionResponse) -> dict[str, Any]:
    """A response body or stream chunk as JSON data, without the keys OpenAI leaves out when they are empty: a chunk's
    usage, the usage's details, a delta's role and tool calls (and their unset id, type, name), the reasoning keys."""
    d = body.model_dump()
    if d.get("usage") is None:
        d.pop("usage", None)
    elif d["usage"].get("completion_tokens_details") is None:
        d["usage"].pop("completion_tokens_details")
    for choice in d.get("choices", ()):
        message = choice.get("delta") or choice.get("message") or {}
        for key in OMITTED_WHEN_NULL:
            if key in message and message[key] is None:
                message.pop(key)
        if "delta" not in choice:
            continue
        for call in message.get("tool_calls") or ():
            for key in ("id", "type"):
                if call.get(key) is None:
                    call.pop(key)
            if call["function"].get("name") is None:
                call["function"].pop("name")
    return d


def chat_logprobs(positions: LogprobPositions, k: int) -> list[ChatTokenLogprob]:
    out = []
    for pos in positions:
        _, lp, _, text = pos[0]
        token = text or ""
        top = sorted((e for e in pos if e[2] is not None and e[2] <= k), key=lambda e: e[2] or 0)[:k]
        out.append(ChatTokenLogprob(
            token=token, logprob=max(lp, -9999.0), bytes=list(token.encode()),
            top_logprobs=[TopLogprob(token=t or "", logprob=max(v, -9999.0), bytes=list((t or "").encode())) for _, v, _, t in top],
        ))
    return out


def completion_logprobs(positions: LogprobPositions, k: int, offset: int) -> CompletionLogprobs:
    lp = CompletionLogprobs()
    for pos in positions:
        _, v, _, text = pos[0]
        token = text or ""
        lp.tokens.append(token)
        lp.token_logprobs.append(max(v, -9999.0))
        lp.text_offset.append(offset)
        offset += len(token)
        top = sorted((e for e in pos if e[2] is not None and e[2] <= k), key=lambda e: e[2] or 0)[:k]
        d = {t or "": max(x, -9999.0) for _, x, _, t in top}
        d.setdefault(token, max(v, -9999.0))
        lp.top_logprobs.append(d)
    return lp


def echo_logprobs(echo: PromptEcho, k: int) -> CompletionLogprobs:
    """Logprobs of the echoed prompt: the first token has none, as in vLLM and OpenAI."""
    lp = CompletionLogprobs()
    offset = 0
    for token, pos in zip(echo.tokens, echo.logprobs):
        part = completion_logprobs([pos], k, offset) if pos else None
        lp.tokens.append(token)
        lp.text_offset.append(offset)
        lp.token_logprobs.append(part.token_logprobs[0] if part else None)
        lp.top_logprobs.append(part.top_logprobs[0] if part else None)
        offset += len(token)
    return lp
