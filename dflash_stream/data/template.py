"""Chat-template tokenization with a loss mask over exactly the tokens the assistant produced.

The mask is found structurally, for any template: each assistant turn is re-rendered with its content replaced
by a one-character stand-in, and the characters where the two renderings differ are that turn's output. Two
stand-ins with different first and last characters make the bound exact even when the real content happens to
start or end like one of them. Character spans map to tokens through the tokenizer's offsets, so the ids are
those of tokenizing the rendered conversation, as `apply_chat_template(tokenize=True)` would produce them.
"""

from __future__ import annotations

import json
import os

import numpy as np

from dflash_stream.data.formats import Message, RowError

_STAND_INS = ("A", "z")
_PROBE_TOOL = "dflash_probe_tool"


def _common_prefix(a: str, b: str) -> int:
    return len(os.path.commonprefix([a, b]))


def _common_suffix(a: str, b: str, limit: int) -> int:
    n = 0
    while n < limit and a[-1 - n] == b[-1 - n]:
        n += 1
    return n


class ChatEncoder:
    """Renders conversations with the target tokenizer's chat template and masks the assistant tokens."""

    def __init__(self, tokenizer) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the target tokenizer has no chat template; data needs one to render conversations")
        if not tokenizer.is_fast:
            raise ValueError("the target tokenizer must be a fast tokenizer (its offsets locate assistant tokens)")
        self.tokenizer = tokenizer
        # A turn ends with a special token the model emits itself (<|im_end|>, <|eot_id|>, </s>): train on it too.
        self.end_ids = set(tokenizer.all_special_ids) - {tokenizer.bos_token_id}
        self.renders_tool_calls = self._renders_tool_calls()

    def _renders_tool_calls(self) -> bool:
        probe = [{"role": "user", "content": "x"},
                 {"role": "assistant", "content": "",
                  "tool_calls": [{"type": "function", "function": {"name": _PROBE_TOOL, "arguments": {}}}]}]
        try:
            return _PROBE_TOOL in self.tokenizer.apply_chat_template(probe, tokenize=False)
        except Exception:
            return False

    def _inline_tool_calls(self, message: Message) -> Message:
        # Templates without tool support would drop the calls: keep them as Hermes-style text instead.
        calls = "".join(f"\n<tool_call>\n{json.dumps(c['function'])}\n</tool_call>" for c in message["tool_calls"])
        return {"role": "assistant", "content": (message["content"] + calls).strip("\n")}

    def render(self, messages: list[Message], add_generation_prompt: bool = False) -> str:
        if not self.renders_tool_calls:
            messages = [self._inline_tool_calls(m) if m.get("tool_calls") else m for m in messages]
        try:
            return self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt
            )
        except Exception as err:  # jinja raises anything from TemplateError to TypeError on a bad row
            raise RowError("template_error", f"{type(err).__name__}: {err}") from None

    def _assistant_span(self, messages: list[Message], index: int, text: str) -> tuple[int, int]:
        starts, ends = [], []
        for stand_in in _STAND_INS:
            variant = list(messages)
            variant[index] = {"role": "assistant", "content": stand_in}
            other = self.render(variant)
            start = _common_prefix(text, other)
            ends.append(len(text) - _common_suffix(text, other, min(len(text), len(other)) - start))
            starts.append(start)
        return min(starts), max(ends)

    def encode(self, messages: list[Message]) -> tuple[np.ndarray, np.ndarray]:
        """(input_ids int32 [T], loss_mask bool [T]) of the whole conversation; mask = assistant output."""
        text = self.render(messages)
        spans = [self._assistant_span(messages, i, text) for i, m in enumerate(messages) if m["role"] == "assistant"]
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = np.asarray(enc["input_ids"], dtype=np.int32)
        offsets = np.asarray(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2)
        mask = np.zeros(len(ids), dtype=bool)
        for start, end in spans:
            mask |= (offsets[:, 0] < end) & (offsets[:, 1] > start)
            after = np.flatnonzero(offsets[:, 0] >= end)
            if len(after) and int(ids[after[0]]) in self.end_ids:
                mask[after[0]] = True
        return ids, mask

    def encode_prompt(self, messages: list[Message]) -> np.ndarray:
        """Token ids of the conversation followed by the template's assistant header, ready to generate from."""
        text = self.render(messages, add_generation_prompt=True)
        return np.asarray(self.tokenizer(text, add_special_tokens=False)["input_ids"], dtype=np.int32)
