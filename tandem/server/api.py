"""The OpenAI-compatible HTTP API (FastAPI). It never runs the model: requests go to the engine core through
`EngineClient`, and deltas come back as JSON bodies or SSE events.

Request life: auth and body-size checks (ASGI middleware) -> pydantic body -> SamplingParams (ParamError -> 400)
-> model name (404) -> admission (429 when the bounded queue is full, 503 when the engine is dead or the server is
draining or shutting down) -> engine. The first delta of a request is awaited before any response starts, so a prompt the engine
refuses, or a grammar that fails to compile, still gets a plain 400. Afterwards a client disconnect, a timeout (504)
or the engine's death ends the request and aborts it in the engine (its KV blocks are freed).
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import hmac
import json
import logging
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import uvicorn
from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tandem.params import ParamError, SamplingParams
from tandem.server.data_parallel import ServingClient
from tandem.server.engine_client import (
    CompletionDelta,
    EngineDeadError,
    PromptEcho,
    RequestDelta,
    RequestRefused,
    RequestStream,
)
from tandem.server.metrics import CONTENT_TYPE, EngineStatsCollector, ServerMetrics, memory_detail
from tandem.server.protocol import (
    APIError,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatLogprobs,
    ChatResponseMessage,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    ErrorResponse,
    FunctionCallOut,
    LogprobPositions,
    ModelCard,
    ModelList,
    ToolCallOut,
    UsageInfo,
    body_dict,
    chat_logprobs,
    completion_logprobs,
    echo_logprobs,
    random_id,
)
from tandem.server.reasoning import (
    ChatReasoning,
    Thought,
    keep_history_reasoning,
    template_kwargs,
    token_details,
    with_thinking_budget,
)
from tandem.server.responses import ResponseBuilder, ResponsesRequest, usage_dict
from tandem.tools.parsers import CallStream, ToolCallDelta, ToolParser
from tandem.tools.plan import ToolError, ToolPlan, choose_parser, fallback_messages, hf_messages

logger = logging.getLogger("tandem.server")

DEFAULT_MAX_BODY_BYTES = 1 << 20
T = TypeVar("T")


@dataclass
class ServerConfig:
    """Settings of the HTTP side (the engine's own settings travel to the core as `engine_kwargs`)."""

    served_model_names: Sequence[str] = ("tandem-demo",)
    api_key: str | None = None
    max_queue: int = 256  # sequences allowed to wait beyond the engine's max_num_seqs before 429
    max_num_seqs: int = 64
    request_timeout_s: float | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    engine_start_timeout_s: float = 900.0
    tool_call_parser: str = "auto"  # 'auto' (the chat format's or template's) | 'hermes' | 'llama3_json' | 'mistral' | 'openai'
    shutdown_grace_period_s: float = 30.0  # on SIGTERM, how long requests in flight may run on before they are failed
    reasoning_parser: str | None = None  # --reasoning-parser: answers show the thinking apart (reasoning.py); None: the
    # one the model's chat format implies (harmony: openai_gptoss), as the engine core chooses it
    default_chat_template_kwargs: dict[str, Any] | None = None  # under each request's chat_template_kwargs
    thinking_token_budget: int | None = None  # for requests that give none (with a reasoning parser)


@dataclass
class ServerState:
    client: ServingClient  # one engine core, or N behind a router (server/data_parallel.py)
    config: ServerConfig
    metrics: ServerMetrics
    admitted_seqs: int = 0
    draining: bool = False
    shutting_down: bool = False
    loop: asyncio.AbstractEventLoop | None = None
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def model_name(self) -> str:
        return self.config.served_model_names[0]

    @property
    def reasoning_parser(self) -> str | None:
        """The engine core's reasoning parser: --reasoning-parser's, else the chat format's (harmony models)."""
        if self.config.reasoning_parser is not None:
            return self.config.reasoning_parser
        info = self.client.info
        return info.reasoning_parser if info is not None else None

    @property
    def grammar_in_reasoning(self) -> bool:
        """The engine core holds every grammar over the thinking too (structured_outputs_config enable_in_reasoning)."""
        info = self.client.info
        return info is not None and info.grammar_in_reasoning

    def tool_format(self) -> tuple[ToolParser, bool]:
        """(the tool-call parser, whether the chat format renders tools itself), from --tool-call-parser and the
        chat format / template the engine core reported."""
        info = self.client.info
        template, fixed = (info.chat_template, info.tool_call_parser) if info is not None else (None, None)
        return choose_parser(self.config.tool_call_parser, template, fixed)

    def begin_drain(self) -> None:
        """Stop accepting (new requests and /health answer 503 "draining"); the requests in flight run on."""
        self.draining = True
        self.client.accepting = False

    async def drain(self, grace_s: float) -> bool:
        """Wait until no request is in flight, at most `grace_s` seconds; True when none is left."""
        deadline = time.monotonic() + grace_s
        while self.admitted_seqs > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return self.admitted_seqs <= 0

    def begin_shutdown(self) -> None:
        """Stop accepting and fail everything in flight (safe to call from a signal handler)."""
        self.shutting_down = True
        self.client.accepting = False
        if self.loop is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.client.abort_all, "the server is shutting down")


