"""The batched sampler: logits rows -> processed logits -> final distributions -> tokens (+ logprobs).

Processing follows vLLM v1's order:
  1. grammar bitmask (disallowed -> -inf)
  2. allowed_token_ids (all others -> -inf)
  3. min_tokens (EOS and stop_token_ids -> -inf while fewer than min_tokens outputs)
  4. logit_bias (added)
  5. repetition penalty over prompt + output tokens (positive logits / r, negative * r),
     then frequency and presence penalties over output tokens (logit -= f * count + p * [count > 0])
  6. greedy rows: argmax. Random rows: temperature, min-p, top-k, top-p (vLLM v1 applies min-p, an
     argmax-invariant processor, before its top-k/top-p sampler), softmax, exponential race.

Every step is vectorised over rows: per-row parameters become [R] tensors and each step runs only when some row
needs it (no penalties -> no counts tensor, all greedy -> no softmax, no top-k/top-p -> no sort).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from tandem.params import SamplingParams
from tandem.sampling.bitmask import apply_token_bitmask_

_NEG_INF = float("-inf")
# Exponential noise is clamped away from 0 so p / q never becomes 0 / 0 (NaN wins argmax) or picks a p = 0 token.
_MIN_NOISE = torch.finfo(torch.float32).tiny


@dataclass
class SamplingRow:
    """One logits row to sample: the request's parameters, its tokens so far and its own generator (if seeded)."""

    params: SamplingParams
    prompt_token_ids: Sequence[int] = ()
    output_token_ids: Sequence[int] = ()  # generated before this row's position (penalties, min_tokens)
    generator: torch.Generator | None = None  # seeded requests: this row's own (`keyed_generator`: its position's)


@dataclass
class RowLogprobs:
    """Logprobs of one row: the chosen token's, its rank (1 = argmax) and the top-n."""

    token_id: int
    logprob: float
    rank: int
    top_ids: list[int]
    top_logprobs: list[float]


@dataclass
class SamplerOutput:
    token_ids: list[int]  # one per row
    logprobs: list[RowLogprobs | None]  # None where params.logprobs is None
    dead_rows: list[int] = field(default_factory=list)  # rows where no token was allowed (their token means nothing)


# ---------------------------------------------------------------------------------------------------------------
# Row-parameter helpers (CPU lists -> device tensors)
# ---------------------------------------------------------------------------------------------------------------


def _index(ids: Sequence[int], device: torch.device) -> Tensor:
    return torch.tensor(ids, dtype=torch.long).to(device, non_blocking=True)


def _select_rows(x: Tensor, idx: list[int]) -> Tensor:
    """x[idx] (a copy), or x itself when idx names every row in order."""
    if len(idx) == x.shape[0]:
        return x
    return x.index_select(0, _index(idx, x.device))


def _pairs(rows_tokens: Sequence[tuple[int, Sequence[int]]]) -> tuple[list[int], list[int]]:
    """Flatten [(row, [tok, ...]), ...] into parallel (row_ids, token_ids) lists for index_put_."""
    row_ids: list[int] = []
    tok_ids: list[int] = []
    for row, toks in rows_tokens:
        row_ids.extend([row] * len(toks))
        tok_ids.extend(toks)
    return row_ids, tok_ids


# ---------------------------------------------------------------------------------------------------------------
# Logits processing steps (each changes `logits` [R, V] float32 in place)
# ---------------------------------------------------------------------------------------------------------------


def apply_allowed_token_ids_(logits: Tensor, rows: Sequence[SamplingRow]) -> None:
    """Rows with allowed_token_ids: every other token -> -inf."""
    limited = [(i, r.params.allowed_token_ids) for i, r in enumerate(rows) if r.params.allowed_token_ids is not None]
    if not limited:
        return
    row_ids, tok_ids = _pairs([(i, ids or ()) for i, ids in limited])
    ri, ti = _index(row_ids, logits.device), _index(tok_ids, logits.device)
    kept = logits[ri, ti]  # [n_allowed]
    logits.index_fill_(0, _index([i for i, _ in limited], logits.device), _NEG_INF)
    logits.index_put_((ri, ti), kept)


