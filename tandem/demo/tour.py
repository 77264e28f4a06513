"""`tandem demo`: build the demo model's engine once, run each section, print the measured figures."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

from tandem.bench.common import print_table
from tandem.demo.common import Rows, section
from tandem.demo.generation import tour_generation
from tandem.demo.reasoning import tour_reasoning
from tandem.demo.speculative import tour_speculative
from tandem.demo.structured import tour_structured
from tandem.demo.tools import tour_tools
from tandem.engine.engine import LLMEngine
from tandem.engine.llm import build_engine

Tour = Callable[[LLMEngine, Rows, bool], None]
TOURS: list[Tour] = [tour_generation, tour_structured, tour_reasoning, tour_tools, tour_speculative]


def run_demo(args: argparse.Namespace) -> int:
    from tandem.models.demo import demo_model_choice
    from tandem.runner.tensor_thread import on_tensor_thread

    path, why = on_tensor_thread(demo_model_choice)  # a conversion, when one is needed, is tensor work
    print(f"tandem demo: SmolLM2-135M-Instruct (the built-in demo model), CPU, {why}", flush=True)
    t0 = time.perf_counter()
    engine = build_engine(str(path), dtype="bfloat16", max_model_len=2048, max_num_seqs=32, kv_cache_memory=256 * 2**20)
    print(f"loaded in {time.perf_counter() - t0:.1f} s")
    rows: Rows = []
    for tour in TOURS:
        tour(engine, rows, bool(getattr(args, "quick", False)))
    section("Measured on this machine")
    print_table(rows)
    return 0
