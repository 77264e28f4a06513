"""What the demo's sections share: headings, streaming to the terminal, a speed row for the closing table."""

from __future__ import annotations

import sys
import time
from typing import Any

from tandem.bench.common import RunResult
from tandem.engine.engine import LLMEngine
from tandem.params import SamplingParams
from tandem.request import RequestOutput

Rows = list[dict[str, object]]


def section(title: str) -> None:
    """Print a bold section heading."""
    print(f"\n\033[1m== {title} ==\033[0m", flush=True)


def speed(result: RunResult) -> dict[str, object]:
    """A closing-table row's figures for one measured run."""
    return {"tok/s": round(result.tok_per_s, 1), "tokens": result.output_tokens, "seconds": round(result.wall_s, 2)}


def stream_to_terminal(engine: LLMEngine, request_id: str, prompt: str | list[int], params: SamplingParams) -> RequestOutput | None:
    """Run one request on `engine`, writing its text to stdout as it grows; returns the final RequestOutput."""
    engine.add_request(request_id, prompt, params)
    shown, final = 0, None
    while engine.has_unfinished_requests():
        for out in engine.step():
            text = out.outputs[0].text
            sys.stdout.write(text[shown:])
            sys.stdout.flush()
            shown = len(text)
            if out.finished:
                final = out
    return final


def stream(engine: LLMEngine, prompt: str | list[int], params: SamplingParams) -> str:
    """Generate one request, printing text as it is produced; returns the text."""
    final = stream_to_terminal(engine, f"demo-{time.monotonic_ns()}", prompt, params)
    print()
    return final.outputs[0].text if final is not None else ""


def chat_prompt(engine: LLMEngine, text: str) -> Any:
    """`text` as one user turn in the model's chat template (token ids)."""
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": text}])