def apply_min_tokens_(logits: Tensor, rows: Sequence[SamplingRow], eos_token_ids: Sequence[int]) -> None:
    """Rows with fewer than min_tokens outputs: EOS and stop_token_ids -> -inf."""
    blocked = [
        (i, tuple(eos_token_ids) + r.params.stop_token_ids)
        for i, r in enumerate(rows)
        if len(r.output_token_ids) < r.params.min_tokens
    ]
    row_ids, tok_ids = _pairs(blocked)
    if not row_ids:
        return
    logits.index_put_((_index(row_ids, logits.device), _index(tok_ids, logits.device)),
                      torch.tensor(_NEG_INF, device=logits.device))


def apply_logit_bias_(logits: Tensor, rows: Sequence[SamplingRow]) -> None:
    """logits[i, t] += logit_bias[t] for each row's bias entries."""
    row_ids: list[int] = []
    tok_ids: list[int] = []
    biases: list[float] = []
    for i, r in enumerate(rows):
        for tok, bias in (r.params.logit_bias or {}).items():
            row_ids.append(i)
            tok_ids.append(tok)
            biases.append(bias)
    if not row_ids:
        return
    dev = logits.device
    values = torch.tensor(biases, dtype=logits.dtype).to(dev, non_blocking=True)
    logits.index_put_((_index(row_ids, dev), _index(tok_ids, dev)), values, accumulate=True)


def only_greedy(rows: Sequence[SamplingRow]) -> bool:
    """Every row greedy, with no allowed ids, logit bias, penalty or pending min_tokens to change its logits (what
    the sampling calls' `all_greedy` argument says, when the caller knows it ahead)."""
    for r in rows:
        p = r.params
        if not p.greedy or p.allowed_token_ids is not None or p.logit_bias or _has_penalty(p):
            return False
        if len(r.output_token_ids) < p.min_tokens:
            return False
    return True


def _wants_logprobs(rows: Sequence[SamplingRow]) -> bool:
    return any(r.params.logprobs is not None for r in rows)


def greedy_kernel_loaded() -> bool:
    """Whether `torch.ops.tandem.greedy_tokens` is registered in this process (tandem/layers/kernels.py loads it)."""
    if _GREEDY_KERNEL:
        return True
    try:
        torch.ops.tandem.greedy_tokens  # noqa: B018 - the lookup is the check
    except (AttributeError, RuntimeError):
        return False
    _GREEDY_KERNEL.append(True)
    return True


_GREEDY_KERNEL: list[bool] = []  # [True] once found (the op cannot be unregistered)


def _has_penalty(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


def apply_penalties_(logits: Tensor, rows: Sequence[SamplingRow]) -> None:
    """Repetition (prompt + output tokens), then frequency and presence (output tokens) penalties.

    repetition r: seen token logit l -> l / r if l > 0 else l * r.
    frequency f, presence p: l -> l - f * count - p * [count > 0], count = occurrences in the output.
    """
    pen = [i for i, r in enumerate(rows) if _has_penalty(r.params)]
    if not pen:
        return
    dev, vocab = logits.device, logits.shape[-1]
    sub_rows = [rows[i] for i in pen]
    x = _select_rows(logits, pen)  # [P, V]; every update below makes a new tensor, so `logits` is read-only here
    out_r, out_t = _pairs([(j, r.output_token_ids) for j, r in enumerate(sub_rows)])
    counts = torch.zeros(len(pen), vocab, dtype=x.dtype, device=dev)  # [P, V] occurrences in the output
    if out_r:
        counts.index_put_((_index(out_r, dev), _index(out_t, dev)),
                          torch.ones(len(out_r), dtype=x.dtype, device=dev), accumulate=True)
    seen_out = counts > 0  # [P, V]

    rep_list = [r.params.repetition_penalty for r in sub_rows]
    if any(v != 1.0 for v in rep_list):
        seen = seen_out.clone()
        pr_r, pr_t = _pairs([(j, r.prompt_token_ids) for j, r in enumerate(sub_rows) if r.params.repetition_penalty != 1.0])
        if pr_r:
            seen[_index(pr_r, dev), _index(pr_t, dev)] = True
        rep = torch.tensor(rep_list, dtype=x.dtype).to(dev, non_blocking=True).unsqueeze(1)  # [P, 1]
        x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)

    freq_list = [r.params.frequency_penalty for r in sub_rows]
    pres_list = [r.params.presence_penalty for r in sub_rows]
    if any(freq_list) or any(pres_list):
        freq = torch.tensor(freq_list, dtype=x.dtype).to(dev, non_blocking=True).unsqueeze(1)  # [P, 1]
        pres = torch.tensor(pres_list, dtype=x.dtype).to(dev, non_blocking=True).unsqueeze(1)  # [P, 1]
        x = x - freq * counts - pres * seen_out.to(x.dtype)
    logits.index_copy_(0, _index(pen, dev), x)