# ------------------------------------------------------------------------------------------------------- errors
def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status_code)


def _engine_error(e: EngineDeadError, in_flight: bool) -> APIError:
    """503 either way: the engine core died (a new one is starting) or the server is shutting down; retry later."""
    if in_flight:
        return APIError(f"the request failed: {e}; retry", 503, type="server_error", code="engine_dead")
    return APIError(f"the engine is unavailable: {e}", 503, type="server_error", code="engine_unavailable")


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errs = exc.errors()
    if not errs:
        return "invalid request body", None
    first = errs[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    msg = first.get("msg", "invalid value")
    more = f" (and {len(errs) - 1} more errors)" if len(errs) > 1 else ""
    return (f"{param}: {msg}{more}" if param else f"{msg}{more}"), param


# --------------------------------------------------------------------------------------------- ASGI middleware
class GuardMiddleware:
    """API key (Bearer, constant-time compare) on /v1/*, a request body size bound (413), and response counting."""

    def __init__(
        self, app: ASGIApp, api_key: str | None, max_body_bytes: int, on_response: Callable[[str, int], None] | None = None
    ) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes
        self.on_response = on_response

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = str(scope.get("path", ""))
        if self.on_response is not None:
            send = self._counting(path, send)
        headers = dict(scope.get("headers") or [])
        if self.api_key is not None and path.startswith("/v1") and not self._authorized(headers):
            err = APIError("invalid or missing API key", 401, type="authentication_error", code="invalid_api_key")
            await _send_json(send, err.status_code, err.body(), extra_headers=[(b"www-authenticate", b"Bearer")])
            return
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            await _send_json(send, 413, self._too_large().body())
            return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            msg = await receive()
            if msg["type"] == "http.request":
                received += len(msg.get("body", b""))
                if received > self.max_body_bytes:
                    raise HTTPException(413, self._too_large().message)
            return msg

        await self.app(scope, limited_receive, send)

    def _counting(self, path: str, send: Send) -> Send:
        on_response = self.on_response
        assert on_response is not None

        async def counting_send(msg: Message) -> None:
            if msg["type"] == "http.response.start":
                on_response(path, int(msg["status"]))
            await send(msg)

        return counting_send

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        assert self.api_key is not None
        auth = headers.get(b"authorization", b"")
        scheme, _, token = auth.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.api_key)

    def _too_large(self) -> APIError:
        return APIError(f"request body exceeds {self.max_body_bytes} bytes", 413, code="request_too_large")


async def _send_json(send: Send, status: int, body: Any, extra_headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
    data = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()), *extra_headers]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})


# -------------------------------------------------------------------------------------------- one generation
class Generation:
    """One engine request seen from the API: deltas with the deadline applied, errors mapped, metrics recorded."""

    def __init__(self, state: ServerState, stream: RequestStream, t0: float, deadline: float | None) -> None:
        self.state = state
        self.stream = stream
        self.t0 = t0
        self.deadline = deadline
        self.num_prompt_tokens = 0
        self.num_generated = 0
        self.reasoning_tokens: dict[int, int] = {}  # per completion: its thinking tokens so far
        self._first_token_at: float | None = None
        self._last_token_at: dict[int, float] = {}
        self._seen_first = False

    async def next(self) -> RequestDelta:
        """The next delta; raises APIError (400 refused / 500-503 engine gone / 504 timeout)."""
        timeout = None if self.deadline is None else max(0.0, self.deadline - time.monotonic())
        try:
            delta = await asyncio.wait_for(self.stream.next(), timeout)
        except asyncio.TimeoutError:
            self.stream.abort()
            raise APIError("the request timed out", 504, type="timeout_error", code="request_timeout") from None
        except RequestRefused as e:
            kind = "rate_limit_error" if e.status == 429 else "invalid_request_error" if e.status < 500 else "server_error"
            raise APIError(e.message, e.status, type=kind) from None
        except EngineDeadError as e:
            raise _engine_error(e, in_flight=True) from None
        self._record(delta)
        if delta.error is not None:  # this request's own work failed (its grammar, ...): the engine goes on
            if self.num_generated == 0:
                raise APIError(delta.error, 400)
            raise APIError(f"generation failed after {self.num_generated} tokens: {delta.error}", 400, code="generation_failed")
        return delta

    def _record(self, delta: RequestDelta) -> None:
        m = self.state.metrics
        now = time.monotonic()
        if not self._seen_first:
            self._seen_first = True
            self.num_prompt_tokens = delta.num_prompt_tokens
            m.prompt_tokens.inc(delta.num_prompt_tokens)
            m.cached_prompt_tokens.inc(delta.num_cached_tokens)
        for c in delta.outputs:
            self.reasoning_tokens[c.index] = c.num_reasoning_tokens
            if c.token_ids:
                self.num_generated += len(c.token_ids)
                m.generation_tokens.inc(len(c.token_ids))
                if self._first_token_at is None:
                    self._first_token_at = now
                    m.ttft.observe(now - self.t0)
                last = self._last_token_at.get(c.index)
                if last is not None:
                    m.itl.observe(now - last)
                self._last_token_at[c.index] = now
            if c.finish_reason is not None:
                m.finish_reasons.labels(c.finish_reason).inc()
        if delta.finished:
            m.e2e.observe(now - self.t0)

    def abort(self) -> None:
        self.stream.abort()


