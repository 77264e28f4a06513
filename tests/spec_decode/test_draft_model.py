"""Draft-model proposer: exact greedy drafts with KV sync and rollback, vocabulary checks, worker life and failures.

The target is stories260K (a real trained Llama with a SentencePiece tokenizer), converted to an HF folder. When the
draft *is* the target, every greedy draft must equal the target's greedy continuation, computed independently by
transformers with a full recompute; so any KV sync or rollback error shows up as a wrong draft.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tandem.config import ConfigError
from tandem.models.llama2c import convert_llama2c
from tandem.spec_decode.config import SpeculativeConfig
from tandem.spec_decode.draft_model import DraftModelProposer, make_draft_model_proposer
from tandem.spec_decode.proposer import DraftRequest, Drafts

STORIES = Path(__file__).parents[2] / "../shared/data/models/stories260K"
VOCAB = 512
K = 4

Reference = Callable[[list[int], int], list[int]]


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("target") / "stories260K"
    return convert_llama2c(STORIES / "stories260K.bin", STORIES / "tok512.model", out)


def hf_greedy(folder: Path, limit: int | None = None) -> Reference:
    """tokens, n -> the model's next n greedy tokens (among ids < `limit`), each from a full forward over the whole
    context (memoised)."""
    model = LlamaForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    memo: dict[tuple[int, ...], int] = {}

    def next_token(context: list[int]) -> int:
        key = tuple(context)
        if key not in memo:
            with torch.no_grad():
                memo[key] = int(model(torch.tensor([context])).logits[0, -1, :limit].argmax())
        return memo[key]

    def greedy(tokens: list[int], n: int) -> list[int]:
        out = list(tokens)
        for _ in range(n):
            out.append(next_token(out))
        return out[len(tokens) :]

    return greedy


@pytest.fixture(scope="module")
def target_greedy(target_dir: Path) -> Reference:
    return hf_greedy(target_dir)


def tiny_draft(folder: Path, target_dir: Path, vocab_size: int = VOCAB, seed: int = 0) -> Path:
    """A random 2-layer Llama saved with the target's tokenizer files."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=vocab_size, max_position_embeddings=256, tie_word_embeddings=True,
    )
    LlamaForCausalLM(config).eval().save_pretrained(str(folder))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(target_dir / name, folder / name)
    return folder


def make(path: Path, target_dir: Path, **kw: object) -> DraftModelProposer:
    options: dict[str, object] = dict(
        num_speculative_tokens=K, target_vocab_size=VOCAB, target_tokenizer=target_dir, draft_dtype="float32",
        in_process=True,
    )
    options.update(kw)
    return DraftModelProposer(path, **options)  # type: ignore[arg-type]


def simulate(proposer: DraftModelProposer, reference: Reference, steps: int = 8) -> list[dict[str, list[int]]]:
    """Drive the proposer like an engine; assert every draft equals `reference`. Returns the drafts of each step.

    Requests join and leave, one asks for fewer drafts, one for none; after each proposal a request accepts a
    varying prefix of its drafts and then gets a token that differs from the next draft (the target "sampled"
    something else), so the draft must roll its KV back past the rejected drafts.
    """
    tokens = {"a": [1], "b": [1, 403, 407, 261, 378, 447, 416, 416], "d": [1, 295, 413]}
    max_drafts = {"a": K, "b": K, "c": K, "d": 2, "z": 0}
    history: list[dict[str, list[int]]] = []
    for step in range(steps):
        if step == 3:
            tokens["c"] = [1, 421, 355, 269, 273, 389]
            tokens["z"] = [1, 262]
        if step == 5:
            proposer.release("b")
            del tokens["b"]
        batch = [DraftRequest(rid, toks, 1, max_drafts[rid]) for rid, toks in tokens.items()]
        out = proposer.propose(batch)
        assert set(out) == set(tokens)  # one entry per request, none lost
        history.append({rid: d.token_ids for rid, d in out.items()})
        for i, (rid, toks) in enumerate(tokens.items()):
            drafts = out[rid].token_ids
            assert drafts == reference(toks, max_drafts[rid]), (step, rid)
            n_acc = (step + i) % (len(drafts) + 1)
            nxt = (drafts[n_acc] + 1) % VOCAB if n_acc < len(drafts) else reference(toks + drafts, 1)[0]
            proposer.on_verified(rid, drafts[:n_acc], len(drafts))
            toks.extend([*drafts[:n_acc], nxt])
    return history


# ------------------------------------------------------------------------------------------------- exactness


