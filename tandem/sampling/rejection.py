"""Speculative-decoding verification: lossless rejection sampling of draft tokens against the target model.

For a draft d proposed from q at a position where the target's (fully processed) distribution is p:
  accept d with probability min(1, p(d) / q(d));
  on rejection emit a token from norm(max(0, p - q)) and stop;
  when all k drafts are accepted, emit one bonus token from p at the row after the last draft.
Every emitted token is then distributed exactly as the target's (Leviathan et al. 2023, Chen et al. 2023).
A deterministic proposer has q = one-hot(d): accept with probability p(d), residual = p with d removed. That is the
law of sampling each row y ~ p and accepting d iff y == d (emitting y at the first mismatch), which is how such drafts
are verified: each row draws as it would without drafts (a seeded request with its position's generator), so a seeded
request emits exactly the tokens it emits without drafts, whatever was drafted, scheduled ahead or not, in any batch.
Greedy rows accept iff d == argmax p and emit argmax p, which is what non-speculative greedy decoding emits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import NamedTuple

import torch
from torch import Tensor

from tandem.sampling.sampler import Sampler, SamplingRow, exponential_race, uniforms


@dataclass
class DraftRows:
    """One request's k drafts and, for a probabilistic proposer, its distribution q at each draft position."""

    draft_token_ids: list[int]
    draft_probs: Tensor | None = None  # [k, V] q per draft position; None = deterministic proposer (one-hot)


class Verified(NamedTuple):
    """One request's verification: the emitted tokens (accepted drafts, then the recovered or bonus token). `dead`:
    the walk reached a row where no token is allowed (see `Sampler.dead_rows`); `tokens` then holds only the drafts
    accepted before that row, and the request cannot go on."""

    tokens: list[int]
    dead: bool = False


def _index(ids: Sequence[int], device: torch.device) -> Tensor:
    return torch.tensor(ids, dtype=torch.long).to(device, non_blocking=True)


def residual_probs(target: Tensor, draft: Tensor) -> Tensor:
    """max(0, p - q) [n, V] (unnormalised) for target p and draft q [n, V]; p itself where that has no mass.

    After a rejection the residual has mass sum(max(0, q - p)) >= q(d) - p(d) > 0, so the fallback only guards
    against rounding when p == q.
    """
    residual = (target - draft).clamp_(min=0.0)
    empty = residual.sum(dim=-1, keepdim=True) <= 0.0  # [n, 1]
    return torch.where(empty, target, residual)


def _draft_distribution(drafts: Sequence[DraftRows], vocab_size: int, device: torch.device) -> Tensor:
    """q [D, V] for all draft positions, requests in order: the given probs, or one-hot at the draft."""
    num = sum(len(d.draft_token_ids) for d in drafts)
    q = torch.zeros(num, vocab_size, device=device)  # [D, V]
    one_hot_pos: list[int] = []
    one_hot_tok: list[int] = []
    given_pos: list[int] = []
    given: list[Tensor] = []
    pos = 0
    for d in drafts:
        k = len(d.draft_token_ids)
        if d.draft_probs is None:
            one_hot_pos.extend(range(pos, pos + k))
            one_hot_tok.extend(d.draft_token_ids)
        elif k > 0:
            if d.draft_probs.dim() != 2 or d.draft_probs.shape[0] != k or d.draft_probs.shape[1] > vocab_size:
                raise ValueError(f"draft_probs has shape {tuple(d.draft_probs.shape)}, expected [{k}, <= {vocab_size}]")
            given_pos.extend(range(pos, pos + k))
            given.append(d.draft_probs)
        pos += k
    if one_hot_pos:
        q[_index(one_hot_pos, device), _index(one_hot_tok, device)] = 1.0
    if given:
        # A draft model with a smaller vocabulary puts no mass on the rest: pad to V.
        if len({b.shape[1] for b in given}) > 1:
            given = [torch.nn.functional.pad(b, (0, vocab_size - b.shape[1])) for b in given]
        block = torch.cat(given).to(device=device, dtype=torch.float32, non_blocking=True)  # [Dg, V or V_draft]
        q.index_copy_(0, _index(given_pos, device), torch.nn.functional.pad(block, (0, vocab_size - block.shape[1])))
    return q


