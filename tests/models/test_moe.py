"""Mixtures of experts (Qwen3-MoE, Mixtral) against transformers on tiny random-weight checkpoints: logits of a
prefill, a chunk over the cache and decodes; one step holding requests that route to different experts; greedy
generation through the engine (Qwen3-MoE and Mixtral), also with n-gram / suffix speculation and JSON-schema
grammars, and over 2 tensor-parallel ranks; each active expert read once per step; Q5_K experts grouped into one kernel
call."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch
import transformers

from tandem import LLM, SamplingParams, StructuredOutputsParams
from tandem.config import CacheConfig, ConfigError, ModelConfig, SchedulerConfig
from tandem.core.plan import ScheduledRequest, StepPlan
from tandem.layers.kernels import load_cpu_kernels
from tandem.layers.linear import DenseProjection, make_linear, quant_isa
from tandem.layers.moe import Expert, MoeMlp
from tandem.layers.quant import FORMATS
from tandem.models.loader import load_checkpoint
from tandem.runner.runner import ModelRunner
from tests.tiny import hf_greedy, perturb_norms, save_tiny

TINY: dict[str, Any] = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                            num_key_value_heads=2, max_position_embeddings=256)


def _tiny_moe(arch: str) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    if arch == "qwen3-moe":  # the real model's routing: top 2 of 8, renormalized
        cfg: Any = transformers.Qwen3MoeConfig(**TINY, head_dim=16, num_experts=8, num_experts_per_tok=2,
                                               moe_intermediate_size=32, norm_topk_prob=True)
        model: transformers.PreTrainedModel = transformers.Qwen3MoeForCausalLM(cfg)
    elif arch == "qwen3-moe-mixed":  # layer 1 dense (mlp_only_layers), raw top-3 softmax weights
        cfg = transformers.Qwen3MoeConfig(**TINY, head_dim=16, num_experts=6, num_experts_per_tok=3, moe_intermediate_size=24,
                                          norm_topk_prob=False, mlp_only_layers=[1])
        model = transformers.Qwen3MoeForCausalLM(cfg)
    elif arch == "mixtral":
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**TINY, num_local_experts=4, num_experts_per_tok=2))
    else:
        raise AssertionError(arch)
    return perturb_norms(model)


def tiny_runner(folder: Path, kernels: bool, blocks: int = 64) -> ModelRunner:
    ckpt = load_checkpoint(folder, torch.float32, progress=False)
    return ModelRunner(ckpt.config, ckpt.weights, torch.float32, "cpu", CacheConfig(block_size=4, num_blocks=blocks),
                       SchedulerConfig(max_model_len=64), use_kernels=kernels)


def test_configs_name_their_experts(tmp_path: Path) -> None:
    for arch, layers, names in [("qwen3-moe", (0, 1, 2), "qwen"), ("qwen3-moe-mixed", (0, 2), "qwen"), ("mixtral", (0, 1, 2), "mixtral")]:
        cfg = ModelConfig.from_hf(_tiny_moe(arch).config.to_dict())
        assert cfg.is_moe and cfg.moe_layers == layers and cfg.expert_names == names
    assert not ModelConfig.from_hf(transformers.Qwen3Config(**TINY).to_dict()).is_moe
    bad = {**_tiny_moe("mixtral").config.to_dict(), "num_experts_per_tok": 9}
    with pytest.raises(ConfigError, match="num_experts_per_tok"):
        ModelConfig.from_hf(bad)


@pytest.mark.parametrize("kernels", [True, False], ids=["tandem-cpu-kernels", "torch-ops"])
@pytest.mark.parametrize("arch", ["qwen3-moe", "qwen3-moe-mixed", "mixtral"])
def test_logits_match_transformers(arch: str, kernels: bool, tmp_path: Path) -> None:
    """30 positions: a prefill chunk, a chunk over the cache, decodes (one token: only k experts run)."""
    ref = _tiny_moe(arch)
    ref.save_pretrained(tmp_path, safe_serialization=True)
    runner = tiny_runner(tmp_path, kernels)
    moe = runner.model.layers[-1].moe
    assert moe is not None and moe.kernels == (kernels and load_cpu_kernels())  # routing by csrc/moe_ops.cpp, or torch
    ids = torch.randint(0, 128, (1, 30), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ref(ids).logits[0]  # [30, V]
    got = logits_in_chunks(runner, ids[0].tolist(), 11, 27, list(range(8)))
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def logits_in_chunks(runner: Any, tok: list[int], first: int, second: int, table: list[int]) -> torch.Tensor:
    """Every position's logits [len(tok), V] as a server computes them: a prefill chunk tok[:first], a chunk over
    the cache tok[first:second], then one decode step per token."""
    got = [runner.execute(StepPlan(0, [ScheduledRequest("a", tok[:first], 0, table, all_logits=True)])),
           runner.execute(StepPlan(1, [ScheduledRequest("a", tok[first:second], first, table, all_logits=True)]))]
    for p in range(second, len(tok)):
        got.append(runner.execute(StepPlan(2 + p, [ScheduledRequest("a", [tok[p]], p, table)])))
    return torch.cat(got)


@pytest.mark.parametrize("arch", ["qwen3-moe", "mixtral"])
def test_a_mixed_batch_routes_each_request_as_alone(arch: str, tmp_path: Path) -> None:
    """A prefill, two decodes and a 4-token verify chunk in one step, their tokens spread over the experts: each
    row's logits are transformers' for that sequence alone."""
    ref = _tiny_moe(arch)
    ref.save_pretrained(tmp_path, safe_serialization=True)
    runner = tiny_runner(tmp_path, kernels=True)
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (9, 14, 21, 12)]
    tables = [list(range(i * 8, i * 8 + 8)) for i in range(4)]
    with torch.no_grad():
        expected = [ref(torch.tensor([s])).logits[0] for s in seqs]
    first = [ScheduledRequest(f"r{i}", s[:-4], 0, tables[i]) for i, s in enumerate(seqs[1:], 1)]
    runner.execute(StepPlan(0, first))
    step = [ScheduledRequest("r0", seqs[0], 0, tables[0]),  # prefill: last row
            ScheduledRequest("r1", [seqs[1][-4]], len(seqs[1]) - 4, tables[1]),
            ScheduledRequest("r2", [seqs[2][-4]], len(seqs[2]) - 4, tables[2]),
            ScheduledRequest("r3", seqs[3][-4:], len(seqs[3]) - 4, tables[3], 3)]  # verify: 4 rows
    got = runner.execute(StepPlan(1, step))
    want = torch.cat([expected[0][-1:], expected[1][-4:-3], expected[2][-4:-3], expected[3][-4:]])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    moe = runner.model.layers[0].moe
    assert moe is not None and len(set(moe.route(torch.randn(64, 64))[1].flatten().tolist())) > 2  # routes spread


class _Counting(DenseProjection):
    calls: list[int]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append(x.shape[0])
        return super().__call__(x)


def test_each_chosen_expert_runs_once_per_step_and_the_others_never() -> None:
    torch.manual_seed(3)
    experts, calls = [], []
    for _ in range(6):
        up = _Counting(torch.randn(16, 8), None)
        up.calls = []
        calls.append(up.calls)
        experts.append(Expert(up, DenseProjection(torch.randn(8, 8), None)))
    moe = MoeMlp(DenseProjection(torch.randn(6, 8), None), experts, top_k=2, renormalize=True)
    h = torch.randn(5, 8)
    weights, ids = moe.route(h)
    out = moe(h, lambda x, tokens=None: torch.nn.functional.silu(x[:, :8]) * x[:, 8:])
    chosen = set(ids.flatten().tolist())
    assert all((len(c) == 1) == (e in chosen) for e, c in enumerate(calls))  # once, or never
    assert sum(c[0] for c in calls if c) == 10  # every (token, expert) pair once
    ref = torch.zeros_like(h)
    for t in range(5):  # token by token, expert by expert
        for w, e in zip(weights[t], ids[t]):
            x = experts[int(e)].gate_up(h[t : t + 1])
            ref[t] += w * experts[int(e)].down(torch.nn.functional.silu(x[:, :8]) * x[:, 8:])[0]
    torch.testing.assert_close(out, ref)
    assert torch.allclose(weights.sum(-1), torch.ones(5))


def _silu_mul(gu: torch.Tensor, tokens: int | None = None) -> torch.Tensor:
    """silu(gate) * up of a fused gate / up output [n, 2 I] (the `SiluMul` the layer ops pass)."""
    half = gu.shape[1] // 2
    return torch.nn.functional.silu(gu[:, :half]) * gu[:, half:]


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_q5_k_experts_grouped_equal_each_expert_alone_to_the_bit(bias: bool) -> None:
    """Q5_K experts (Q5_K_M files' type; 256-wide rows, hidden and expert width 256), routed by the kernels: the
    grouped gate / up and down calls give each pair's row what its expert alone gives it, bit for bit; a token alone
    gets its bits in the batch; the layer's output is the dequantized experts' within the activations' 8-bit
    rounding."""
    from tests.layers.test_quant import random_blocks

    if not (load_cpu_kernels() and quant_isa()):
        pytest.skip("no quantized CPU kernels here")
    torch.manual_seed(4)
    h_dim, width, n = 256, 256, 6

    def expert(e: int) -> tuple[Expert, Expert]:
        gate, up, down = (random_blocks("Q5_K", rows, 256, 3 * e + i) for i, rows in enumerate((width, width, h_dim)))
        b_gu, b_down = (torch.randn(2 * width) if bias else None), (torch.randn(h_dim) if bias else None)
        quant = Expert(make_linear([gate, up], b_gu, use_kernels=True, dtype=torch.float32),
                       make_linear(down, b_down, use_kernels=True, dtype=torch.float32))
        dense = Expert(DenseProjection(torch.cat([gate.dequantize(torch.float32), up.dequantize(torch.float32)]), b_gu),
                       DenseProjection(down.dequantize(torch.float32), b_down))
        return quant, dense

    quant, dense = zip(*(expert(e) for e in range(n)))
    router = DenseProjection(torch.randn(n, h_dim), None)
    moe = MoeMlp(router, list(quant), top_k=2, renormalize=True, kernels=True)
    assert moe.gate_ups.segments is not None and moe.downs.segments is not None  # one quant_grouped call each
    assert {f for seg in [*moe.gate_ups.segments, *moe.downs.segments] for f in seg.formats} == {FORMATS["Q5_K"].kernel_id}
    h = torch.randn(9, h_dim)
    tokens, _, chosen, counts = moe.pairs(h)
    assert len([c for c in counts if c]) > 2  # the pairs spread over several experts
    x = h.index_select(0, tokens)
    gu = moe.gate_ups(x, chosen, counts)
    y = moe.downs(_silu_mul(gu), chosen, counts)
    start = 0
    for e, c in zip(chosen, counts):
        if c:
            assert torch.equal(gu[start : start + c], quant[e].gate_up(x[start : start + c])), e
            assert torch.equal(y[start : start + c], quant[e].down(_silu_mul(gu[start : start + c]))), e
        start += c
    out = moe(h, _silu_mul)
    for t in (0, 4, 8):
        assert torch.equal(moe(h[t : t + 1], _silu_mul), out[t : t + 1]), t
    ref = MoeMlp(router, list(dense), top_k=2, renormalize=True)(h, _silu_mul)
    assert float((out - ref).norm() / ref.norm()) < 0.02


GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = ["t1 t2 t3 t4 t1 t2 t3 t4 t1 t2", "t5 t9 t20 t30 t31 t40", "t7"]


def generate_tokens(folder: str, prompts: list[str], params: SamplingParams | list[SamplingParams], **kw: Any) -> list[list[int]]:
    llm = LLM(folder, dtype="float32", kv_cache_memory=4 << 20, progress=False, **kw)
    try:
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def qwen3_moe_folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(save_tiny(tmp_path_factory.mktemp("tiny-qwen3-moe"), _tiny_moe("qwen3-moe")))


@pytest.fixture(scope="module")
def mixtral_folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(save_tiny(tmp_path_factory.mktemp("tiny-mixtral"), _tiny_moe("mixtral")))


@pytest.mark.parametrize("folder", ["qwen3_moe_folder", "mixtral_folder"], ids=["qwen3-moe", "mixtral"])
def test_engine_greedy_equals_transformers_generate(folder: str, request: pytest.FixtureRequest) -> None:
    """Three prompts batched through `LLM` (float32, greedy): each one's tokens are transformers' `generate`'s for
    that prompt alone (Qwen3-MoE's renormalized top 2 of 8, Mixtral's top 2 of 4)."""
    path = request.getfixturevalue(folder)
    want = hf_greedy(path, PROMPTS)
    assert generate_tokens(path, PROMPTS, GREEDY) == want


def test_speculation_and_tensor_parallel_keep_the_tokens(qwen3_moe_folder: str) -> None:
    """n-gram and suffix drafts verified, and 2 ranks (each a slice of every expert): the plain engine's greedy
    tokens."""
    plain = generate_tokens(qwen3_moe_folder, PROMPTS, GREEDY)
    for method in ("ngram", "suffix"):
        spec = {"method": method, "num_speculative_tokens": 3}
        assert generate_tokens(qwen3_moe_folder, PROMPTS, GREEDY, speculative_config=spec) == plain, method
    assert generate_tokens(qwen3_moe_folder, PROMPTS, GREEDY, tensor_parallel_size=2) == plain


def save_gpt2_vocab_moe(folder: Path, shared_data: Path) -> None:
    """A random Qwen3-MoE (2 layers, top 2 of 4 experts) over GPT-2's real vocabulary, and that tokenizer, in
    `folder`: its logits are noise, a grammar does the work."""
    import shutil

    from tandem.tokenizer import Tokenizer

    for name in ("vocab.json", "merges.txt"):
        shutil.copy(shared_data / "tokenizers" / "gpt2" / name, folder / name)
    tok = Tokenizer.from_path(folder).hf
    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, head_dim=8,
                                      num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                                      moe_intermediate_size=16, max_position_embeddings=512, eos_token_id=tok.eos_token_id)
    transformers.Qwen3MoeForCausalLM(cfg).save_pretrained(folder, safe_serialization=True)


def test_json_schema_on_a_moe_model_over_the_gpt2_vocabulary(tmp_path: Path, shared_data: Path) -> None:
    """A random Qwen3-MoE over GPT-2's real vocabulary (its logits noise, the grammar does the work): the answer is
    the schema's JSON, and the same with n-gram drafts (lossless: identical tokens)."""
    save_gpt2_vocab_moe(tmp_path, shared_data)
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    p = SamplingParams(max_tokens=60, temperature=0.0, structured_outputs=StructuredOutputsParams(json=schema))
    outs = []
    for spec in (None, {"method": "ngram", "num_speculative_tokens": 3}):
        llm = LLM(str(tmp_path), dtype="float32", kv_cache_memory=16 << 20, max_model_len=512, progress=False, speculative_config=spec)
        try:
            outs.append(llm.generate(["My record:"], p, use_tqdm=False)[0].outputs[0])
        finally:
            llm.shutdown()
    assert outs[0].token_ids == outs[1].token_ids
    if outs[0].finish_reason == "stop":
        assert set(json.loads(outs[0].text)) == {"name", "age"}
    else:  # cut by max_tokens inside the JSON: still a prefix of one
        assert outs[0].finish_reason == "length" and outs[0].text.startswith("{")


SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]}, "tags": {"type": "array", "items":
     {"type": "string", "maxLength": 4}, "maxItems": 3}}, "required": ["city", "tags"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 2, "maxItems": 6},
]
# prompts that hold the answers' shape, so that suffix drafting finds continuations to propose from the start
JSON_PROMPTS = ['Records: {"name":"Ann","age":31} {"name":"","age":22} {"name":"Bo","age":7}. Another:',
                'Trips: {"city":"Oslo","tags":["a","b"]} {"city":"Lima","tags":[" aux"," aux"]}. Next:',
                "Numbers: [1,2,3,4] [13,68] [5,6]. More:"]


