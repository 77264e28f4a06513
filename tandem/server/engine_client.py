"""The process boundary: an engine-core process runs the model; the HTTP process talks to it with plain data.

Engine core (spawned child): builds the engine, then loops
    drain the command queue (add / abort / shutdown) -> step() -> send one ("step", events, stats) message,
and blocks on the command queue while nothing is unfinished. Each event is plain data: an output *delta* of one
request (text, token ids and logprobs produced since the last event for it) or the error of a refused request.
Because the engine's visible text only grows (see tandem/engine/stop.py), deltas are exact.

Client (HTTP process, asyncio): `EngineClient.add()` registers a per-request asyncio queue and sends the command;
one reader callback (loop.add_reader on the output connection) dispatches every message to those queues, and its EOF
(or, for a local child, the process sentinel) notices the core's death at once: every in-flight request then fails
with 503, and the client starts a new engine core (crash-only recovery, with back-off when cores keep dying); until
it is ready, new requests are refused with 503 and /health says the engine is restarting.

Where the core runs is the client's one seam, a `CoreLauncher`: `LocalCoreLauncher` spawns a child process joined by
two pipes; `server/ray_cores.py` places the core as a Ray actor joined by two authenticated TCP connections
(multiprocessing.connection). Either way the core runs `run_engine_core` and the messages are the same.

Messages child -> parent: ("ready", info with the idle engine's stats) | ("failed", reason) | ("step", events, stats
or None: at most every STATS_EVERY_S while busy, and whenever the engine turns busy or idle) | ("fatal", reason).
Commands parent -> child: ("add", request_id, prompt, SamplingParams) | ("abort", [ids]) | ("shutdown",).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing as mp
import os
import queue
import signal
import threading
import time
import traceback
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from tandem.params import EngineOverloaded, SamplingParams
from tandem.request import RequestOutput

logger = logging.getLogger("tandem.server")

IDLE_POLL_S = 1.0  # idle core: how often it checks that its parent is still alive
_MAX_MESSAGES_PER_WAKEUP = 64
PENDING_POLL_S = 0.002
STATS_EVERY_S = 0.25  # while busy, engine stats go with a step message at most this often (0.5-1 ms to build)
RESTART_BASE_DELAY_S = 1.0  # a core that dies again within RESTART_WINDOW_S waits 1, 2, 4 ... s before restarting
RESTART_MAX_DELAY_S = 30.0
RESTART_WINDOW_S = 60.0  # unfinished requests but nothing scheduled (e.g. a grammar compiling): wait this long for commands

# Exceptions from add_request / chat templating that mean "this request is invalid" (400), not "the server broke".
_BAD_REQUEST_ERRORS: tuple[type[BaseException], ...] = (ValueError, TypeError, OverflowError, KeyError)


# --------------------------------------------------------------------------------------------- plain-data events
@dataclass
class CompletionDelta:
    """What one of a request's `n` completions produced since its previous delta."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[list[tuple[int, float, int | None, str | None]]] | None  # per token: [(id, logprob, rank, text)], sampled first
    finish_reason: str | None
    stop_reason: int | str | None
    # with a reasoning parser (`text` is the whole output's delta): the new thinking and answer text, every thinking
    # character in a delta before the first answer character of the completion; thinking tokens so far
    reasoning: str = ""
    content: str = ""
    num_reasoning_tokens: int = 0
    answering: bool = False  # the answer has begun (the thinking ended, or there was none): content is not null


@dataclass
class PromptEcho:
    """The prompt as text and per token, with its logprobs (per position as in CompletionDelta; position 0: [])."""

    text: str
    tokens: list[str]
    logprobs: list[list[tuple[int, float, int | None, str | None]]]


@dataclass
class RequestDelta:
    request_id: str
    num_prompt_tokens: int
    num_cached_tokens: int
    finished: bool
    error: str | None
    outputs: list[CompletionDelta] = field(default_factory=list)
    prompt: PromptEcho | None = None  # on the first delta of a request that asked for prompt logprobs (echo)


