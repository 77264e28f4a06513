"""`tandem bench tools`: tool calls over the function corpus through the engine, every call validated.

Each definition of the corpus (tests/data/functions/*.json: a user prompt and one OpenAI function definition) makes
up to three requests, rendered and constrained exactly as the server does it (tandem.tools.ToolPlan: the template's
`tools` argument or the fallback prompt, and the structural-tag grammar):

    named     tool_choice names the definition's function, offered alone
    required  tool_choice "required" over a distinct three-function set (the definition's and two others)
    auto      tool_choice "auto" over the same set: the model decides between text and a call

Every answer is parsed with the format's ToolParser and each call's arguments are validated with `jsonschema`
against the function's schema as the client wrote it (not the closed copy the grammar uses). Outcomes:

    valid     named / required: exactly one call (parallel_tool_calls off), of an offered function, that validates;
              auto: every call made validates
    text      auto only: the model answered in text, no call
    length    cut by max_tokens inside a call: it cannot be complete, so it is counted apart and never as valid
    invalid   anything else (a call that does not parse or validate, a wrong name, text where a call was forced)
    error     the engine ended the request with an error

Requests run `--concurrency` at a time with continuous top-up; `--backend` runs the whole corpus once per backend
on one engine (the grammar cache is per backend). Exit status 1 when any call is invalid or errored.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema

from tandem.bench.common import drive, machine_line, print_table
from tandem.engine.engine import LLMEngine
from tandem.engine_args import add_engine_args, engine_kwargs
from tandem.params import SamplingParams
from tandem.request import RequestOutput
from tandem.tools import ToolPlan, choose_parser

DEFAULT_TOOLS = Path(__file__).resolve().parents[2] / "tests" / "data" / "functions"
MODES = ("named", "required", "auto")
OUTCOMES = ("valid", "text", "length", "invalid", "error")


def load_functions(tools_dir: Path = DEFAULT_TOOLS) -> list[dict[str, Any]]:
    """The function corpus: [{"prompt", "function"}], every *.json file of `tools_dir` in name order."""
    out: list[dict[str, Any]] = []
    for path in sorted(Path(tools_dir).glob("*.json")):
        out.extend(json.loads(path.read_text()))
    return out


def as_tool(entry: dict[str, Any]) -> dict[str, Any]:
    """A corpus entry's function as an OpenAI tool."""
    return {"type": "function", "function": entry["function"]}


def tool_set(functions: Sequence[dict[str, Any]], i: int, size: int = 3, seed: int = 0) -> list[dict[str, Any]]:
    """Entry i's tool and size - 1 others drawn from the corpus, shuffled: a distinct tool set per request
    (deterministic in i and seed)."""
    rng = random.Random(seed * 100003 + i)
    chosen = [i, *rng.sample([j for j in range(len(functions)) if j != i], size - 1)]
    rng.shuffle(chosen)
    return [as_tool(functions[j]) for j in chosen]


@dataclass
class CorpusRequest:
    """One request of the run: its mode, corpus index, plan and rendered prompt."""

    mode: str
    name: str  # the corpus entry's function
    plan: ToolPlan
    prompt: list[int]


@dataclass
class Tally:
    """Outcomes of one mode on one backend, with the names behind the ones that are not valid."""

    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OUTCOMES, 0))
    calls: int = 0  # calls returned (auto: the requests that made one)
    notes: list[str] = field(default_factory=list)

    def add(self, outcome: str, note: str | None = None) -> None:
        self.counts[outcome] += 1
        if note is not None and outcome not in ("valid", "text"):
            self.notes.append(note)


def corpus_requests(engine: LLMEngine, functions: Sequence[dict[str, Any]], modes: Sequence[str], seed: int = 0,
                    every: Mapping[str, int] | None = None) -> list[CorpusRequest]:
    """The requests of `modes` for every definition (every[mode]-th one only, where given), rendered through the
    engine's chat template (or the fallback)."""
    tok = engine.tokenizer
    parser, native = choose_parser("auto", tok.hf.chat_template, tok.chat_format.tool_call_parser)
    out = []
    for i, entry in enumerate(functions):
        name = entry["function"]["name"]
        choices = {"named": ([as_tool(entry)], {"type": "function", "function": {"name": name}}),
                   "required": (tool_set(functions, i, seed=seed), "required"),
                   "auto": (tool_set(functions, i, seed=seed), "auto")}
        for mode in modes:
            if i % (every or {}).get(mode, 1):
                continue
            tools, choice = choices[mode]
            plan = ToolPlan.build(tools, choice, False, parser, native)
            assert plan is not None
            messages = plan.conversation([{"role": "user", "content": entry["prompt"]}])
            prompt = tok.apply_chat_template(messages, add_generation_prompt=True, **plan.template_kwargs())
            out.append(CorpusRequest(mode, name, plan, prompt))
    return out


