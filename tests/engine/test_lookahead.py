"""Look-ahead drafting (engine/speculation.py) with a proposer that drafts concurrently, no model: a proposal made
ahead is used whenever the context it assumed came true and its first drafts match what was emitted since; on a
miss the request drafts nothing that step and nothing waits for the stale proposal (the device waits at most once)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Future

import pytest

from tandem.engine.speculation import SpeculativeDecoder
from tandem.params import SamplingParams
from tandem.request import Request
from tandem.spec_decode.config import SpeculativeConfig
from tandem.spec_decode.proposer import DraftRequest, Drafts, Proposer


class _Counting(Proposer):
    """Proposes `next, next + 1, ...` after the last token (+100 offset), concurrently; futures can be held back."""

    name = "counting"
    drafts_concurrently = True

    def __init__(self) -> None:
        self.calls: list[list[list[int]]] = []
        self.hold = threading.Event()
        self.hold.set()

    def _drafts(self, r: DraftRequest) -> Drafts:
        last = int(r.token_ids[-1])
        return Drafts([last + 1 + j for j in range(r.max_drafts)])

    def propose(self, batch: Sequence[DraftRequest]) -> dict[str, Drafts]:
        self.calls.append([list(r.token_ids) for r in batch])
        return {r.request_id: self._drafts(r) for r in batch}

    def propose_async(self, batch: Sequence[DraftRequest]) -> Future[dict[str, Drafts]]:
        self.calls.append([list(r.token_ids) for r in batch])
        result = {r.request_id: self._drafts(r) for r in batch}
        future: Future[dict[str, Drafts]] = Future()
        if self.hold.is_set():
            future.set_result(result)
        else:  # completes only when released: a stale look-ahead still running
            threading.Thread(target=lambda: (self.hold.wait(), future.set_result(result)), daemon=True).start()
        return future

    def on_verified(self, request_id: str, accepted: Sequence[int], num_drafted: int) -> None:
        pass

    def release(self, request_id: str) -> None:
        pass


def _setup(k: int = 3) -> tuple[SpeculativeDecoder, _Counting, Request]:
    proposer = _Counting()
    spec = SpeculativeDecoder(SpeculativeConfig(method="ngram", num_speculative_tokens=k, adaptive=False), proposer, 4096)
    req = Request("r", [1, 2, 10], SamplingParams())
    req.num_computed_tokens = req.num_tokens - 1  # steady decode
    return spec, proposer, req


def _emit(req: Request, tokens: list[int]) -> None:
    req.append_tokens(tokens)
    req.num_computed_tokens = req.num_tokens - 1
    req.draft_token_ids = []


def test_hit_uses_the_lookahead() -> None:
    spec, proposer, req = _setup()
    spec.draft([req], lambda r: 8)
    assert req.draft_token_ids == [11, 12, 13]  # guess of the bonus: 14
    spec.start_lookahead([req])  # assumes 11, 12, 13, 14 -> proposes 15, 16, 17, 18
    spec.observe(req, [11, 12, 13], [11, 12, 13, 14])
    _emit(req, [11, 12, 13, 14])
    calls = len(proposer.calls)
    spec.draft([req], lambda r: 8)
    assert req.draft_token_ids == [15, 16, 17] and len(proposer.calls) == calls  # no new proposal
    assert spec.stats.lookahead_hits == 1


def test_miss_drafts_nothing_and_waits_for_nothing() -> None:
    spec, proposer, req = _setup()
    spec.draft([req], lambda r: 8)
    proposer.hold.clear()  # the look-ahead will still be running when the outcome is known
    spec.start_lookahead([req])
    spec.observe(req, [11, 12, 13], [11, 99])  # one draft accepted, then a different token
    _emit(req, [11, 99])
    spec.draft([req], lambda r: 8)  # returns although the stale look-ahead never finished
    assert req.draft_token_ids == [] and spec.stats.lookahead_misses == 1
    assert proposer.calls[-1] == [[1, 2, 10, 11, 99]]  # a fresh proposal on the true context, started at once
    proposer.hold.set()
    # next step: one token decoded without drafts; the fresh proposal's first draft was 100 -> its rest are used
    _emit(req, [100])
    spec.draft([req], lambda r: 8)
    assert req.draft_token_ids == [101, 102, 103] and spec.stats.lookahead_hits == 1


def test_fresh_proposal_whose_first_draft_missed_is_not_used() -> None:
    spec, proposer, req = _setup()
    spec.draft([req], lambda r: 8)
    spec.start_lookahead([req])
    spec.observe(req, [11, 12, 13], [5])
    _emit(req, [5])  # miss: fresh proposal on [..., 5] proposes 6, 7, 8, 9
    spec.draft([req], lambda r: 8)
    assert req.draft_token_ids == []
    _emit(req, [42])  # decoded 42, not the proposal's 6: miss again, nothing used
    spec.draft([req], lambda r: 8)
    assert req.draft_token_ids == [] and spec.stats.lookahead_misses == 2


class _Cheap(_Counting):
    drafts_concurrently = False


def test_a_prompt_caught_up_beside_a_forward_on_the_same_cores_teaches_no_cost() -> None:
    """Scheduling ahead with a cheap proposer: the step whose drafting fed it a new request's prompt (work beside a
    forward that shares the host's cores) counts as a step but its time is not a size's cost for adaptive K; the
    next steps' are, and on an accelerator (no shared cores) every step's is."""
    for shared in (True, False):
        spec = SpeculativeDecoder(SpeculativeConfig(method="ngram", num_speculative_tokens=3, adaptive=True), _Cheap(), 4096)
        req = Request("r", list(range(1, 200)), SamplingParams())
        req.num_computed_tokens = req.num_tokens - 1
        assert spec.adaptive is not None
        spec.draft_ahead([req], lambda r: 8, None)  # a 199-token prompt caught up
        spec.observe_step(4, 0.050, 0.0, shared_cores=shared)
        assert bool(spec.adaptive._verify) is not shared
        _emit(req, [7])
        spec.draft_ahead([req], lambda r: 8, None)  # one new token: an ordinary step
        spec.observe_step(4, 0.012, 0.0, shared_cores=shared)
        assert spec.adaptive.verify_seconds(4) == pytest.approx(0.012 if shared else 0.050 + 0.2 * (0.012 - 0.050))


def test_the_ahead_policy_credits_a_plans_tokens_to_the_choice_that_made_it() -> None:
    """Scheduled ahead, the tokens of the plan chosen in one period land in the next: each period is measured with
    the tokens its own plan emitted, so the first period after a change is not credited with the previous
    choice's tokens."""
    from tandem.spec_decode.ahead_policy import AheadChoice

    spec, _, req = _setup()
    assert spec.policy is not None
    seen: list[tuple[int, int]] = []
    choices = iter([AheadChoice(k, False, 0.0) for k in (2, 2, 0, 0, 0)])
    spec.policy.choose = lambda batch: next(choices)  # type: ignore[method-assign]
    spec.policy.observe_period = lambda batch, choice, seconds, tokens: seen.append((choice.k, tokens))  # type: ignore[method-assign]
    emitted = [1, 3, 3, 1]  # what lands during each period: the outcome of the plan chosen one period earlier
    for n in emitted:
        spec.draft_ahead([req], lambda r: 8, None)
        spec.observe(req, [], list(range(n)))
    spec.draft_ahead([req], lambda r: 8, None)
    # plans: K = 2 (its 3 tokens land in period 2), K = 2 (3, period 3), K = 0 (1, period 4), K = 0 (next period)
    assert seen == [(2, 3), (2, 3), (0, 1)]