class _DeltaTracker:
    """Core side: turns the engine's cumulative RequestOutputs into deltas (sent lengths per completion)."""

    def __init__(self, decode: Any = None) -> None:
        # rid -> index -> (tokens, chars, logprobs, thinking chars, answer chars)
        self._sent: dict[str, dict[int, tuple[int, int, int, int, int]]] = {}
        self._decode = decode  # Tokenizer.decode, for the prompt's text when it is echoed

    def _prompt_echo(self, out: RequestOutput) -> PromptEcho | None:
        if out.prompt_logprobs is None or self._decode is None:
            return None
        ids = out.prompt_token_ids
        lps = [[] if pos is None else [(tid, lp.logprob, lp.rank, lp.decoded_token) for tid, lp in
                                       sorted(pos.items(), key=lambda kv: kv[0] != ids[i])]
               for i, pos in enumerate(out.prompt_logprobs)]
        return PromptEcho(self._decode(ids, skip_special_tokens=False),
                          [self._decode([t], skip_special_tokens=False) for t in ids], lps)

    def delta(self, out: RequestOutput) -> RequestDelta:
        first = out.request_id not in self._sent
        sent = self._sent.setdefault(out.request_id, {})
        deltas: list[CompletionDelta] = []
        for c in out.outputs:
            nt, nc, nl, nr, na = sent.get(c.index, (0, 0, 0, 0, 0))
            new_lp = None
            if c.logprobs is not None:
                new_lp = [[(tid, lp.logprob, lp.rank, lp.decoded_token) for tid, lp in pos.items()] for pos in c.logprobs[nl:]]
            reasoning, content = c.reasoning or "", c.content or ""
            if len(c.token_ids) == nt and len(c.text) == nc and c.finish_reason is None and len(reasoning) == nr \
                    and len(content) == na:
                continue
            deltas.append(CompletionDelta(c.index, c.text[nc:], list(c.token_ids[nt:]), new_lp, c.finish_reason,
                                          c.stop_reason, reasoning[nr:], content[na:], c.num_reasoning_tokens,
                                          c.content is not None))
            sent[c.index] = (len(c.token_ids), len(c.text), len(c.logprobs) if c.logprobs is not None else 0,
                             len(reasoning), len(content))
        if out.finished:
            self._sent.pop(out.request_id, None)
        cached = out.metrics.num_cached_tokens if out.metrics is not None else 0
        return RequestDelta(out.request_id, len(out.prompt_token_ids), cached, out.finished, out.error, deltas,
                            self._prompt_echo(out) if first else None)

    def forget(self, request_id: str) -> None:
        self._sent.pop(request_id, None)