def apply_min_p_(logits: Tensor, min_p: Tensor) -> None:
    """Tokens with prob < min_p * max prob -> -inf. logits [R, V], min_p [R] (0 = off)."""
    probs = logits.softmax(dim=-1)  # [R, V]
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)  # [R, 1]
    logits.masked_fill_(probs < threshold, _NEG_INF)


def apply_top_k_top_p(logits: Tensor, top_k: Tensor | None, top_p: Tensor | None) -> Tensor:
    """Keep each row's top-k tokens (ties with the k-th kept), then the smallest prefix of them with mass >= top_p.

    logits [R, V]; top_k [R] long in [1, V] (V = off); top_p [R] in (0, 1] (1 = off). Returns new logits [R, V]
    with the dropped tokens at -inf. One descending sort serves both filters.
    """
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [R, V] each
    if top_k is not None:
        kth = sorted_logits.gather(1, (top_k - 1).unsqueeze(1))  # [R, 1] the k-th largest logit
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, _NEG_INF)
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)  # [R, V] descending
        mass_before = probs.cumsum(dim=-1) - probs  # exclusive prefix mass; 0 at the argmax, so it always stays
        drop = (mass_before >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(drop, _NEG_INF)
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


# ---------------------------------------------------------------------------------------------------------------
# Randomness
# ---------------------------------------------------------------------------------------------------------------


_MASK64 = (1 << 64) - 1


def keyed_generator(generator: torch.Generator, position: int) -> torch.Generator:
    """A generator for the token at output `position` of the sequence seeded by `generator`, seeded from that seed and
    the position (splitmix64): the token's draws are the same however the steps before it ran, with drafts or
    without, verified in any number, in any batch."""
    z = (generator.initial_seed() * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return torch.Generator(generator.device).manual_seed((z ^ (z >> 31)) >> 1)


def exponential_noise(generators: Sequence[torch.Generator | None], vocab_size: int, device: torch.device) -> Tensor:
    """[n, V] i.i.d. Exp(1) noise, one row per entry of `generators`.

    Rows with a generator draw exactly V values from it (in list order), so a seeded request's noise does not depend
    on the rest of the batch; the other rows come from one batched call on the default generator (untouched when
    every row is seeded).
    """
    q = torch.empty(len(generators), vocab_size, device=device)  # [n, V]
    seeded = [j for j, g in enumerate(generators) if g is not None]
    if len(seeded) < len(generators):
        shared = [j for j, g in enumerate(generators) if g is None]
        if not seeded:
            q.exponential_()
        else:
            q.index_copy_(0, _index(shared, device), torch.empty(len(shared), vocab_size, device=device).exponential_())
    if seeded:
        own = torch.stack([
            torch.empty(vocab_size, device=g.device).exponential_(generator=g).to(device)
            for g in generators if g is not None
        ])  # [n_seeded, V]
        q.index_copy_(0, _index(seeded, device), own)
    return q.clamp_(min=_MIN_NOISE)


def exponential_race(probs: Tensor, generators: Sequence[torch.Generator | None]) -> Tensor:
    """One token per row drawn from `probs` [n, V] (need not be normalised): argmax(probs / q), q ~ Exp(1).

    P(argmax = t) = probs[t] / sum(probs) (the first arrival of independent exponential clocks with rates probs).
    Returns [n] long.
    """
    q = exponential_noise(generators, probs.shape[-1], probs.device)
    return (probs / q).argmax(dim=-1)


def uniforms(generators: Sequence[torch.Generator | None], device: torch.device) -> Tensor:
    """[n] U[0, 1) draws, one per entry; entries with a generator draw from it in list order."""
    seeded = [j for j, g in enumerate(generators) if g is not None]
    if not seeded:
        return torch.rand(len(generators), device=device)
    u = torch.empty(len(generators), device=device)
    if len(seeded) < len(generators):
        shared = [j for j, g in enumerate(generators) if g is None]
        u.index_copy_(0, _index(shared, device), torch.rand(len(shared), device=device))
    own = torch.cat([torch.rand(1, device=g.device, generator=g).to(device) for g in generators if g is not None])
    u.index_copy_(0, _index(seeded, device), own)
    return u


# ---------------------------------------------------------------------------------------------------------------
# Logprobs
# ---------------------------------------------------------------------------------------------------------------


def _row_logprobs(logprobs: Tensor, token_ids: Tensor, top_ns: Sequence[int]) -> list[RowLogprobs]:
    """RowLogprobs of each row of `logprobs` [n, V] for `token_ids` [n] with top-`top_ns[i]` lists."""
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))  # [n, 1]
    ranks = ((logprobs > chosen).sum(dim=-1) + 1).tolist()  # rank 1 = argmax
    max_n = min(max(top_ns, default=0), logprobs.shape[-1])
    if max_n > 0:
        top_vals, top_ids = logprobs.topk(max_n, dim=-1)  # [n, max_n], descending
        top_vals_l, top_ids_l = top_vals.tolist(), top_ids.tolist()
    else:
        top_vals_l = top_ids_l = [[] for _ in top_ns]
    return [
        RowLogprobs(token_id=t, logprob=lp, rank=rank, top_ids=ids[:n], top_logprobs=vals[:n])
        for t, lp, rank, ids, vals, n in zip(
            token_ids.tolist(), chosen.squeeze(1).tolist(), ranks, top_ids_l, top_vals_l, top_ns, strict=True
        )
    ]


