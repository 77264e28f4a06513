"""Speculation scheduled ahead through `tandem serve`, driven by the official `openai` client: the same mixed traffic
(chat and completions, streamed and not, distinct JSON schemas, stop strings, logprobs, n = 2, text that repeats so
that drafts are accepted, multi-byte text) sent at once to a server without drafts and to one with suffix drafts
(`--async-scheduling --speculative-method suffix`) gets the same tokens, texts, finish reasons and token counts
from both; streamed deltas add up to the whole text; the speculative server really drafted, accepted drafts and
scheduled its steps ahead (its /metrics)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2 as httpx
import jsonschema
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.launch import running_server

from .test_server import MODEL, demo, read_stream

ARGS = ["--dtype", "float32", "--max-model-len", "512", "--max-num-seqs", "32", "--num-kv-blocks", "400",
        "--max-queue", "128", "--log-level", "warning", "--async-scheduling"]
SPECULATIVE = ["--speculative-method", "suffix", "--num-speculative-tokens", "4"]
REPEATING = ["Repeat this list three times: apple, pear, plum, fig, kiwi.",
             "Write the numbers from 1 to 30 separated by commas.",
             "Copy this sentence twice: The quick brown fox jumps over the lazy dog.",
             "List the days of the week, then list them again.",
             "Repeat exactly: 東京 東京 東京 東京",
             "Translate to Japanese: Tokyo, Japan, water.",
             "Spell the word banana letter by letter, three times."]


def _schema(i: int) -> dict[str, Any]:
    """A distinct schema per request: its own property names and bounds."""
    return {"type": "object", "properties": {f"name_{i}": {"type": "string", "maxLength": 8 + i},
                                             f"count_{i}": {"type": "integer", "minimum": i, "maximum": 1000 + i}},
            "required": [f"name_{i}", f"count_{i}"], "additionalProperties": False}


def _traffic() -> list[tuple[str, dict[str, Any]]]:
    """(kind, request body) of every request, in a fixed order."""
    chat = [{"role": "user", "content": p} for p in REPEATING]
    out: list[tuple[str, dict[str, Any]]] = []
    for message in chat:
        out.append(("chat", {"messages": [message], "max_tokens": 64}))
        out.append(("stream", {"messages": [message], "max_tokens": 64}))
    for i in range(6):
        out.append(("chat", {"messages": [{"role": "user", "content": f"Item {i}: a tool called bolt{i}. As JSON:"}],
                             "max_tokens": 64, "response_format": {"type": "json_schema",
                                                                    "json_schema": {"name": f"s{i}", "schema": _schema(i)}}}))
    for p in REPEATING[:3]:
        out.append(("chat", {"messages": [{"role": "user", "content": p}], "max_tokens": 64, "stop": [",", " dog"]}))
        out.append(("completion", {"prompt": f"{p}\n", "max_tokens": 32, "logprobs": 2}))
        out.append(("n2", {"messages": [{"role": "user", "content": p}], "max_tokens": 24, "n": 2}))
    out.append(("chat", {"messages": [chat[0]], "max_tokens": 1}))
    return out


async def _one(client: openai.AsyncOpenAI, kind: str, body: dict[str, Any]) -> dict[str, Any]:
    """The parts of one answer both servers must agree on."""
    if kind == "completion":
        r = await client.completions.create(model=MODEL, temperature=0, **body)
        c = r.choices[0]
        lp = c.logprobs
        assert lp is not None and lp.tokens is not None and lp.top_logprobs is not None
        return {"text": c.text, "finish": c.finish_reason, "tokens": r.usage.completion_tokens if r.usage else None,
                "lp_tokens": list(lp.tokens), "lp_values": list(lp.token_logprobs or []),
                "top": [sorted(t) for t in lp.top_logprobs]}
    if kind == "stream":
        stream = await client.chat.completions.create(model=MODEL, temperature=0, stream=True,
                                                      stream_options={"include_usage": True}, **body)
        text, finish, tokens = await read_stream(stream)
        return {"text": text, "finish": finish, "tokens": tokens}
    r = await client.chat.completions.create(model=MODEL, temperature=0, **body)
    return {"texts": [c.message.content for c in r.choices], "finish": [c.finish_reason for c in r.choices],
            "tokens": r.usage.completion_tokens if r.usage else None}


def _serve(log_path: Path, extra: list[str]) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """Start a server with `extra` flags, send all the traffic at once, and return the answers and its metrics."""
    async def send(url: str) -> list[dict[str, Any]]:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300.0)
        try:
            return list(await asyncio.gather(*(_one(client, kind, body) for kind, body in _traffic())))
        finally:
            await client.close()

    with running_server(log_path, None, ARGS + extra) as (_, url):
        answers = asyncio.run(send(url))
        metrics = {s.name: s.value for fam in text_string_to_metric_families(httpx.get(f"{url}/metrics").text)
                   for s in fam.samples if not s.labels}
    return answers, metrics


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, tuple[list[dict[str, Any]], dict[str, float]]]]:
    """Both servers' answers and metrics: one after the other (each alone on the host's cores)."""
    folder = tmp_path_factory.mktemp("speculative-serve")
    yield {"plain": _serve(folder / "plain.log", []), "suffix": _serve(folder / "suffix.log", SPECULATIVE)}


@demo
def test_drafts_scheduled_ahead_serve_what_the_server_without_drafts_does(served: dict[str, Any]) -> None:
    plain, suffix = served["plain"][0], served["suffix"][0]
    for (kind, body), a, b in zip(_traffic(), plain, suffix, strict=True):
        values_a, values_b = a.pop("lp_values", None), b.pop("lp_values", None)
        assert a == b, f"{kind} {json.dumps(body)[:120]}"
        if values_a is not None:
            assert values_b == pytest.approx(values_a, abs=1e-3)


@demo
def test_what_each_request_asked_for_holds(served: dict[str, Any]) -> None:
    answers, stopped = served["suffix"][0], 0
    for (kind, body), got in zip(_traffic(), answers, strict=True):
        if "response_format" in body:
            schema = body["response_format"]["json_schema"]["schema"]
            jsonschema.validate(json.loads(got["texts"][0]), schema)
        if "stop" in body:
            assert not any(s in got["texts"][0] for s in body["stop"])
            stopped += got["finish"] == ["stop"]
        if kind == "n2":
            assert got["texts"][0] == got["texts"][1]  # greedy: both choices alike
        if body.get("max_tokens") == 1:
            assert got["tokens"] == 1 and got["finish"] == ["length"]
    assert stopped  # a stop string was met and cut


@demo
def test_streamed_deltas_add_up_to_the_whole_text(served: dict[str, Any]) -> None:
    traffic, answers = _traffic(), served["suffix"][0]
    whole = {json.dumps(body): got for (kind, body), got in zip(traffic, answers, strict=True) if kind == "chat"}
    streams = [(body, got) for (kind, body), got in zip(traffic, answers, strict=True) if kind == "stream"]
    assert streams
    for body, got in streams:
        same = whole[json.dumps(body)]
        assert (got["text"], [got["finish"]], got["tokens"]) == (same["texts"][0], same["finish"], same["tokens"])
    assert any("東京" in got["text"] for _, got in streams)  # multi-byte text came through (several tokens a step)


@demo
def test_the_speculative_server_drafted_and_scheduled_ahead(served: dict[str, Any]) -> None:
    metrics = served["suffix"][1]
    assert metrics["vllm:spec_decode_num_draft_tokens_total"] > 0
    assert metrics["vllm:spec_decode_num_accepted_tokens_total"] > 0
    assert metrics["tandem_steps_scheduled_ahead"] > 0
    assert "vllm:spec_decode_num_draft_tokens_total" not in served["plain"][1]