# ------------------------------------------------------------------------------------------------ engine core
def run_engine_core(
    model: str | None, engine_kwargs: Mapping[str, Any], commands: Connection, results: Connection, parent_pid: int
) -> None:
    """Entry point of the engine-core process: build the engine, report ready, run the busy loop until shutdown."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine-core %(levelname)s %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the whole group: the HTTP process decides
    try:
        from tandem.engine.engine import freeze_startup_heap
        from tandem.engine.llm import build_engine

        engine = build_engine(model, **dict(engine_kwargs))
        freeze_startup_heap()  # this process keeps its engine: full GC passes skip the start-up heap
    except BaseException as e:  # noqa: BLE001 - any failure to start is reported, then the process ends
        results.send(("failed", f"{type(e).__name__}: {e}"))
        return
    results.send(("ready", {"max_model_len": engine.max_model_len, "vocab_size": engine.vocab_size,
                            "has_chat_template": engine.tokenizer.has_chat_template, "pid": os.getpid(),
                            "chat_template": getattr(engine.tokenizer.hf, "chat_template", None),
                            "tool_call_parser": engine.tokenizer.chat_format.tool_call_parser,
                            "reasoning_parser": engine.tokenizer.chat_format.reasoning_parser,
                            "grammar_in_reasoning": engine.grammar_in_reasoning,
                            "stats": engine.get_stats()}))
    try:
        _core_loop(engine, commands, results, parent_pid)
    except BaseException as e:  # noqa: BLE001 - the engine is broken: say why, then die (the client fails requests)
        logger.exception("engine core failed")
        with contextlib.suppress(Exception):
            results.send(("fatal", f"{type(e).__name__}: {e}"))
        raise SystemExit(1) from e


def _core_loop(engine: Any, commands: Connection, results: Connection, parent_pid: int) -> None:
    tracker = _DeltaTracker(engine.tokenizer.decode)
    progressed = True
    stats_sent = 0.0
    while True:
        if os.getppid() != parent_pid:
            logger.warning("parent process is gone; engine core exits")
            return
        idle = not engine.has_unfinished_requests()
        if idle:
            wait_s: float | None = IDLE_POLL_S
        else:
            wait_s = None if progressed else PENDING_POLL_S  # nothing moved last step (e.g. a grammar compiling)
        cmds = _drain(commands, wait_s)
        if any(c[0] == "shutdown" for c in cmds):
            return
        events: list[tuple[Any, ...]] = [ev for cmd in cmds for ev in _apply(engine, tracker, cmd)]
        progressed = False
        if engine.has_unfinished_requests():
            outs = engine.step()
            progressed = bool(outs)
            events.extend(("out", tracker.delta(o)) for o in outs)
        if events or cmds:
            # percentiles over thousands of samples each step cost the engine thread 0.5-1 ms at 256 requests;
            # fresh ones whenever the engine turns busy or idle, so /metrics never shows the other state
            now = time.monotonic()
            fresh = idle or not engine.has_unfinished_requests() or now - stats_sent >= STATS_EVERY_S
            results.send(("step", events, engine.get_stats() if fresh else None))
            stats_sent = now if fresh else stats_sent


def _drain(commands: Connection, block_s: float | None) -> list[tuple[Any, ...]]:
    """All commands already sent; first waits up to `block_s` for one when given (None: do not wait).

    The parent closing its end (it died) reads as a shutdown command.
    """
    out: list[tuple[Any, ...]] = []
    try:
        if block_s is not None and not commands.poll(block_s):
            return out
        while commands.poll():
            out.append(commands.recv())
    except (EOFError, OSError):
        out.append(("shutdown",))
    return out


def _apply(engine: Any, tracker: _DeltaTracker, cmd: tuple[Any, ...]) -> list[tuple[Any, ...]]:
    """Run one add / abort command on the engine; the error events of refused requests."""
    if cmd[0] == "abort":
        for rid in cmd[1]:
            engine.abort_request(rid)
            tracker.forget(rid)
        return []
    _, rid, prompt_input, params = cmd
    try:
        prompt = prompt_input["prompt"] if "prompt" in prompt_input else engine.tokenizer.apply_chat_template(
            prompt_input["messages"], add_generation_prompt=prompt_input.get("add_generation_prompt", True),
            **prompt_input.get("chat_template_kwargs", {}))
        if isinstance(prompt, str):
            prompt = engine.tokenizer.encode(prompt)  # tokenized here once, to check its length
        _check_context(engine, prompt, params)
        engine.add_request(rid, prompt, params)
    except EngineOverloaded as e:  # e.g. the grammar compile queue is full: the client may retry
        return [("error", rid, 429, str(e))]
    except _BAD_REQUEST_ERRORS as e:  # ParamError and ConfigError are ValueErrors
        return [("error", rid, 400, str(e))]
    except Exception as e:  # noqa: BLE001 - e.g. a Jinja template error: this request alone fails
        if type(e).__module__.startswith("jinja2"):
            return [("error", rid, 400, f"chat template failed: {e}")]
        logger.exception("add_request %s failed", rid)
        return [("error", rid, 500, f"{type(e).__name__}: {e}")]
    return []


def _check_context(engine: Any, prompt: Any, params: SamplingParams) -> None:
    """As vLLM: a max_tokens that does not fit in the context beside the prompt is refused (ValueError: 400)."""
    if params.max_tokens is None:
        return
    if len(prompt) + params.max_tokens > engine.max_model_len:
        raise ValueError(
            f"This model's maximum context length is {engine.max_model_len} tokens. However, you requested "
            f"{len(prompt) + params.max_tokens} tokens ({len(prompt)} in the messages, {params.max_tokens} in the "
            "completion). Please reduce the length of the messages or completion.")


# ------------------------------------------------------------------------------------------------------ client
class _CommandSender:
    """Parent side of the command pipe: `send` never blocks the event loop (a writer thread does the pipe writes,
    which may wait while the core is inside a step and the pipe buffer is full)."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._queue: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="tandem-engine-commands", daemon=True)
        self._thread.start()

    def send(self, cmd: tuple[Any, ...]) -> None:
        self._queue.put(cmd)

    def _run(self) -> None:
        while True:
            cmd = self._queue.get()
            if cmd is None:
                break
            try:
                self._conn.send(cmd)
            except (OSError, ValueError):  # the core is gone; its death is handled by the reader side
                break
        with contextlib.suppress(OSError):
            self._conn.close()

    def close(self, timeout_s: float = 2.0) -> None:
        """Send what is queued, then close the pipe."""
        self._queue.put(None)
        self._thread.join(timeout_s)


