"""Whole models on the same GGUF file: tandem's greedy tokens against llama.cpp's (llama-cpp-python, in its own
process), the demo model's own Q4_1 file among them. Both keep the weights in the file's blocks and quantize
activations to int8 blocks the same way (tandem with float32 activations, llama.cpp with a float32 KV cache), so
what differs is summation order, and the int8 rounding of activations turns that into logit noise: ~0.1 mean
absolute difference on logits spread ~3-4 (std), measured, the same distance that separates tandem's own quantized
and dequantized runs of the file. So:
  * greedy tokens (decode path) are identical up to the first difference, and there llama.cpp's own logits are a
    near tie (< NEAR_TIE); after it the continuations differ and are not compared;
  * over llama.cpp's sequences (teacher forcing, tandem's prefill path) the logits agree within that noise, and the
    argmax agrees wherever llama.cpp's top two are further apart than NEAR_TIE.

Needs a llama.cpp peer that runs here (`make llama-cpp` builds one and smoke-tests it, tandem/bench/llama_peer.py);
skipped, naming why, without one. Every failure message names the build compared against.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from tandem.config import ConfigError

pytestmark = pytest.mark.demo


@pytest.fixture(scope="module", autouse=True)
def peer() -> str:
    """The llama.cpp build these tests compare against (its line: version, build, ISA paths); a skip naming why
    when none runs here."""
    from tandem.bench.llama_peer import peer_status

    status = peer_status()
    if not status.usable:
        pytest.skip(status.describe())
    return status.describe()

PROMPTS = ["The capital of France is", "def fibonacci(n):\n", "Once upon a time, there was a little"]
NEW_TOKENS = 32
NEAR_TIE = 0.5  # logits: 5x the measured mean difference; the demo model's logits spread ~3-4 (std)
MEAN_LOGIT_DIFF = 0.3


def _demo_gguf() -> Path:
    from tandem.models.demo import find_demo_gguf

    try:
        return find_demo_gguf()
    except ConfigError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def demo_tokenizer() -> Path:
    from tandem.models.gguf_loader import gguf_tokenizer_folder

    return gguf_tokenizer_folder(_demo_gguf())


def tandem_runs(path: Path, tokenizer: Path, prompts: list[list[int]], forced: list[list[int]]) -> tuple[list[list[int]], list[np.ndarray]]:
    """tandem's greedy continuations of `prompts`, and its logits [len - 1, V] over each `forced` sequence."""
    import torch

    from tandem import LLM, SamplingParams
    from tandem.core.plan import ScheduledRequest, StepPlan

    llm = LLM(str(path), tokenizer=str(tokenizer), dtype="float32", max_model_len=256, max_num_seqs=4, progress=False)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True), use_tqdm=False)
        runner = llm.llm_engine.runner  # idle now: its blocks are free to use directly
        logits = []
        for seq in forced:
            plan = StepPlan(0, [ScheduledRequest("forced", seq, 0, list(range(16)), all_logits=True)])
            logits.append(runner.execute(plan).to(torch.float32).numpy())
        return [list(o.outputs[0].token_ids) for o in outs], logits
    finally:
        llm.shutdown()


def assert_matches_llama_cpp(path: Path, tokenizer: Path, peer: str) -> int:
    """Both checks of the module doc against the build `peer` describes; returns the number of greedy tokens that
    matched."""
    from tandem.bench.peers import llama_cpp_greedy
    from tandem.tokenizer import Tokenizer

    tok = Tokenizer.from_path(tokenizer)
    prompts = [tok.encode(t) for t in PROMPTS]
    theirs = llama_cpp_greedy(path, prompts, NEW_TOKENS)
    ours, forced = tandem_runs(path, tokenizer, prompts, [p + t[:-1] for p, (t, _) in zip(prompts, theirs)])
    matched = 0
    for p, mine, (tokens, logits), tf in zip(prompts, ours, theirs, forced):
        first = next((i for i, (a, b) in enumerate(zip(mine, tokens)) if a != b), len(tokens))
        matched += first
        if first < len(tokens):
            gap = float(logits[first][tokens[first]] - logits[first][mine[first]])
            assert gap < NEAR_TIE, f"{path.name}: token {first} differs ({mine[first]} vs llama.cpp {tokens[first]}), " \
                                   f"llama.cpp's logits {gap:.3f} apart ({peer})"
        ours_tf = tf[len(p) - 1 :]  # rows predicting llama.cpp's tokens
        diff = np.abs((ours_tf - ours_tf.mean(1, keepdims=True)) - (logits - logits.mean(1, keepdims=True)))
        assert diff.mean() < MEAN_LOGIT_DIFF, f"{path.name}: mean logit difference {diff.mean():.3f} ({peer})"
        top2 = np.sort(logits, axis=1)[:, -2:]
        clear = top2[:, 1] - top2[:, 0] > NEAR_TIE
        assert np.array_equal(ours_tf.argmax(1)[clear], np.asarray(tokens)[clear]), f"{path.name}: argmax differs ({peer})"
    return matched