def test_a_redraft_drafts_as_the_whole_batch_chose() -> None:
    """Scheduling ahead, a miss drafted again drafts the K its step chose for the whole decode batch: chosen anew
    for the few redrafted at a time, adaptive K priced a step of 2 rows (a flat forward: K = 3 pays) where the
    plan holds 32 (a forward linear in its tokens: K = 0 pays)."""
    proposer = _Cheap()
    spec = SpeculativeDecoder(SpeculativeConfig(method="ngram", num_speculative_tokens=3, adaptive=True), proposer, 4096)
    assert spec.adaptive is not None
    for tokens, seconds in [(2, 0.010), (8, 0.011), (32, 0.040), (64, 0.080), (128, 0.160)]:
        spec.observe_step(tokens, seconds, 0.0)
    assert spec.adaptive.choose("probe", 2) == 3 and spec.adaptive.choose("probe", 32) == 0
    reqs = [Request(f"r{i}", [1, 2, 10 + i], SamplingParams()) for i in range(32)]
    for req in reqs:
        req.num_computed_tokens = req.num_tokens - 1
    spec.draft_ahead(reqs, lambda r: 8, None)
    calls = len(proposer.calls)
    late = Request("late", [1, 2, 99], SamplingParams())  # not in the plan draft_ahead saw: chosen for its batch
    late.num_computed_tokens = late.num_tokens - 1
    assert spec.redraft([reqs[0], reqs[1], late], lambda r: 8) == {}
    assert len(proposer.calls) == calls  # K = 0: nothing proposed


