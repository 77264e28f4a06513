"""The Responses API (`POST /v1/responses`, what the OpenAI Agents SDK uses by default), over the chat machinery.

A Responses request is turned into the equivalent chat request (instructions -> system message; input items ->
messages: `message`, `function_call` -> an assistant turn with tool_calls, `function_call_output` -> a tool turn;
flat function tools -> chat tools; `text.format` -> response_format), so templating, tool grammars and parsing are
the chat endpoint's. Answers are Response objects: `message` items with `output_text` parts and `function_call`
items; streams are the typed events (response.created, output_item.added, content_part.added, output_text.delta,
function_call_arguments.delta, the matching .done events, response.completed).

Reasoning models (--reasoning-parser): `reasoning.effort` is the chat request's reasoning_effort; the thinking comes
first as a `reasoning` item (its text as one `reasoning_text` part; streamed: output_item.added, content_part.added,
reasoning_text.delta ..., reasoning_text.done, content_part.done, output_item.done, all before the message's events);
`usage.output_tokens_details.reasoning_tokens`. A `reasoning` input item becomes the thinking (`reasoning_content`)
of the assistant turn that follows it.

Not kept: stored responses (`store` is accepted and ignored, `previous_response_id` is refused with 400), built-in
tools (web search, file search, computer use: 400), encrypted reasoning.
"""

from __future__ import annotations

import time
from typing import Any

from pydantic import Field, ValidationError

from tandem.server.protocol import (
    MAX_LOGPROBS,
    REASONING_EFFORTS,
    APIError,
    ChatCompletionRequest,
    UsageInfo,
    _Lenient,
)
from tandem.tools.parsers import ToolCall, ToolCallDelta, ToolParser


class ResponsesRequest(_Lenient):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    seed: int | None = None
    user: str | None = None
    metadata: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None  # {"effort": ...}
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's extras, as on the chat endpoint
    thinking_token_budget: int | None = Field(default=None, ge=0)

    def chat_request(self) -> ChatCompletionRequest:
        """The equivalent chat request; APIError (400) for what this server does not do."""
        if self.previous_response_id is not None:
            raise APIError("previous_response_id is not supported: responses are not stored; send the whole input",
                           param="previous_response_id")
        body: dict[str, Any] = {
            "model": self.model, "messages": self.messages(), "max_completion_tokens": self.max_output_tokens,
            "temperature": self.temperature, "top_p": self.top_p, "seed": self.seed, "stream": self.stream,
            "parallel_tool_calls": self.parallel_tool_calls, "reasoning_effort": self._effort(),
            "chat_template_kwargs": self.chat_template_kwargs, "thinking_token_budget": self.thinking_token_budget,
        }
        if self.tools:
            body["tools"] = [_chat_tool(t, i) for i, t in enumerate(self.tools)]
        if self.tool_choice is not None:
            body["tool_choice"] = _chat_tool_choice(self.tool_choice)
        fmt = (self.text or {}).get("format")
        if fmt is not None and not isinstance(fmt, dict):
            raise APIError("text.format must be an object", param="text.format")
        if fmt and fmt.get("type") == "json_schema":
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": fmt.get("name", "response"), "schema": fmt.get("schema"), "strict": fmt.get("strict")}}
        elif fmt and fmt.get("type") == "json_object":
            body["response_format"] = {"type": "json_object"}
        try:
            return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
        except ValidationError as e:  # what the input items became is not a valid chat request: the client's error
            errors = e.errors()
            where = ".".join(str(p) for p in errors[0]["loc"]) if errors else ""
            msg = errors[0]["msg"] if errors else "invalid"
            raise APIError(f"input does not make a valid conversation: {where}: {msg}", param="input") from e

    def _effort(self) -> str | None:
        effort = (self.reasoning or {}).get("effort")
        if effort is not None and effort not in REASONING_EFFORTS:
            raise APIError(f"reasoning.effort must be one of {list(REASONING_EFFORTS)}, got {effort!r}", param="reasoning.effort")
        return effort

    def messages(self) -> list[dict[str, Any]]:
        """Instructions and input items as chat messages (consecutive function_call items form one assistant turn;
        a reasoning item is the thinking of the assistant turn after it)."""
        out: list[dict[str, Any]] = [{"role": "system", "content": self.instructions}] if self.instructions else []
        if isinstance(self.input, str):
            return [*out, {"role": "user", "content": self.input}]
        thought: str | None = None
        for i, item in enumerate(self.input):
            kind = item.get("type", "message")
            turn: dict[str, Any] | None = None
            if kind == "message":
                turn = {"role": item.get("role", "user"), "content": _text(item.get("content"), i)}
            elif kind == "function_call":
                call = {"id": item.get("call_id"), "type": "function",
                        "function": {"name": item.get("name"), "arguments": item.get("arguments") or "{}"}}
                if thought is None and out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls"):
                    out[-1]["tool_calls"].append(call)
                else:
                    turn = {"role": "assistant", "content": None, "tool_calls": [call]}
            elif kind == "function_call_output":
                output = item.get("output")
                turn = {"role": "tool", "tool_call_id": item.get("call_id"),
                        "content": output if isinstance(output, str) else _text(output, i)}
            elif kind == "reasoning":
                thought = (thought or "") + _reasoning_text(item, i)
            else:
                raise APIError(f"input[{i}]: items of type {kind!r} are not supported", param=f"input[{i}]")
            if turn is not None:
                if turn["role"] == "assistant" and thought is not None:
                    turn["reasoning_content"] = thought
                thought = None
                out.append(turn)
        return out