def test_draft_equal_to_target_drafts_its_greedy_continuation(target_dir: Path, target_greedy: Reference) -> None:
    with make(target_dir, target_dir) as p:
        assert p.info.vocab_size == VOCAB and p.info.num_layers == 5
        simulate(p, target_greedy)
        assert p.stats.num_drafted > 0 and 0 < p.stats.num_accepted < p.stats.num_drafted
        assert p.backend.core.num_requests == 3  # type: ignore[attr-defined]  # a, c, d (b released, z never drafted)


def test_a_draft_vocabulary_drafts_the_greedy_continuation_among_its_first_ids(target_dir: Path) -> None:
    """`draft_vocab_size`: the draft's output projection keeps its first rows, and every draft is the greedy token
    among those ids (the embedding still reads every id: the context may hold any)."""
    with make(target_dir, target_dir, draft_vocab_size=300) as p:
        assert p.info.vocab_size == VOCAB
        simulate(p, hf_greedy(target_dir, limit=300))
        core = p.backend.core  # type: ignore[attr-defined]
        assert core.vocab_limit == 300 and core.runner.model.lm_head.out_features == 300
        assert max(t for seq in core._seqs.values() for t in seq.token_ids) >= 300  # contexts beyond the drafts' ids


def test_repeated_proposal_without_progress_gives_the_same_drafts(target_dir: Path, target_greedy: Reference) -> None:
    with make(target_dir, target_dir) as p:
        toks = [1, 403, 407]
        first = p.propose([DraftRequest("r", toks, 1, K)])["r"].token_ids
        assert p.propose([DraftRequest("r", toks, 1, K)])["r"].token_ids == first == target_greedy(toks, K)
        # all drafts accepted plus a bonus token: only the last draft and the bonus are new to the draft's KV
        toks = toks + first + target_greedy(toks + first, 1)
        assert p.backend.core.tokens_of("r") == toks[: len(toks) - 2]  # type: ignore[attr-defined]
        assert p.propose([DraftRequest("r", toks, 1, K)])["r"].token_ids == target_greedy(toks, K)


def test_small_random_draft_drafts_its_own_greedy_tokens(tmp_path: Path, target_dir: Path) -> None:
    draft_dir = tiny_draft(tmp_path / "draft", target_dir)
    with make(draft_dir, target_dir) as p:
        simulate(p, hf_greedy(draft_dir), steps=4)


def test_kv_eviction_when_draft_blocks_run_short(target_dir: Path, target_greedy: Reference) -> None:
    # 6 blocks of 16 positions: the simulated requests do not all fit, idle ones are evicted and re-prefilled later
    with make(target_dir, target_dir, num_kv_blocks=6) as p:
        simulate(p, target_greedy, steps=6)


def test_request_at_the_draft_context_limit_gets_fewer_drafts(target_dir: Path) -> None:
    with make(target_dir, target_dir, max_model_len=12) as p:
        assert p.propose([DraftRequest("r", list(range(1, 11)), 1, K)])["r"].token_ids.__len__() == 2
        assert p.propose([DraftRequest("s", list(range(1, 13)), 1, K)])["s"] == Drafts([])


def test_propose_async_returns_a_future(target_dir: Path, target_greedy: Reference) -> None:
    with make(target_dir, target_dir) as p:
        fut = p.propose_async([DraftRequest("r", [1, 403], 1, 3)])
        assert fut.result(timeout=30)["r"].token_ids == target_greedy([1, 403], 3)
        assert p.propose_async([DraftRequest("r", [1, 403], 1, 0)]).result()["r"] == Drafts([])


# ------------------------------------------------------------------------------------------------ vocabulary


def test_vocab_size_mismatch_is_a_config_error(tmp_path: Path, target_dir: Path) -> None:
    draft_dir = tiny_draft(tmp_path / "draft", target_dir, vocab_size=256)
    with pytest.raises(ConfigError, match="vocab_size 256 differs from the target's 512"):
        make(draft_dir, target_dir)


