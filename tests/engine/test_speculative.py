"""Speculative decoding is lossless: greedy outputs identical, sampled distributions unchanged (and the test
notices a broken rejection rule)."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tandem.engine.engine import LLMEngine
from tandem.params import SamplingParams
from tandem.spec_decode.proposer import Drafts, Proposer
from tandem.spec_decode.registry import register_proposer

from .test_engine import run_all

GREEDY = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)


def _story_prompts(engine: LLMEngine, n: int) -> dict[str, list[int]]:
    texts = [
        "Once upon a time, there was a little girl named Lily. Once upon a time, there was a little",
        "Tom had a big red ball. Tom had a big red ball. Tom had a",
        "The cat sat on the mat. The dog sat on the mat. The bird",
        "One day, Lily went to the park. She saw a big tree. One day, Lily went to the",
    ]
    tok = engine.tokenizer
    return {f"p{i}": tok.encode(texts[i % len(texts)] + " " * (i // len(texts))) for i in range(n)}


@pytest.mark.parametrize("method", ["ngram", "suffix"])
@pytest.mark.parametrize("batch", [1, 6])
def test_greedy_lossless(stories_engine_factory, method: str, batch: int) -> None:  # type: ignore[no-untyped-def]
    base = stories_engine_factory()
    spec = stories_engine_factory(speculative_config={"method": method, "num_speculative_tokens": 4, "adaptive": False})
    prompts = _story_prompts(base, batch)
    want = run_all(base, prompts, GREEDY)
    got = run_all(spec, prompts, GREEDY)
    for rid in prompts:
        assert got[rid].outputs[0].token_ids == want[rid].outputs[0].token_ids
    stats = spec.get_stats()
    assert stats["spec_num_drafted"] > 0 and stats["spec_num_accepted"] > 0


def test_greedy_lossless_with_preemption_and_prefix_cache(stories_engine_factory) -> None:  # type: ignore[no-untyped-def]
    base = stories_engine_factory()
    spec = stories_engine_factory(num_kv_blocks=14, block_size=8, max_num_batched_tokens=48,
                                  speculative_config={"method": "ngram", "num_speculative_tokens": 5})
    prompts = _story_prompts(base, 8)
    want = run_all(base, prompts, GREEDY)
    got = run_all(spec, prompts, GREEDY)
    assert spec.stats.num_preemptions > 0
    assert spec.block_manager.stats.hits > 0
    for rid in prompts:
        assert got[rid].outputs[0].token_ids == want[rid].outputs[0].token_ids
    assert spec.block_manager.num_free_blocks == 14


def test_draft_model_lossless_in_process(stories_engine_factory, stories_dir: Path) -> None:  # type: ignore[no-untyped-def]
    """The target as its own draft (in-process): every greedy draft is right, outputs identical."""
    base = stories_engine_factory()
    spec = stories_engine_factory(speculative_config={
        "method": "draft_model", "model": str(stories_dir), "num_speculative_tokens": 3, "draft_dtype": "float32",
        "draft_in_process": True, "adaptive": False})
    prompts = _story_prompts(base, 3)
    want = run_all(base, prompts, GREEDY)
    got = run_all(spec, prompts, GREEDY)
    for rid in prompts:
        assert got[rid].outputs[0].token_ids == want[rid].outputs[0].token_ids
    stats = spec.get_stats()
    assert stats["spec_acceptance_rate"] > 0.95
    assert stats["spec_lookahead_hits"] > 0  # drafts for step t + 1 were made while step t was verified


def test_sampling_options_behave_as_without_speculation(stories_engine_factory) -> None:  # type: ignore[no-untyped-def]
    """Stop strings, max_tokens and logprobs are the same with and without drafts (greedy, so comparable)."""
    base = stories_engine_factory()
    spec = stories_engine_factory(speculative_config={"method": "ngram", "num_speculative_tokens": 4, "adaptive": False})
    p = SamplingParams(temperature=0.0, max_tokens=30, stop=["park"], logprobs=2, repetition_penalty=1.1)
    prompts = _story_prompts(base, 4)
    want, got = run_all(base, prompts, p), run_all(spec, prompts, p)
    for rid in prompts:
        a, b = want[rid].outputs[0], got[rid].outputs[0]
        assert (a.text, a.token_ids, a.finish_reason, a.stop_reason) == (b.text, b.token_ids, b.finish_reason, b.stop_reason)
        assert a.logprobs is not None and b.logprobs is not None and len(a.logprobs) == len(b.logprobs)
        for x, y in zip(a.logprobs, b.logprobs):
            assert x.keys() == y.keys()
            for t in x:
                assert abs(x[t].logprob - y[t].logprob) < 1e-4


# ---------------------------------------------------------------------------------------------------------------
# Sampled distributions on a tiny-vocabulary model
# ---------------------------------------------------------------------------------------------------------------
V = 6


class _CyclingProposer(Proposer):
    """Test driver: proposes t+1, t+2, ... (mod V) — a fixed deterministic guess that is often wrong."""

    name = "cycle"

    def propose(self, batch):  # type: ignore[no-untyped-def]
        return {r.request_id: Drafts([(r.token_ids[-1] + 1 + j) % V for j in range(r.max_drafts)]) for r in batch}

    def on_verified(self, request_id, accepted, num_drafted):  # type: ignore[no-untyped-def]
        pass

    def release(self, request_id):  # type: ignore[no-untyped-def]
        pass


@pytest.fixture(scope="module")
def tiny_vocab_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import tokenizers
    import transformers

    d = tmp_path_factory.mktemp("tinyvocab")
    torch.manual_seed(3)
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   bos_token_id=0, eos_token_id=V - 1)
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.mul_(30.0)  # a peaked but not degenerate next-token distribution
    model.save_pretrained(d, safe_serialization=True)
    vocab = {f"t{i}": i for i in range(V)}
    tk = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab=vocab, unk_token="t0"))
    tk.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tk, eos_token=f"t{V - 1}", bos_token="t0", unk_token="t0")
    fast.save_pretrained(d)
    return d


def _pair_counts(engine: LLMEngine, n: int, seed: int, max_tokens: int = 3) -> Counter[tuple[int, int]]:
    # max_tokens 3: the second token is emitted by verifying one draft (the first comes from the prefill)
    p = SamplingParams(n=n, temperature=1.0, seed=seed, max_tokens=max_tokens, ignore_eos=True)
    out = run_all(engine, {"s": [0, 1, 2]}, p)["s"]
    return Counter(tuple(o.token_ids[:2]) for o in out.outputs)  # type: ignore[misc]


def _exact_pair_probs(engine: LLMEngine) -> dict[tuple[int, int], float]:
    """p(t1, t2 | prompt) enumerated with the engine's own forward (V + 1 greedy-free logits queries)."""
    from tandem.core.plan import ScheduledRequest, StepPlan

    r = engine.runner
    table = list(range(r.num_blocks))[:4]

    def next_probs(ids: list[int]) -> torch.Tensor:
        return torch.softmax(r.execute(StepPlan(0, [ScheduledRequest("x", ids, 0, table)]))[0], -1)

    p1 = next_probs([0, 1, 2])
    return {(a, b): float(p1[a] * next_probs([0, 1, 2, a])[b]) for a in range(V) for b in range(V)}