def test_demo_q4_1_file_matches_llama_cpp(demo_tokenizer: Path, peer: str) -> None:
    """The demo model's own SmolLM2-135M-Instruct.Q4_1.gguf (Q4_1 layers, Q8_0 tied embedding)."""
    matched = assert_matches_llama_cpp(_demo_gguf(), demo_tokenizer, peer)
    assert matched >= len(PROMPTS) * NEW_TOKENS // 2


@pytest.mark.slow
@pytest.mark.parametrize("file_type", ["Q8_0", "Q4_0", "Q4_K_M"])
def test_llama_cpp_quantized_demo_matches_llama_cpp(file_type: str, demo_tokenizer: Path, peer: str) -> None:
    """The demo model quantized by llama.cpp itself: Q8_0, Q4_0, and Q4_K_M (Q4_K / Q6_K where rows are multiples of
    256, its Q5_0 / Q8_0 fallbacks elsewhere)."""
    from tandem.bench.peers import llama_cpp_quantize, write_bf16_gguf
    from tandem.paths import tandem_home

    folder = tandem_home() / "models"
    folder.mkdir(parents=True, exist_ok=True)
    bf16 = write_bf16_gguf(_demo_gguf(), folder / "SmolLM2-135M-Instruct.bf16.gguf")
    path = llama_cpp_quantize(bf16, folder / f"SmolLM2-135M-Instruct.{file_type}.gguf", file_type)
    assert assert_matches_llama_cpp(path, demo_tokenizer, peer) >= len(PROMPTS) * NEW_TOKENS // 2


@pytest.mark.parametrize(("family", "file_type"), [(f, t) for f in ("qwen3moe", "mixtral") for t in ("Q8_0", "Q4_K_M")]
                         + [("qwen3moe", "Q5_K_M"), ("gpt-oss", "MXFP4_MOE"), ("gpt-oss", "MXFP4")])
def test_mixture_of_experts_matches_llama_cpp(family: str, file_type: str, demo_tokenizer: Path, peer: str,
                                              tmp_path_factory: pytest.TempPathFactory) -> None:
    """A small Qwen3-MoE (`qwen3moe`), Mixtral (`llama` with experts) and gpt-oss (`gpt-oss`: MXFP4 experts, the rest
    Q8_0 or BF16; sinks, a sliding window, YaRN), written by tandem's GGUF writer with stacked expert tensors: batch 1
    greedy tokens and teacher-forced logits against llama.cpp's, on the same file; the three prompts route to
    different experts. gpt-oss's file holds no YaRN here: llama.cpp floors / ceils YaRN's ramp bounds whatever the
    model says and gpt-oss's config says not to (`truncate: false`, which tandem follows, as transformers does:
    tests/models/test_moe_gguf.py); with truncation forced both ways the YaRN file matched too (96 of 96 tokens)."""
    from tests.models.test_moe_gguf import TINY_SHAPES, write_tiny_moe

    shape = replace(TINY_SHAPES[family], yarn_factor=0.0, yarn_original=0)
    path = write_tiny_moe(tmp_path_factory.mktemp(f"moe-{family}-{file_type}"), family, file_type, shape)
    assert assert_matches_llama_cpp(path, demo_tokenizer, peer) >= len(PROMPTS) * NEW_TOKENS // 2


def test_batched_peer_is_llama_cpp_one_request_at_a_time(demo_tokenizer: Path, peer: str) -> None:
    """The benchmarks' `llama-server -np N` stand-in (one context, every sequence's token in one llama_decode) gives
    the greedy tokens llama.cpp gives each prompt alone, on the demo model (llama.cpp's batched and single sums
    differ only at near ties)."""
    from tandem.bench.peers import llama_cpp_batched, llama_cpp_greedy
    from tandem.tokenizer import Tokenizer

    tok = Tokenizer.from_path(demo_tokenizer)
    prompts = [tok.encode(t) for t in PROMPTS]
    res, batched = llama_cpp_batched(_demo_gguf(), prompts, 8, 0)
    alone = llama_cpp_greedy(_demo_gguf(), prompts, 8)
    assert res.output_tokens == 24 and res.wall_s > 0
    assert [b[:4] for b in batched] == [list(a[:4]) for a, _ in alone], peer