async def _merged(gens: Sequence[Generation], firsts: Sequence[RequestDelta]) -> AsyncIterator[tuple[int, RequestDelta]]:
    """(generation index, delta) of several generations as they arrive, starting with their first deltas."""
    pending: dict[asyncio.Future[RequestDelta], int] = {}
    for i, first in enumerate(firsts):
        yield i, first
        if not first.finished:
            pending[asyncio.ensure_future(gens[i].next())] = i
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for fut in done:
                i = pending.pop(fut)
                delta = fut.result()
                yield i, delta
                if not delta.finished:
                    pending[asyncio.ensure_future(gens[i].next())] = i
    finally:
        for fut in pending:
            fut.cancel()


async def _until_disconnect(request: Request) -> None:
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """`work`'s result, or None when the client disconnects first (work is then cancelled)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_until_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(BaseException):
        await task
    return None


@dataclass
class _Choice:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: LogprobPositions = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt: PromptEcho | None = None  # the echoed prompt (completions with echo)
    thought: Thought = field(default_factory=Thought)  # the thinking and the answer (reasoning parser)

    def add(self, c: CompletionDelta) -> None:
        self.text += c.text
        self.thought.add(c)
        self.token_ids += c.token_ids
        if c.logprobs:
            self.logprobs += c.logprobs
        if c.finish_reason is not None:
            self.finish_reason, self.stop_reason = c.finish_reason, c.stop_reason


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


# ------------------------------------------------------------------------------------------------------ the app
def create_app(client: ServingClient, config: ServerConfig) -> FastAPI:
    """The FastAPI app over `client`; its lifespan starts the engine core and shuts it down."""
    metrics = ServerMetrics(EngineStatsCollector(lambda: client.stats, lambda: client.alive, lambda: client.core_pid,
                                                 lambda: client.restarts))
    state = ServerState(client=client, config=config, metrics=metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.loop = asyncio.get_running_loop()
        info = await client.start(config.engine_start_timeout_s)
        logger.info("engine core ready (pid %s, max_model_len %d); serving %s", info.core_pid, info.max_model_len, state.model_name)
        if config.reasoning_parser is None and info.reasoning_parser is not None:
            logger.info("reasoning parser %s (the model's chat format's)", info.reasoning_parser)
        try:
            yield
        finally:
            state.shutting_down = True
            await client.shutdown()

    app = FastAPI(title="tandem OpenAI-compatible server", version="0.1.0", lifespan=lifespan)
    app.state.tandem = state
    app.add_middleware(GuardMiddleware, api_key=config.api_key, max_body_bytes=config.max_body_bytes,
                       on_response=metrics.count_response)
    _install_error_handlers(app)
    _install_routes(app, state)
    return app


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(APIError(message, 400, param=param))

    @app.exception_handler(ParamError)
    async def on_param_error(request: Request, exc: ParamError) -> JSONResponse:
        return error_response(APIError(str(exc), 400))

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        typ = "invalid_request_error" if exc.status_code < 500 else "server_error"
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(exc.status_code)
        return error_response(APIError(str(exc.detail), exc.status_code, type=typ, code=code))

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s", request.url.path)
        return error_response(APIError(f"internal error: {type(exc).__name__}", 500, type="server_error"))


_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 429, 500, 503, 504)
}


def _install_routes(app: FastAPI, state: ServerState) -> None:
    client, config, metrics = state.client, state.config, state.metrics

    @app.get("/health")
    async def health() -> JSONResponse:
        if client.restarting:
            return error_response(APIError(f"engine core is restarting ({client.restarts} restarts so far): {client.dead_reason}",
                                           503, type="server_error", code="engine_restarting"))
        if client.dead_reason is not None:
            return error_response(APIError(f"engine core is down: {client.dead_reason}", 503, type="server_error", code="engine_dead"))
        if state.shutting_down:
            return error_response(APIError("the server is shutting down", 503, type="server_error", code="shutting_down"))
        if state.draining:
            return error_response(APIError(f"the server is draining: {state.admitted_seqs} sequences in flight finish, "
                                           "new requests go elsewhere", 503, type="server_error", code="draining"))
        return JSONResponse({"status": "ok", "engine_core_pid": client.core_pid, "engine_core_pids": client.core_pids,
                             "in_flight": client.num_in_flight, "replicas": client.replica_states,
                             "engine_restarts": client.restarts, "memory": memory_detail(client.stats, client.core_pids)})

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models", responses=_ERRORS)
    async def list_models() -> ModelList:
        max_len = client.info.max_model_len if client.info else None
        return ModelList(data=[ModelCard(id=n, created=state.created, root=client.model or n, max_model_len=max_len) for n in config.served_model_names])

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=_ERRORS)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        plan = tool_plan(state, body.tool_dicts(), body.tool_choice_value(), body.parallel_tool_calls)
        params = _prepare(state, body.model, lambda: with_tools(body.sampling_params(), plan))
        prompt = chat_prompt(state, body, plan)
        rid = random_id("chatcmpl")
        fmt = _ChatFormat(state, body, rid, plan.parser if plan is not None and plan.constrained else None)
        return await _serve(state, request, rid, [prompt], params, body.stream, fmt)

    @app.post("/v1/responses", responses=_ERRORS)
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        chat = body.chat_request()
        plan = tool_plan(state, chat.tool_dicts(), chat.tool_choice_value(), chat.parallel_tool_calls)
        params = _prepare(state, chat.model, lambda: with_tools(chat.sampling_params(), plan))
        prompt = chat_prompt(state, chat, plan)
        rid = random_id("resp")
        fmt = _ResponsesFormat(state, body, rid, plan.parser if plan is not None and plan.constrained else None)
        return await _serve(state, request, rid, [prompt], params, body.stream, fmt)

    @app.post("/v1/completions", response_model=CompletionResponse, responses=_ERRORS)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        params = _prepare(state, body.model, body.sampling_params)
        if body.echo:  # the engine reports the prompt (and its logprobs) on the first delta
            params = params.clone(prompt_logprobs=body.logprobs or 0)
        prompts = [{"prompt": p} for p in body.prompts()]
        rid = random_id("cmpl")
        return await _serve(state, request, rid, prompts, params, body.stream, _CompletionFormat(state, body, rid))


def tool_plan(state: ServerState, tools: list[dict[str, Any]] | None, tool_choice: Any, parallel: bool | None) -> ToolPlan | None:
    """The request's ToolPlan (None without tools); ToolError becomes a 400 naming the field."""
    parser, native = state.tool_format()
    try:
        return ToolPlan.build(tools, tool_choice, parallel, parser, native)
    except ToolError as e:
        raise APIError(str(e), 400, param=e.param) from e