class EngineDeadError(RuntimeError):
    """The engine-core process is gone; the message says why."""


class RequestRefused(Exception):
    """The engine refused a request (`status` 400 for invalid input)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class ModelInfo:
    max_model_len: int
    vocab_size: int
    has_chat_template: bool
    core_pid: int
    chat_template: str | None = None
    tool_call_parser: str | None = None  # the call format the model's chat format fixes (harmony: "openai")
    reasoning_parser: str | None = None  # the reasoning parser the chat format implies (harmony: "openai_gptoss")
    grammar_in_reasoning: bool = False  # structured_outputs_config's enable_in_reasoning: grammars hold the thinking


class RequestStream:
    """Deltas of one request, in order; `next()` raises RequestRefused / EngineDeadError instead of hanging."""

    def __init__(self, client: EngineClient, request_id: str) -> None:
        self.request_id = request_id
        self.finished = False
        self._client = client
        self._queue: asyncio.Queue[RequestDelta | BaseException] = asyncio.Queue()

    def _put(self, item: RequestDelta | BaseException) -> None:
        self._queue.put_nowait(item)

    async def next(self) -> RequestDelta:
        """The next delta; the last one has `finished` set."""
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    def abort(self) -> None:
        """Stop the request in the engine (frees its KV blocks) unless it already finished."""
        if not self.finished:
            self.finished = True
            self._client.abort(self.request_id)


class RunningCore(ABC):
    """One started engine core as its client sees it: the two connections of the message protocol, and how to name,
    watch and end what runs behind them."""

    def __init__(self, commands: Connection, results: Connection) -> None:
        self.commands = commands  # client -> core
        self.results = results  # core -> client: EOF once the core is gone

    @property
    @abstractmethod
    def pid(self) -> int | None:
        """The core's process id, on the node it runs on."""

    @property
    def sentinel(self) -> int | None:
        """A file descriptor that becomes readable when the core is gone, beside EOF on `results` (None: EOF only)."""
        return None

    @abstractmethod
    def is_alive(self) -> bool:
        """Whether the core still runs (after a shutdown command: whether it has not left yet)."""

    @abstractmethod
    def kill(self) -> None:
        """End the core now, whether or not it is still running, and wait a little for it."""

    @abstractmethod
    def reap(self) -> str:
        """The core is gone (EOF or sentinel): collect what is left of it and say why it ended."""