def rejection_sample(
    sampler: Sampler,
    target_logits: Tensor,
    rows: Sequence[SamplingRow],
    drafts: Sequence[DraftRows],
    bitmask: Tensor | None = None,
    all_greedy: bool | None = None,
) -> list[Verified]:
    """Verify each request's drafts; returns per request the emitted tokens (accepted drafts + one more), or, when
    its walk reaches a row where nothing is allowed (see `Sampler.dead_rows`), the drafts accepted before it and
    `dead`. Rows past the walk's end (after a rejection) do not matter, dead or not.

    target_logits [sum(k_i + 1), V]: request i owns k_i + 1 consecutive rows (its last real token's position, then
    each draft's); `rows` and `bitmask` match those rows one to one. Each row draws from its own generator (seeded
    requests: `keyed_generator`, its position's): one-hot drafts' rows and the bonus row one noise vector, a draft
    model's rows a uniform then one residual noise vector; greedy requests draw nothing.
    `all_greedy`: `only_greedy(rows)` when the caller made it ahead (sampling/sampler.py)."""
    sizes, starts = _request_rows(drafts, target_logits.shape[0], len(rows))
    fused = sampler.greedy_tokens(target_logits, rows, bitmask, all_greedy)  # all greedy, on the host: [N], -1 = dead
    if fused is not None:
        return _greedy_verify(drafts, fused, starts)
    p = sampler.probs(target_logits, rows, bitmask)  # [N, V]
    dev, vocab = p.device, p.shape[-1]

    heads = [rows[s] for s in starts]  # one request's rows share params
    greedy = [h.params.greedy for h in heads]
    draft_rows = [s + j for s, n in zip(starts, sizes, strict=True) for j in range(n - 1)]  # [D]
    draft_req = [i for i, n in enumerate(sizes) for _ in range(n - 1)]  # [D] owning request
    bonus_rows = [s + n - 1 for s, n in zip(starts, sizes, strict=True)]  # [n_req]

    targets = p.argmax(dim=-1)  # [N] greedy choice (p is one-hot on greedy rows)
    recovered = targets[_index(draft_rows, dev)]  # [D]
    bonus = targets[_index(bonus_rows, dev)]  # [n_req]
    draft_ids = _index([t for d in drafts for t in d.draft_token_ids], dev)  # [D]
    p_d = p[_index(draft_rows, dev), draft_ids]  # [D] p(d)
    accept = p_d > 0.5  # greedy: p is one-hot, so this is d == argmax p; random entries are overwritten below

    given = [d.draft_probs is not None for d in drafts]
    matched = [j for j, i in enumerate(draft_req) if not greedy[i] and not given[i]]
    if matched:  # one-hot drafts: each row samples as without drafts; a draft is accepted iff it is its row's sample
        pos = _index(matched, dev)
        sampled = _row_samples(p, rows, [draft_rows[j] for j in matched])  # [Dm]
        accept[pos] = sampled == draft_ids[pos]
        recovered[pos] = sampled
    weighed = [j for j, i in enumerate(draft_req) if not greedy[i] and given[i]]
    if weighed:  # a draft model's q: accept with probability p(d) / q(d), else a token from the residual
        pos = _index(weighed, dev)
        q = _draft_distribution([d for d, g, w in zip(drafts, greedy, given, strict=True) if w and not g], vocab, dev)
        accept[pos], recovered[pos] = _weigh(p, q, rows, [draft_rows[j] for j in weighed], draft_ids[pos])
    rand_req = [i for i, g in enumerate(greedy) if not g]
    if rand_req:
        bonus[_index(rand_req, dev)] = _row_samples(p, rows, [bonus_rows[i] for i in rand_req])

    emitted = _accept_walk(drafts, accept.tolist(), recovered.tolist(), bonus.tolist())
    dead = (p.sum(dim=-1) == 0).tolist()  # [N] rows with nothing allowed come out of `probs` all zero
    # a dead row has p(d) = 0, so no draft there is accepted: the walk's last token comes from the first dead row
    # it reaches, and means nothing
    return [Verified(e[:-1], True) if dead[s + len(e) - 1] else Verified(e) for e, s in zip(emitted, starts, strict=True)]


