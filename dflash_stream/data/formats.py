"""Row shapes found in chat datasets, turned into one normalised conversation.

A conversation is a list of messages `{"role": system|user|assistant|tool, "content": str}`; assistant turns may
carry `tool_calls` (OpenAI shape) and tool turns a `name`/`tool_call_id`. A row that cannot be read raises
`RowError` with a short reason, which the data report counts.
"""

from __future__ import annotations

import json
from typing import Any

Message = dict[str, Any]

FORMATS = ("sharegpt", "messages", "alpaca", "prompt_response")

SHAREGPT_ROLES = {
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "model": "assistant",
    "function_call": "assistant",
    "system": "system",
    "function": "tool", "tool": "tool", "observation": "tool", "function_response": "tool",
}
PROMPT_KEYS = ("prompt", "question", "query", "instruction")
RESPONSE_KEYS = ("response", "completion", "answer", "output")
SYSTEM_KEYS = ("system_prompt", "system")
MESSAGE_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
                 "tool": "tool", "function": "tool"}


class RowError(ValueError):
    """A row that cannot become a training sample; `reason` is the counted category."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


def _present(row: dict[str, Any], key: str) -> bool:
    # Mixed-shape files give every row every column, absent ones as None.
    return row.get(key) is not None


def detect_format(row: dict[str, Any]) -> str:
    if _present(row, "conversations"):
        return "sharegpt"
    if _present(row, "messages"):
        return "messages"
    if _present(row, "instruction"):
        return "alpaca"
    if any(_present(row, k) for k in PROMPT_KEYS):
        return "prompt_response"
    raise RowError("unknown_format", f"keys {sorted(k for k in row if row[k] is not None)}")


def _text(value: Any, *, allow_empty: bool = False) -> str:
    if isinstance(value, list):  # OpenAI content parts
        parts = []
        for part in value:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise RowError("non_text_content", f"content part {part!r:.60}")
            parts.append(part["text"])
        value = "".join(parts)
    if not isinstance(value, str):
        raise RowError("non_string_content", f"{type(value).__name__} content")
    if not value.strip() and not allow_empty:
        raise RowError("empty_turn")
    return value


def _tool_call(call: Any) -> dict[str, Any]:
    fn = call.get("function", call) if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise RowError("bad_tool_call", f"{call!r:.60}")
    args = fn.get("arguments")
    if isinstance(args, str):
        # Templates expect a mapping (they `tojson` it); OpenAI rows carry a JSON string.
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            raise RowError("bad_tool_call", f"arguments are not JSON: {args!r:.60}") from None
    if args is None:
        args = {}
    if not isinstance(args, dict):
        raise RowError("bad_tool_call", f"arguments {args!r:.60}")
    return {"type": "function", "function": {"name": fn["name"], "arguments": args}}


def _turns(row: dict[str, Any], key: str) -> list[Any]:
    turns = row.get(key)
    if not isinstance(turns, list) or not turns:
        raise RowError("empty_conversation")
    return turns


def _role(turn: Any, key: str, roles: dict[str, str]) -> str:
    """The turn's role in OpenAI terms, from its `key` field mapped through `roles`."""
    if not isinstance(turn, dict) or turn.get(key) is None:
        raise RowError("missing_role")
    role = roles.get(str(turn[key]).lower())
    if role is None:
        raise RowError("unknown_role", str(turn[key]))
    return role


def _sharegpt(row: dict[str, Any]) -> list[Message]:
    messages = []
    for turn in _turns(row, "conversations"):
        role = _role(turn, "from", SHAREGPT_ROLES)
        messages.append({"role": role, "content": _text(turn.get("value"))})
    return messages if messages[0]["role"] == "system" else _with_system(row, messages)


def _messages(row: dict[str, Any]) -> list[Message]:
    messages = []
    for turn in _turns(row, "messages"):
        role = _role(turn, "role", MESSAGE_ROLES)
        calls = turn.get("tool_calls") if role == "assistant" else None
        message: Message = {"role": role}
        if calls:
            if not isinstance(calls, list):
                raise RowError("bad_tool_call", "tool_calls is not a list")
            message["tool_calls"] = [_tool_call(c) for c in calls]
            content = turn.get("content")
            message["content"] = "" if content is None else _text(content, allow_empty=True)
        else:
            message["content"] = _text(turn.get("content"))
        for key in ("name", "tool_call_id"):
            if role == "tool" and isinstance(turn.get(key), str):
                message[key] = turn[key]
        messages.append(message)
    return messages


def _first(row: dict[str, Any], keys: tuple[str, ...]) -> Any:
    return next((row[k] for k in keys if row.get(k) is not None), None)


def _with_system(row: dict[str, Any], messages: list[Message]) -> list[Message]:
    system = _first(row, SYSTEM_KEYS)
    if isinstance(system, str) and system.strip():
        return [{"role": "system", "content": system}, *messages]
    return messages


def _alpaca(row: dict[str, Any]) -> list[Message]:
    prompt = _text(row.get("instruction"))
    extra = row.get("input")
    if extra is not None and _text(extra, allow_empty=True).strip():
        prompt = f"{prompt}\n\n{extra}"
    messages = [{"role": "user", "content": prompt}]
    response = _first(row, ("output", "response"))
    if response is not None:
        messages.append({"role": "assistant", "content": _text(response)})
    return _with_system(row, messages)


def _prompt_response(row: dict[str, Any]) -> list[Message]:
    """prompt/response and its spellings (OpenOrca's question/response, Magicoder's instruction/response)."""
    messages = [{"role": "user", "content": _text(_first(row, PROMPT_KEYS))}]
    response = _first(row, RESPONSE_KEYS)
    if response is not None:
        messages.append({"role": "assistant", "content": _text(response)})
    return _with_system(row, messages)


PARSERS = {"sharegpt": _sharegpt, "messages": _messages, "alpaca": _alpaca, "prompt_response": _prompt_response}


def to_messages(row: dict[str, Any], fmt: str = "auto", system_prompt: str | None = None) -> list[Message]:
    """The row as a normalised conversation (`fmt` = auto or one of FORMATS); raises RowError."""
    messages = PARSERS[detect_format(row) if fmt == "auto" else fmt](row)
    if system_prompt and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    if not any(m["role"] == "user" for m in messages):
        raise RowError("no_user_turn")
    return messages


def split_for_regeneration(messages: list[Message]) -> list[Message]:
    """The prompt whose answer the target regenerates: everything before the last assistant turn."""
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=len(messages))
    prompt = messages[:last]
    if not any(m["role"] == "user" for m in prompt):
        raise RowError("no_user_turn")
    return prompt