def with_tools(params: SamplingParams, plan: ToolPlan | None) -> SamplingParams:
    """`params` with the plan's grammar and special-token setting (ToolPlan.apply)."""
    return params if plan is None else plan.apply(params)


def chat_prompt(state: ServerState, body: ChatCompletionRequest, plan: ToolPlan | None) -> dict[str, Any]:
    """The engine-core prompt of a chat: messages in the form the template takes (their thinking kept), its `tools`
    argument if any, the request's template kwargs (reasoning.py)."""
    messages = body.conversation()
    kwargs = template_kwargs(state.config.default_chat_template_kwargs, body.chat_template_kwargs, body.reasoning_effort)
    if plan is not None:
        conversation, kwargs = plan.conversation(messages), {**kwargs, **plan.template_kwargs()}
    elif any(m.get("tool_calls") or m["role"] in ("tool", "function") for m in messages):
        parser, native = state.tool_format()  # a tool conversation continued without tools
        conversation = hf_messages(messages) if native else fallback_messages(messages, parser, None)
    else:
        conversation = [{**m, "role": "system" if m["role"] == "developer" else m["role"]} for m in messages]
    prompt: dict[str, Any] = {"messages": keep_history_reasoning(conversation, messages),
                              "add_generation_prompt": body.add_generation_prompt}
    if kwargs:
        prompt["chat_template_kwargs"] = kwargs
    return prompt


def _prepare(state: ServerState, model: str | None, make_params: Callable[[], SamplingParams]) -> SamplingParams:
    """Check the model name and build the sampling params (APIError on failure)."""
    if model is not None and model not in state.config.served_model_names:
        raise APIError(f"the model {model!r} does not exist; this server serves {list(state.config.served_model_names)}",
                       404, param="model", code="model_not_found")
    try:
        params = make_params()
        if state.grammar_in_reasoning:  # before the default budget, which a grammar holding the thinking leaves out
            params = params.grammar_in_reasoning()
        return with_thinking_budget(params, state.reasoning_parser, state.config.thinking_token_budget)
    except ToolError as e:
        raise APIError(str(e), 400, param=e.param) from e
    except ParamError as e:
        raise APIError(str(e), 400) from e