class _Empty(_Cheap):
    """Finds nothing for request "e" (a chat answer the suffix tree has no match for)."""

    def propose(self, batch: Sequence[DraftRequest]) -> dict[str, Drafts]:
        out = super().propose(batch)
        return {rid: (Drafts([]) if rid == "e" else d) for rid, d in out.items()}


@pytest.mark.parametrize("setting", [None, True, False])
@pytest.mark.parametrize("shared", [True, False], ids=["host-cores", "accelerator"])
def test_a_cheap_proposer_drafts_after_the_outcome_on_the_hosts_cores(setting: bool | None, shared: bool) -> None:
    """Scheduling ahead, where the forward runs on the host's cores a cheap proposer proposes nothing beside it:
    K is chosen, and `redraft` drafts from the real outcome before the launch; `draft_past_outcome` overrides
    either way. Drafting after the outcome, a request whose proposals come back empty is asked less often, as
    when drafting past it (`_due`)."""
    proposer = _Empty()
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=3, adaptive=False, draft_past_outcome=setting)
    spec = SpeculativeDecoder(config, proposer, 4096)
    reqs = [Request(rid, [1, 2, 10], SamplingParams()) for rid in ("r", "e")]
    for req in reqs:
        req.num_computed_tokens = req.num_tokens - 1
    after = setting is False or (setting is None and shared)
    spec.draft_ahead(reqs, lambda r: 8, None, shared_cores=shared)
    assert spec.drafts_after_outcome is after
    assert (proposer.calls == []) is after and (reqs[0].draft_token_ids == []) is after
    if not after:
        return
    assert spec.redraft(reqs, lambda r: 8) == {"r": [11, 12, 13]}
    asked = []
    for _ in range(8):  # "e" comes back empty each time it is asked
        for req in reqs:
            _emit(req, [5])
        spec.draft_ahead(reqs, lambda r: 8, None, shared_cores=shared)
        assert spec.redraft(reqs, lambda r: 8) == {"r": [6, 7, 8]}
        asked.append(len(proposer.calls[-1]) == 2)  # the one call asked for "e" too
    assert asked[:2] == [True, False] and sum(asked) <= 3  # backing off: every 2nd step, then every 4th


def test_drafting_after_the_outcome_drafts_a_request_draft_ahead_did_not_see() -> None:
    """A request whose prefill ended in the plan in flight was not decoding when `draft_ahead` ran: drafting after
    the outcome, its first decode step gets drafts too (as the synchronous step drafts it)."""
    proposer = _Cheap()
    spec = SpeculativeDecoder(SpeculativeConfig(method="ngram", num_speculative_tokens=3, adaptive=False), proposer, 4096)
    new = Request("new", [1, 2, 10], SamplingParams())  # still prefilling when draft_ahead ran
    spec.draft_ahead([new], lambda r: 8, None, shared_cores=True)
    assert spec.drafts_after_outcome and proposer.calls == []
    new.num_computed_tokens = new.num_tokens - 1  # its outcome: steady decode
    assert spec.redraft([new], lambda r: 8) == {"new": [11, 12, 13]}


@pytest.mark.parametrize("name", ["draft_past_outcome", "alternate_groups"])
def test_a_three_way_setting_that_is_not_a_bool_is_a_config_error(name: str) -> None:
    from tandem.config import ConfigError

    with pytest.raises(ConfigError, match=name):
        SpeculativeConfig.from_dict({"method": "suffix", name: "false"})  # a string is truthy: refused
    assert getattr(SpeculativeConfig.from_dict({"method": "suffix", name: False}), name) is False
