"""The hostile structured-output corpus (tests/structured/hostile_corpus.py) through `tandem serve`, beside normal
requests, streamed and not: every hostile request gets a 4xx or a 200 (an error event at worst, inside a 200
stream), never a 5xx; every normal request succeeds with valid JSON; the server stays healthy throughout."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2 as httpx
import jsonschema
import pytest

from tests.server.launch import running_server

from ..structured.hostile_corpus import corpus, request_body_text
from .test_server import MODEL, demo

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log_path: Path = tmp_path_factory.mktemp("hostile") / "server.log"
    args = ["--dtype", "bfloat16", "--max-model-len", "512", "--max-num-seqs", "32", "--num-kv-blocks", "600",
            "--max-queue", "512", "--log-level", "warning",
            "--structured-outputs-config", json.dumps({"compile_timeout_s": 1.0, "max_fill_ms": 200.0})]
    with running_server(log_path, None, args) as (_, server_url):
        yield server_url


async def _post(client: httpx.AsyncClient, url: str, body: dict[str, Any] | str) -> tuple[int, str]:
    data = (body if isinstance(body, str) else request_body_text(body)).encode()
    async with client.stream("POST", f"{url}/v1/chat/completions", content=data,
                             headers={"content-type": "application/json"}) as r:
        return r.status_code, (await r.aread()).decode(errors="replace")


def _normal(i: int) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": f"Person {i}: Bo, {20 + i}. As JSON:"}],
            "max_tokens": 40, "temperature": 0, "response_format": {"type": "json_schema",
                                                                  "json_schema": {"name": "p", "schema": PERSON}}}


async def _send_all(url: str) -> tuple[list[tuple[str, int, str]], list[tuple[int, str]]]:
    entries = corpus()
    gate = asyncio.Semaphore(48)

    async def one(client: httpx.AsyncClient, name: str, body: dict[str, Any] | str) -> tuple[str, int, str]:
        async with gate:
            status, text = await _post(client, url, body)
            return name, status, text

    async with httpx.AsyncClient(timeout=300) as client:
        hostile = [one(client, name, {"model": MODEL, "messages": [{"role": "user", "content": "Answer."}],
                                      "max_tokens": 8, "temperature": 0, "stream": i % 3 == 0, "structured_outputs": so})
                   for i, (name, so) in enumerate(entries)]
        for depth in (600, 5000):  # the schema as a nested object of the body itself, deeper than json parsers go
            schema = '{"type":"object","properties":{"a":' * depth + '{"type":"string"}' + "}}" * depth
            text = '{"model":"%s","messages":[{"role":"user","content":"x"}],"max_tokens":4,"structured_outputs":{"json":%s}}'
            hostile.append(one(client, f"deep-body-{depth}", text % (MODEL, schema)))
        normal = [_post(client, url, _normal(i)) for i in range(8)]
        results = await asyncio.gather(*hostile, *normal)
    return list(results[: len(hostile)]), list(results[len(hostile) :])  # type: ignore[arg-type]


@demo
def test_hostile_corpus_gets_4xx_or_200_never_5xx(url: str) -> None:
    hostile, normal = asyncio.run(_send_all(url))
    assert len(hostile) >= 200
    bad = [(name, status, text[:200]) for name, status, text in hostile if status >= 500 or status < 200]
    assert not bad, bad
    for status, text in normal:
        assert status == 200, text[:300]
        jsonschema.validate(json.loads(json.loads(text)["choices"][0]["message"]["content"]), PERSON)
    health = httpx.get(f"{url}/health")
    assert health.status_code == 200 and health.json()["engine_restarts"] == 0, health.text
    counts = Counter(status for _, status, _ in hostile)
    events = sum(1 for _, status, text in hostile if status == 200 and '"error"' in text)
    print(f"\nserver, hostile corpus: {len(hostile)} requests -> {dict(counts)}; {events} 200-streams ended with an "
          f"error event; 0 5xx; 8/8 normal requests valid; engine restarts 0")