def judge(req: CorpusRequest, out: RequestOutput, schemas: dict[str, Any]) -> tuple[str, str | None]:
    """(outcome, a note naming what went wrong) of one finished request; see the module doc."""
    c = out.outputs[0]
    finish, text = c.finish_reason or "", c.text
    where = f"{req.mode}:{req.name}"
    if out.error or finish == "error":
        return "error", f"{where}: {out.error}"
    parsed = req.plan.parser.parse(text)
    if finish == "length":
        return ("text", None) if req.mode == "auto" and req.plan.parser.trigger not in text else ("length", where)
    if req.mode == "auto" and not parsed.tool_calls:
        return ("text", None) if req.plan.parser.trigger not in text else ("invalid", f"{where}: {text[:200]!r}")
    if req.mode != "auto" and (len(parsed.tool_calls) != 1 or parsed.content):
        return "invalid", f"{where}: {len(parsed.tool_calls)} calls, {text[:200]!r}"
    offered = {f.name for f in req.plan.tools}
    for call in parsed.tool_calls:
        if call.name not in offered:
            return "invalid", f"{where}: called {call.name!r}"
        try:
            jsonschema.validate(json.loads(call.arguments), schemas[call.name])
        except (ValueError, jsonschema.ValidationError) as e:
            return "invalid", f"{where}: {call.name}({call.arguments[:200]}): {str(e).splitlines()[0]}"
    return "valid", None


def run_corpus(engine: LLMEngine, functions: Sequence[dict[str, Any]], backend: str, modes: Sequence[str] = MODES,
               max_tokens: int = 160, concurrency: int = 32, seed: int = 0, every: Mapping[str, int] | None = None,
               sampling: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The requests of `modes` over the corpus on `backend` (see corpus_requests); {mode: Tally} plus the run's figures.
    Greedy unless `sampling` (SamplingParams fields) says otherwise; a sampled request i gets seed `seed + i`."""
    reqs = corpus_requests(engine, functions, modes, seed, every)
    schemas = {e["function"]["name"]: e["function"].get("parameters") or {} for e in functions}
    kw: dict[str, Any] = {"temperature": 0.0, **(sampling or {})}
    params = [SamplingParams(max_tokens=max_tokens, structured_outputs=r.plan.structured_outputs(backend),
                             **{**kw, **({"seed": seed + i} if kw["temperature"] > 0 else {})})
              for i, r in enumerate(reqs)]
    outs: dict[int, RequestOutput] = {}
    t0 = time.perf_counter()
    res = drive(engine, [r.prompt for r in reqs], params, concurrency, f"tools-{backend}",
                on_output=lambda o: outs.__setitem__(int(o.request_id.rsplit("-", 1)[1]), o))
    wall = time.perf_counter() - t0
    tallies = {m: Tally() for m in modes}
    for i, req in enumerate(reqs):
        outcome, note = judge(req, outs[i], schemas)
        tally = tallies[req.mode]
        tally.add(outcome, note)
        tally.calls += bool(req.plan.parser.parse(outs[i].outputs[0].text).tool_calls)
    return {"backend": backend, "tallies": tallies, "requests": len(reqs), "output_tokens": res.output_tokens,
            "wall_s": wall, "prompt_tokens": sum(len(r.prompt) for r in reqs)}


def report_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    """One table row per mode."""
    rows = []
    for mode, t in report["tallies"].items():
        n = sum(t.counts.values())
        made = t.calls if mode == "auto" else n - t.counts["length"]
        rows.append({"backend": report["backend"], "mode": mode, "requests": n, **t.counts,
                     "valid share of calls": f"{t.counts['valid']}/{made}"})
    return rows


def add_parser(bsub: Any) -> None:
    p = bsub.add_parser("tools", help="tool calls over the function corpus through the engine, each one validated")
    p.add_argument("model", nargs="?", default=None)
    p.add_argument("--backend", default="xgrammar,llguidance", help="comma-separated: xgrammar, llguidance, auto")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated: named, required, auto")
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--limit", type=int, default=None, help="only the first N definitions")
    p.add_argument("--tools-dir", default=str(DEFAULT_TOOLS), help="function corpus (*.json of {prompt, function})")
    p.add_argument("--json", default=None, help="write the report here")
    add_engine_args(p)
    p.set_defaults(func=run, dtype="bfloat16", max_num_seqs=32)


def run(args: argparse.Namespace) -> int:
    from tandem.engine.llm import build_engine

    functions = load_functions(Path(args.tools_dir))[: args.limit]
    modes = [m for m in args.modes.split(",") if m]
    if not functions or any(m not in MODES for m in modes):
        raise SystemExit(f"need function definitions in {args.tools_dir} and modes among {MODES}")
    kw = engine_kwargs(args)
    kw["max_model_len"] = kw["max_model_len"] or 4096
    engine = build_engine(args.model, **kw)
    print(f"machine: {machine_line()}; {len(functions)} definitions; modes {modes}; max_tokens {args.max_tokens}")
    rows, notes, bad = [], {}, 0
    for backend in args.backend.split(","):
        report = run_corpus(engine, functions, backend, modes, args.max_tokens, args.concurrency, args.seed)
        rows += report_rows(report)
        print(f"{backend}: {report['requests']} requests, {report['output_tokens']} output tokens in {report['wall_s']:.1f} s")
        for mode, t in report["tallies"].items():
            notes[f"{backend}/{mode}"] = t.notes
            bad += t.counts["invalid"] + t.counts["error"]
            for note in t.notes:
                print(f"  {backend}/{mode}: {note}")
    print()
    print_table(rows, title="tandem bench tools (valid: parses, names an offered function, arguments validate)")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine_line(), "rows": rows, "notes": notes}, indent=2))
    engine.shutdown()
    return 1 if bad else 0
