"""Recorded greedy runs of the demo model, for `tandem bench simulated --logits replay`.

A simulated accelerator's random logits almost never accept a draft, so they measure what speculation costs the
host, never what it gains. A recording is the demo model's own greedy output on real prompts (MT-Bench, HumanEval,
GSM8K, a copy-heavy editing task) or under real schemas (one distinct JSON schema per request, the grammar
applied as in serving); replayed (`runner/simulated.py: ReplayLogits`), the simulated target emits exactly those
tokens, so n-gram, suffix and draft-model drafts are accepted exactly as that model would accept them, in its own
vocabulary. Recorded once per (workload, count, length) with the demo model on this machine's CPU, cached under
`$TANDEM_HOME/replay/`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tandem.bench.common import drive, load_prompts
from tandem.bench.schemas import describe, distinct_schemas
from tandem.engine.engine import LLMEngine
from tandem.params import RequestOutputKind, SamplingParams, StructuredOutputsParams

TEXT_WORKLOADS = ("mixed", "mt_bench", "humaneval", "gsm8k", "copy")
GUIDED_WORKLOAD = "schemas"
RECORDING_VERSION = 1  # bump when what a recording holds changes


@dataclass
class Recording:
    """Prompts (token ids, chat template applied) and the demo model's greedy outputs, one schema each when guided."""

    workload: str
    prompts: list[list[int]]
    outputs: list[list[int]]
    schemas: list[dict[str, Any] | None] = field(default_factory=list)
    model: str = ""

    def __len__(self) -> int:
        return len(self.prompts)

    def sequence(self, i: int) -> list[int]:
        """Prompt and output of request i: what the replayed target emits after the prompt."""
        return self.prompts[i] + self.outputs[i]


def recording_path(workload: str, n: int, max_tokens: int) -> Path:
    from tandem.paths import tandem_home

    return tandem_home() / "replay" / f"v{RECORDING_VERSION}-{workload}-{n}-{max_tokens}.json"


def load_or_record(workload: str, n: int, max_tokens: int) -> Recording:
    """The recording of `n` requests of `workload` with up to `max_tokens` output tokens (recorded now if absent)."""
    if workload not in (*TEXT_WORKLOADS, GUIDED_WORKLOAD):
        raise ValueError(f"unknown workload {workload!r}; known: {', '.join((*TEXT_WORKLOADS, GUIDED_WORKLOAD))}")
    path = recording_path(workload, n, max_tokens)
    if path.is_file():
        return Recording(**json.loads(path.read_text()))
    rec = record(workload, n, max_tokens)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(rec)))
    tmp.rename(path)
    return rec


def record(workload: str, n: int, max_tokens: int) -> Recording:
    """Run the demo model (bf16, this CPU) greedily over the workload's prompts; 64 requests at a time."""
    from tandem.engine.llm import build_engine

    print(f"recording {n} greedy runs of the demo model ({workload}, up to {max_tokens} tokens) once; "
          f"cached in {recording_path(workload, n, max_tokens)}", flush=True)
    engine = build_engine(None, dtype="bfloat16", max_num_seqs=64, max_model_len=4096, progress=False)
    try:
        prompts, schemas = workload_prompts(engine, workload, n)
        params = [SamplingParams(temperature=0.0, max_tokens=max_tokens, output_kind=RequestOutputKind.FINAL_ONLY,
                                 structured_outputs=StructuredOutputsParams(json=s) if s is not None else None)
                  for s in schemas]
        outputs: dict[int, list[int]] = {}

        def keep(out: Any) -> None:
            outputs[int(out.request_id.rsplit("-", 1)[1])] = list(out.outputs[0].token_ids)

        drive(engine, prompts, params, 64, "rec", on_output=keep)
    finally:
        engine.shutdown()
    return Recording(workload, prompts, [outputs.get(i, []) for i in range(n)], schemas, model="demo")


def workload_prompts(engine: LLMEngine, workload: str, n: int) -> tuple[list[list[int]], list[dict[str, Any] | None]]:
    """`n` distinct chat prompts of the workload as token ids, and the schema of each (None for text)."""
    from tandem.bench.spec import copy_prompts

    tok = engine.tokenizer
    if workload == GUIDED_WORKLOAD:
        schemas: list[dict[str, Any] | None] = list(distinct_schemas(n, seed=n))
        return [tok.apply_chat_template([{"role": "user", "content": describe(s)}]) for s in schemas if s], schemas
    if workload == "copy":
        return copy_prompts(engine, n), [None] * n
    texts = mixed_prompts(n) if workload == "mixed" else load_prompts(workload, n)
    if len(texts) < n:
        raise ValueError(f"{workload} has {len(texts)} prompts, fewer than {n}")
    return [tok.apply_chat_template([{"role": "user", "content": t}]) for t in texts[:n]], [None] * n


def mixed_prompts(n: int) -> list[str]:
    """Every MT-Bench and HumanEval prompt and as many GSM8K ones as needed, interleaved: `n` distinct prompts."""
    sets = [load_prompts("mt_bench", n), load_prompts("humaneval", n), load_prompts("gsm8k", n)]
    out: list[str] = []
    i = 0
    while len(out) < n and any(i < len(s) for s in sets):
        out.extend(s[i] for s in sets if i < len(s))
        i += 1
    return out[:n]