def test_tokenizer_mismatch_is_a_config_error(tmp_path: Path, target_dir: Path) -> None:
    draft_dir = tiny_draft(tmp_path / "draft", target_dir)
    spec = json.loads((draft_dir / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    vocab["<0x00>"], vocab["<0x01>"] = vocab["<0x01>"], vocab["<0x00>"]  # ids 3 and 4 swap their strings
    (draft_dir / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(ConfigError, match="tokenizer differs.*id 3"):
        make(draft_dir, target_dir)


def test_padded_vocabularies_of_one_tokenizer_are_accepted(tmp_path: Path, target_dir: Path) -> None:
    draft_dir = tiny_draft(tmp_path / "draft", target_dir, vocab_size=576)  # padding rows beyond the 512 tokens
    with make(draft_dir, target_dir) as p:
        drafts = p.propose([DraftRequest("r", [1, 403], 1, K)])["r"].token_ids
        assert len(drafts) == K and all(0 <= t < VOCAB for t in drafts)


def test_bad_options_are_config_errors(target_dir: Path) -> None:
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        make(target_dir, target_dir, num_speculative_tokens=0)
    with pytest.raises(ConfigError, match="draft_dtype"):
        make(target_dir, target_dir, draft_dtype="int8")
    with pytest.raises(ConfigError, match="cpu_cores"):
        make(target_dir, target_dir, cpu_cores=[10_000])
    with pytest.raises(ConfigError, match="does not exist"):
        make(target_dir / "missing", target_dir)
    with pytest.raises(ConfigError, match="model_path"):
        make_draft_model_proposer(num_speculative_tokens=K, target_vocab_size=VOCAB, target_tokenizer=None)
    with pytest.raises(ConfigError, match="draft_vocab_size"):
        SpeculativeConfig(method="draft_model", model=str(target_dir), draft_vocab_size=0)
    with pytest.raises(ConfigError, match="draft_vocab_size applies to method 'draft_model' only"):
        SpeculativeConfig(method="suffix", draft_vocab_size=16384)
    for bad in (0, -5, 2.5, True):
        with pytest.raises(ConfigError, match="draft_vocab_size must be a positive integer"):
            make(target_dir, target_dir, draft_vocab_size=bad)
    spec = SpeculativeConfig.from_dict({"method": "draft_model", "model": str(target_dir), "draft_vocab_size": 300})
    assert spec.proposer_options(VOCAB, None)["draft_vocab_size"] == 300


def test_factory_accepts_vllm_model_alias(target_dir: Path) -> None:
    p = make_draft_model_proposer(
        model=str(target_dir), num_speculative_tokens=2, target_vocab_size=VOCAB, target_tokenizer=target_dir,
        in_process=True,
    )
    with p:
        assert p.name == "draft_model" and len(p.propose([DraftRequest("r", [1], 1, 2)])["r"].token_ids) == 2


# ---------------------------------------------------------------------------------------------- worker process


def worker(target_dir: Path, **kw: object) -> DraftModelProposer:
    return make(target_dir, target_dir, in_process=False, startup_timeout_s=120.0, **kw)


def test_worker_process_starts_matches_in_process_and_stops(target_dir: Path, target_greedy: Reference) -> None:
    with make(target_dir, target_dir) as local:
        expected = simulate(local, target_greedy, steps=5)
    p = worker(target_dir, cpu_cores=[0], draft_threads=1)
    process = p.backend.process  # type: ignore[attr-defined]
    assert process.is_alive() and p.info.pid == process.pid != os.getpid()
    assert os.sched_getaffinity(process.pid) == {0}  # pinned to its own core
    assert simulate(p, target_greedy, steps=5) == expected
    p.close()
    assert not process.is_alive() and process.exitcode == 0
    assert p.propose([DraftRequest("a", [1], 1, K)]) == {"a": Drafts([])}  # closed: no drafts, no error


def test_killed_worker_gives_empty_drafts_with_a_warning(target_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    p = worker(target_dir, timeout_s=3600.0)  # only the pipe's EOF can end the wait below, never the timeout
    pid = p.info.pid
    try:
        assert len(p.propose([DraftRequest("a", [1, 403], 1, K)])["a"].token_ids) == K
        os.kill(pid, signal.SIGSTOP)  # freeze it so the next proposal is surely in flight when it dies
        batch = [DraftRequest("a", [1, 403, 407], 1, K), DraftRequest("b", [1], 1, K)]
        fut = p.propose_async(batch)
        os.kill(pid, signal.SIGKILL)
        with caplog.at_level(logging.WARNING, logger="tandem.spec_decode.draft_model"):
            assert fut.result(timeout=300) == {"a": Drafts([]), "b": Drafts([])}  # (a hang guard, not a speed bound)
        assert "speculation turned off" in caplog.text and "killed by signal 9" in caplog.text
        assert not p.enabled
        assert p.propose(batch) == {"a": Drafts([]), "b": Drafts([])}  # speculation off, nothing lost
    finally:
        p.close()


@pytest.mark.slow
def test_hung_worker_times_out(target_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    p = worker(target_dir, timeout_s=1.0)
    try:
        os.kill(p.info.pid, signal.SIGSTOP)
        with caplog.at_level(logging.WARNING, logger="tandem.spec_decode.draft_model"):
            assert p.propose([DraftRequest("a", [1, 403], 1, K)]) == {"a": Drafts([])}
        assert "did not answer a proposal within 1.0 s" in caplog.text
        assert not p.backend.process.is_alive()  # type: ignore[attr-defined]
    finally:
        p.close()


@pytest.mark.slow
def test_worker_start_failure_is_a_clear_error(tmp_path: Path, target_dir: Path) -> None:
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(ConfigError, match="unsupported architecture"):
        worker(bad)
