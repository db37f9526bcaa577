"""Row shapes found in chat datasets, turned into one normalised conversation.

A conversation is a list of messages `{"role": system|user|assistant|tool, "content": str}`; assistant turns may
carry `tool_calls` (OpenAI shape) and tool turns a `name`/`tool_call_id`. The tools offered to the model ride on
the list as `.tools` (`Conversation`), in the shape `transformers`' `apply_chat_template(tools=...)` takes. A row
that cannot be read raises `RowError` with a short reason, which the data report counts, and a detail that says
what was wrong.

Published layouts read (see docs/data.md): ShareGPT `conversations` (hermes-function-calling: a `tools` column,
`<tools>` in the system turn, `<tool_call>` blocks in gpt turns, `<tool_response>` in tool turns), OpenAI
`messages` and SWE-agent `trajectory` (roles system/user/ai, `text`, the system turn's `system_prompt`), alpaca
`instruction/input/output`, prompt/response and its spellings (OpenOrca `question/response`, Magicoder
`problem/solution`), and glaive's `{system, chat}` text protocol (`SYSTEM:` + function JSON, `USER:`,
`ASSISTANT: <functioncall> {...}`, `FUNCTION RESPONSE:`).
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

Message = dict[str, Any]

FORMATS = ("sharegpt", "messages", "alpaca", "prompt_response", "glaive")


class Conversation(list):
    """Messages, plus the tool definitions the conversation offers (`tools`, OpenAI shape) or None."""

    def __init__(self, messages: Any = (), tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(messages)
        self.tools = tools or None


SHAREGPT_ROLES = {
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "model": "assistant",
    "function_call": "assistant",
    "system": "system",
    "function": "tool", "tool": "tool", "observation": "tool", "function_response": "tool",
}
PROMPT_KEYS = ("prompt", "question", "query", "instruction", "problem")
RESPONSE_KEYS = ("response", "completion", "answer", "output", "solution")
SYSTEM_KEYS = ("system_prompt", "system")
MESSAGE_ROLES = {"system": "system", "developer": "system", "user": "user", "human": "user",
                 "assistant": "assistant", "ai": "assistant", "tool": "tool", "function": "tool"}
MESSAGE_KEYS = ("messages", "trajectory")
"""Columns holding a role/content list: OpenAI `messages`, SWE-agent's `trajectory`."""


