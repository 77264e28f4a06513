"""A tiny random-weight Qwen2-shaped checkpoint whose chat template knows tools (Qwen 2.5's, Hermes-style
`<tool_call>` blocks), to drive the native-template path of tool calling: the template renders `tools=` and the
tool history itself, and the format is read off the template.

The tokenizer is the demo model's (ChatML, as Qwen's) with `<tool_call>` and `</tool_call>` added as single,
non-special tokens, as in Qwen's vocabulary, so the auto-mode trigger is one token; the embedding table is padded
past the tokenizer (49216 rows for 49154 tokens), as Qwen's is. Random weights write nothing sensible: tests
bound the schemas (enums, ranges, maxLength) and push the trigger with logit_bias where they need a call in auto mode.
"""

from __future__ import annotations

from pathlib import Path

QWEN25_TOOL_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

TOOL_TOKENS = ("<tool_call>", "</tool_call>")
PADDED_VOCAB = 49216


def build_tiny_tool_model(tokenizer_dir: Path, out_dir: Path) -> Path:
    """Save the tiny checkpoint (config, random weights, tokenizer with the tool tokens and template) in `out_dir`."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    tok.add_tokens(list(TOOL_TOKENS), special_tokens=False)
    tok.chat_template = QWEN25_TOOL_TEMPLATE
    assert len(tok) <= PADDED_VOCAB
    torch.manual_seed(0)
    config = Qwen2Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=PADDED_VOCAB, max_position_embeddings=4096, tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
    )
    Qwen2ForCausalLM(config).eval().save_pretrained(str(out_dir))
    tok.save_pretrained(str(out_dir))
    return out_dir