def top_candidates(logits: Tensor, rows: Sequence[int], k: int) -> list[tuple[list[float], list[int]]]:
    """The k largest logits of each of `rows` of logits [R, V], as host lists (values, token ids), unordered ties.
    For rows sampled greedily without their grammar mask whose argmax the grammar rejected."""
    sub = logits.index_select(0, _index(rows, logits.device))  # [n, V], the logits' dtype (bf16: exact in float)
    values, ids = sub.topk(min(k, sub.shape[-1]), dim=-1)  # [n, k] each; 1.6x faster than on a float32 copy
    return list(zip(values.float().cpu().tolist(), ids.cpu().tolist(), strict=True))


def tied_ids(logits: Tensor, rows: Sequence[int], values: Sequence[float], limit: int) -> list[list[int] | None]:
    """For each (row, value): the token ids whose logit in that row of logits [R, V] equals `value`, ascending; None
    where more than `limit` do. For a top-k candidate walk that a tie at the k-th value left undecided."""
    out: list[list[int] | None] = []
    for row, value in zip(rows, values, strict=True):
        ids = (logits[row] == value).nonzero().flatten()  # [n] ascending; the logits' dtype holds `value` exactly
        out.append(ids.cpu().tolist() if ids.numel() <= limit else None)
    return out


def prompt_logprobs(
    logits: Tensor, next_token_ids: Sequence[int], top_n: int, chunk_rows: int = 256
) -> list[RowLogprobs]:
    """Logprobs of the raw model logits [N, V] for the prompt's next tokens [N], with top-`top_n` lists.

    Works through `chunk_rows` rows at a time, so a long prompt never holds a float32 [N, V] copy.
    """
    if logits.shape[0] != len(next_token_ids):
        raise ValueError(f"{logits.shape[0]} logits rows but {len(next_token_ids)} next tokens")
    out: list[RowLogprobs] = []
    for start in range(0, len(next_token_ids), chunk_rows):
        stop = min(start + chunk_rows, len(next_token_ids))
        logprobs = logits[start:stop].float().log_softmax(dim=-1)  # [chunk, V]
        tokens = _index(next_token_ids[start:stop], logits.device)
        out.extend(_row_logprobs(logprobs, tokens, [top_n] * (stop - start)))
    return out


# ---------------------------------------------------------------------------------------------------------------
# The sampler
# ---------------------------------------------------------------------------------------------------------------


