"""Chat-template tokenization with a loss mask over exactly the tokens the assistant produced.

The mask is found structurally, for any template: each assistant turn is re-rendered with its content replaced
by a one-character stand-in, and the characters where the two renderings differ are that turn's output. Two
stand-ins with different first and last characters make the bound exact even when the real content happens to
start or end like one of them. Character spans map to tokens through the tokenizer's offsets, so the ids are
those of tokenizing the rendered conversation, as `apply_chat_template(tokenize=True)` would produce them.

The template is the target tokenizer's, or `data.chat_template` (inline Jinja or a file), with
`data.chat_template_kwargs` (e.g. `enable_thinking`) passed to it. Tool definitions go in as
`apply_chat_template(tools=...)` and calls as assistant `tool_calls`; a template that renders neither gets them
as Hermes-style text. Row text that spells a special token (`<|im_start|>` in a code sample about ChatML) is
tokenized as text, never as the control token: only the template's own markers are control tokens.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

import numpy as np

from dflash_stream.data.formats import Message, RowError
from dflash_stream.errors import ConfigError

_STAND_INS = ("A", "z")
_PROBE_TOOL = "dflash_probe_tool"
# Noncharacters (never in real text) that bracket special-token strings of row content while rendering.
_OPEN, _CLOSE = "\U0010fffe", "\U0010ffff"
_MARKS = re.compile(f"[{_OPEN}{_CLOSE}]")


def resolve_chat_template(value: str | None) -> str | None:
    """`data.chat_template` as Jinja text: inline Jinja as is, else the file it names (a tokenizer_config.json's
    `chat_template`, or the whole file)."""
    if value is None:
        return None
    if "{{" in value or "{%" in value:
        return value
    path = Path(value).expanduser()
    if not path.is_file():
        raise ConfigError(f"data.chat_template: '{value}' is neither a file nor a Jinja template ({{% ... %}})")
    text = path.read_text()
    if path.suffix == ".json":
        try:
            text = json.loads(text)["chat_template"]
        except (ValueError, KeyError, TypeError):
            raise ConfigError(f"data.chat_template: {path} has no `chat_template` string") from None
        if isinstance(text, list):  # [{name, template}, ...]: the default one
            text = next((t["template"] for t in text if t.get("name") == "default"), text[0]["template"])
    return text


def template_fingerprint(data: Any) -> dict[str, Any]:
    """The template part of the data spec: present only when set, so that runs without it keep their digest."""
    spec: dict[str, Any] = {}
    text = resolve_chat_template(data.chat_template)
    if text is not None:
        spec["chat_template"] = "sha256:" + hashlib.sha256(text.encode()).hexdigest()[:16]
    if data.chat_template_kwargs:
        spec["chat_template_kwargs"] = dict(data.chat_template_kwargs)
    return spec


def _common_prefix(a: str, b: str) -> int:
    return len(os.path.commonprefix([a, b]))


def _common_suffix(a: str, b: str, limit: int) -> int:
    n = 0
    while n < limit and a[-1 - n] == b[-1 - n]:
        n += 1
    return n


class ChatEncoder:
    """Renders conversations with the chat template and masks the assistant tokens."""

    def __init__(self, tokenizer, chat_template: str | None = None,
                 template_kwargs: dict[str, Any] | None = None) -> None:
        self.template = chat_template or getattr(tokenizer, "chat_template", None)
        if not self.template:
            raise ValueError("the target tokenizer has no chat template; set data.chat_template "
                             "(a file or inline Jinja) to render conversations")
        if not tokenizer.is_fast:
            raise ValueError("the target tokenizer must be a fast tokenizer (its offsets locate assistant tokens)")
        self.tokenizer = tokenizer
        self.template_kwargs = dict(template_kwargs or {})
        # A turn ends with a special token the model emits itself (<|im_end|>, <|eot_id|>, </s>): train on it too.
        self.end_ids = set(tokenizer.all_special_ids) - {tokenizer.bos_token_id}
        self.special_ids = set(tokenizer.all_special_ids)
        specials = sorted({t for t in tokenizer.all_special_tokens if t}, key=len, reverse=True)
        self._special_text = re.compile("|".join(map(re.escape, specials))) if specials else None
        self.special_text_count = 0
        """Special-token strings found in row text (and tokenized as text) by the last encode/encode_prompt."""
        self.renders_tool_calls = self._renders_tool_calls()
        self.renders_tools = self._renders_tools()

    @classmethod
    def from_config(cls, tokenizer, data: Any) -> ChatEncoder:
        """The encoder a run uses: `data.chat_template` (default: the tokenizer's) with its kwargs."""
        return cls(tokenizer, resolve_chat_template(data.chat_template), data.chat_template_kwargs)

    def _apply(self, messages: list[Message], tools: list[dict[str, Any]] | None,
               add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=tools, chat_template=self.template, tokenize=False,
            add_generation_prompt=add_generation_prompt, **self.template_kwargs,
        )

    def _renders_tool_calls(self) -> bool:
        probe = [{"role": "user", "content": "x"},
                 {"role": "assistant", "content": "",
                  "tool_calls": [{"type": "function", "function": {"name": _PROBE_TOOL, "arguments": {}}}]}]
        try:
            return _PROBE_TOOL in self._apply(probe, None, False)
        except Exception:
            return False

    def _renders_tools(self) -> bool:
        tool = {"type": "function", "function": {"name": _PROBE_TOOL, "description": "probe",
                                                 "parameters": {"type": "object", "properties": {}}}}
        try:
            return _PROBE_TOOL in self._apply([{"role": "user", "content": "x"}], [tool], False)
        except Exception:
            return False

    def _inline_tool_calls(self, message: Message) -> Message:
        # Templates without tool support would drop the calls: keep them as Hermes-style text instead.
        calls = "".join(f"\n<tool_call>\n{json.dumps(c['function'])}\n</tool_call>" for c in message["tool_calls"])
        return {"role": "assistant", "content": (message["content"] + calls).strip("\n")}

    @staticmethod
    def _inline_tools(messages: list[Message], tools: list[dict[str, Any]]) -> list[Message]:
        # Templates without tool support would drop the definitions: state them in the system turn instead.
        listing = "\n".join(json.dumps(t) for t in tools)
        text = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                f"<tools>\n{listing}\n</tools>\n\nFor each function call, return a JSON object with the function "
                'name and arguments within <tool_call></tool_call> tags: {"name": ..., "arguments": {...}}')
        if messages and messages[0]["role"] == "system":
            return [{**messages[0], "content": f"{messages[0]['content']}\n\n{text}"}, *messages[1:]]
        return [{"role": "system", "content": text}, *messages]

    def _mark_special_text(self, messages: list[Message]) -> list[Message]:
        """Bracket special-token strings in row content, so that they can be found after rendering."""
        if self._special_text is None:
            return messages
        out = []
        for m in messages:
            content = m.get("content")
            if isinstance(content, str) and self._special_text.search(content):
                m = {**m, "content": self._special_text.sub(lambda x: f"{_OPEN}{x.group(0)}{_CLOSE}", content)}
            out.append(m)
        return out

    def _render(self, messages: list[Message], add_generation_prompt: bool,
                tools: list[dict[str, Any]] | None) -> tuple[str, list[tuple[int, int]]]:
        """(text, character spans of row text that spells special tokens) of the rendered conversation."""
        if tools is None:
            tools = getattr(messages, "tools", None)
        messages = list(messages)
        if not self.renders_tool_calls:
            messages = [self._inline_tool_calls(m) if m.get("tool_calls") else m for m in messages]
        if tools and not self.renders_tools:
            messages, tools = self._inline_tools(messages, tools), None
        try:
            text = self._apply(self._mark_special_text(messages), tools or None, add_generation_prompt)
        except Exception as err:  # jinja raises anything from TemplateError to TypeError on a bad row
            raise RowError("template_error", f"{type(err).__name__}: {err}") from None
        if _OPEN not in text:
            return _MARKS.sub("", text), []
        spans, parts, length, start = [], [], 0, None
        for piece in re.split(f"([{_OPEN}{_CLOSE}])", text):
            if piece == _OPEN:
                start = length
            elif piece == _CLOSE:
                if start is not None and length > start:
                    spans.append((start, length))
                start = None
            else:
                parts.append(piece)
                length += len(piece)
        return "".join(parts), spans

    def render(self, messages: list[Message], add_generation_prompt: bool = False,
               tools: list[dict[str, Any]] | None = None) -> str:
        return self._render(messages, add_generation_prompt, tools)[0]

    def _tokenize(self, text: str, literal: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
        """(ids, offsets [T, 2]) of the text; special tokens inside `literal` spans become their text's tokens."""
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = np.asarray(enc["input_ids"], dtype=np.int32)
        offsets = np.asarray(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2)
        self.special_text_count = len(literal)
        if not literal:
            return ids, offsets

        def inside(start: int, end: int) -> bool:
            return any(a <= start and end <= b for a, b in literal)

        special = [i for i, t in enumerate(ids.tolist()) if t in self.special_ids]
        if not any(inside(*offsets[i]) for i in special):
            return ids, offsets
        # The template's own special tokens cut the text into pieces (as the tokenizer itself does); each piece is
        # tokenized with special-token matching off, so the row's spelled-out ones are plain text.
        real = [i for i in special if not inside(*offsets[i])]
        out_ids: list[int] = []
        out_offsets: list[tuple[int, int]] = []
        cursor = 0
        for i in [*real, None]:
            end = len(text) if i is None else int(offsets[i][0])
            if end > cursor:
                piece = self.tokenizer(text[cursor:end], add_special_tokens=False, return_offsets_mapping=True,
                                       split_special_tokens=True)
                out_ids.extend(piece["input_ids"])
                out_offsets.extend((a + cursor, b + cursor) for a, b in piece["offset_mapping"])
            if i is not None:
                out_ids.append(int(ids[i]))
                out_offsets.append((int(offsets[i][0]), int(offsets[i][1])))
                cursor = int(offsets[i][1])
        return np.asarray(out_ids, dtype=np.int32), np.asarray(out_offsets, dtype=np.int64).reshape(-1, 2)

    def _assistant_span(self, messages: list[Message], index: int, text: str) -> tuple[int, int]:
        starts, ends = [], []
        tools = getattr(messages, "tools", None)
        for stand_in in _STAND_INS:
            variant = list(messages)
            variant[index] = {"role": "assistant", "content": stand_in}
            other = self.render(variant, tools=tools)
            start = _common_prefix(text, other)
            ends.append(len(text) - _common_suffix(text, other, min(len(text), len(other)) - start))
            starts.append(start)
        return min(starts), max(ends)

    def encode(self, messages: list[Message]) -> tuple[np.ndarray, np.ndarray]:
        """(input_ids int32 [T], loss_mask bool [T]) of the whole conversation; mask = assistant output."""
        text, literal = self._render(messages, False, None)
        spans = [self._assistant_span(messages, i, text) for i, m in enumerate(messages) if m["role"] == "assistant"]
        ids, offsets = self._tokenize(text, literal)
        mask = np.zeros(len(ids), dtype=bool)
        for start, end in spans:
            mask |= (offsets[:, 0] < end) & (offsets[:, 1] > start)
            after = np.flatnonzero(offsets[:, 0] >= end)
            if len(after) and int(ids[after[0]]) in self.end_ids:
                mask[after[0]] = True
        return ids, mask

    def encode_prompt(self, messages: list[Message]) -> np.ndarray:
        """Token ids of the conversation followed by the template's assistant header, ready to generate from."""
        text, literal = self._render(messages, True, None)
        return self._tokenize(text, literal)[0]
