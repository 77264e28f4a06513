"""Which part of each checkpoint tensor a tensor-parallel rank keeps (`layers/parallel.py` says which heads, features
and vocabulary ids are its own): column-parallel weights (q/k/v, gate/up, embedding, LM head) by output rows,
row-parallel ones (o, down) by input columns; norms replicated; the o bias on rank 0 only (added once to the sum).
A mixture of experts: every expert's gate / up by its output rows and its down by input columns (each rank a slice of
every expert's width, so routing needs no communication), the router replicated. gpt-oss: the sinks by query heads,
the stacked experts by their intermediate features (gate_up's interleaved gate / up column pairs 2j, 2j + 1 together),
the down bias on rank 0 only."""

from __future__ import annotations

import torch

from tandem.config import ModelConfig
from tandem.layers.parallel import TensorParallel
from tandem.layers.quant import QuantizedTensor

Stored = torch.Tensor | QuantizedTensor  # noqa: UP007 (a runtime alias on Python 3.10)


class WeightShard:
    """Cuts a rank's slice out of each tensor as it is read from the checkpoint."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel) -> None:
        d = cfg.head_dim
        q0, q1 = tp.q_heads(cfg)
        k0, k1 = tp.kv_heads(cfg)
        vocab = tp.vocab(cfg.vocab_size)
        self.rank = tp.rank
        # name suffix -> (dim, [start, end)) ; dim 0: output rows, dim 1: input columns
        self.rules: dict[str, tuple[int, tuple[int, int]]] = {
            "q_proj": (0, (q0 * d, q1 * d)), "k_proj": (0, (k0 * d, k1 * d)), "v_proj": (0, (k0 * d, k1 * d)),
            "o_proj": (1, (q0 * d, q1 * d)),
            "gate_proj": (0, tp.intermediate(cfg)), "up_proj": (0, tp.intermediate(cfg)),
            "down_proj": (1, tp.intermediate(cfg)),
            "embed_tokens": (0, vocab), "lm_head": (0, vocab),
        }
        width = tp.moe_intermediate(cfg)
        self.expert_rules: dict[str, tuple[int, tuple[int, int]]] = {
            "gate_proj": (0, width), "up_proj": (0, width), "down_proj": (1, width), "w1": (0, width), "w3": (0, width), "w2": (1, width),
        }
        pairs = (2 * width[0], 2 * width[1])
        # gpt-oss, by the name's last part: sinks [H], gate_up [E, hidden, 2 I] / its bias [E, 2 I], down [E, I, hidden]
        self.named_rules: dict[str, tuple[int, tuple[int, int]]] = {
            "sinks": (0, (q0, q1)), "gate_up_proj": (2, pairs), "gate_up_proj_bias": (1, pairs), "down_proj": (1, width),
        }

    def cut(self, name: str, w: Stored) -> Stored:
        """This rank's part of the tensor `name` (the whole tensor when it is replicated)."""
        parts = name.split(".")
        if parts[-1] == "down_proj_bias":  # gpt-oss: added once, after the sum
            return w if self.rank == 0 else torch.zeros_like(w)  # type: ignore[arg-type]
        rules = self.expert_rules if ".experts." in name else self.rules
        rule = self.named_rules.get(parts[-1]) or (rules.get(parts[-2]) if len(parts) >= 2 else None)
        if rule is None:
            return w
        dim, (start, end) = rule
        if parts[-1] == "bias" and dim == 1:  # a row-parallel bias is added once, after the sum: rank 0's
            return w if self.rank == 0 else torch.zeros_like(w)  # type: ignore[arg-type]
        return slice_weight(w, dim, start, end)


def slice_weight(w: Stored, dim: int, start: int, end: int) -> Stored:
    """w[start:end] along `dim` as its own storage; quantized blocks are kept when the cut falls on block borders."""
    if isinstance(w, torch.Tensor):
        return w.narrow(dim, start, end - start).contiguous()
    if dim == 0:
        scales = None if w.scales is None else w.scales[start:end].contiguous()
        return QuantizedTensor(w.qtype, (end - start, w.shape[1]), w.data[start:end].contiguous(), scales)
    fmt = w.format
    if start % fmt.block or end % fmt.block:
        return w.dequantize(torch.float32).narrow(1, start, end - start).contiguous()
    b0, b1 = start // fmt.block * fmt.block_bytes, end // fmt.block * fmt.block_bytes
    return QuantizedTensor(w.qtype, (w.shape[0], end - start), w.data[:, b0:b1].contiguous(), w.scales)
