"""Long contexts through the whole engine against transformers (float32): a 1,500-token prompt prefilled in chunks
of 256 (every prompt position's logprob compared), then greedy decoding until the request hits max_model_len (every
generated token's logprob compared, each token the reference's argmax). Tiny random models: Llama 3 (RoPE scaling
past its original context), Qwen2 (q/k/v bias) and Mistral with a 200-token sliding window, on the CPU kernels and
on the torch operations."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tandem.engine.llm import build_engine
from tandem.params import SamplingParams

from ..engine.test_engine import run_all
from ..tiny import save_tiny, tiny_model

PROMPT_LEN = 1500
MAX_MODEL_LEN = 1600
WINDOW = 200
ARCHS = {
    "llama3": ("llama3", {}),
    "qwen2": ("qwen2", {}),
    "mistral-window": ("mistral", {"sliding_window": WINDOW}),
}


@pytest.fixture(scope="module", params=list(ARCHS))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, torch.nn.Module]:
    arch, overrides = ARCHS[request.param]
    model = tiny_model(arch, max_position_embeddings=2048, **overrides)
    return request.param, save_tiny(tmp_path_factory.mktemp(request.param), model), model


def _reference_logprobs(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().log_softmax(-1)  # [len, V]: row i predicts token i + 1


@pytest.mark.slow
@pytest.mark.parametrize("kernels", [True, False], ids=["tandem-cpu-kernels", "torch-ops"])
def test_chunked_prefill_and_decode_to_max_model_len_match_transformers(
    checkpoint: tuple[str, Path, torch.nn.Module], kernels: bool
) -> None:
    name, folder, model = checkpoint
    engine = build_engine(str(folder), dtype="float32", max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=256,
                          block_size=16, num_kv_blocks=MAX_MODEL_LEN // 16 + 4, cpu_kernels=kernels, progress=False)
    prompt = torch.randint(3, 128, (PROMPT_LEN,), generator=torch.Generator().manual_seed(7)).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    out = run_all(engine, {"long": prompt}, params)["long"]
    engine.shutdown()
    comp = out.outputs[0]
    assert comp.finish_reason == "length" and PROMPT_LEN + len(comp.token_ids) == MAX_MODEL_LEN
    ref = _reference_logprobs(model, prompt + comp.token_ids)
    # the prompt: chunked prefill over 6 chunks, each over the keys of the ones before
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == PROMPT_LEN
    got_prompt = torch.tensor([out.prompt_logprobs[i][prompt[i]].logprob for i in range(1, PROMPT_LEN)])  # type: ignore[index]
    want_prompt = ref[torch.arange(PROMPT_LEN - 1), torch.tensor(prompt[1:])]
    torch.testing.assert_close(got_prompt, want_prompt, atol=2e-4, rtol=1e-4)
    # the generated tokens: positions 1500 .. 1599
    assert comp.logprobs is not None
    rows = ref[PROMPT_LEN - 1 : MAX_MODEL_LEN - 1]  # [100, V]
    got = torch.tensor([lp[t].logprob for t, lp in zip(comp.token_ids, comp.logprobs)])
    torch.testing.assert_close(got, rows[torch.arange(len(comp.token_ids)), torch.tensor(comp.token_ids)], atol=2e-4, rtol=1e-4)
    top2 = rows.topk(2, dim=-1)
    for j, t in enumerate(comp.token_ids):  # greedy: the reference's argmax, unless the two best tie within rounding
        assert t == int(top2.indices[j, 0]) or float(top2.values[j, 0] - top2.values[j, 1]) < 1e-4, (name, j)


def test_the_window_matters_at_this_length() -> None:
    """Negative control for the windowed model: the same weights without the window give other logprobs past it,
    by far more than the tolerance above, so the parity test cannot pass while ignoring the window."""
    ids = torch.randint(3, 128, (PROMPT_LEN,), generator=torch.Generator().manual_seed(7)).tolist()
    arch, overrides = ARCHS["mistral-window"]
    windowed = _reference_logprobs(tiny_model(arch, max_position_embeddings=2048, **overrides), ids)
    unwindowed = _reference_logprobs(tiny_model(arch, max_position_embeddings=2048, sliding_window=None), ids)
    assert torch.equal(windowed[:WINDOW], unwindowed[:WINDOW])  # the same model inside the window
    assert (windowed[WINDOW:] - unwindowed[WINDOW:]).abs().max() > 1e-2