def _chi2(counts: Counter[tuple[int, int]], probs: dict[tuple[int, int], float], n: int) -> tuple[float, int]:
    stat, dof = 0.0, -1
    for k, p in probs.items():
        if p * n < 5:  # pool the rare cells into one
            continue
        stat += (counts.get(k, 0) - p * n) ** 2 / (p * n)
        dof += 1
    rare_p = sum(p for p in probs.values() if p * n < 5)
    if rare_p * n >= 5:
        rare = sum(c for k, c in counts.items() if probs[k] * n < 5)
        stat += (rare - rare_p * n) ** 2 / (rare_p * n)
        dof += 1
    return stat, dof


def _chi2_threshold(dof: int) -> float:
    """Upper ~1e-5 quantile (Wilson-Hilferty): the bound on the statistic shrinks relative to n as n grows."""
    z = 4.26
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


@pytest.fixture(scope="module")
def cycle_method() -> str:
    register_proposer("cycle", lambda **_: _CyclingProposer())
    return "cycle"


def test_sampled_distribution_is_preserved(tiny_vocab_dir: Path, cycle_method: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from tandem.engine.llm import build_engine

    n = 3000
    spec = build_engine(str(tiny_vocab_dir), dtype="float32", progress=False, max_num_seqs=n, num_kv_blocks=2 * n,
                        block_size=4, max_num_batched_tokens=4 * n,
                        speculative_config={"method": cycle_method, "num_speculative_tokens": 1, "adaptive": False})
    probs = _exact_pair_probs(spec)
    counts = _pair_counts(spec, n, seed=11)
    assert spec.get_stats()["spec_num_drafted"] >= n // 2
    stat, dof = _chi2(counts, probs, n)
    assert stat < _chi2_threshold(dof), (stat, dof)

    # the same check must catch a broken rule: every row of a sequence drawing the same noise (its seed's, the
    # position left out of the key), so a draft is judged by the previous row's draw
    _noise_without_position(monkeypatch)
    broken = _pair_counts(spec, n, seed=11)
    stat_b, dof_b = _chi2(broken, probs, n)
    assert stat_b > _chi2_threshold(dof_b), (stat_b, dof_b)


def _noise_without_position(monkeypatch: pytest.MonkeyPatch) -> None:
    """Break the draws: every row of a seeded sequence gets its seed's generator, whatever its position."""
    import tandem.engine.step_sampler as step_sampler

    monkeypatch.setattr(step_sampler, "keyed_generator",
                        lambda generator, position: torch.Generator(generator.device).manual_seed(generator.initial_seed()))


def test_draft_model_worker_process_lossless(stories_engine_factory, stories_dir: Path) -> None:  # type: ignore[no-untyped-def]
    """The draft runs in its own process (its own KV cache and cores); drafts for step t + 1 overlap step t."""
    base = stories_engine_factory()
    spec = stories_engine_factory(speculative_config={
        "method": "draft_model", "model": str(stories_dir), "num_speculative_tokens": 4, "draft_dtype": "float32",
        "adaptive": False})  # adaptive K's goodput guard may switch a 260K-parameter draft off: a timing verdict
    try:
        prompts = _story_prompts(base, 4)
        want = run_all(base, prompts, GREEDY)
        got = run_all(spec, prompts, GREEDY)
        for rid in prompts:
            assert got[rid].outputs[0].token_ids == want[rid].outputs[0].token_ids
        stats = spec.get_stats()
        assert stats["spec_num_accepted"] > 0 and stats["draft_threads"] >= 1
    finally:
        spec.shutdown()


# ---------------------------------------------------------------------------------------------------------------
# K = 3 with the real proposers, top-k / top-p, n > 1: the joint law of three tokens
# ---------------------------------------------------------------------------------------------------------------
CYCLIC_PROMPT = [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]  # repeats: both proposers draft from the first step on
TEMPERATURE, TOP_K, TOP_P = 0.9, 4, 0.85


def reference_filter(logits: list[float], temperature: float, top_k: int, top_p: float) -> list[float]:
    """The target's sampling law written out: softmax(logits / T) over the top_k tokens, then the smallest set of
    them, most likely first, whose mass reaches top_p; renormalised."""
    z = [x / temperature for x in logits]
    order = sorted(range(len(z)), key=lambda t: -z[t])[:top_k]
    m = max(z[t] for t in order)
    w = {t: math.exp(z[t] - m) for t in order}
    total = sum(w.values())
    kept, mass = [], 0.0
    for t in order:
        kept.append(t)
        mass += w[t] / total
        if mass >= top_p:
            break
    norm = sum(w[t] for t in kept)
    return [w[t] / norm if t in kept else 0.0 for t in range(len(logits))]


def _exact_triple_probs(engine: LLMEngine, prompt: list[int], law: Callable[[list[float]], list[float]]) -> dict[tuple[int, ...], float]:
    """p(t1, t2, t3 | prompt) from the engine's own forward (1 + V + V^2 queries), each row through `law`."""
    from tandem.core.plan import ScheduledRequest, StepPlan

    r = engine.runner
    table = list(range(4))

    def nxt(ids: list[int]) -> list[float]:
        return law(r.execute(StepPlan(0, [ScheduledRequest("x", ids, 0, table)]))[0].tolist())

    p1 = nxt(prompt)
    out: dict[tuple[int, ...], float] = {}
    for a in range(V):
        if p1[a] == 0.0:
            continue
        p2 = nxt(prompt + [a])
        for b in range(V):
            if p2[b] == 0.0:
                continue
            p3 = nxt(prompt + [a, b])
            for c in range(V):
                out[(a, b, c)] = p1[a] * p2[b] * p3[c]
    return out


def _triple_counts(engine: LLMEngine, n: int, seed: int) -> Counter[tuple[int, ...]]:
    p = SamplingParams(n=n, temperature=TEMPERATURE, top_k=TOP_K, top_p=TOP_P, seed=seed, max_tokens=4, ignore_eos=True)
    out = run_all(engine, {"s": CYCLIC_PROMPT}, p)["s"]
    return Counter(tuple(o.token_ids[:3]) for o in out.outputs)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_sampled_k3_top_k_top_p_distribution_is_preserved(tiny_vocab_dir: Path, method: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """3,000 samples of one request (n = 3000, seeded) with 3 drafts per step from the real proposer: the joint
    law of its first three tokens (the second and third come out of verifying the drafts) is the target's under
    temperature, top-k and top-p. Negative controls: the same counts against the law without top-k / top-p, and
    the rows drawing without their position in the key at K = 3, both fail the test."""
    from tandem.engine.llm import build_engine

    n = 3000
    spec = build_engine(str(tiny_vocab_dir), dtype="float32", progress=False, max_num_seqs=n, num_kv_blocks=5 * n,
                        block_size=4, max_num_batched_tokens=16 * n,
                        speculative_config={"method": method, "num_speculative_tokens": 3, "adaptive": False})
    law = _exact_triple_probs(spec, CYCLIC_PROMPT, lambda row: reference_filter(row, TEMPERATURE, TOP_K, TOP_P))
    assert abs(sum(law.values()) - 1.0) < 1e-6
    counts = _triple_counts(spec, n, seed=21)
    stats = spec.get_stats()
    assert stats["spec_num_drafted"] >= 2 * n and stats["spec_num_accepted"] >= n // 2  # K = 3 drafts really verified
    assert set(counts) <= {k for k, v in law.items() if v > 0}  # nothing top-k / top-p excludes ever comes out
    stat, dof = _chi2(counts, law, n)
    assert stat < _chi2_threshold(dof), (stat, dof)
    # the test can tell: without the top-k / top-p filters the law is another one
    plain = _exact_triple_probs(spec, CYCLIC_PROMPT, lambda row: reference_filter(row, TEMPERATURE, V, 1.0))
    stat_p, dof_p = _chi2(counts, plain, n)
    assert stat_p > _chi2_threshold(dof_p), (stat_p, dof_p)
    if method == "ngram":  # and a broken verification at K = 3 is caught
        _noise_without_position(monkeypatch)
        broken = _triple_counts(spec, n, seed=21)
        stat_b, dof_b = _chi2(broken, law, n)
        assert stat_b > _chi2_threshold(dof_b), (stat_b, dof_b)
    spec.shutdown()