def _text(content: Any, i: int) -> str:
    """A message's content (a string or input_text / output_text parts) as one string."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise APIError(f"input[{i}]: content must be a string or a list of parts", param=f"input[{i}]")
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text", ""), str):
            raise APIError(f"input[{i}]: content parts of type {kind!r} are not supported", param=f"input[{i}]")
        parts.append(part.get("text", ""))
    return "".join(parts)


def _reasoning_text(item: dict[str, Any], i: int) -> str:
    """A reasoning input item's text: its reasoning_text parts, else its summary."""
    parts = item.get("content") or item.get("summary") or []
    if not isinstance(parts, list) or not all(isinstance(p, dict) and isinstance(p.get("text", ""), str) for p in parts):
        raise APIError(f"input[{i}]: a reasoning item's content must be a list of text parts", param=f"input[{i}]")
    return "".join(p.get("text", "") for p in parts)


def _chat_tool(tool: dict[str, Any], i: int) -> dict[str, Any]:
    if tool.get("type") != "function":
        raise APIError(f"tools[{i}]: only function tools are supported, got {tool.get('type')!r}", param=f"tools[{i}]")
    fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
    return {"type": "function", "function": fn}


def _chat_tool_choice(choice: str | dict[str, Any]) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    if isinstance(choice, str):
        return choice
    raise APIError('tool_choice must be "none", "auto", "required" or {"type": "function", "name": ...}', param="tool_choice")


def usage_dict(usage: UsageInfo, cached: int = 0) -> dict[str, Any]:
    details = usage.completion_tokens_details
    return {"input_tokens": usage.prompt_tokens, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": details.reasoning_tokens if details is not None else 0},
            "total_tokens": usage.prompt_tokens + usage.completion_tokens}


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}] if text or status != "in_progress" else []
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": item_id, "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def call_item(call: ToolCall, status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": f"fc_{call.id}", "call_id": call.id, "name": call.name,
            "arguments": call.arguments, "status": status}