class RowError(ValueError):
    """A row that cannot become a training sample; `reason` is the counted category."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


def _present(row: dict[str, Any], key: str) -> bool:
    # Mixed-shape files give every row every column, absent ones as None.
    return row.get(key) is not None


def _keys(row: dict[str, Any]) -> str:
    return ", ".join(sorted(str(k) for k in row if row[k] is not None)) or "none"


def _is_glaive(row: dict[str, Any]) -> bool:
    chat = row.get("chat")
    return isinstance(chat, str) and bool(GLAIVE_TURN.search(chat))


def detect_format(row: dict[str, Any]) -> str:
    if _present(row, "conversations"):
        return "sharegpt"
    if any(_present(row, k) for k in MESSAGE_KEYS):
        return "messages"
    if _is_glaive(row):
        return "glaive"
    if _present(row, "instruction"):
        return "alpaca"
    if any(_present(row, k) for k in PROMPT_KEYS):
        return "prompt_response"
    raise RowError("unknown_format", f"no known column (conversations, messages, trajectory, chat, instruction, "
                                     f"prompt/question/problem); keys are {_keys(row)}")


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


def _loads(text: str) -> Any:
    """JSON, or the Python literal some datasets print instead (hermes' `{'arguments': ..., 'name': ...}`)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    try:
        return ast.literal_eval(text.strip())
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        raise ValueError(f"neither JSON nor a literal: {text.strip()!r:.60}") from None


def _tool_call(call: Any) -> dict[str, Any]:
    fn = call.get("function", call) if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise RowError("bad_tool_call", f"{call!r:.60}")
    args = fn.get("arguments", fn.get("parameters"))
    if isinstance(args, str):
        # Templates expect a mapping (they `tojson` it); OpenAI rows carry a JSON string.
        try:
            args = _loads(args) if args.strip() else {}
        except ValueError:
            raise RowError("bad_tool_call", f"arguments are not JSON: {args!r:.60}") from None
    if args is None:
        args = {}
    if not isinstance(args, dict):
        raise RowError("bad_tool_call", f"arguments {args!r:.60}")
    return {"type": "function", "function": {"name": fn["name"], "arguments": args}}


def _tool(tool: Any) -> dict[str, Any]:
    """A tool definition in the OpenAI shape `{"type": "function", "function": {name, description, parameters}}`."""
    fn = tool.get("function", tool) if isinstance(tool, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise RowError("bad_tools", f"a tool definition without a name: {tool!r:.60}")
    return {"type": "function", "function": fn}


def _tools(value: Any) -> list[dict[str, Any]] | None:
    """Tool definitions from a column or a system prompt: a list, one object, or their JSON text."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if isinstance(value, str):
        try:
            value = _loads(value)
        except ValueError as err:
            raise RowError("bad_tools", f"tools: {err}") from None
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, list):
        raise RowError("bad_tools", f"tools is a {type(value).__name__}, not a list")
    return [_tool(t) for t in value] or None


def _turns(row: dict[str, Any], keys: tuple[str, ...]) -> tuple[str, list[Any]]:
    key = next((k for k in keys if k in row and row[k] is not None), None)
    if key is None:
        names = " or ".join(f"`{k}`" for k in keys)
        raise RowError("missing_column", f"no {names} column; keys are {_keys(row)}")
    turns = row[key]
    if isinstance(turns, str):
        try:
            turns = json.loads(turns)
        except json.JSONDecodeError:
            raise RowError("empty_conversation", f"`{key}` is text, not a list of turns") from None
    if hasattr(turns, "tolist"):  # a numpy array from a parquet reader
        turns = turns.tolist()
    if not isinstance(turns, list) or not turns:
        raise RowError("empty_conversation", f"`{key}` is {'empty' if isinstance(turns, list) else type(turns).__name__}")
    return key, turns


def _role(turn: Any, key: str, roles: dict[str, str], where: str) -> str:
    """The turn's role in OpenAI terms, from its `key` field mapped through `roles`."""
    if not isinstance(turn, dict) or turn.get(key) is None:
        got = f"keys are {_keys(turn)}" if isinstance(turn, dict) else f"a {type(turn).__name__}"
        raise RowError("missing_role", f"{where}: no `{key}`; {got}")
    role = roles.get(str(turn[key]).lower())
    if role is None:
        raise RowError("unknown_role", f"{where}: {key} {turn[key]!r}; known: {', '.join(sorted(roles))}")
    return role


def _turn_text(value: Any, where: str, *, allow_empty: bool = False) -> str:
    try:
        return _text(value, allow_empty=allow_empty)
    except RowError as err:
        detail = {"empty_turn": "blank text"}.get(err.reason, str(err).split(": ", 1)[-1])
        detail = "no text" if value is None else detail
        raise RowError(err.reason, f"{where}: {detail}") from None


TOOL_CALL_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
TOOLS_BLOCK = re.compile(r"<tools>\s*(.*?)\s*</tools>", re.S)
TOOL_RESPONSE_BLOCK = re.compile(r"^\s*<tool_response>\s*(.*?)\s*</tool_response>\s*$", re.S)


def _hermes_calls(text: str) -> tuple[str, list[dict[str, Any]]] | None:
    """A gpt turn's `<tool_call>{...}</tool_call>` blocks as structured calls, with the text around them;
    None when there are none, or one does not parse (the turn then stays text)."""
    blocks = TOOL_CALL_BLOCK.findall(text)
    if not blocks:
        return None
    try:
        calls = [_tool_call(_loads(b)) for b in blocks]
    except (ValueError, RowError):
        return None
    return TOOL_CALL_BLOCK.sub("", text).strip(), calls


def _sharegpt(row: dict[str, Any]) -> Conversation:
    tools = _tools(row.get("tools"))
    messages = []
    for i, turn in enumerate(_turns(row, ("conversations",))[1]):
        where = f"conversations[{i}]"
        role = _role(turn, "from", SHAREGPT_ROLES, where)
        content = _turn_text(turn.get("value"), where)
        message: Message = {"role": role, "content": content}
        if role == "system" and TOOLS_BLOCK.search(content):
            # hermes: the system turn lists the tools (and how to call them); as structured tools the template
            # writes its own version of that text.
            if tools is None:
                try:
                    tools = _tools(TOOLS_BLOCK.search(content).group(1))
                except RowError:
                    tools = None
            if tools is not None:
                continue
        if role == "assistant" and (parsed := _hermes_calls(content)) is not None:
            message = {"role": "assistant", "content": parsed[0], "tool_calls": parsed[1]}
        if role == "tool" and (match := TOOL_RESPONSE_BLOCK.match(content)):
            message["content"] = match.group(1)
        messages.append(message)
    if not messages:
        raise RowError("empty_conversation", "only a tools system turn")
    if messages[0]["role"] != "system":
        messages = _with_system(row, messages)
    return Conversation(messages, tools)


def _messages(row: dict[str, Any]) -> Conversation:
    key, turns = _turns(row, MESSAGE_KEYS)
    messages = []
    for i, turn in enumerate(turns):
        where = f"{key}[{i}]"
        role = _role(turn, "role", MESSAGE_ROLES, where)
        calls = turn.get("tool_calls") if role == "assistant" else None
        # OpenAI `content`; SWE-agent `text`, with the system turn's text in `system_prompt`.
        content = turn.get("content", turn.get("text"))
        if content is None and role == "system":
            content = turn.get("system_prompt")
        message: Message = {"role": role}
        if calls:
            if hasattr(calls, "tolist"):
                calls = calls.tolist()
            if not isinstance(calls, list):
                raise RowError("bad_tool_call", f"{where}: tool_calls is not a list")
            message["tool_calls"] = [_tool_call(c) for c in calls]
            message["content"] = "" if content is None else _turn_text(content, where, allow_empty=True)
        else:
            message["content"] = _turn_text(content, where)
        for name in ("name", "tool_call_id"):
            if role == "tool" and isinstance(turn.get(name), str):
                message[name] = turn[name]
        messages.append(message)
    return Conversation(messages, _tools(row.get("tools")))


def _first(row: dict[str, Any], keys: tuple[str, ...]) -> Any:
    return next((row[k] for k in keys if row.get(k) is not None), None)


def _with_system(row: dict[str, Any], messages: list[Message]) -> list[Message]:
    system = _first(row, SYSTEM_KEYS)
    if isinstance(system, str) and system.strip():
        return [{"role": "system", "content": system}, *messages]
    return messages


def _alpaca(row: dict[str, Any]) -> list[Message]:
    if row.get("instruction") is None:
        raise RowError("missing_column", f"no `instruction` column; keys are {_keys(row)}")
    prompt = _turn_text(row.get("instruction"), "instruction")
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
    prompt_key = next((k for k in PROMPT_KEYS if row.get(k) is not None), None)
    if prompt_key is None:
        raise RowError("missing_column", f"no prompt column ({'/'.join(PROMPT_KEYS)}); keys are {_keys(row)}")
    messages = [{"role": "user", "content": _turn_text(row[prompt_key], prompt_key)}]
    response_key = next((k for k in RESPONSE_KEYS if row.get(k) is not None), None)
    if response_key is not None:
        messages.append({"role": "assistant", "content": _turn_text(row[response_key], response_key)})
    return _with_system(row, messages)


GLAIVE_TURN = re.compile(r"(?:^|\n)[ \t]*(SYSTEM|USER|ASSISTANT|FUNCTION RESPONSE):[ \t]*")
GLAIVE_ROLES = {"SYSTEM": "system", "USER": "user", "ASSISTANT": "assistant", "FUNCTION RESPONSE": "tool"}
GLAIVE_END = "<|endoftext|>"
"""glaive ends each assistant turn with this marker: protocol, not content."""
GLAIVE_CALL = re.compile(r"<functioncall>\s*(.*)$", re.S)
GLAIVE_QUOTED_ARGS = re.compile(r"""^\{\s*"name"\s*:\s*"([^"]+)"\s*,\s*"arguments"\s*:\s*'(.*)'\s*\}$""", re.S)


def _glaive_system(text: str) -> tuple[str, list[dict[str, Any]] | None]:
    """glaive's system prompt: a sentence, then the functions as JSON objects one after another."""
    text = GLAIVE_TURN.sub("", text, count=1) if GLAIVE_TURN.match(text) else text
    start = text.find("{")
    if start < 0:
        return text.strip(), None
    decoder, functions, pos = json.JSONDecoder(), [], start
    while pos < len(text):
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text):
            break
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            raise RowError("bad_tools", f"system: function definition is not JSON near {text[pos:pos + 40]!r}") from None
        functions.append(obj)
    sentence = text[:start].strip().rstrip("-").rstrip(" :")
    return sentence, _tools(functions)


def _glaive_call(text: str) -> tuple[str, list[dict[str, Any]]] | None:
    match = GLAIVE_CALL.search(text)
    if match is None:
        return None
    blob = match.group(1).strip()
    try:
        call = json.loads(blob)
    except json.JSONDecodeError:
        quoted = GLAIVE_QUOTED_ARGS.match(blob)  # "arguments": '{...}', single-quoted JSON text
        if quoted is None:
            raise RowError("bad_tool_call", f"<functioncall> is not JSON: {blob!r:.60}") from None
        call = {"name": quoted.group(1), "arguments": quoted.group(2)}
    return text[:match.start()].strip(), [_tool_call(call)]


def _glaive(row: dict[str, Any]) -> Conversation:
    chat = row.get("chat")
    if not isinstance(chat, str):
        raise RowError("missing_column", f"no `chat` text column; keys are {_keys(row)}")
    system = row.get("system")
    messages: list[Message] = []
    tools = None
    if isinstance(system, str) and system.strip():
        sentence, tools = _glaive_system(system)
        if sentence:
            messages.append({"role": "system", "content": sentence})
    marks = list(GLAIVE_TURN.finditer(chat))
    if not marks:
        raise RowError("empty_conversation", "`chat` has no USER:/ASSISTANT: turns")
    last_call = None
    for i, mark in enumerate(marks):
        end = marks[i + 1].start() if i + 1 < len(marks) else len(chat)
        role = GLAIVE_ROLES[mark.group(1)]
        text = chat[mark.end():end].strip()
        if role == "assistant":
            text = text.removesuffix(GLAIVE_END).rstrip()
            if i + 1 == len(marks) and not text:
                continue  # a trailing empty `ASSISTANT:` awaiting an answer
            parsed = _glaive_call(text)
            if parsed is not None:
                last_call = parsed[1][0]["function"]["name"]
                messages.append({"role": "assistant", "content": parsed[0], "tool_calls": parsed[1]})
                continue
        message: Message = {"role": role, "content": _turn_text(text, f"chat turn {i} ({mark.group(1)})")}
        if role == "tool" and last_call:
            message["name"] = last_call
        messages.append(message)
    return Conversation(messages, tools)


PARSERS = {"sharegpt": _sharegpt, "messages": _messages, "alpaca": _alpaca, "prompt_response": _prompt_response,
           "glaive": _glaive}


def to_messages(row: dict[str, Any], fmt: str = "auto", system_prompt: str | None = None) -> Conversation:
    """The row as a normalised conversation (`fmt` = auto or one of FORMATS); raises RowError."""
    parsed = PARSERS[detect_format(row) if fmt == "auto" else fmt](row)
    messages = Conversation(parsed, getattr(parsed, "tools", None))
    if system_prompt and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    if not any(m["role"] == "user" for m in messages):
        raise RowError("no_user_turn", f"roles are {', '.join(m['role'] for m in messages)}")
    return messages


def assistant_turns(messages: list[Message]) -> list[int]:
    return [i for i, m in enumerate(messages) if m["role"] == "assistant"]


def split_for_regeneration(messages: list[Message], at: int | None = None) -> Conversation:
    """The prompt whose answer the target regenerates: everything before the last assistant turn (or before
    message `at`), with the conversation's tools."""
    last = max(assistant_turns(messages), default=len(messages)) if at is None else at
    prompt = Conversation(messages[:last], getattr(messages, "tools", None))
    if not any(m["role"] == "user" for m in prompt):
        raise RowError("no_user_turn", "no user turn before the answer to regenerate")
    return prompt
