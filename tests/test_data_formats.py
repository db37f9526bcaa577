"""Row shapes -> normalised conversations, and the reasons bad rows are skipped with."""

from __future__ import annotations

import pytest

from dflash_stream.data.formats import RowError, detect_format, split_for_regeneration, to_messages


def test_sharegpt_roles_are_normalised():
    row = {"conversations": [
        {"from": "system", "value": "Be brief."}, {"from": "human", "value": "Weather?"},
        {"from": "function_call", "value": '{"name": "w"}'}, {"from": "observation", "value": "sunny"},
        {"from": "gpt", "value": "Sunny."},
    ]}
    assert [m["role"] for m in to_messages(row)] == ["system", "user", "assistant", "tool", "assistant"]


def test_openai_messages_with_tool_calls_and_content_parts():
    row = {"messages": [
        {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]},
        {"role": "tool", "content": "2", "tool_call_id": "c1", "name": "f"},
        {"role": "assistant", "content": "Two.", "tool_calls": None},
    ]}
    messages = to_messages(row)
    assert messages[0]["content"] == "Hi there"
    assert messages[1] == {"role": "assistant", "content": "",
                           "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]}
    assert messages[2] == {"role": "tool", "content": "2", "name": "f", "tool_call_id": "c1"}
    assert "tool_calls" not in messages[3]


def test_alpaca_joins_instruction_and_input():
    messages = to_messages({"instruction": "Fix it.", "input": "x = 1 +", "output": "x = 1 + 1"})
    assert messages == [{"role": "user", "content": "Fix it.\n\nx = 1 +"}, {"role": "assistant", "content": "x = 1 + 1"}]


@pytest.mark.parametrize("row, fmt", [
    ({"prompt": "Q", "response": "A"}, "prompt_response"),
    ({"question": "Q", "response": "A", "system_prompt": "S"}, "prompt_response"),  # OpenOrca
    ({"instruction": "Q", "response": "A"}, "alpaca"),  # Magicoder
    ({"prompt": "Q", "completion": "A"}, "prompt_response"),
])
def test_prompt_response_spellings(row, fmt):
    assert detect_format(row) == fmt
    messages = to_messages(row)
    assert [m["content"] for m in messages if m["role"] != "system"] == ["Q", "A"]
    assert ("system_prompt" in row) == (messages[0]["role"] == "system")


def test_system_prompt_is_added_only_when_missing():
    assert to_messages({"prompt": "Q"}, system_prompt="S")[0] == {"role": "system", "content": "S"}
    row = {"messages": [{"role": "system", "content": "own"}, {"role": "user", "content": "Q"}]}
    assert to_messages(row, system_prompt="S")[0]["content"] == "own"


def test_mixed_shape_columns_set_to_none_are_ignored():
    # datasets gives every row of a mixed file every column; absent ones are None.
    row = {"conversations": None, "messages": None, "instruction": None, "prompt": "Q", "response": None}
    assert to_messages(row) == [{"role": "user", "content": "Q"}]


@pytest.mark.parametrize("row, reason", [
    ({"conversations": [{"value": "hi"}, {"from": "gpt", "value": "yo"}]}, "missing_role"),
    ({"messages": [{"content": "hi"}]}, "missing_role"),
    ({"messages": [{"role": "user", "content": "  "}, {"role": "assistant", "content": "x"}]}, "empty_turn"),
    ({"messages": [{"role": "user", "content": 42}]}, "non_string_content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "u"}]}]}, "non_text_content"),
    ({"conversations": [{"from": "narrator", "value": "x"}]}, "unknown_role"),
    ({"messages": [{"role": "system", "content": "s"}, {"role": "assistant", "content": "a"}]}, "no_user_turn"),
    ({"conversations": []}, "empty_conversation"),
    ({"text": "free text"}, "unknown_format"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": None,
      "tool_calls": [{"function": {"name": "f", "arguments": "{not json"}}]}]}, "bad_tool_call"),
])
def test_bad_rows_raise_their_reason(row, reason):
    with pytest.raises(RowError) as err:
        to_messages(row)
    assert err.value.reason == reason


def test_forced_format_overrides_detection():
    row = {"prompt": "Q", "conversations": [{"from": "human", "value": "other"}]}
    assert to_messages(row, "prompt_response")[0]["content"] == "Q"
    with pytest.raises(RowError):
        to_messages({"prompt": "Q"}, "sharegpt")


def test_regeneration_prompt_ends_before_the_last_assistant_turn():
    messages = to_messages({"conversations": [
        {"from": "human", "value": "a"}, {"from": "gpt", "value": "b"},
        {"from": "human", "value": "c"}, {"from": "gpt", "value": "d"},
    ]})
    assert [m["content"] for m in split_for_regeneration(messages)] == ["a", "b", "c"]
    prompt_only = to_messages({"prompt": "p"})
    assert split_for_regeneration(prompt_only) == prompt_only
