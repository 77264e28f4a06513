"""The step sampler's rows: a row's output history read in place (`OutputHistory`) is the list it stands for."""

from __future__ import annotations

import pytest
import torch

from tandem.engine.step_sampler import OutputHistory
from tandem.params import SamplingParams
from tandem.sampling.sampler import Sampler, SamplingRow

EOS = 9


@pytest.mark.parametrize(("start", "stop", "drafts"), [(3, 9, ()), (3, 9, (40, 41)), (5, 5, (42,)), (6, 2, ()),
                                                       (0, 12, (7, 8, 9))])
def test_an_output_history_is_the_slice_and_drafts_it_stands_for(start: int, stop: int, drafts: tuple[int, ...]) -> None:
    tokens = [100 + i for i in range(12)]
    want = tokens[start:stop] + list(drafts)
    got = OutputHistory(tokens, start, stop, drafts)
    assert len(got) == len(want) and list(got) == want
    assert [got[i] for i in range(-len(want), len(want))] == want + want
    assert got[1:] == want[1:] and got[::-1] == want[::-1]
    assert all(t in got for t in want) and 99 not in got and bool(got) == bool(want)
    for bad in (len(want), -len(want) - 1):
        with pytest.raises(IndexError):
            got[bad]


def test_penalties_and_min_tokens_read_an_output_history_as_the_list() -> None:
    """The sampler's processing of rows whose history is read in place equals that of rows holding copies:
    repetition, frequency and presence penalties (the tokens), min_tokens (the length), with drafts after them."""
    vocab = 48
    tokens = [1, 2, 3, 4, 5, 7, 7, 11, 11, 11, 20]  # a prompt of 4, then the output
    cases = [
        (SamplingParams(temperature=0.0, repetition_penalty=1.6), 9, (11, 30)),
        (SamplingParams(temperature=0.0, frequency_penalty=0.7, presence_penalty=0.3), 11, ()),
        (SamplingParams(temperature=0.0, min_tokens=8), 10, (7, 7)),  # reached with its drafts alone
        (SamplingParams(temperature=0.0, min_tokens=3, frequency_penalty=-0.5), 8, (20,)),
        (SamplingParams(temperature=0.0), 11, (5,)),
    ]
    logits = torch.randn(len(cases), vocab, generator=torch.Generator().manual_seed(3)) * 3  # [R, V]
    copied = [SamplingRow(p, tokens[:4], tokens[4:known] + list(d)) for p, known, d in cases]
    in_place = [SamplingRow(p, tokens[:4], OutputHistory(tokens, 4, known, d)) for p, known, d in cases]
    sampler = Sampler(vocab, [EOS])
    want = sampler.processed_logits(logits, copied)
    assert torch.equal(sampler.processed_logits(logits, in_place), want)
    assert not torch.equal(want, logits.float())  # (the cases do change the logits)
    assert sampler.sample(logits, in_place).token_ids == sampler.sample(logits, copied).token_ids


def _row_view(row: SamplingRow) -> tuple[object, ...]:
    return (id(row.params), list(row.prompt_token_ids), list(row.output_token_ids), row.generator)


def test_rows_made_while_the_forward_runs_are_those_made_at_sampling(stories_engine_factory,  # type: ignore[no-untyped-def]
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Scheduling ahead with drafts, the engine makes a step's sampling rows (`StepSampler.prepare`) before its
    forward ends: at each sampling they must equal rows made then (the split, each row's params, prompt, history
    and generator; prompt logprobs recorded as before), and be used."""
    from tandem.engine.step_sampler import SampleRows, StepSampler

    from .test_engine import run_all
    from .test_speculative import _story_prompts

    sample, used = StepSampler.sample, []

    def checked(self: StepSampler, plan, logits, masks, seqs, prepared: SampleRows | None = None):  # type: ignore[no-untyped-def]
        if prepared is not None:
            now = self.prepare(plan, seqs)
            assert prepared.plan is plan
            assert [(s and s.request_id, r, k) for s, r, k in prepared.plain] == [(s and s.request_id, r, k) for s, r, k in now.plain]
            assert [(s and s.request_id, r, d, k) for s, r, d, k in prepared.verify] == \
                   [(s and s.request_id, r, d, k) for s, r, d, k in now.verify]
            for made, want in ((prepared.plain_group, now.plain_group), (prepared.verify_group, now.verify_group)):
                assert made.index == want.index and made.all_greedy == want.all_greedy
                assert [_row_view(r) for r in made.rows] == [_row_view(r) for r in want.rows]
            assert [(s.request_id, f) for s, f, _ in prepared.record] == [(s.request_id, f) for s, f, _ in now.record]
            used.append(bool(prepared.verify))
        return sample(self, plan, logits, masks, seqs, prepared)

    monkeypatch.setattr(StepSampler, "sample", checked)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, repetition_penalty=1.1, min_tokens=6,
                            logprobs=2, prompt_logprobs=1)
    base = stories_engine_factory(async_scheduling=False)
    ahead = stories_engine_factory(async_scheduling=True, speculative_config={"method": "suffix", "num_speculative_tokens": 3,
                                                                                           "draft_past_outcome": True})
    prompts = _story_prompts(base, 5)
    got, want = run_all(ahead, prompts, params), run_all(base, prompts, params)
    assert used and any(used)  # prepared rows were sampled, verify rows among them
    for rid, out in want.items():
        assert list(got[rid].outputs[0].token_ids) == list(out.outputs[0].token_ids)
        assert got[rid].prompt_logprobs == out.prompt_logprobs
        # (a verify row's forward batches other rows than the synchronous step's: the values agree to float noise)
        for a, b in zip(got[rid].outputs[0].logprobs or [], out.outputs[0].logprobs or [], strict=True):
            assert a.keys() == b.keys()
            assert all(a[t].rank == b[t].rank and a[t].logprob == pytest.approx(b[t].logprob, abs=1e-4) for t in a)