def test_json_schemas_with_suffix_drafts_on_a_moe_model_are_lossless(tmp_path: Path, shared_data: Path) -> None:
    """Three requests with three different JSON schemas batched on a random Qwen3-MoE over GPT-2's vocabulary: with
    suffix drafts (greedy, fixed K) every request's tokens are the undrafted run's (lossless), drafts were really
    verified and some accepted, and each finished answer is its schema's JSON."""
    save_gpt2_vocab_moe(tmp_path, shared_data)
    params = [SamplingParams(max_tokens=40, temperature=0.0, structured_outputs=StructuredOutputsParams(json=schema))
              for schema in SCHEMAS]
    runs: list[list[Any]] = []
    stats: dict[str, Any] = {}
    for spec in (None, {"method": "suffix", "num_speculative_tokens": 3, "adaptive": False}):
        llm = LLM(str(tmp_path), dtype="float32", kv_cache_memory=16 << 20, max_model_len=512, progress=False, speculative_config=spec)
        try:
            runs.append([o.outputs[0] for o in llm.generate(JSON_PROMPTS, params, use_tqdm=False)])
            stats = llm.llm_engine.get_stats()
        finally:
            llm.shutdown()
    plain, suffix = runs
    assert [o.token_ids for o in suffix] == [o.token_ids for o in plain]
    assert stats["spec_num_drafted"] > 0 and stats["spec_num_accepted"] > 0  # drafts verified, some kept by the grammar
    for out, schema in zip(plain, SCHEMAS):
        if out.finish_reason == "stop":
            jsonschema.validate(json.loads(out.text), schema)
        else:  # cut by max_tokens inside the JSON: still a prefix of one
            assert out.finish_reason == "length" and out.text.startswith(("{", "["))