class CoreLauncher(ABC):
    """Starts engine cores running `run_engine_core`: a local child process (`LocalCoreLauncher`), or a Ray actor on
    any node of a cluster (`server/ray_cores.py: RayCoreLauncher`)."""

    @abstractmethod
    async def start(self, model: str | None, engine_kwargs: Mapping[str, Any], timeout_s: float) -> RunningCore:
        """Start one core; return once its connections are up (it then builds its engine and says 'ready'). Raises
        EngineDeadError when it cannot be started within `timeout_s`."""


class LocalCore(RunningCore):
    """A spawned child process; its sentinel says at once when it dies, its exit code or signal why."""

    def __init__(self, proc: Any, commands: Connection, results: Connection) -> None:
        super().__init__(commands, results)
        self.proc = proc

    @property
    def pid(self) -> int | None:
        return int(self.proc.pid) if self.proc.pid is not None else None

    @property
    def sentinel(self) -> int | None:
        return int(self.proc.sentinel)

    def is_alive(self) -> bool:
        return bool(self.proc.is_alive())

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)

    def reap(self) -> str:
        self.proc.join(0.5)
        code = self.proc.exitcode
        if code is not None and code < 0:
            with contextlib.suppress(ValueError):
                return f"engine core process was killed by {signal.Signals(-code).name}"
        return f"engine core process exited (code {code})"


class LocalCoreLauncher(CoreLauncher):
    """The core as a spawned child of this process, joined by two one-way pipes."""

    async def start(self, model: str | None, engine_kwargs: Mapping[str, Any], timeout_s: float) -> RunningCore:
        ctx = mp.get_context("spawn")
        cmd_reader, cmd_writer = ctx.Pipe(duplex=False)
        reader, writer = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=run_engine_core, args=(model, engine_kwargs, cmd_reader, writer, os.getpid()),
                           name="tandem-engine-core", daemon=True)
        proc.start()
        writer.close()  # only the child writes: its death then reads as EOF here
        cmd_reader.close()
        return LocalCore(proc, cmd_writer, reader)