class ResponseBuilder:
    """The Response object of one request, and its stream of typed events as output arrives: the reasoning item
    (output index 0 when there is one), then the message, then the function calls."""

    def __init__(self, rid: str, model: str, body: ResponsesRequest, parser: ToolParser | None) -> None:
        self.rid, self.model, self.body, self.parser = rid, model, body, parser
        self.created = int(time.time())
        self.seq = 0
        self.text = ""
        self.reasoning = ""
        self.calls: list[ToolCall] = []
        self._open_calls: dict[int, dict[str, Any]] = {}
        self._msg_open = False
        self._rs_state = "none"  # "none" | "open" | "done": the streamed reasoning item

    @property
    def _first_index(self) -> int:
        """The message's output index: after the reasoning item, if any."""
        return int(self._rs_state != "none")

    def response(self, output: list[dict[str, Any]], status: str, usage: dict[str, Any] | None,
                 finish_reason: str | None = None) -> dict[str, Any]:
        b = self.body
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {"id": self.rid, "object": "response", "created_at": self.created, "model": self.model, "status": status,
                "output": output, "usage": usage, "incomplete_details": incomplete, "error": None,
                "instructions": b.instructions, "tools": b.tools or [], "tool_choice": b.tool_choice or "auto",
                "parallel_tool_calls": b.parallel_tool_calls is not False, "temperature": b.temperature, "top_p": b.top_p,
                "max_output_tokens": b.max_output_tokens, "text": b.text or {"format": {"type": "text"}},
                "reasoning": b.reasoning, "metadata": b.metadata or {}, "store": False, "previous_response_id": None}

    def output(self, content: str | None, calls: list[ToolCall], reasoning: str | None = None,
               reasoning_status: str = "completed") -> list[dict[str, Any]]:
        items = [reasoning_item(f"rs_{self.rid}", reasoning, reasoning_status)] if reasoning else []
        items += [message_item(f"msg_{self.rid}", content)] if content else []
        return items + [call_item(c) for c in calls]

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq, **fields}

    def start_events(self) -> list[dict[str, Any]]:
        snapshot = self.response([], "in_progress", None)
        return [self.event("response.created", response=snapshot), self.event("response.in_progress", response=snapshot)]

    def reasoning_events(self, delta: str) -> list[dict[str, Any]]:
        """Events for new thinking text (opening the reasoning item and its part first)."""
        if not delta or self._rs_state == "done":
            return []
        out = []
        item_id = f"rs_{self.rid}"
        if self._rs_state == "none":
            self._rs_state = "open"
            out.append(self.event("response.output_item.added", output_index=0, item=reasoning_item(item_id, "", "in_progress")))
            out.append(self.event("response.content_part.added", item_id=item_id, output_index=0, content_index=0,
                                  part={"type": "reasoning_text", "text": ""}))
        self.reasoning += delta
        out.append(self.event("response.reasoning_text.delta", item_id=item_id, output_index=0, content_index=0, delta=delta))
        return out

    def _close_reasoning(self, status: str = "completed") -> list[dict[str, Any]]:
        """The reasoning item's .done events, once (before anything of the answer is sent)."""
        if self._rs_state != "open":
            return []
        self._rs_state = "done"
        item_id, part = f"rs_{self.rid}", {"type": "reasoning_text", "text": self.reasoning}
        return [self.event("response.reasoning_text.done", item_id=item_id, output_index=0, content_index=0, text=self.reasoning),
                self.event("response.content_part.done", item_id=item_id, output_index=0, content_index=0, part=part),
                self.event("response.output_item.done", output_index=0, item=reasoning_item(item_id, self.reasoning, status))]

    def text_events(self, delta: str) -> list[dict[str, Any]]:
        """Events for new message text (opening the message item and its part first)."""
        if not delta:
            return []
        out = self._close_reasoning()
        item_id, index = f"msg_{self.rid}", self._first_index
        if not self._msg_open:
            self._msg_open = True
            out.append(self.event("response.output_item.added", output_index=index, item=message_item(item_id, "", "in_progress")))
            out.append(self.event("response.content_part.added", item_id=item_id, output_index=index, content_index=0,
                                  part={"type": "output_text", "text": "", "annotations": []}))
        self.text += delta
        out.append(self.event("response.output_text.delta", item_id=item_id, output_index=index, content_index=0, delta=delta,
                              logprobs=[]))
        return out

    def call_events(self, pieces: list[ToolCallDelta]) -> list[dict[str, Any]]:
        """Events for streamed tool-call pieces: an item per call, then its argument deltas."""
        out = self._close_reasoning() if pieces else []
        for p in pieces:
            index = self._first_index + int(self._msg_open) + p.index
            if p.id is not None:
                item = {"type": "function_call", "id": f"fc_{p.id}", "call_id": p.id, "name": p.name, "arguments": "",
                        "status": "in_progress"}
                self._open_calls[p.index] = item
                out.append(self.event("response.output_item.added", output_index=index, item=dict(item)))
            item = self._open_calls[p.index]
            if p.arguments:
                item["arguments"] = str(item["arguments"]) + p.arguments
                out.append(self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                                      delta=p.arguments))
        return out

    def done_events(self, status: str, usage: dict[str, Any], complete: list[ToolCall]) -> list[dict[str, Any]]:
        """Close the open items, then response.completed (or .incomplete) with the whole response."""
        rs_status = "completed" if status == "completed" or self._rs_state != "open" else "incomplete"  # cut while thinking
        out = self._close_reasoning(rs_status)
        item_id, first = f"msg_{self.rid}", self._first_index
        if self._msg_open:
            out.append(self.event("response.output_text.done", item_id=item_id, output_index=first, content_index=0,
                                  text=self.text, logprobs=[]))
            out.append(self.event("response.content_part.done", item_id=item_id, output_index=first, content_index=0,
                                  part={"type": "output_text", "text": self.text, "annotations": []}))
            out.append(self.event("response.output_item.done", output_index=first, item=message_item(item_id, self.text)))
        done_ids = {c.id for c in complete}
        for i, item in sorted(self._open_calls.items()):
            if item["call_id"] not in done_ids:
                continue
            index = first + int(self._msg_open) + i
            out.append(self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                  arguments=item["arguments"]))
            out.append(self.event("response.output_item.done", output_index=index, item={**item, "status": "completed"}))
        output = self.output(self.text if self._msg_open else None, complete, self.reasoning, rs_status)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        out.append(self.event(kind, response=self.response(output, status, usage)))
        return out