async def _serve(
    state: ServerState,
    request: Request,
    rid: str,
    prompts: list[dict[str, Any]],
    params: SamplingParams,
    stream: bool,
    fmt: _Format,
) -> Response:
    """Admit, submit each prompt ({"prompt": text or ids} or {"messages": [...]}), wait for the first deltas, then answer as JSON or as an SSE stream."""
    client, config = state.client, state.config
    if client.dead_reason is not None:
        raise _engine_error(EngineDeadError(client.dead_reason), in_flight=False)
    if state.draining and not state.shutting_down:
        raise APIError("the server is draining before it shuts down; retry on another instance", 503,
                       type="server_error", code="draining")
    if state.shutting_down or not client.accepting:
        raise APIError("the server is shutting down", 503, type="server_error", code="shutting_down")
    num_seqs = params.n * len(prompts)
    limit = config.max_num_seqs + config.max_queue
    if state.admitted_seqs > 0 and state.admitted_seqs + num_seqs > limit:
        state.metrics.rejected.labels("queue_full").inc()
        raise APIError(f"the request queue is full ({state.admitted_seqs} sequences admitted, limit {limit}); retry later",
                       429, type="rate_limit_error", code="queue_full")
    t0 = time.monotonic()
    deadline = t0 + config.request_timeout_s if config.request_timeout_s else None
    state.admitted_seqs += num_seqs
    gens: list[Generation] = []
    handed_off = False
    try:
        for i, prompt in enumerate(prompts):
            sub_id = rid if len(prompts) == 1 else f"{rid}-{i}"
            try:
                gens.append(Generation(state, client.add(sub_id, prompt, params), t0, deadline))
            except EngineDeadError as e:
                raise _engine_error(e, in_flight=False) from None
        firsts = await _unless_disconnected(request, _first_deltas(gens))
        if firsts is None:
            return Response(status_code=499)
        if stream:
            handed_off = True
            return StreamingResponse(
                _stream_events(state, gens, firsts, fmt, num_seqs),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        result = await _unless_disconnected(request, _collect(gens, firsts, fmt))
        if result is None:
            return Response(status_code=499)
        return JSONResponse(result)
    finally:
        if not handed_off:
            for g in gens:
                g.abort()
            state.admitted_seqs -= num_seqs


async def _first_deltas(gens: Sequence[Generation]) -> list[RequestDelta]:
    """The first delta of each generation (the first error wins; the other waits are cancelled)."""
    tasks = [asyncio.ensure_future(g.next()) for g in gens]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            t.cancel()


async def _collect(gens: Sequence[Generation], firsts: Sequence[RequestDelta], fmt: _Format) -> dict[str, Any]:
    n = fmt.n
    choices = [_Choice() for _ in range(n * len(gens))]
    async for i, delta in _merged(gens, firsts):
        for c in delta.outputs:
            choices[i * n + c.index].add(c)
        if delta.prompt is not None:
            for j in range(n):
                choices[i * n + j].prompt = delta.prompt
    usage = _usage(gens)
    return fmt.full_response(choices, usage)


def _usage(gens: Sequence[Generation]) -> UsageInfo:
    prompt = sum(g.num_prompt_tokens for g in gens)
    gen = sum(g.num_generated for g in gens)
    details = token_details(gens[0].state.reasoning_parser, sum(sum(g.reasoning_tokens.values()) for g in gens))
    return UsageInfo(prompt_tokens=prompt, completion_tokens=gen, total_tokens=prompt + gen, completion_tokens_details=details)


async def _stream_events(
    state: ServerState, gens: Sequence[Generation], firsts: Sequence[RequestDelta], fmt: _Format, num_seqs: int
) -> AsyncIterator[str]:
    """SSE events: deltas as chunks, an optional usage chunk, then `data: [DONE]`; errors become an error event.

    The `finally` also runs when the client disconnects (the response task is cancelled): the requests are aborted.
    """
    try:
        try:
            for chunk in fmt.stream_start(len(gens)):
                yield _sse(chunk)
            async for i, delta in _merged(gens, firsts):
                for chunk in fmt.stream_chunks(i, delta):
                    yield _sse(chunk)
            for chunk in fmt.stream_end(_usage(gens)):
                yield _sse(chunk)
        except APIError as e:
            yield _sse(e.body())
        yield "data: [DONE]\n\n"
    finally:
        for g in gens:
            g.abort()
        state.admitted_seqs -= num_seqs


class _Format(abc.ABC):
    """How deltas become one endpoint's response bodies and stream chunks."""

    n: int
    include_usage: bool

    @abc.abstractmethod
    def full_response(self, choices: list[_Choice], usage: UsageInfo) -> dict[str, Any]:
        """The non-streaming response body."""

    @abc.abstractmethod
    def stream_start(self, num_prompts: int) -> list[dict[str, Any]]:
        """Chunks sent before any token (e.g. the assistant role)."""

    @abc.abstractmethod
    def stream_chunks(self, prompt_index: int, delta: RequestDelta) -> list[dict[str, Any]]:
        """Chunks for one request's new output."""

    @abc.abstractmethod
    def usage_chunk(self, usage: UsageInfo) -> dict[str, Any]:
        """The final usage chunk (stream_options.include_usage)."""

    def stream_end(self, usage: UsageInfo) -> list[dict[str, Any]]:
        """Chunks after the last delta: the usage chunk when asked for."""
        return [self.usage_chunk(usage)] if self.include_usage else []


class _ChatFormat(_Format):
    """Chat bodies and chunks; with a tool parser, each choice's text is read as content plus tool calls (streamed
    calls as OpenAI's tool-call deltas: id, type and name first, then the arguments in pieces). With a reasoning
    parser that text is the answer after the thinking, and the thinking is shown apart (reasoning.py)."""

    def __init__(self, state: ServerState, body: ChatCompletionRequest, rid: str, parser: ToolParser | None = None) -> None:
        self.model = state.model_name if body.model is None else body.model
        self.rid = rid
        self.n = body.n
        self.k = (body.top_logprobs or 0) if body.logprobs else -1
        self.include_usage = bool(body.stream_options and body.stream_options.include_usage)
        self.created = int(time.time())
        self.parser = parser
        self.reasoning = ChatReasoning(state.reasoning_parser, body.include_reasoning)
        self._streams: dict[int, CallStream] = {}

    def _logprobs(self, positions: LogprobPositions | None) -> ChatLogprobs | None:
        if self.k < 0:
            return None
        return ChatLogprobs(content=chat_logprobs(positions or [], self.k))

    def _message(self, c: _Choice) -> tuple[ChatResponseMessage, str | None]:
        """The message of a finished choice and its finish reason ('tool_calls' when calls ended it)."""
        answer = self.reasoning.answer(c.text, c.thought)
        shown = self.reasoning.shown_reasoning(c.thought)
        if self.parser is None or answer is None:
            return ChatResponseMessage(content=answer, reasoning=shown, reasoning_content=shown), c.finish_reason
        parsed = self.parser.parse(answer, c.token_ids)
        calls = [ToolCallOut(id=t.id, function=FunctionCallOut(name=t.name, arguments=t.arguments)) for t in parsed.tool_calls]
        reason = "tool_calls" if calls and c.finish_reason == "stop" else c.finish_reason
        return ChatResponseMessage(content=parsed.content, tool_calls=calls, reasoning=shown, reasoning_content=shown), reason

    def full_response(self, choices: list[_Choice], usage: UsageInfo) -> dict[str, Any]:
        out = []
        for i, c in enumerate(choices):
            message, reason = self._message(c)
            out.append(ChatCompletionChoice(index=i, message=message, logprobs=self._logprobs(c.logprobs),
                                            finish_reason=reason, stop_reason=c.stop_reason))
        return body_dict(ChatCompletionResponse(id=self.rid, created=self.created, model=self.model, usage=usage, choices=out))

    def _chunk(self, choices: list[ChatCompletionStreamChoice], usage: UsageInfo | None = None) -> dict[str, Any]:
        return body_dict(ChatCompletionChunk(id=self.rid, created=self.created, model=self.model, choices=choices, usage=usage))

    def stream_start(self, num_prompts: int) -> list[dict[str, Any]]:
        return [self._chunk([ChatCompletionStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))])
                for i in range(self.n * num_prompts)]

    def _deltas(self, index: int, c: CompletionDelta) -> list[tuple[DeltaMessage, str | None]]:
        """One choice's delta messages and finish reasons: its thinking first (a message of its own), then its
        answer, which goes through its tool-call stream parser if any."""
        thought, text = self.reasoning.split(c)
        out = [(DeltaMessage(reasoning=thought, reasoning_content=thought), None)] if thought else []
        if self.parser is None:
            return [*out, (DeltaMessage(content=(text or None) if self.reasoning.on else text), c.finish_reason)]
        stream = self._streams.setdefault(index, self.parser.stream())
        content = stream.feed(text, c.token_ids) + (stream.finish() if c.finish_reason is not None else "")
        calls = _tool_call_deltas(stream.take_deltas())
        reason = "tool_calls" if c.finish_reason == "stop" and stream.calls() else c.finish_reason
        return [*out, (DeltaMessage(content=content or None, tool_calls=calls or None), reason)]

    def stream_chunks(self, prompt_index: int, delta: RequestDelta) -> list[dict[str, Any]]:
        out = []
        for c in delta.outputs:
            # a delta of special tokens alone has no text, but a parser reading token ids (harmony) needs it
            if not (c.text or c.reasoning or c.content or c.token_ids and self.parser is not None) \
                    and c.finish_reason is None and not c.logprobs:
                continue
            index = prompt_index * self.n + c.index
            logprobs = self._logprobs(c.logprobs) if c.logprobs else None  # with the delta's first chunk
            for message, reason in self._deltas(index, c):
                if message.content is None and message.tool_calls is None and message.reasoning is None and reason is None \
                        and logprobs is None:
                    continue
                out.append(self._chunk([ChatCompletionStreamChoice(index=index, delta=message, logprobs=logprobs, finish_reason=reason,
                                                                   stop_reason=c.stop_reason if reason is not None else None)]))
                logprobs = None
        return out

    def usage_chunk(self, usage: UsageInfo) -> dict[str, Any]:
        return self._chunk([], usage)