def _weigh(p: Tensor, q: Tensor, rows: Sequence[SamplingRow], index: list[int], draft_ids: Tensor) -> tuple[Tensor, Tensor]:
    """Drafts `draft_ids` [Dw] of a draft model at the rows `index` of `p` [N, V], q [Dw, V] their distributions:
    (accepted [Dw] with probability min(1, p(d) / q(d)), each row's token from the residual norm(max(0, p - q)))."""
    gens = [rows[r].generator for r in index]
    p_rows = p[_index(index, p.device)]  # [Dw, V]
    q_d = q.gather(1, draft_ids.unsqueeze(1)).squeeze(1)  # [Dw] q(d)
    p_d = p_rows.gather(1, draft_ids.unsqueeze(1)).squeeze(1)  # [Dw] p(d)
    accepted = uniforms(gens, p.device) * q_d < p_d  # u < p(d) / q(d), safe for q(d) = 0
    return accepted, exponential_race(residual_probs(p_rows, q), gens)


def _row_samples(p: Tensor, rows: Sequence[SamplingRow], index: list[int]) -> Tensor:
    """One token from each of the rows `index` of `p` [N, V], with its own generator (seeded rows: their position's)."""
    return exponential_race(p[_index(index, p.device)], [rows[r].generator for r in index])


def greedy_verify(sampler: Sampler, logits: Tensor, index: Tensor, rows: Sequence[SamplingRow],
                  drafts: Sequence[DraftRows], bitmask: Tensor | None = None,
                  all_greedy: bool | None = None) -> list[Verified] | None:
    """`rejection_sample` of the rows `index` (int64 [N]) of `logits`, read where they are, when every row is greedy
    and the sampler's fused greedy kernel applies (`Sampler.greedy_tokens`); None otherwise (the caller copies the
    rows out for `rejection_sample`)."""
    starts = _request_rows(drafts, index.numel(), len(rows))[1]
    fused = sampler.greedy_tokens(logits, rows, bitmask, all_greedy, index)
    return None if fused is None else _greedy_verify(drafts, fused, starts)


def _request_rows(drafts: Sequence[DraftRows], num_targets: int, num_rows: int) -> tuple[list[int], list[int]]:
    """Each request's rows (k + 1) and its first row; ValueError unless the target and sampling rows are theirs."""
    sizes = [len(d.draft_token_ids) + 1 for d in drafts]
    if sum(sizes) != num_targets or num_rows != num_targets:
        raise ValueError(f"{num_targets} target rows, {num_rows} sampling rows, drafts need {sum(sizes)}")
    return sizes, [0, *accumulate(sizes)][:-1]


def _greedy_verify(drafts: Sequence[DraftRows], targets: list[int], starts: list[int]) -> list[Verified]:
    """`rejection_sample` when every row is greedy, from each row's greedy token (-1: nothing allowed): a draft is
    accepted iff it is its row's token; a dead row accepts nothing and ends its request's walk as dead."""
    out: list[Verified] = []
    for d, s in zip(drafts, starts, strict=True):
        emitted: list[int] = []
        for j, tok in enumerate([*d.draft_token_ids, None]):
            target = targets[s + j]
            if target < 0:
                out.append(Verified(emitted, True))
                break
            emitted.append(target)
            if tok != target:
                out.append(Verified(emitted))
                break
    return out


def _accept_walk(
    drafts: Sequence[DraftRows], accept: list[bool], recovered: list[int], bonus: list[int]
) -> list[list[int]]:
    """Per request: drafts up to the first rejection, then that position's recovered token (or the bonus)."""
    out: list[list[int]] = []
    pos = 0
    for d, extra in zip(drafts, bonus, strict=True):
        emitted: list[int] = []
        for j, tok in enumerate(d.draft_token_ids):
            if not accept[pos + j]:
                emitted.append(recovered[pos + j])
                break
            emitted.append(tok)
        else:
            emitted.append(extra)
        out.append(emitted)
        pos += len(d.draft_token_ids)
    return out
