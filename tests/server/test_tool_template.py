"""`tandem serve` on a model whose chat template knows tools (Qwen 2.5's, tests/tools/tiny_model.py: a tiny random
Qwen2 with `<tool_call>` as one token): the server reads the format off the template, passes `tools=` to it, and
streams calls whose trigger is a single token. Random weights: bounded schemas, and logit_bias where a test needs the
model to start a call on its own."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2 as httpx
import jsonschema
import openai
import pytest

from tests.server.launch import running_server
from tests.server.test_server import demo
from tests.tools.test_native_template import ASK, SCHEMAS, TOOLS
from tests.tools.tiny_model import TOOL_TOKENS


class Srv:
    def __init__(self, url: str, model_dir: Path) -> None:
        self.url, self.model_dir = url, model_dir
        self.model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        self.client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120.0)

    def token_id(self, text: str) -> int:
        from transformers import AutoTokenizer

        return int(AutoTokenizer.from_pretrained(str(self.model_dir), local_files_only=True).convert_tokens_to_ids(text))


@pytest.fixture(scope="module")
def srv(tool_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Srv]:
    log_path = tmp_path_factory.mktemp("tool_template") / "server.log"
    args = ["--dtype", "float32", "--max-model-len", "2048", "--max-num-seqs", "8", "--num-kv-blocks", "256",
            "--log-level", "warning"]
    with running_server(log_path, str(tool_model_dir), args, os.environ) as (_, url):
        yield Srv(url, tool_model_dir)


def _valid(name: str, arguments: str) -> None:
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


@demo
def test_streamed_call_with_the_template_format(srv: Srv) -> None:
    kw: dict[str, Any] = {"model": srv.model, "messages": ASK, "tools": TOOLS, "tool_choice": "required",
                          "parallel_tool_calls": False, "temperature": 0, "max_tokens": 120}
    whole = srv.client.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "tool_calls" and len(whole.message.tool_calls or []) == 1
    call = whole.message.tool_calls[0]  # type: ignore[index]
    _valid(call.function.name, call.function.arguments)
    first, args, finish = None, "", None
    for chunk in srv.client.chat.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            finish = ch.finish_reason or finish
            for d in ch.delta.tool_calls or ():
                if d.id:
                    assert first is None, "id and name come once"
                    first = (d.function.name, d.type)
                args += d.function.arguments or ""
            assert not ch.delta.content, "no text around a forced call"
    assert first == (call.function.name, "function") and args == call.function.arguments and finish == "tool_calls"


@demo
def test_auto_call_started_by_the_trigger_token(srv: Srv) -> None:
    trigger = srv.token_id(TOOL_TOKENS[0])
    r = srv.client.chat.completions.create(model=srv.model, messages=ASK, tools=TOOLS, tool_choice="auto",
                                           parallel_tool_calls=False, temperature=0, max_tokens=120,
                                           logit_bias={str(trigger): 100})
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and len(ch.message.tool_calls or []) == 1, ch.message
    call = ch.message.tool_calls[0]  # type: ignore[index]
    _valid(call.function.name, call.function.arguments)
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": "rain on Tuesday"}]
    again = srv.client.chat.completions.create(model=srv.model, messages=history, tools=TOOLS, tool_choice="none",
                                               temperature=0, max_tokens=5)
    assert again.usage is not None and r.usage is not None and again.usage.prompt_tokens > r.usage.prompt_tokens + 20



@demo
def test_responses_function_call_with_the_template_format(srv: Srv) -> None:
    tools = [{"type": "function", "name": t["function"]["name"], "parameters": t["function"]["parameters"]} for t in TOOLS]
    r = srv.client.responses.create(model=srv.model, input=ASK[0]["content"], tools=tools,  # type: ignore[arg-type]
                                    tool_choice={"type": "function", "name": "set_lamp"}, max_output_tokens=120, temperature=0)
    calls = [o for o in r.output if o.type == "function_call"]
    assert r.status == "completed" and len(calls) == 1 and calls[0].name == "set_lamp"
    _valid("set_lamp", calls[0].arguments)


@demo
def test_bench_tool_compare_pairs_tool_calls_with_text_of_equal_length(srv: Srv) -> None:
    """`tandem bench serve --tool-compare` end to end (a few requests): the text run repeats each tool request's
    length, so the two throughputs compare like with like."""
    import argparse
    import asyncio

    from tandem.bench.serve import add_arguments, run_tool_compare

    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--num-requests", "6", "--concurrency", "6", "--max-tokens", "48", "--model", srv.model])
    report = asyncio.run(run_tool_compare(args, srv.url, None))
    tool, text = report["tool_calls"], report["text_same_lengths"]
    assert tool["completed"] == 6 and tool["errors"] == 0 and text["completed"] == 6 and text["errors"] == 0
    assert tool["output_tokens"] == text["output_tokens"] > 0
    assert report["tool_vs_text_throughput"] > 0