def _tool_call_deltas(pieces: list[ToolCallDelta]) -> list[DeltaToolCall]:
    """Parser pieces -> OpenAI tool-call deltas, the pieces of one call within one chunk merged."""
    out: list[DeltaToolCall] = []
    for p in pieces:
        if out and out[-1].index == p.index and p.id is None:
            fn = out[-1].function
            fn.arguments = (fn.arguments or "") + p.arguments
            continue
        out.append(DeltaToolCall(index=p.index, id=p.id, type="function" if p.id else None,
                                 function=DeltaFunctionCall(name=p.name, arguments=p.arguments)))
    return out


class _ResponsesFormat(_Format):
    """Response objects and the Responses API's typed stream events (one choice; the thinking as a reasoning item)."""

    def __init__(self, state: ServerState, body: ResponsesRequest, rid: str, parser: ToolParser | None) -> None:
        self.n = 1
        self.include_usage = True  # the final response.completed event carries the usage
        self.parser = parser
        self.builder = ResponseBuilder(rid, state.model_name if body.model is None else body.model, body, parser)
        self._stream: CallStream | None = parser.stream() if parser is not None else None
        self._finish: str | None = None
        self.reasoning = ChatReasoning(state.reasoning_parser)

    def full_response(self, choices: list[_Choice], usage: UsageInfo) -> dict[str, Any]:
        c = choices[0]
        content, calls = self.reasoning.answer(c.text, c.thought), []
        if self.parser is not None and content is not None:
            parsed = self.parser.parse(content, c.token_ids)
            content, calls = parsed.content, parsed.tool_calls
        status = "incomplete" if c.finish_reason == "length" else "completed"
        b = self.builder
        output = b.output(content, calls, c.thought.reasoning, "completed" if status == "completed" or content is not None else status)
        return b.response(output, status, usage_dict(usage))

    def stream_start(self, num_prompts: int) -> list[dict[str, Any]]:
        return self.builder.start_events()

    def stream_chunks(self, prompt_index: int, delta: RequestDelta) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for c in delta.outputs:
            thought, text = self.reasoning.split(c)
            out += self.builder.reasoning_events(thought or "")
            if self._stream is not None:
                text = self._stream.feed(text, c.token_ids) + (self._stream.finish() if c.finish_reason is not None else "")
            out += self.builder.text_events(text)
            if self._stream is not None:
                out += self.builder.call_events(self._stream.take_deltas())
            self._finish = c.finish_reason or self._finish
        return out

    def usage_chunk(self, usage: UsageInfo) -> dict[str, Any]:
        raise AssertionError("the Responses stream ends with stream_end")

    def stream_end(self, usage: UsageInfo) -> list[dict[str, Any]]:
        status = "incomplete" if self._finish == "length" else "completed"
        calls = self._stream.calls() if self._stream is not None else []
        return self.builder.done_events(status, usage_dict(usage), calls)