class EngineClient:
    """Owns the engine core (started by its `CoreLauncher`, a local child by default); asyncio side of the boundary.
    Use from one event loop."""

    def __init__(
        self, model: str | None, engine_kwargs: Mapping[str, Any] | None = None, launcher: CoreLauncher | None = None,
    ) -> None:
        self.model = model
        self.engine_kwargs = dict(engine_kwargs or {})
        self.launcher = launcher if launcher is not None else LocalCoreLauncher()
        self.stats: dict[str, Any] = {}
        self.info: ModelInfo | None = None
        self.dead_reason: str | None = None
        self.accepting = True
        self._streams: dict[str, RequestStream] = {}
        self._core: RunningCore | None = None
        self._commands: _CommandSender | None = None
        self._closing = False
        self._results: Connection | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready: asyncio.Future[ModelInfo] | None = None
        self._start_timeout_s = 900.0
        self.restarts = 0  # engine cores started after the first one died
        self.restarting = False
        self._restart_task: asyncio.Task[None] | None = None
        self._deaths: list[float] = []  # monotonic times of recent unexpected deaths (back-off)

    # ---- lifecycle ----------------------------------------------------------------------------------------------
    async def start(self, timeout_s: float = 900.0) -> ModelInfo:
        """Spawn the engine core and wait until its engine is built; raises EngineDeadError if it fails to start."""
        self._start_timeout_s = timeout_s
        return await self._spawn()

    async def _spawn(self) -> ModelInfo:
        """Start one engine core and wait for its 'ready'."""
        timeout_s = self._start_timeout_s
        self._loop = asyncio.get_running_loop()
        started = time.monotonic()
        core = self._core = await self.launcher.start(self.model, self.engine_kwargs, timeout_s)
        self._commands = _CommandSender(core.commands)
        self._results = core.results
        self._ready = self._loop.create_future()
        self._loop.add_reader(core.results.fileno(), self._on_readable)
        if core.sentinel is not None:
            self._loop.add_reader(core.sentinel, self._on_exit)
        try:
            left_s = max(1.0, timeout_s - (time.monotonic() - started))
            self.info = await asyncio.wait_for(asyncio.shield(self._ready), left_s)
        except asyncio.TimeoutError:
            self._mark_dead(f"engine core did not start within {timeout_s:.0f} s")
            self._kill()
            raise EngineDeadError(self.dead_reason) from None
        except EngineDeadError:
            self._kill()  # it said 'failed' (a local child then exits by itself; a Ray actor would stay)
            raise
        self.dead_reason = None  # serving (again)
        return self.info

    def _schedule_restart(self) -> None:
        """The core died unexpectedly: start a new one (after a back-off when deaths come in quick succession)."""
        if self._closing or self._loop is None or self._restart_task is not None:
            return
        self.restarting = True
        self._restart_task = self._loop.create_task(self._restart())

    async def _restart(self) -> None:
        now = time.monotonic()
        self._deaths = [t for t in self._deaths if now - t < RESTART_WINDOW_S] + [now]
        delay = min(RESTART_MAX_DELAY_S, RESTART_BASE_DELAY_S * 2 ** (len(self._deaths) - 1)) if len(self._deaths) > 1 else 0.0
        try:
            while not self._closing:
                await asyncio.sleep(delay)
                if self._closing:
                    return
                self._old_pipes_closed()
                try:
                    await self._spawn()
                except EngineDeadError as e:
                    logger.error("engine core restart failed: %s", e)
                    delay = min(RESTART_MAX_DELAY_S, max(1.0, 2 * delay))
                    continue
                self.restarts += 1
                logger.warning("engine core restarted (pid %s); serving again", self.core_pid)
                return
        finally:
            self.restarting = False
            self._restart_task = None

    def _old_pipes_closed(self) -> None:
        if self._commands is not None:
            self._commands.close(0.1)
            self._commands = None
        self._detach()

    @property
    def core_pid(self) -> int | None:
        return self._core.pid if self._core is not None else None

    @property
    def core_pids(self) -> list[int]:
        """The engine cores' process ids (one here; one per replica behind a `DataParallelClient`)."""
        return [self._core.pid] if self._core is not None and self._core.pid is not None else []

    @property
    def replica_states(self) -> list[dict[str, Any]]:
        """Per engine core (one here): its pid, whether it serves, requests in flight, tokens it generated."""
        return [{"pid": self.core_pid, "alive": self.alive, "in_flight": self.num_in_flight,
                 "generated_tokens": int(self.stats.get("num_generated_tokens", 0))}]

    @property
    def alive(self) -> bool:
        return self.dead_reason is None and self.info is not None

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        """Abort everything in flight, ask the core to exit, and wait for it (killing it after `timeout_s`)."""
        self.accepting = False
        self._closing = True
        if self._restart_task is not None:
            self._restart_task.cancel()
        self.abort_all("the server is shutting down")
        if self._core is None:
            return
        if self.dead_reason is None:
            self._send(("shutdown",))
        deadline = time.monotonic() + timeout_s
        while self._core.is_alive() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self._kill()
        self._mark_dead("the server shut down")
        self._detach()
        if self._commands is not None:
            self._commands.close()

    def _kill(self) -> None:
        if self._core is not None:
            self._core.kill()

    def _detach(self) -> None:
        if self._loop is None:
            return
        for fd in (self._results, self._core.sentinel if self._core is not None else None):
            if fd is not None:
                with contextlib.suppress(Exception):
                    self._loop.remove_reader(fd)
        if self._results is not None:
            with contextlib.suppress(Exception):
                self._results.close()
            self._results = None

    # ---- requests -----------------------------------------------------------------------------------------------
    def add(self, request_id: str, prompt: Mapping[str, Any], params: SamplingParams) -> RequestStream:
        """Send a request to the engine; its deltas arrive on the returned stream. Raises EngineDeadError."""
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        if not self.accepting:
            raise EngineDeadError("the server is shutting down")
        stream = RequestStream(self, request_id)
        self._streams[request_id] = stream
        self._send(("add", request_id, dict(prompt), params))
        return stream

    def _send(self, cmd: tuple[Any, ...]) -> None:
        if self._commands is not None:
            self._commands.send(cmd)

    def abort(self, request_id: str) -> None:
        """Abort one request (no more deltas arrive for it)."""
        if self._streams.pop(request_id, None) is not None and self.dead_reason is None:
            self._send(("abort", [request_id]))

    def abort_all(self, reason: str) -> None:
        """Abort every in-flight request; each stream raises EngineDeadError(reason)."""
        streams, self._streams = self._streams, {}
        if streams and self.dead_reason is None:
            self._send(("abort", list(streams)))
        for s in streams.values():
            s._put(EngineDeadError(reason))

    # ---- reader callbacks -----------------------------------------------------------------------------------------
    def _on_readable(self) -> None:
        conn = self._results
        if conn is None:
            return
        try:
            for _ in range(_MAX_MESSAGES_PER_WAKEUP):  # then yield to the loop; the reader fires again
                if not conn.poll():
                    break
                self._dispatch(conn.recv())
        except (EOFError, OSError):
            self._on_exit()

    def _dispatch(self, msg: tuple[Any, ...]) -> None:
        kind = msg[0]
        if kind == "step":
            for ev in msg[1]:
                self._dispatch_event(ev)
            if msg[2] is not None:  # None: unchanged since the last stats (sent at most every STATS_EVERY_S)
                self.stats = msg[2]
        elif kind == "ready":
            info = msg[1]
            self.stats = info.get("stats", {})  # a new core's own (idle) stats, not the last ones of one that died
            if self._ready is not None and not self._ready.done():
                self._ready.set_result(ModelInfo(info["max_model_len"], info["vocab_size"], info["has_chat_template"], info["pid"],
                                                 info.get("chat_template"), info.get("tool_call_parser"),
                                                 info.get("reasoning_parser"), bool(info.get("grammar_in_reasoning"))))
        elif kind in ("failed", "fatal"):
            self._mark_dead(f"engine core {'failed to start' if kind == 'failed' else 'failed'}: {msg[1]}")

    def _dispatch_event(self, ev: tuple[Any, ...]) -> None:
        if ev[0] == "out":
            delta: RequestDelta = ev[1]
            stream = self._streams.get(delta.request_id)
            if stream is not None:
                if delta.finished:
                    del self._streams[delta.request_id]
                stream._put(delta)
        elif ev[0] == "error":
            _, rid, status, message = ev
            stream = self._streams.pop(rid, None)
            if stream is not None:
                stream._put(RequestRefused(status, message))

    def _on_exit(self) -> None:
        """The core's sentinel fired (or its connection closed): it is gone."""
        self._on_readable_final()  # a 'fatal' message sent before dying names the real reason
        if self._results is None and self.dead_reason is not None:
            return  # the other signal of the same death, already handled
        self._mark_dead(self._core.reap() if self._core is not None else "engine core is gone")
        self._detach()
        if not self._closing and self.info is not None:
            self._schedule_restart()

    def _on_readable_final(self) -> None:
        """Read what the core sent before dying (e.g. its 'fatal' reason)."""
        conn = self._results
        if conn is None:
            return
        with contextlib.suppress(EOFError, OSError):
            while conn.poll():
                self._dispatch(conn.recv())

    def _mark_dead(self, reason: str) -> None:
        if self.dead_reason is None:
            self.dead_reason = reason
            logger.log(logging.INFO if self._closing else logging.ERROR, "%s", reason)
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(EngineDeadError(self.dead_reason))
        streams, self._streams = self._streams, {}
        for s in streams.values():
            s._put(EngineDeadError(self.dead_reason))


def format_exception(e: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(e), e)).strip()
