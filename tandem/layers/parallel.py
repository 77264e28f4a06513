"""Tensor parallelism (Megatron-style) inside one forward: which shard of the heads, the MLP and the vocabulary a rank
holds, and the collectives that join the shards, counted byte by byte.

A rank holds the kv heads `kv_heads` (an even split, the first ranks one more when they do not divide) with the query
heads of their groups, a slice of the MLP's intermediate features and a slice of the vocabulary. With more ranks than
kv heads (a multiple of them), each kv head is replicated on `size / num_kv_heads` consecutive ranks and its group's
query heads are split among them: every rank holds one kv head (its K/V projections and its KV cache) and the query
heads that read it, as vLLM does. q/k/v and gate/up are
split by output columns (no communication), o and down by input rows: each rank's output is a partial sum, joined by
one all-reduce. The embedding is looked up in each rank's vocabulary slice (zero rows elsewhere) and all-reduced; the
LM head's logits slices are gathered on rank 0. `TensorParallel(rank=0, size=1)` is the single-device case: every
collective is a no-op and nothing is counted.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from tandem.config import ConfigError, ModelConfig
from tandem.layers.linear import Projection


def even_split(n: int, parts: int, index: int) -> tuple[int, int]:
    """[start, end) of part `index` when `n` items are split in `parts` contiguous parts, the first ones one larger."""
    base, extra = divmod(n, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


@dataclass
class CommMeter:
    """Payload bytes this rank hands to each kind of collective (what it sends into the operation)."""

    bytes_by_op: Counter[str] = field(default_factory=Counter)
    calls_by_op: Counter[str] = field(default_factory=Counter)

    def add(self, op: str, tensor: torch.Tensor) -> None:
        self.bytes_by_op[op] += tensor.numel() * tensor.element_size()
        self.calls_by_op[op] += 1

    @property
    def total(self) -> int:
        return sum(self.bytes_by_op.values())

    def reset(self) -> None:
        self.bytes_by_op.clear()
        self.calls_by_op.clear()


@dataclass
class TensorParallel:
    """This rank's place in a tensor-parallel group and its collectives (torch.distributed's default group)."""

    rank: int = 0
    size: int = 1
    meter: CommMeter = field(default_factory=CommMeter)

    @property
    def enabled(self) -> bool:
        return self.size > 1

    def kv_replicas(self, cfg: ModelConfig) -> int:
        """Ranks that hold each kv head: 1 up to `num_kv_heads` ranks, `size / num_kv_heads` beyond."""
        kvh = cfg.num_kv_heads
        if self.size <= kvh:
            return 1
        if self.size % kvh or self.size > cfg.num_heads:
            raise ConfigError(f"tensor_parallel_size {self.size} exceeds the model's {kvh} kv heads: it must then be a "
                              f"multiple of them (each kv head replicated) and at most its {cfg.num_heads} query heads")
        return self.size // kvh

    def kv_heads(self, cfg: ModelConfig) -> tuple[int, int]:
        """[first, end) of this rank's kv heads (one replicated head when the ranks outnumber them)."""
        replicas = self.kv_replicas(cfg)
        if replicas > 1:
            head = self.rank // replicas
            return head, head + 1
        return even_split(cfg.num_kv_heads, self.size, self.rank)

    def q_heads(self, cfg: ModelConfig) -> tuple[int, int]:
        """[first, end) of this rank's query heads: those of its kv heads' groups (its share of the one group when
        its kv head is replicated)."""
        group = cfg.num_heads // cfg.num_kv_heads
        k0, k1 = self.kv_heads(cfg)
        replicas = self.kv_replicas(cfg)
        if replicas == 1:
            return k0 * group, k1 * group
        g0, g1 = even_split(group, replicas, self.rank % replicas)
        return k0 * group + g0, k0 * group + g1

    def intermediate(self, cfg: ModelConfig) -> tuple[int, int]:
        return even_split(cfg.intermediate_size, self.size, self.rank)

    def moe_intermediate(self, cfg: ModelConfig) -> tuple[int, int]:
        """[start, end) of every expert's intermediate features this rank holds."""
        return even_split(cfg.moe_intermediate_size, self.size, self.rank)

    def vocab(self, vocab_size: int) -> tuple[int, int]:
        return even_split(vocab_size, self.size, self.rank)

    def shard_config(self, cfg: ModelConfig) -> ModelConfig:
        """The architecture this rank computes: its heads and intermediate features (head_dim and hidden unchanged)."""
        if not self.enabled:
            return cfg
        q0, q1 = self.q_heads(cfg)
        k0, k1 = self.kv_heads(cfg)
        i0, i1 = self.intermediate(cfg)
        m0, m1 = self.moe_intermediate(cfg)
        return replace(cfg, num_heads=q1 - q0, num_kv_heads=k1 - k0, intermediate_size=i1 - i0, moe_intermediate_size=m1 - m0)

    def all_reduce(self, x: torch.Tensor, op: str = "all_reduce") -> torch.Tensor:
        """Sum `x` over the ranks, in place (the partial outputs of a row-parallel projection)."""
        if self.enabled:
            self.meter.add(op, x)
            dist.all_reduce(x)
        return x

    def embed(self, table: Projection, ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Embedding rows float32 [T, hidden] of `ids` from this rank's vocabulary slice of the table, summed."""
        if not self.enabled:
            return table.rows(ids)
        v0, v1 = self.vocab(vocab_size)
        mine = (ids >= v0) & (ids < v1)  # [T]
        rows = table.rows((ids - v0).clamp(0, v1 - v0 - 1))  # [T, hidden]
        rows = rows * mine[:, None].to(rows.dtype)
        return self.all_reduce(rows.contiguous(), "embed_all_reduce")

    def gather_logits(self, local: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Logits slices [R, V_rank] float32 -> [R, V] on rank 0 (the other ranks get their slice back)."""
        if not self.enabled:
            return local
        width = even_split(vocab_size, self.size, 0)[1]  # the widest slice; narrower ones are padded to it
        padded = torch.nn.functional.pad(local, (0, width - local.shape[1])).contiguous()
        self.meter.add("logits_gather", padded)
        parts = [torch.empty_like(padded) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(padded, parts, dst=0)
        if parts is None:
            return local
        return torch.cat([p[:, : self.vocab_slice_width(r, vocab_size)] for r, p in enumerate(parts)], dim=1)

    def vocab_slice_width(self, rank: int, vocab_size: int) -> int:
        start, end = even_split(vocab_size, self.size, rank)
        return end - start