class _CompletionFormat(_Format):
    def __init__(self, state: ServerState, body: CompletionRequest, rid: str) -> None:
        self.model = state.model_name if body.model is None else body.model
        self.rid = rid
        self.n = body.n
        self.k = -1 if body.logprobs is None else body.logprobs
        self.include_usage = bool(body.stream_options and body.stream_options.include_usage)
        self.created = int(time.time())
        self.echo = body.echo
        self._prompts = body.prompts()
        self._offsets: dict[int, int] = {}
        self._echoed: set[int] = set()
        self._echo_prompts: dict[int, PromptEcho] = {}

    def _logprobs(self, index: int, positions: LogprobPositions | None) -> CompletionLogprobs | None:
        if self.k < 0:
            return None
        lp = completion_logprobs(positions or [], self.k, self._offsets.get(index, 0))
        if lp.text_offset:
            self._offsets[index] = lp.text_offset[-1] + len(lp.tokens[-1])
        return lp

    def _echo_text(self, prompt_index: int, echo: PromptEcho) -> str:
        """The prompt as the client sent it (text), or the decoded token ids."""
        p = self._prompts[prompt_index]
        return p if isinstance(p, str) else echo.text

    def _with_echo(self, index: int, prompt_index: int, echo: PromptEcho | None, text: str,
                   logprobs: CompletionLogprobs | None) -> tuple[str, CompletionLogprobs | None]:
        """`text` and `logprobs` of choice `index` with its prompt in front, the first time it is seen."""
        if not self.echo or echo is None or index in self._echoed:
            return text, logprobs
        self._echoed.add(index)
        prefix = self._echo_text(prompt_index, echo)
        if logprobs is not None:
            head = echo_logprobs(echo, self.k)
            shift = len(prefix)
            head.tokens += logprobs.tokens
            head.token_logprobs += logprobs.token_logprobs
            head.top_logprobs += logprobs.top_logprobs
            head.text_offset += [o + shift for o in logprobs.text_offset]
            self._offsets[index] = self._offsets.get(index, 0) + shift
            logprobs = head
        return prefix + text, logprobs

    def full_response(self, choices: list[_Choice], usage: UsageInfo) -> dict[str, Any]:
        out = []
        for i, c in enumerate(choices):
            text, lp = self._with_echo(i, i // self.n, c.prompt, c.text, self._logprobs(i, c.logprobs))
            out.append(CompletionChoice(index=i, text=text, logprobs=lp, finish_reason=c.finish_reason, stop_reason=c.stop_reason))
        return body_dict(CompletionResponse(id=self.rid, created=self.created, model=self.model, usage=usage, choices=out))

    def stream_start(self, num_prompts: int) -> list[dict[str, Any]]:
        return []

    def stream_chunks(self, prompt_index: int, delta: RequestDelta) -> list[dict[str, Any]]:
        out = []
        if delta.prompt is not None:
            self._echo_prompts[prompt_index] = delta.prompt
        echo = self._echo_prompts.get(prompt_index)
        for c in delta.outputs:
            if not c.text and c.finish_reason is None and not c.logprobs:
                continue
            index = prompt_index * self.n + c.index
            text, lp = self._with_echo(index, prompt_index, echo, c.text,
                                       self._logprobs(index, c.logprobs) if c.logprobs else None)
            choice = CompletionChoice(index=index, text=text, logprobs=lp, finish_reason=c.finish_reason, stop_reason=c.stop_reason)
            out.append(body_dict(CompletionResponse(id=self.rid, created=self.created, model=self.model, choices=[choice])))
        return out

    def usage_chunk(self, usage: UsageInfo) -> dict[str, Any]:
        return body_dict(CompletionResponse(id=self.rid, created=self.created, model=self.model, choices=[], usage=usage))


CUT_MARGIN_S = 1.0  # shutdown: connections still open this long before uvicorn's graceful timeout are cut


class GracefulServer(uvicorn.Server):
    """On SIGTERM / SIGINT, a drain: still listening, /health and new requests answer 503 "draining" (a load
    balancer takes the instance out), the requests in flight run on for up to the grace period; then whatever is
    left is failed ("the server is shutting down") and uvicorn's own shutdown follows (stop listening, wait up to
    timeout_graceful_shutdown for connections, lifespan shutdown: the core exits). A second signal, or a grace
    period of 0, skips the drain."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.tandem_state = state
        self._drain_requested = False
        self._drain_task: asyncio.Future[None] | None = None

    def handle_exit(self, sig: int, frame: Any) -> None:
        """The signal handler (main thread, between the loop's callbacks): only flags and a callback scheduled."""
        state, loop = self.tandem_state, self.tandem_state.loop
        if not self._drain_requested and state.config.shutdown_grace_period_s > 0 and loop is not None and not loop.is_closed():
            self._drain_requested = True
            state.begin_drain()
            loop.call_soon_threadsafe(self._start_drain, sig, frame)
            return
        state.begin_shutdown()
        super().handle_exit(sig, frame)

    def _start_drain(self, sig: int, frame: Any) -> None:
        self._drain_task = asyncio.ensure_future(self._drain_then_exit(sig, frame))

    async def _drain_then_exit(self, sig: int, frame: Any) -> None:
        state = self.tandem_state
        grace = state.config.shutdown_grace_period_s
        logger.info("draining: %d sequences in flight, up to %.0f s", state.admitted_seqs, grace)
        if await state.drain(grace):
            logger.info("drained: every request in flight finished")
        else:
            logger.warning("grace period over: failing %d sequences still in flight", state.admitted_seqs)
        if not self.should_exit:
            state.begin_shutdown()
            super().handle_exit(sig, frame)

    async def shutdown(self, sockets: list[Any] | None = None) -> None:
        """uvicorn's shutdown, except that a client still connected just before timeout_graceful_shutdown has its
        connection cut: uvicorn would cancel its response task instead, and its protocol logs each cancelled
        response as "Exception in ASGI application" with a traceback. Cut, the response's writes return at once
        (uvicorn drops writes to a lost connection) and the request ends as a client disconnect."""
        timeout = self.config.timeout_graceful_shutdown
        cutter = None if timeout is None else asyncio.ensure_future(self._cut_connections(max(0.0, timeout - CUT_MARGIN_S)))
        try:
            await super().shutdown(sockets)
        finally:
            if cutter is not None:
                cutter.cancel()

    async def _cut_connections(self, after_s: float) -> None:
        await asyncio.sleep(after_s)
        stuck = list(self.server_state.connections)
        if stuck:
            logger.warning("shutdown: cutting %d connection(s) whose clients stopped reading", len(stuck))
        for connection in stuck:
            transport: Any = getattr(connection, "transport", None)
            if transport is not None:
                transport.abort()


def bind_listener(host: str, port: int) -> socket.socket:
    """The server's socket on (`host`, `port`), bound now and listened on once `run_server` starts. Bound before
    the engine starts: a port an engine's workers pick meanwhile (Ray's, a tensor-parallel group's rendezvous) cannot
    be this one (it once was, and the server exited after its engine had loaded), and a port in use fails here,
    before any weights are read. Raises OSError."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: a restart reuses its port at once
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def run_server(app: FastAPI, sock: socket.socket, log_level: str = "info", graceful_timeout_s: int = 5) -> None:
    """Serve `app` (made by create_app) with uvicorn on `sock` (from `bind_listener`) until a signal; blocks."""
    host, port = sock.getsockname()[:2]
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=graceful_timeout_s)
    GracefulServer(config, app.state.tandem).run(sockets=[sock])
