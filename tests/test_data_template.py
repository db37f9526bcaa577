"""The assistant loss mask, token-level, on the demo model's chat template and on a Qwen3-style template."""

from __future__ import annotations

import pytest

from dflash_stream.data.formats import RowError
from dflash_stream.data.template import ChatEncoder

# Qwen3's template (tools, tool calls, tool responses, <think> handling), as shipped with Qwen3 models.
QWEN3_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}{%- if messages[0].role == 'system' %}"
    "{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions.\\n\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}{{- '\\n</tools><|im_end|>\\n' }}"
    "{%- else %}{%- if messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}{%- endif %}{%- endif %}"
    "{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}"
    "{%- for message in messages[::-1] %}{%- set index = (messages|length - 1) - loop.index0 %}"
    "{%- if ns.multi_step_tool and message.role == 'user' and message.content is string and "
    "not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}"
    "{%- set ns.multi_step_tool = false %}{%- set ns.last_query_index = index %}{%- endif %}{%- endfor %}"
    "{%- for message in messages %}{%- if message.content is string %}{%- set content = message.content %}"
    "{%- else %}{%- set content = '' %}{%- endif %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}{%- set reasoning_content = '' %}"
    "{%- if message.reasoning_content is string %}{%- set reasoning_content = message.reasoning_content %}"
    "{%- else %}{%- if '</think>' in content %}"
    "{%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}{%- endif %}"
    "{%- if loop.index0 > ns.last_query_index %}{%- if loop.last or (not loop.last and reasoning_content) %}"
    "{{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n'"
    " + content.lstrip('\\n') }}{%- else %}{{- '<|im_start|>' + message.role + '\\n' + content }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + content }}{%- endif %}"
    "{%- if message.tool_calls %}{%- for tool_call in message.tool_calls %}"
    "{%- if (loop.first and content) or (not loop.first) %}{{- '\\n' }}{%- endif %}"
    "{%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}{{- '\", \"arguments\": ' }}"
    "{%- if tool_call.arguments is string %}{{- tool_call.arguments }}{%- else %}"
    "{{- tool_call.arguments | tojson }}{%- endif %}{{- '}\\n</tool_call>' }}{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or (messages[loop.index0 - 1].role != 'tool') %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}{%- endif %}"
)

# Llama-2 style: refuses roles it does not know, as many templates do.
STRICT_TEMPLATE = (
    "{% for m in messages %}{% if m.role not in ['user', 'assistant', 'system'] %}"
    "{{ raise_exception('unsupported role ' + m.role) }}{% endif %}"
    "{% if m.role == 'user' %}[INST] {{ m.content }} [/INST]{% elif m.role == 'assistant' %}"
    " {{ m.content }}{{ eos_token }}{% else %}<<SYS>>{{ m.content }}<</SYS>>{% endif %}{% endfor %}"
)

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Add 2 and 3."},
    {"role": "assistant", "content": "Adding now.",
     "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
    {"role": "tool", "content": "5"},
    {"role": "assistant", "content": "A: the sum is 5."},
    {"role": "user", "content": "And times 4?"},
    {"role": "assistant", "content": "zero? No: 5 x 4 = 20, z"},
]


@pytest.fixture(scope="module")
def tokenizer(demo_tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo_tokenizer_dir)


def _encoder(tokenizer, template: str | None) -> ChatEncoder:
    tok = tokenizer.__class__.from_pretrained(tokenizer.name_or_path) if template else tokenizer
    if template:
        tok.chat_template = template
    return ChatEncoder(tok)


def _masked_runs(encoder: ChatEncoder, ids, mask) -> list[str]:
    runs, current = [], []
    for token, keep in zip(ids.tolist(), mask.tolist(), strict=True):
        if keep:
            current.append(token)
        elif current:
            runs.append(encoder.tokenizer.decode(current))
            current = []
    if current:
        runs.append(encoder.tokenizer.decode(current))
    return runs


def test_demo_template_masks_each_assistant_turn_and_its_end_token(tokenizer):
    encoder = _encoder(tokenizer, None)
    assert not encoder.renders_tool_calls  # SmolLM2 ignores tool_calls: they are inlined as text
    ids, mask = encoder.encode(CONVERSATION)
    assert _masked_runs(encoder, ids, mask) == [
        'Adding now.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>',
        "A: the sum is 5.<|im_end|>",
        "zero? No: 5 x 4 = 20, z<|im_end|>",
    ]


def test_ids_are_those_of_apply_chat_template(tokenizer):
    encoder = _encoder(tokenizer, None)
    plain = [m for m in CONVERSATION if "tool_calls" not in m and m["role"] != "tool"]
    ids, _ = encoder.encode(plain)
    assert ids.tolist() == list(tokenizer.apply_chat_template(plain, tokenize=True, return_dict=False))


def test_qwen3_template_masks_reasoning_free_turns_and_structured_tool_calls(tokenizer):
    encoder = _encoder(tokenizer, QWEN3_TEMPLATE)
    assert encoder.renders_tool_calls
    ids, mask = encoder.encode(CONVERSATION)
    # The last turn is rendered with an empty <think> block by the template: not the model's output here.
    assert _masked_runs(encoder, ids, mask) == [
        'Adding now.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>',
        "A: the sum is 5.<|im_end|>",
        "zero? No: 5 x 4 = 20, z<|im_end|>",
    ]
    text = encoder.tokenizer.decode(ids)
    assert "<tool_response>\n5\n</tool_response>" in text and "<think>\n\n</think>" in text


def test_qwen3_reasoning_in_the_last_turn_is_supervised(tokenizer):
    encoder = _encoder(tokenizer, QWEN3_TEMPLATE)
    ids, mask = encoder.encode([{"role": "user", "content": "Hi"},
                                {"role": "assistant", "content": "<think>greet back</think>Hello!"}])
    runs = _masked_runs(encoder, ids, mask)
    assert len(runs) == 1 and "greet back" in runs[0] and runs[0].endswith("Hello!<|im_end|>")


def test_a_template_that_refuses_a_role_is_a_counted_row_error(tokenizer):
    encoder = _encoder(tokenizer, STRICT_TEMPLATE)
    ids, mask = encoder.encode(CONVERSATION[:2] + [CONVERSATION[4]])
    assert _masked_runs(encoder, ids, mask) == [" A: the sum is 5.<|im_end|>"]
    with pytest.raises(RowError) as err:
        encoder.encode(CONVERSATION)
    assert err.value.reason == "template_error"


def test_prompt_ends_with_the_assistant_header(tokenizer):
    encoder = _encoder(tokenizer, None)
    prompt = encoder.encode_prompt(CONVERSATION[:2])
    assert tokenizer.decode(prompt).endswith("Add 2 and 3.<|im_end|>\n<|im_start|>assistant\n")
