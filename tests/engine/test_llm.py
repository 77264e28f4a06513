"""`tandem.LLM`, the README's quickstart, on the real stories260K model: outputs in prompt order whatever finishes
first, one SamplingParams per prompt, every prompt form, a bad input in the middle of a batch leaving nothing
behind, requests queued past a full grammar-compile queue, and the vLLM keyword arguments it maps, ignores or
refuses."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tandem import LLM, SamplingParams, StructuredOutputsParams
from tandem.engine import llm as llm_module
from tandem.params import EngineOverloaded, ParamError

from ..conftest import STORIES_GREEDY
from .test_engine import run_all

GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(stories_dir: Path) -> Iterator[LLM]:
    model = LLM(str(stories_dir), dtype="float32", max_model_len=256, seed=0)
    yield model
    model.shutdown()


def _idle(llm: LLM) -> bool:
    """No request left in the engine and every KV block free."""
    engine = llm.llm_engine
    return not engine.has_unfinished_requests() and engine.block_manager.num_free_blocks == engine.runner.num_blocks


def test_outputs_in_prompt_order_not_completion_order(llm: LLM) -> None:
    prompts = ["Once upon a time", "The little dog", "Lily and Tom went to", "One day"]
    # the first prompt runs longest and the last finishes first: the list must still follow the prompts
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (30, 20, 10, 2)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt for o in outs] == prompts
    assert [len(o.outputs[0].token_ids) for o in outs] == [30, 20, 10, 2]
    assert len({o.request_id for o in outs}) == 4 and all(o.finished for o in outs)
    # each is what the engine gives that prompt alone (an independent run, one request at a time)
    engine = llm.llm_engine
    for i, (p, sp) in enumerate(zip(prompts, params)):
        alone = run_all(engine, {f"alone-{i}": p}, sp)[f"alone-{i}"]
        assert outs[i].outputs[0].token_ids == alone.outputs[0].token_ids
    assert _idle(llm)


def test_known_greedy_continuation(llm: LLM) -> None:
    """stories260K from BOS, greedy: the reference text (checked by an independent numpy forward)."""
    out = llm.generate({"prompt_token_ids": [1]}, SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True),
                       use_tqdm=False)
    assert len(out) == 1 and out[0].outputs[0].text.startswith(STORIES_GREEDY)


def test_every_prompt_form(llm: LLM) -> None:
    tok = llm.get_tokenizer()
    ids = tok.encode("Once upon a time")
    forms: list[Any] = ["Once upon a time", ids, {"prompt": "Once upon a time"}, {"prompt_token_ids": ids}]
    outs = llm.generate(forms, GREEDY, use_tqdm=False)
    assert all(o.prompt_token_ids == ids for o in outs)
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1  # one prompt, four spellings, one greedy answer
    assert [o.prompt for o in outs] == ["Once upon a time", None, "Once upon a time", None]
    single = llm.generate(ids, GREEDY, use_tqdm=False)  # a flat list of ints is one prompt, not many
    assert len(single) == 1 and single[0].outputs[0].token_ids == outs[0].outputs[0].token_ids


def test_per_prompt_params(llm: LLM) -> None:
    params = [
        SamplingParams(temperature=0.0, max_tokens=60, stop=["Lily"]),
        SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=5, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=StructuredOutputsParams(choice=["yes", "no"])),
    ]
    a, b, c = llm.generate([[1], "Tom", "Once"], params, use_tqdm=False)
    assert a.outputs[0].text == "Once upon a time, there was a little girl named " and a.outputs[0].stop_reason == "Lily"
    assert [o.index for o in b.outputs] == [0, 1, 2] and all(len(o.token_ids) == 5 for o in b.outputs)
    assert c.outputs[0].text in ("yes", "no") and c.outputs[0].finish_reason == "stop"
    with pytest.raises(ParamError, match="2 SamplingParams for 3 prompts"):
        llm.generate(["a", "b", "c"], params[:2], use_tqdm=False)
    assert _idle(llm)


@pytest.mark.parametrize("bad", ["long-prompt", "oov-token", "bad-dict", "huge-schema"])
def test_bad_input_in_the_middle_leaves_nothing_behind(llm: LLM, bad: str) -> None:
    """The prompts before the bad one were already added when it is refused: they are aborted, their blocks freed,
    and the LLM serves the next call normally."""
    p: Any = GREEDY
    middle: Any = "Once"
    if bad == "long-prompt":
        middle = [5] * 300  # max_model_len is 256
    elif bad == "oov-token":
        middle = [1, 10**6]
    elif bad == "bad-dict":
        middle = {"text": "Once"}
    else:
        huge = {"type": "object", "properties": {f"k{i}": {"type": "string"} for i in range(20000)}}
        p = [GREEDY, SamplingParams(structured_outputs=StructuredOutputsParams(json=huge)), GREEDY, GREEDY]
    with pytest.raises(ParamError):
        llm.generate(["Once upon a time", middle if bad != "huge-schema" else "Once", "Tom", "Lily"], p, use_tqdm=False)
    assert _idle(llm)
    assert llm.generate("Once", SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)[0].outputs[0].token_ids


def test_requests_wait_past_a_full_compile_queue(stories_dir: Path) -> None:
    """More distinct grammars than the compile queue holds: LLM keeps the rest back until there is room (the
    engine alone refuses them with EngineOverloaded), and every one ends valid."""
    llm = LLM(str(stories_dir), dtype="float32", max_model_len=256,
              structured_outputs_config={"max_queued_compiles": 2, "backend": "xgrammar"})
    engine = llm.llm_engine
    refusals: list[str] = []
    add = engine.add_request

    def counting_add(rid: str, *args: Any, **kw: Any) -> None:
        try:
            add(rid, *args, **kw)
        except EngineOverloaded:
            refusals.append(rid)
            raise

    try:
        engine.add_request = counting_add  # type: ignore[method-assign]
        choices = [[f"c{i}a", f"c{i}b"] for i in range(6)]
        params = [SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=StructuredOutputsParams(choice=c))
                  for c in choices]
        outs = llm.generate(["Once"] * 6, params, use_tqdm=False)
        assert refusals  # the queue did fill: some requests waited for room
        assert [o.outputs[0].text in c for o, c in zip(outs, choices)] == [True] * 6
        assert _idle(llm)
    finally:
        llm.shutdown()


def test_chat_renders_the_template_then_generates(llm: LLM) -> None:
    template = "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}"  # as generate() encodes text
    convs = [[{"role": "user", "content": "Once upon a time"}], [{"role": "user", "content": "Tom"}]]
    outs = llm.chat(convs, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False,
                    chat_template=template)
    direct = llm.generate(["Once upon a time", "Tom"], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                          use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in direct]
    one = llm.chat(convs[0], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert len(one) == 1 and one[0].outputs[0].token_ids == outs[0].outputs[0].token_ids


# ------------------------------------------------------------------------------------ vLLM keyword arguments
@pytest.fixture
def captured(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """What LLM passes to build_engine (no model is loaded)."""
    seen: dict[str, Any] = {}

    def fake_build_engine(model: Any, **kw: Any) -> object:
        seen.update(kw, model=model)
        return object()

    monkeypatch.setattr(llm_module, "build_engine", fake_build_engine)
    return seen


def test_vllm_arguments_are_mapped_or_ignored(captured: dict[str, Any]) -> None:
    LLM("m", gpu_memory_utilization=0.3, kv_cache_memory_bytes=1 << 20, tensor_parallel_size=1, trust_remote_code=True,
        enforce_eager=True, disable_log_stats=True, tokenizer_mode="auto", swap_space=4, max_model_len=128, seed=5)
    assert captured == {"model": "m", "memory_fraction": 0.3, "kv_cache_memory": 1 << 20, "max_model_len": 128, "seed": 5,
                        "tensor_parallel_size": 1}
    captured.clear()
    LLM("m", gpu_memory_utilization=0.99)  # vLLM allows up to 1.0; tandem's cache fraction stops at 0.95
    assert captured["memory_fraction"] == 0.95


def test_tensor_parallel_size_reaches_build_engine(captured: dict[str, Any]) -> None:
    LLM("m", tensor_parallel_size=2)
    assert captured["tensor_parallel_size"] == 2


def test_real_engine_honours_mapped_arguments(stories_dir: Path) -> None:
    llm = LLM(str(stories_dir), dtype="float32", kv_cache_memory_bytes=1 << 20, trust_remote_code=True, enforce_eager=True)
    try:
        engine = llm.llm_engine
        assert 0 < engine.runner.kv_cache_bytes <= 1 << 20
        assert engine.get_stats()["kv_num_blocks"] == engine.runner.num_blocks
    finally:
        llm.shutdown()
    with pytest.raises(TypeError, match="no_such_argument"):
        LLM(str(stories_dir), no_such_argument=1)


def test_outputs_are_plain_data(llm: LLM) -> None:
    out = llm.generate("Once", SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)[0]
    d = out.to_dict()
    assert json.loads(json.dumps(d))["outputs"][0]["token_ids"] == out.outputs[0].token_ids
