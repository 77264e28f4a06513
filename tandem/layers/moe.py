"""Mixture-of-experts MLP: a router picks k experts per token; each expert a step needs runs once, over all its tokens.

Routing, as transformers computes it for Qwen3-MoE and Mixtral: logits = router(h) in the model dtype, a float32
softmax over every expert, the top k kept (`torch.topk`'s order), renormalized to sum to 1 where the family does
(`norm_topk_prob`), then cast to the model dtype. An expert is the dense MLP's shape, down(silu(gate(x)) * up(x)), with
gate and up fused into one projection, so every expert is a `Projection` of the existing kernels (the bf16 GEMM,
quantized blocks kept as stored, AMX where the plan chose it) and keeps their promise: a row's result does not depend on
the other rows beside it. A step's (token, expert) pairs are sorted by expert: an expert no token chose is never read,
one chosen by several tokens of a batch (prefill, batched decode, verification) is read once for all of them, so decode
at batch 1 streams only k experts' weights per layer. All chosen experts' gate / up run as one grouped call, then all
their downs (`GroupedProjections`: one kernel call each for quantized experts). The outputs are summed in ascending
expert order, each scaled by its routing weight (the order transformers adds them in).

Built with `kernels` (a CPU layer when tandem's kernels load), routing from h through the router's logits to the
grouped pairs, and the weighted sum, run as two calls (`csrc/moe_ops.cpp`: `moe_route`, `moe_combine`) instead of ~15
torch operations, ~0.3 ms a layer at batch 1 on two cores (a fifth of a Qwen3-30B-A3B layer's decode step). Same
arithmetic up to float32 rounding (the router's sums in their own fixed order, the softmax's exp), except that a tie
at the k-th place goes to the lower expert (torch.topk's choice among ties depends on the tensor's size); a row's
routing then depends on its own h alone, whatever else shares the step.

gpt-oss (`GptOssMoe`) differs in the router and the activation only: the router has a bias, the top k of its logits
are softmaxed among themselves (in the model dtype, as transformers does), and an expert's fused gate / up output goes
through a clamped SwiGLU, (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g) with g = min(gate, limit). Its
experts carry biases, which their projections add after the matmul (`make_linear(weight, bias)`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.layers.linear import DenseProjection, GroupedProjections, KernelSegments, Projection
from tandem.layers.ops import SiluMul


@dataclass
class Expert:
    gate_up: Projection  # [n, hidden] -> [n, 2 I]
    down: Projection  # [n, I] -> [n, hidden]

    @property
    def nbytes(self) -> int:
        return self.gate_up.nbytes + self.down.nbytes


class MoeMlp:
    """One layer's experts and router. Call with the step's normed hidden states and the ops' silu_mul."""

    softmax_after_topk = False  # the family's routing: softmax over all experts, then the top k (gpt-oss: reversed)

    def __init__(self, router: DenseProjection, experts: list[Expert], top_k: int, renormalize: bool,
                 kernels: bool = False) -> None:
        """`kernels`: route and combine with tandem's CPU kernels (the caller checked they load and the layer is on
        the CPU); otherwise with torch operations on any device."""
        if not 0 < top_k <= len(experts):
            raise ValueError(f"top_k must be in [1, {len(experts)}], got {top_k}")
        self.router = router  # [T, hidden] -> [T, E]; dense in the model dtype (the kernels read its weight and bias)
        self.experts = experts
        self.top_k = top_k
        self.renormalize = renormalize
        self.kernels = kernels
        self.gate_ups = GroupedProjections([e.gate_up for e in experts])  # one call for a step's chosen experts
        self.downs = GroupedProjections([e.down for e in experts])

    @property
    def nbytes(self) -> int:
        return self.router.nbytes + sum(e.nbytes for e in self.experts)

    @property
    def active_params(self) -> int:
        """Parameters multiplied per token: the router and k experts."""
        e = self.experts[0]
        per_expert = e.gate_up.out_features * e.gate_up.in_features + e.down.out_features * e.down.in_features
        return self.router.out_features * self.router.in_features + self.top_k * per_expert

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h [T, hidden] -> (weights [T, k] in h's dtype, expert ids [T, k] int64)."""
        logits = self.router(h)  # [T, E] in the model dtype
        probs = torch.softmax(logits.float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(logits.dtype), ids

    def activation(self, gu: torch.Tensor, silu_mul: SiluMul, tokens: int) -> torch.Tensor:
        """An expert's fused gate / up output gu [n, 2 I] -> [n, I] in a step of `tokens` tokens: silu(gate) * up (the
        ops' kernel in a decode step, as a dense MLP's, however many pairs its k experts make)."""
        return silu_mul(gu, tokens)

    def __call__(self, h: torch.Tensor, silu_mul: SiluMul) -> torch.Tensor:
        """h [T, hidden] (model dtype) -> the weighted sum of each token's k experts [T, hidden] (model dtype)."""
        tokens, scale, chosen, counts = self.pairs(h)
        x = h.index_select(0, tokens)  # [P, hidden]: pair p's token, pairs grouped by expert
        y = self.downs(self.activation(self.gate_ups(x, chosen, counts), silu_mul, h.shape[0]), chosen, counts)
        return self.combine(y, scale, tokens, h.shape[0])  # y [P, hidden]

    def stack_activation(self) -> tuple[int, float, float]:
        """The activation as `DecodeStack` names it: (0: SiLU, alpha, limit unused) here."""
        return 0, 0.0, 0.0

    def stack_entry(self) -> MoeStackEntry | None:
        """This layer as a `DecodeStack` runs it from C++ (`layers/decode_stack.py`): routing and sums by the kernels,
        every expert quantized for them, with a bias on every part or on none; None otherwise."""
        gate_ups, downs = self.gate_ups.segments, self.downs.segments
        if not self.kernels or gate_ups is None or downs is None:
            return None
        segments = [*gate_ups, *downs]
        with_bias = {b is not None for seg in segments for b in seg.biases}
        if len(with_bias) != 1 or len({(s.isa, s.amx_rows) for s in segments}) != 1:
            return None
        kind, alpha, limit = self.stack_activation()
        return MoeStackEntry(self.router.weight, self.router.bias, self.top_k, self.renormalize, self.softmax_after_topk,
                             gate_ups, downs, segments[0].isa, segments[0].amx_rows, kind, alpha, limit)

    def pairs(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[int], list[int]]:
        """h [T, hidden] -> the step's (token, expert) pairs grouped by ascending expert, tokens ascending within one:
        each pair's token [P] int64 and routing weight [P] (h's dtype), the experts chosen and their pair counts."""
        if not self.kernels:
            return self._by_expert(*self.route(h))
        tokens, scale, plan = torch.ops.tandem.moe_route(h, self.router.weight, self.router.bias, self.top_k,
                                                         self.renormalize, self.softmax_after_topk)
        chosen, counts = plan.tolist()
        return tokens, scale, chosen, counts

    def combine(self, y: torch.Tensor, scale: torch.Tensor, tokens: torch.Tensor, rows: int) -> torch.Tensor:
        """The pairs' outputs y [P, hidden] -> [rows, hidden]: each token's terms y[p] * scale[p] added from zero in
        pair order (ascending expert, as transformers adds them), whatever else shares the step (a row's result does
        not depend on the rows beside it)."""
        if self.kernels:
            return torch.ops.tandem.moe_combine(y, scale, tokens, rows)
        out = torch.zeros(rows, y.shape[1], dtype=y.dtype, device=y.device)
        return out.index_add_(0, tokens, y * scale[:, None])

    def _by_expert(self, weights: torch.Tensor, ids: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, list[int], list[int]]:
        """weights, ids [T, k] -> the (token, expert) pairs grouped by ascending expert: each pair's token [P] and
        routing weight [P], the experts chosen and their pair counts. A decode at batch 1 sorts its k ids in Python
        and passes only the k chosen experts, not a count for each of the E."""
        t, k = ids.shape
        if t == 1:
            picked = ids[0].tolist()
            order = sorted(range(k), key=picked.__getitem__)
            at = torch.tensor(order, device=ids.device)
            return torch.zeros(k, dtype=torch.long, device=ids.device), weights[0][at], [picked[i] for i in order], [1] * k
        flat = ids.reshape(-1)  # [T k]: pair p is token p // k's (p % k)-th choice
        pairs = torch.argsort(flat, stable=True)  # pairs grouped by expert, ascending
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        return pairs // k, weights.reshape(-1)[pairs], list(range(len(self.experts))), counts


class GptOssMoe(MoeMlp):
    """gpt-oss's experts: softmax over the top k router logits, the clamped SwiGLU (see the module's docstring)."""

    softmax_after_topk = True

    def __init__(self, router: DenseProjection, experts: list[Expert], top_k: int, alpha: float, limit: float,
                 kernels: bool = False) -> None:
        super().__init__(router, experts, top_k, renormalize=True, kernels=kernels)
        self.alpha = alpha
        self.limit = limit

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h [T, hidden] -> (softmax of the top k logits [T, k] in h's dtype, expert ids [T, k] int64)."""
        logits = self.router(h)  # [T, E] in the model dtype, the router's bias added
        top, ids = torch.topk(logits, self.top_k, dim=-1)
        return torch.softmax(top, dim=-1, dtype=top.dtype), ids

    def activation(self, gu: torch.Tensor, silu_mul: SiluMul, tokens: int) -> torch.Tensor:
        """gu [n, 2 I] (gate | up, de-interleaved at load) -> [n, I]."""
        gate, up = gu.chunk(2, dim=-1)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def stack_activation(self) -> tuple[int, float, float]:
        return 1, self.alpha, self.limit  # 1: the clamped SwiGLU above


@dataclass(frozen=True)
class MoeStackEntry:
    """A MoE layer as plain arguments of `DecodeStack.add_moe` / `add_expert` (csrc/decode_stack.cpp): the router's
    weight [E, hidden] and bias for `moe_route`, each expert's gate / up and down segments (and their biases) for
    `quant_grouped`, the activation between them."""

    router_weight: torch.Tensor
    router_bias: torch.Tensor | None
    top_k: int
    renormalize: bool
    softmax_after_topk: bool
    gate_ups: list[KernelSegments]
    downs: list[KernelSegments]
    isa: int
    amx_rows: int
    activation: int  # 0: silu(gate) * up; 1: gpt-oss's clamped SwiGLU with `alpha` and `limit`
    alpha: float
    limit: float
