"""tandem's MoE routing kernels (`csrc/moe_ops.cpp`) against the torch path of `layers/moe.py` they replace."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem.layers.kernels import load_cpu_kernels
from tandem.layers.linear import DenseProjection
from tandem.layers.moe import Expert, GptOssMoe, MoeMlp

pytestmark = pytest.mark.skipif(not load_cpu_kernels(), reason="tandem CPU kernels could not be built here")


def _moe(cls: type[MoeMlp], E: int, k: int, hidden: int, dtype: torch.dtype, kernels: bool, renormalize: bool = True,
         seed: int = 0) -> MoeMlp:
    g = torch.Generator().manual_seed(seed)
    experts = [Expert(DenseProjection(torch.randn(16, hidden, generator=g).to(dtype), None),
                      DenseProjection(torch.randn(hidden, 8, generator=g).to(dtype), None)) for _ in range(E)]
    router = DenseProjection(torch.randn(E, hidden, generator=g).to(dtype), None)
    if cls is GptOssMoe:
        return GptOssMoe(router, experts, k, alpha=1.702, limit=7.0, kernels=kernels)
    return MoeMlp(router, experts, k, renormalize, kernels=kernels)


def _silu_mul(gu: torch.Tensor, tokens: int | None = None) -> torch.Tensor:  # noqa: ARG001 - a `SiluMul`
    g, u = gu.chunk(2, dim=-1)
    return F.silu(g) * u


def _reference_route(moe: MoeMlp, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch path's routing with ties at the k-th place sent to the lower expert (torch.topk's choice among tied
    values depends on the tensor's size; in bf16, router logits tie often): (weights [T, k], ids [T, k])."""
    logits = moe.router(h)
    score = logits.float() if moe.softmax_after_topk else torch.softmax(logits.float(), dim=-1)
    ids = torch.tensor([sorted(range(score.shape[1]), key=lambda e: (-row[e], e))[: moe.top_k] for row in score.tolist()])
    if moe.softmax_after_topk:
        return torch.softmax(logits.gather(1, ids), dim=-1, dtype=logits.dtype), ids
    weights = score.gather(1, ids)
    if moe.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("cls", "renormalize"), [(MoeMlp, True), (MoeMlp, False), (GptOssMoe, True)])
@pytest.mark.parametrize("T", [1, 7, 40])
def test_route_gives_the_torch_pairs(dtype: torch.dtype, cls: type[MoeMlp], renormalize: bool, T: int) -> None:
    torch_moe = _moe(cls, 32, 4, 24, dtype, kernels=False, renormalize=renormalize)
    kernel_moe = _moe(cls, 32, 4, 24, dtype, kernels=True, renormalize=renormalize)
    h = torch.randn(T, 24, generator=torch.Generator().manual_seed(T)).to(dtype)
    want_weights, want_ids = _reference_route(torch_moe, h)
    torch_weights, torch_ids = torch_moe.route(h)
    untied = [t for t in range(T) if set(want_ids[t].tolist()) == set(torch_ids[t].tolist())]
    assert len(untied) >= T - max(1, T // 8)  # the reference is torch's routing except at a tie
    want_tokens, want_scale, want_chosen, want_counts = torch_moe._by_expert(want_weights, want_ids)
    tokens, scale, chosen, counts = kernel_moe.pairs(h)
    used = [(e, n) for e, n in zip(want_chosen, want_counts) if n]  # the torch path lists every expert at T > 1
    assert list(zip(chosen, counts)) == used
    assert torch.equal(tokens, want_tokens)
    assert scale.dtype == dtype
    # the router's sums and the softmax's exp round differently from torch's (MKL, Sleef) by ulps of float32, then the
    # weight is rounded once to the dtype: equal in bf16 except at a rounding boundary
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 8e-3, "atol": 0.0}
    torch.testing.assert_close(scale, want_scale, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_combine_adds_in_pair_order_exactly_as_index_add(dtype: torch.dtype) -> None:
    torch_moe, kernel_moe = (_moe(MoeMlp, 16, 3, 24, dtype, kernels=k) for k in (False, True))
    g = torch.Generator().manual_seed(5)
    for T in (1, 3, 200):  # 200 tokens x 3 pairs: columns split across threads
        h = torch.randn(T, 24, generator=g).to(dtype)
        tokens, scale, _, _ = torch_moe.pairs(h)
        y = (torch.randn(3 * T, 1000, generator=g) * 10).to(dtype)
        assert torch.equal(kernel_moe.combine(y, scale, tokens, T), torch_moe.combine(y, scale, tokens, T))


@pytest.mark.parametrize("cls", [MoeMlp, GptOssMoe])
def test_a_layer_with_the_kernels_matches_torch(cls: type[MoeMlp]) -> None:
    torch_moe, kernel_moe = (_moe(cls, 16, 4, 24, torch.float32, kernels=k, seed=2) for k in (False, True))
    h = torch.randn(9, 24, generator=torch.Generator().manual_seed(9))
    torch.testing.assert_close(kernel_moe(h, _silu_mul), torch_moe(h, _silu_mul), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_token_routes_alone_as_beside_others(dtype: torch.dtype) -> None:
    moe = _moe(GptOssMoe, 32, 4, 72, dtype, kernels=True, seed=4)  # hidden 72: 16-lane sums and a tail
    h = torch.randn(11, 72, generator=torch.Generator().manual_seed(11)).to(dtype)
    tokens, scale, chosen, counts = moe.pairs(h)
    expert_of = [e for e, n in zip(chosen, counts) for _ in range(n)]
    for t in range(11):
        mine = [i for i in range(len(tokens)) if tokens[i] == t]
        _, alone_scale, alone_chosen, _ = moe.pairs(h[t : t + 1])
        assert [expert_of[i] for i in mine] == alone_chosen
        assert torch.equal(scale[mine], alone_scale)


def test_ties_go_to_the_lower_expert() -> None:
    logits = torch.tensor([[0.0, 1.0, 1.0, 1.0, 0.5], [0.0, 2.0, 0.0, 0.0, 2.0]])
    tokens, scale, plan = torch.ops.tandem.moe_route(logits, torch.eye(5), None, 2, True, False)  # the logits as h
    assert plan.tolist() == [[1, 2, 4], [2, 1, 1]]  # row 0: experts 1, 2 of the three tied at 1.0; row 1: 1 and 4
    assert tokens.tolist() == [0, 1, 0, 1]
    assert torch.allclose(scale, torch.full((4,), 0.5))


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(RuntimeError, match="k must be"):
        torch.ops.tandem.moe_route(torch.zeros(2, 4), torch.zeros(4, 4), None, 5, True, False)
    with pytest.raises(RuntimeError, match="weight"):
        torch.ops.tandem.moe_route(torch.zeros(2, 4), torch.zeros(4, 3), None, 2, True, False)
    with pytest.raises(RuntimeError, match="out of range"):
        torch.ops.tandem.moe_combine(torch.zeros(2, 3), torch.ones(2), torch.tensor([0, 4]), 2)
