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