class Sampler:
    """Turns a batch of logits rows into tokens, one row per `SamplingRow` (vectorised over rows)."""

    def __init__(self, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)

    # -- steps 1-5 ------------------------------------------------------------------------------------------

    def processed_logits(self, logits: Tensor, rows: Sequence[SamplingRow], bitmask: Tensor | None = None) -> Tensor:
        """A float32 copy [R, V] of `logits` after bitmask, allowed ids, min_tokens, logit_bias and penalties.

        Columns at or beyond `vocab_size` (a padded lm_head) are -inf. `logits` is not changed.
        """
        if logits.shape[0] != len(rows):
            raise ValueError(f"{logits.shape[0]} logits rows but {len(rows)} sampling rows")
        x = logits.to(torch.float32, copy=True)  # [R, V]
        if x.shape[-1] > self.vocab_size:
            x[:, self.vocab_size:] = _NEG_INF
        if bitmask is not None:
            apply_token_bitmask_(x, bitmask)
        apply_allowed_token_ids_(x, rows)
        apply_min_tokens_(x, rows, self.eos_token_ids)
        apply_logit_bias_(x, rows)
        apply_penalties_(x, rows)
        return x

    # -- step 6 ---------------------------------------------------------------------------------------------

    def _random_probs(self, x: Tensor, rows: Sequence[SamplingRow]) -> Tensor:
        """The distribution [n, V] of non-greedy rows from processed logits `x` [n, V]: temperature, min-p,
        top-k, top-p, softmax. `x` may be changed."""
        dev, vocab = x.device, x.shape[-1]
        params = [r.params for r in rows]
        temps = torch.tensor([p.temperature for p in params], dtype=x.dtype).to(dev, non_blocking=True)
        x = x / temps.unsqueeze(1)
        if any(p.min_p > 0.0 for p in params):
            apply_min_p_(x, torch.tensor([p.min_p for p in params], dtype=x.dtype).to(dev, non_blocking=True))
        use_k = any(0 < p.top_k < vocab for p in params)
        use_p = any(p.top_p < 1.0 for p in params)
        if use_k or use_p:
            top_k = _index([p.top_k if 0 < p.top_k < vocab else vocab for p in params], dev) if use_k else None
            top_p = torch.tensor([p.top_p for p in params], dtype=x.dtype).to(dev, non_blocking=True) if use_p else None
            x = apply_top_k_top_p(x, top_k, top_p)
        return x.softmax(dim=-1)

    @staticmethod
    def dead_rows(x: Tensor) -> list[int]:
        """Rows of processed logits `x` [R, V] where every token is -inf (a grammar, min_tokens, stop ids, allowed
        ids and logit bias that together exclude everything). They are set to 0 in place, so what is drawn from
        them is finite and harmless: the caller must discard it."""
        dead = torch.isneginf(x).all(dim=-1)  # [R]
        if not bool(dead.any()):
            return []
        x[dead] = 0.0
        return dead.nonzero().flatten().tolist()

    def probs(self, logits: Tensor, rows: Sequence[SamplingRow], bitmask: Tensor | None = None) -> Tensor:
        """[R, V] the distribution each row samples from; greedy rows are one-hot at the argmax. A row where no
        token is allowed comes out all zero."""
        x = self.processed_logits(logits, rows, bitmask)
        dead = self.dead_rows(x)
        greedy = [i for i, r in enumerate(rows) if r.params.greedy]
        rand = [i for i, r in enumerate(rows) if not r.params.greedy]
        out = torch.zeros_like(x)  # [R, V]
        if greedy:
            g_idx = _index(greedy, x.device)
            top = _select_rows(x, greedy).argmax(dim=-1)  # [G]
            out[g_idx, top] = 1.0
        if rand:
            p = self._random_probs(_select_rows(x, rand), [rows[i] for i in rand])  # [n_rand, V]
            out.index_copy_(0, _index(rand, x.device), p)
        if dead:
            out[_index(dead, x.device)] = 0.0
        return out

    def sample(self, logits: Tensor, rows: Sequence[SamplingRow], bitmask: Tensor | None = None,
               all_greedy: bool | None = None, index: Tensor | None = None) -> SamplerOutput:
        """One token per row (greedy: argmax; otherwise an exponential race over the final distribution), plus
        logprobs of the raw logits where requested. Seeded rows consume V exponentials from their generator.
        `all_greedy`: `only_greedy(rows)`, when the caller made it ahead (None: asked here). `index` (int64 [R]):
        the rows of `logits` to sample, in order (None: all of them): read where they are by the fused greedy path
        when no row wants logprobs, else copied out first."""
        all_greedy = only_greedy(rows) if all_greedy is None else all_greedy
        if index is not None:
            fused = None if _wants_logprobs(rows) else self.greedy_tokens(logits, rows, bitmask, all_greedy, index)
            if fused is not None:
                return self._from_fused(fused, logits, rows)  # (no logprobs: the logits are not read again)
            logits = logits.index_select(0, index)
        if all_greedy and self._plain_greedy(logits, bitmask):  # nothing changes the logits: argmax of them, no copy
            tokens = logits.argmax(dim=-1)
            ids = tokens.tolist()
            return SamplerOutput(token_ids=ids, logprobs=self._logprobs(logits, ids, rows))
        fused = self.greedy_tokens(logits, rows, bitmask, all_greedy)
        if fused is not None:
            return self._from_fused(fused, logits, rows)
        x = self.processed_logits(logits, rows, bitmask)
        dead = self.dead_rows(x)
        greedy = [i for i, r in enumerate(rows) if r.params.greedy]
        rand = [i for i, r in enumerate(rows) if not r.params.greedy]
        if not rand:
            tokens = x.argmax(dim=-1)  # [R]
        else:
            rand_rows = [rows[i] for i in rand]
            p = self._random_probs(_select_rows(x, rand), rand_rows)  # [n_rand, V]
            drawn = exponential_race(p, [r.generator for r in rand_rows])  # [n_rand]
            if not greedy:
                tokens = drawn
            else:
                tokens = torch.empty(len(rows), dtype=torch.long, device=x.device)
                tokens.index_copy_(0, _index(rand, x.device), drawn)
                tokens.index_copy_(0, _index(greedy, x.device), _select_rows(x, greedy).argmax(dim=-1))
        ids = tokens.tolist()
        return SamplerOutput(token_ids=ids, logprobs=self._logprobs(logits, ids, rows), dead_rows=dead)

    def _from_fused(self, fused: list[int], logits: Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        """The output of `greedy_tokens`' tokens `fused` (-1: a dead row, given token 0) for `rows` of `logits`."""
        dead = [i for i, t in enumerate(fused) if t < 0]
        ids = [max(t, 0) for t in fused]
        return SamplerOutput(token_ids=ids, logprobs=self._logprobs(logits, ids, rows), dead_rows=dead)

    def _plain_greedy(self, logits: Tensor, bitmask: Tensor | None) -> bool:
        """For rows all greedy (`only_greedy`): True when no processing step of `processed_logits` would change a
        value."""
        return bitmask is None and logits.shape[-1] <= self.vocab_size and logits.dtype == torch.float32

    def _fused_greedy_applies(self, logits: Tensor, bitmask: Tensor | None, num_rows: int) -> bool:
        """For `num_rows` rows of `logits`, all greedy (`only_greedy`): True when nothing but a grammar bitmask and
        the vocabulary's end changes the logits, and they are on the host, where `torch.ops.tandem.greedy_tokens`
        (tandem's CPU kernels) is loaded."""
        if logits.device.type != "cpu" or logits.dim() != 2 or logits.stride(-1) != 1 or not greedy_kernel_loaded():
            return False
        return bitmask is None or (bitmask.device.type == "cpu" and bitmask.dtype == torch.int32
                                   and bitmask.shape[0] == num_rows)

    def greedy_tokens(self, logits: Tensor, rows: Sequence[SamplingRow], bitmask: Tensor | None = None,
                      all_greedy: bool | None = None, index: Tensor | None = None) -> list[int] | None:
        """Each row's greedy token, -1 where no token is allowed, in one fused pass over the logits when
        `_fused_greedy_applies` (else None: the caller takes the general path). The same tokens and dead rows as
        processed_logits + argmax, without the [R, V] float32 copy and unpacked mask (256 rows x 200k tokens:
        ~0.2-0.5 s -> 6 ms a step on 2 cores, docs/benchmarks.md). `all_greedy`, `index` (the rows read, in place): as in `sample`."""
        if not (only_greedy(rows) if all_greedy is None else all_greedy):
            return None
        if not self._fused_greedy_applies(logits, bitmask, logits.shape[0] if index is None else index.numel()):
            return None
        mask = bitmask.contiguous() if bitmask is not None else None
        vocab = min(self.vocab_size, logits.shape[-1])
        out: list[int] = torch.ops.tandem.greedy_tokens(logits, mask, vocab, index).tolist()
        return out

    def _logprobs(self, logits: Tensor, token_ids: list[int], rows: Sequence[SamplingRow]) -> list[RowLogprobs | None]:
        """Logprobs of the raw logits (log_softmax before any processing) for rows that asked for them (`token_ids`:
        each row's token)."""
        want = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        out: list[RowLogprobs | None] = [None] * len(rows)
        if not want:
            return out
        raw = _select_rows(logits[:, : self.vocab_size], want).float().log_softmax(dim=-1)  # [n, V]
        chosen = torch.tensor([token_ids[i] for i in want], dtype=torch.long, device=logits.device)  # [n]
        top_ns = [rows[i].params.logprobs or 0 for i in want]
        for i, lp in zip(want, _row_logprobs(raw, chosen, top_ns), strict=True):
            out[i] = lp
        return out
